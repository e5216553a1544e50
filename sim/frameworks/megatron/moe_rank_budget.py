"""HybridEP's static rank budget (``moe_expert_rank_capacity_factor``) and paged stashing
(``moe_paged_stash``): a dropless MoE layer whose shapes are fixed on the device, so the host
never waits for the token counts and a whole iteration can be one CUDA graph.

From Megatron-Core (``transformer_config.py``, ``moe/token_dispatcher.py``
``_HybridEPManager``, ``moe/experts.py``, ``moe/paged_stash.py`` at d98e8a6, 2026-08):

* **Budget.** ``setup_metadata`` sets ``num_permuted_tokens = tokens x top_k x factor``,
  rounded up to ``get_align_size_for_quantization`` (256 on the Transformer Engine
  grouped-tensor path the budget requires); HybridEP's dispatch then allocates its output
  at that size and drops the copies above it (``overflow_flag``), and the dispatcher keeps
  ``tokens_per_expert`` on the device instead of reading its sum on the host (the
  ``cuda_sync_point`` the other dropless paths pay). The grouped GEMMs read the counts on
  the device (``moe_use_grouped_tensor`` / the operation fuser: one launch a GEMM, not one
  cuBLASLt call an expert), so they compute the rows received, while every tensor of the
  experts' forward is allocated for the budget: the saved ones are held at the budget's size.
* **Paged stash.** ``paged_stash_group_start`` / the stash context copy the experts' saved
  activations, the rows received only, into pages of a pool allocated once
  (``PagedStashBuffer``: ``moe_paged_stash_buffer_size_factor_cuda`` x the average rows, 1.10
  by default), releasing the budget-sized tensors; ``paged_stash_pop_kernel`` copies them
  back before the backward. Held: the rows received times the pool's factor; paid: one
  device copy of those bytes after the forward and one before the backward. The copies run
  on the manager's pack stream, but as kernels of up to 2,048 blocks beside GEMMs whose
  CTAs fill the SMs (:attr:`sim.program.ir.Op.side_kernel`), so they take their turn on the
  SMs: priced in the experts' ops, in series.

Refused here (naming the key): a backend other than HybridEP (Megatron-Core also takes
``ncclep``, not modelled) or the budget without the operation fuser (core_r0.18.0), the budget
under skewed routing (the copies above it are dropped: not modelled), paged stashing without
a budget (Megatron-Core refuses it) or beside fine-grained offloading of the experts'
activations (Megatron-Core refuses that too); and the fuser itself where ``TEGroupedMLP``
refuses it (:func:`check_op_fuser`). Each expert's 256-row segment padding is the experts'
block's (:func:`sim.workload.moe_ops.expected_aligned_rows`). Not modelled: the pool's host
spill.
"""

from __future__ import annotations

from dataclasses import replace

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import scenario_shares
from sim.hardware.compute import ComputeModel
from sim.scenario import MegatronOptions
from sim.workload.block_pricing import BlockCost
from sim.workload.moe_ops import GROUPED_TENSOR_ALIGN

KEY = "framework.moe_expert_rank_capacity_factor"


def budget_rows(tokens: float, top_k: int, factor: float) -> float:
    """Rows HybridEP's dispatch allocates on a rank: ``int(tokens x top_k x factor)``
    rounded up to the grouped-tensor alignment
    (:data:`sim.workload.moe_ops.GROUPED_TENSOR_ALIGN`).

    >>> budget_rows(16384, 8, 1.5)    # Qwen3-30B-A3B, 4 x 4,096 tokens a micro-batch
    196608.0
    >>> budget_rows(1000, 2, 1.1)
    2304.0
    """
    b = int(tokens * top_k * factor)
    return float(b + (-b % GROUPED_TENSOR_ALIGN))


def check_rank_budget(ctx: JobContext) -> None:
    """Refuse what Megatron-Core refuses, and what is not modelled (module docstring)."""
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    if opts.moe_paged_stash:
        ctx.require(opts.moe_expert_rank_capacity_factor is not None,
                    "framework.moe_paged_stash",
                    "moe_paged_stash requires moe_expert_rank_capacity_factor to be set")
        mods = set(opts.offload_modules or []) if opts.fine_grained_activation_offloading \
            else set()
        ctx.require(not mods & {"expert_fc1", "moe_act"}, "framework.offload_modules",
                    "when moe_paged_stash is enabled, offload_modules must not include "
                    "expert_fc1 or moe_act (paged stash covers those activations)")
    if opts.moe_expert_rank_capacity_factor is None:
        return
    ctx.require(opts.moe_token_dispatcher_type == "flex"
                and opts.moe_flex_dispatcher_backend == "hybridep", KEY,
                "moe_expert_rank_capacity_factor requires the flex dispatcher with "
                "moe_flex_dispatcher_backend hybridep (Megatron-Core's ncclep backend is not "
                "modelled)")
    ctx.require(opts.use_transformer_engine_op_fuser or opts.cutedsl_fused_grouped_mlp, KEY,
                "moe_expert_rank_capacity_factor with the hybridep backend requires "
                "use_transformer_engine_op_fuser (Megatron-Core core_r0.18.0)")
    ctx.require(scenario_shares(ctx) is None, KEY,
                "a rank budget under skewed routing (training.routing) drops the copies "
                "above it: not modelled yet")


def check_op_fuser(ctx: JobContext) -> None:
    """Refuse the operation fuser's experts where Megatron-Core asserts against them
    (``TEGroupedMLP._is_fused_impl_supported``, core_r0.18.0 d0b3b775): expert tensor
    parallelism, fine-grained offloading of the experts' activations, an activation other
    than a gated SwiGLU or quick-GEGLU."""
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    if not (opts.use_transformer_engine_op_fuser or opts.cutedsl_fused_grouped_mlp):
        return
    key = "framework.use_transformer_engine_op_fuser"
    ctx.require(ctx.scenario.parallelism.expert_tp == 1, key,
                "Fused GroupedMLP is not supported with expert tensor parallelism (etp 1)")
    mods = set(opts.offload_modules or []) if opts.fine_grained_activation_offloading \
        else set()
    ctx.require(not mods & {"expert_fc1", "moe_act"}, key,
                "Fused GroupedMLP is not supported with offloading expert_fc1 or moe_act")
    ctx.require(ctx.model.mlp == "swiglu", key,
                "Fused GroupedMLP needs a gated SwiGLU or quick-GEGLU expert MLP")


def held_scale(opts: MegatronOptions, tokens: float, top_k: int, rows: float) -> float:
    """What the routed experts' saved activations are held at, over the ``rows`` a rank
    received: the pool's factor with paged stashing, the budget over ``rows`` without it,
    1 without a budget."""
    factor = opts.moe_expert_rank_capacity_factor
    if factor is None or rows <= 0:
        return 1.0
    if opts.moe_paged_stash:
        return opts.moe_paged_stash_buffer_size_factor_cuda
    return budget_rows(tokens, top_k, factor) / rows


def with_stash_copies(cost: BlockCost, cm: ComputeModel) -> BlockCost:
    """The experts' block with paged stashing's two copies of its saved activations (the
    stash after the forward, the pop before the backward): each reads and writes them once,
    a memory-bound kernel (:meth:`~sim.hardware.compute.ComputeModel.membound_time`)."""
    copy_s = cm.membound_time(2.0 * cost.saved_bytes)
    return replace(cost, fwd_s=cost.fwd_s + copy_s, bwd_s=cost.bwd_s + copy_s,
                   fwd_gpu_s=cost.fwd_gpu_s + copy_s, bwd_gpu_s=cost.bwd_gpu_s + copy_s,
                   fwd_kernels=cost.fwd_kernels + 1, bwd_kernels=cost.bwd_kernels + 1)
