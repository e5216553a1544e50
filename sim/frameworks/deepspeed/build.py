"""The registered ``deepspeed`` builder: ZeRO 0-2, ZeRO-3, or (tensor or pipeline parallel)
Megatron-DeepSpeed 3D."""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.frameworks.deepspeed.moe import check_moe
from sim.frameworks.deepspeed.resolve import _resolve
from sim.frameworks.deepspeed.stage3 import _Stage3
from sim.frameworks.deepspeed.zero012 import _Stage012
from sim.program.ir import Program


def build_deepspeed(ctx: JobContext) -> Program:
    """The program of one steady-state DeepSpeed training step (see
    :mod:`sim.frameworks.deepspeed`); with tensor or pipeline parallelism, Megatron-DeepSpeed's
    3D step (:mod:`sim.frameworks.deepspeed.pipe`)."""
    par = ctx.scenario.parallelism
    if ctx.model.moe is not None:
        ctx.require(par.tp == 1 and par.pp == 1, "parallelism",
                    "DeepSpeed-MoE is modelled beside ZeRO data parallelism (tp and pp 1)")
        check_moe(ctx, _resolve(ctx))
    if par.tp > 1 or par.pp > 1:
        # Megatron-DeepSpeed's ParallelAttention has no query/key norm; the ZeRO path runs
        # Hugging Face's blocks, whose Qwen3 attention normalises each head's q and k.
        ctx.require(not ctx.model.qk_norm, "model.qk_norm",
                    "Megatron-DeepSpeed's layers (tp or pp above 1) have no query/key norm; "
                    "DeepSpeed's ZeRO path with Hugging Face's blocks has (tp and pp 1)")
        from sim.frameworks.deepspeed.pipe import build_deepspeed_pipe
        return build_deepspeed_pipe(ctx)
    z = _resolve(ctx)
    if z.stage == 3:
        return _Stage3(ctx, z).build()
    return _Stage012(ctx, z).build()
