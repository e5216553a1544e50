"""Megatron-Core's optimizer-state offloading (``--offload-optimizer-states``).

Megatron-Core's dev branch (``core_dev_r0.16.0``; the Megatron MoE model zoo's DeepSeek-V3
GB200 script passes it from yanring/Megatron-MoE-ModelZoo f2ed1f9, 2026-01-20, to e8650517)
keeps the distributed optimizer's states on the GPU only around the optimizer step
(``megatron/core/optimizer/cpu_offloading/optimizer_state_offloader.py``,
``OptimizerStateOffloader``; unlike ``--optimizer-cpu-offload`` the step itself stays on
the GPU):

* at the start of ``train_step`` (``megatron/training/training.py``) ``offload_states``
  copies Adam's ``exp_avg`` and ``exp_avg_sq`` and the fp32 master weights (held by TE's
  ``FusedAdam`` or in ``shard_fp32_from_float16_groups``) device-to-host on a side stream
  (``_d2h_stream``, after the current stream), and ``release_offloaded_gpu_states`` frees
  their storages (``resize_(0)``; ``record_stream`` keeps the blocks until the copy ends);
* ``finalize_model_grads`` (wrapped, ``finalize_model_grads_with_state_reload``) first calls
  ``reload_offloaded_states``: the storages are allocated again on the current stream and
  filled host-to-device on ``_h2d_stream``, beside the gradient reduction;
* ``step_with_ready_grads`` waits for that copy (``sync_before_step``) before stepping.

So the states are off the GPU through the whole forward and backward of every micro-batch:
the pipeline's activation peak no longer sits on top of them. The copies ride the GPU's host
link (PCIe, NVLink-C2C on Grace), not the SMs. Megatron-LM refuses it without the
distributed optimizer (``validate_args``: "offload_optimizer_states is only supported with
distributed optimizer") and with Megatron-FSDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.program.ir import Op, Program, RankClass

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape

KEY = "framework.offload_optimizer_states"


def check_state_offload(ctx: JobContext, s: MegatronShape) -> None:
    """Refuse what Megatron-LM's ``validate_args`` refuses."""
    if s.opts.offload_optimizer_states:
        ctx.require(s.opts.distributed_optimizer, KEY,
                    "offload_optimizer_states is only supported with the distributed "
                    "optimizer (framework.distributed_optimizer: true)")


def add_state_offloads(s: MegatronShape, program: Program, classes: list[RankClass]
                       ) -> None:
    """Each stage's D2H at the step's start (first in program order: ``train_step`` issues
    it before the forward-backward)."""
    if not s.opts.offload_optimizer_states:
        return
    for st, cls in enumerate(classes):
        nbytes = s.initial_memory(st).get("optimizer", 0.0)
        if nbytes > 0:
            program.add(cls, state_offload_ops(nbytes, [])[0])


def add_state_reload(s: MegatronShape, program: Program, cls: RankClass, st: int,
                     after: list[Op]) -> list[Op]:
    """Stage ``st``'s H2D, issued by ``finalize_model_grads`` after ``after``: the ops the
    optimizer step must wait for (none without the option)."""
    nbytes = s.initial_memory(st).get("optimizer", 0.0)
    if not s.opts.offload_optimizer_states or nbytes <= 0:
        return []
    return [program.add(cls, state_offload_ops(nbytes, after)[1])]


def state_offload_ops(nbytes: float, reload_after: list[Op]) -> tuple[Op, Op]:
    """(D2H at the step's start, H2D before the optimizer step) of one rank's ``nbytes`` of
    optimizer state: the first frees them when its copy ends, the second allocates them
    when it starts, after ``reload_after`` (the stage's last backward: finalize_model_grads
    runs once the schedule returns). The optimizer step must depend on the second."""
    d2h = Op(name="optimizer states offload D2H", kind="copy", stream="d2h",
             phase="optimizer", host_transfer="d2h", nbytes=nbytes, category="copy",
             free=(("optimizer", nbytes),))
    h2d = Op(name="optimizer states reload H2D", kind="copy", stream="h2d",
             phase="optimizer", deps=list(reload_after), host_transfer="h2d", nbytes=nbytes,
             category="copy", alloc=(("optimizer", nbytes),))
    return d2h, h2d
