"""Megatron's MoE layer host time from its Python-level calls
(:mod:`sim.workload.moe_host_ops`), set on the ops :class:`.moe.MoEOps` lays out.

Each op keeps its host time in ``Op.cpu_s`` (a per-op attribute: whatever removes launches,
as a captured CUDA graph does, can zero it there)."""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.hardware.compute import EAGER_BWD_OP_CPU_S, EAGER_FWD_OP_CPU_S, VIEW_CPU_S
from sim.program.ir import Op
from sim.scenario import MegatronOptions
from sim.workload.block_pricing import CPP_LAUNCH_CPU_S, CUBLASLT_CALL_CPU_S
from sim.workload.megatron_host_ops import backward_host_s, fp8_linear_host_s
from sim.workload.moe_host_ops import HostCalls, MoEHostConfig, moe_host_calls
from sim.workload.moe_ops import MoELayout


def megatron_host_calls(ctx: JobContext, lay: MoELayout) -> dict[str, HostCalls] | None:
    """The host calls of one MoE layer's components under the scenario's options."""
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    moe = ctx.model.moe
    if moe is None:
        return None
    return moe_host_calls(MoEHostConfig(
        local_experts=max(1, moe.experts // lay.ep),
        dispatcher=opts.moe_token_dispatcher_type,
        flex_backend=opts.moe_flex_dispatcher_backend,
        router_fp32=opts.moe_router_dtype == "fp32",
        fp8=lay.fp8 is not None, router=moe.router, router_fusion=lay.router_fusion,
        group_limited=opts.moe_router_num_groups is not None,
        aux_loss=lay.aux_loss, z_loss=lay.z_loss, token_drop=lay.token_drop,
        permute_fusion=lay.permute != "torch", chunk_sources=lay.ep * lay.etp,
        bias=ctx.model.bias,
        clamp=ctx.model.activation_clamp is not None, shared=moe.shared > 0))


def set_host(op: Op, calls: dict[str, HostCalls] | None, component: str, phase: str,
             cpu_call: float, launched: int = 0, gemms: int = 0) -> None:
    """Price ``op``'s host time by its component's calls: ``cpu_call`` a module call (half in
    backward, but a TE Function body as :func:`backward_host_s` prices it), an eager op's cost a
    plain torch call; at least the kernels it already pays for. Its ``cpu_s`` holds its kernels'
    cost, ``launched`` of them C++ launches at :data:`CPP_LAUNCH_CPU_S` (TE's per-expert
    quantizations) and ``gemms`` per-expert cuBLASLt GEMM calls at :data:`CUBLASLT_CALL_CPU_S`.
    The per-expert C++ objects are built by the same calls as the quantizations
    (``split_quantize`` builds an expert's quantized tensor and launches its quantization), so
    the larger of those two counts; a GEMM call builds none of them (the split views, weight
    casts and saved tensors are made before it) and adds."""
    h = calls.get(component) if calls is not None else None
    if h is None:
        return
    fp8_fwd, fp8_bwd = fp8_linear_host_s(h.fp8_linears, cpu_call)
    if phase == "bwd":
        py = (h.bwd * EAGER_BWD_OP_CPU_S + backward_host_s(h.mod_bwd, h.te_bwd, cpu_call)
              + h.views_bwd * VIEW_CPU_S + fp8_bwd)
        cpp = h.cpp_bwd
    else:
        py = (h.fwd * EAGER_FWD_OP_CPU_S + h.mod_fwd * cpu_call + h.views_fwd * VIEW_CPU_S
              + fp8_fwd)
        cpp = h.cpp_fwd
    # The kernels' per-op charge and the calls price the same host work: the larger of the
    # two, not their sum (Python side and per-expert C++ side each).
    gemm_s = gemms * CUBLASLT_CALL_CPU_S
    floor = op.cpu_s - launched * CPP_LAUNCH_CPU_S - gemm_s
    op.cpu_s = max(floor, py) + max(launched, cpp) * CPP_LAUNCH_CPU_S + gemm_s


AG_COMPONENTS = {"permute": "ag_permute", "unpermute": "ag_combine", "combine": "combine"}
"""The allgather dispatcher's compute ops (by the last word of their name) and their
components; its experts and router are priced where they are created."""


def set_host_allgather(ops: list[Op], calls: dict[str, HostCalls] | None, phase: str,
                       cpu_call: float) -> None:
    """:func:`set_host` on the ``allgather`` dispatcher's permutation, unpermutation and cast
    ops (just laid out: their ``cpu_s`` still their kernels' cost)."""
    for op in ops:
        comp = AG_COMPONENTS.get(op.name.rsplit(" ", 1)[-1])
        if comp is not None and op.kind == "compute":
            set_host(op, calls, comp, phase, cpu_call)
