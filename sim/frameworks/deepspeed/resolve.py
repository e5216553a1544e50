"""The scenario's DeepSpeed options checked against what DeepSpeed accepts and resolved to its
effective settings (``zero/config.py``, ``zero/offload_config.py``, ``groups.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.scenario import DeepSpeedOptions
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec


def kernel_style(m: ModelSpec) -> Style:
    """The kernels ZeRO stages 0-3 run: Hugging Face's eager code in 16-bit (``hf_bf16``, see
    :mod:`sim.frameworks.deepspeed`); DeepSpeed-MoE models keep ``bf16``, the style their MoE
    blocks (:mod:`sim.frameworks.deepspeed.moe_blocks`) are written in."""
    return Style("hf_bf16" if m.moe is None else "bf16")


def job_kernel_style(ctx: JobContext) -> Style:
    """:func:`kernel_style` of the job's model (the registry's ``kernel_style``)."""
    return kernel_style(ctx.model)


@dataclass(frozen=True)
class _Zero:
    """The scenario's options resolved to DeepSpeed's effective settings."""

    stage: int
    overlap: bool
    contiguous: bool
    bucket: int
    prefetch: int
    persistence: int
    max_live: int
    offload_opt: str
    offload_param: str
    qwz: bool
    hpz: int
    qgz: bool
    fp16: bool
    max_reuse: int = 1_000_000_000
    sub_group: int = 1_000_000_000


def _resolve(ctx: JobContext) -> _Zero:
    """Check the options against what DeepSpeed accepts and resolve the defaults."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, DeepSpeedOptions)
    ctx.require_data_parallel_only("deepspeed")
    stage = opts.zero_stage
    zpp = opts.zeropp
    ctx.require(opts.offload_param == "none" or stage == 3, "framework.offload_param",
                f"parameter offload needs zero_stage 3 (got {stage})")
    ctx.require(opts.offload_optimizer == "none" or stage >= 1, "framework.offload_optimizer",
                "optimizer offload needs zero_stage 1, 2 or 3 (ZeRO-Offload)")
    ctx.require(not (zpp.qwz or zpp.hpz or zpp.qgz) or stage == 3, "framework.zeropp",
                f"ZeRO++ (qwz, hpz, qgz) needs zero_stage 3 (got {stage})")
    ctx.require(zpp.hpz_partition_size is None or zpp.hpz, "framework.zeropp.hpz_partition_size",
                "is set but zeropp.hpz is false")
    n = ctx.n_ranks
    hpz = 1
    if zpp.hpz:
        hpz = zpp.hpz_partition_size or s.cluster.gpus_per_node
        # groups._create_zero_param_parallel_group: min(size, world), world divisible by it.
        hpz = min(hpz, n)
        ctx.require(n % hpz == 0, "framework.zeropp.hpz_partition_size",
                    f"{hpz} does not divide the {n} data-parallel ranks")
    overlap = opts.overlap_comm if opts.overlap_comm is not None else stage == 3
    return _Zero(stage=stage, overlap=overlap, contiguous=opts.contiguous_gradients,
                 bucket=opts.reduce_bucket_size, prefetch=opts.stage3_prefetch_bucket_size,
                 persistence=opts.stage3_param_persistence_threshold,
                 max_live=opts.stage3_max_live_parameters,
                 offload_opt=opts.offload_optimizer, offload_param=opts.offload_param,
                 qwz=zpp.qwz, hpz=hpz, qgz=zpp.qgz,
                 fp16=s.training.precision == "fp16",
                 max_reuse=opts.stage3_max_reuse_distance, sub_group=opts.sub_group_size)
