"""The SM clock a job's step runs at, from the mix of work its kernels put under the power
limit (:func:`sim.hardware.power.balanced_sm_clock_mhz`).

The firmware holds one clock for a whole step (it averages the board's draw over about a
tenth of a second), so the clock is a property of the job, set before its schedule is built:
:func:`at_power_limit` prices the model's blocks in the framework's kernel style at the reference
clocks, forward and backward of every micro-batch (and the forward again under full
recomputation), layers counted, and gives the job a compute model at the clock where that
mix's mean draw meets the limit, the optimizer's AdamW included. Every kernel the builder
then prices follows it.

What the mix leaves out: host gaps beyond Hugging Face's forward start (a few percent of a
step; they draw less than the mix, so the clock is if anything a little low), and the
collectives a multi-GPU step overlaps with its compute, whose draw is unmeasured. Models
beyond a dense block (experts, latent attention) keep the reference clocks: their blocks are
priced by the builders alone.
"""

from __future__ import annotations

from dataclasses import replace

from sim.frameworks.common.base import JobContext
from sim.hardware.compute import KERNEL_BOUNDARY_S
from sim.hardware.power import StepMix, balanced_sm_clock_mhz, has_power_balance
from sim.scenario import ScenarioError
from sim.workload.block_pricing import gpu_time_by_class, priced_kernels
from sim.workload.kernels import Style
from sim.workload.layer_ops import model_blocks

#: Features beyond a dense block that :func:`~sim.workload.layer_ops.model_blocks` prices.
DENSE_BLOCK_FEATURES = frozenset({"qk_norm"})


def step_mix(ctx: JobContext, style: Style) -> StepMix:
    """GPU seconds of one step by kind, at the reference clocks: each micro-batch's forward
    and backward (GEMMs, fused attention, the rest; the host time the GPU waits through
    idle), and the optimizer's memory-bound AdamW over the job's parameters shared out over
    its GPUs (as FSDP, ZeRO and Megatron's distributed optimizer shard it; DDP's whole copy
    is a few percent of a multi-GPU step either way)."""
    m = ctx.model
    totals = [0.0, 0.0, 0.0, 0.0, 0.0]
    idle = 0.0
    blocks = model_blocks(m, style, ctx.micro_batch, ctx.seq, kv_cache=False)
    for block, count in zip(blocks, (1, m.layers, m.layers, 1), strict=True):
        fwd, bwd = priced_kernels(block, style)
        passes = [fwd, bwd] + ([fwd] if ctx.recompute and count > 1 else [])
        for kernels in passes:
            for i, t in enumerate(gpu_time_by_class(ctx.compute, kernels)):
                totals[i] += count * t * ctx.micro_batches
            # The stream idles between kernels (KERNEL_BOUNDARY_S each).
            idle += count * len(kernels) * KERNEL_BOUNDARY_S * ctx.micro_batches
        idle += count * block.exposed_host_s * ctx.micro_batches
    gemm, attention, masked, copy, other = totals
    optimizer = ctx.compute.adamw_time(
        m.total_params / ctx.n_ranks, ctx.scenario.training.optimizer == "adamw_fused",
        len(m.parameter_tensors()))
    return StepMix(gemm, attention, other + optimizer, idle_s=idle,
                   masked_attention_s=masked, copy_s=copy)


def at_power_limit(ctx: JobContext, style: Style) -> JobContext:
    """``ctx`` with its compute model at the step's balanced SM clock; ``ctx`` itself where
    the part has no power balance or the model is not a dense block (experts, latent
    attention, ...).

    Examples
    --------
    >>> from sim.scenario import load_scenario
    >>> ctx = JobContext.from_scenario(load_scenario("scenarios/llama3.2-1b-1xh200.yaml"))
    >>> round(at_power_limit(ctx, Style("autocast")).compute.sm_clock_mhz)
    1806
    """
    if not has_power_balance(ctx.gpu) or ctx.model.beyond_dense(DENSE_BLOCK_FEATURES):
        return ctx
    try:
        mix = step_mix(ctx, style)
    except ScenarioError:
        return ctx    # the builder refuses the job and names why, with its own checks first
    clock = balanced_sm_clock_mhz(ctx.gpu, mix)
    # The balance is solved at the cap (cluster.gpu_power_w) itself, so the compute model
    # prices the part uncapped at that clock rather than taking the cap's ratio again.
    uncapped = replace(ctx.gpu, power_cap_w=None)
    return replace(ctx, compute=replace(ctx.compute, gpu=uncapped, sm_clock_mhz=clock))
