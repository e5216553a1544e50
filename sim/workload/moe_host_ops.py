"""Host (CPU) calls of one Megatron-Core MoE layer, counted from the source as the dense
layer's are (:data:`sim.workload.megatron_host_ops.PYTHON_OPS_TE`).

A dense Transformer Engine layer's host time is its Python-level calls (torch ops, views and
module calls) times the cost of a TE module call on the job's host
(:func:`sim.hardware.host.te_module_call_cpu_s`; ``MEGATRON_CPU_S_PER_OP``, fitted on vTrain's
dense rows, before the fifty-fifth session). The MoE layer was priced by its *kernel* count
instead, which misses the many calls that launch nothing (views, ``.tolist()``, stream and
event bookkeeping, autograd ``apply``) and the per-expert Python of TE's ``GroupedLinear``.
This module counts them, per component, at Megatron-Core ``core_v0.14.0`` (NeMo /
Megatron-Bridge 25.09) and TE 2.7:

* ``router``: ``MoELayer.router`` (``TopKRouter.forward``: ``gating`` ->
  ``RouterGatingLinearFunction``, ``routing``: z-loss, ``topk_routing_with_score_function``,
  ``apply_router_token_dropping``, ``compute_routing_scores_for_aux_loss``,
  ``_apply_aux_loss`` with ``attach_and_log_load_balancing_loss``; ``moe_utils.py``) plus the
  dispatcher's ``dispatch_preprocess`` (``preprocess``, the device-to-host copies of
  ``_maybe_dtoh_and_synchronize``, ``permute``) and ``token_dispatch`` (``token_dispatcher.py``);
* ``experts``: ``dispatch_postprocess`` (``sort_chunks_by_idxs``), ``TEGroupedMLP.forward``
  (``experts.py``: ``tolist``, FP8 padding, the two ``GroupedLinear`` module calls, the
  activation), ``combine_preprocess`` (the chunk unsort); plus, per local expert, the objects
  ``GroupedLinear``'s forward and backward build one an expert (:data:`PER_EXPERT`);
* the ``flex`` dispatcher's calls per backend: DeepEP's ``_DeepepManager`` (:data:`FLEX`) and
  NVIDIA's HybridEP (``_HybridEPManager``, :data:`HYBRIDEP`, counted at the 26.04 container's
  Megatron-Core 23265d2d and DeepEP's hybrid-ep branch), whose dispatch already permutes for
  the experts, so the experts side adds none;
* ``combine``: ``token_combine`` and ``combine_postprocess`` (``unpermute``, the view, the
  shared experts' output added); with the ``allgather`` dispatcher (:data:`ALLGATHER`) its
  permutation and unpermutation are components of their own (``ag_permute``, ``ag_combine``);
* ``shared``: ``SharedExpertMLP`` is a TE MLP (``PYTHON_OPS_TE["mlp_main"]``) plus its gate.

Backward counts are autograd nodes (each native op's node, each custom ``Function``'s
Python ``backward`` body calls). Each count is checked against the kernels the component
issues (:mod:`sim.workload.moe_ops`) in ``tests/unit/workload/test_moe_host_ops.py``: a kernel
launched from Python is one call or more.

Per-call cost: a module call (the router, ``TEGroupedMLP``, each ``GroupedLinear``, the shared
experts' MLP: :data:`MODULES`) costs what a dense TE layer's call costs, a TE module call (half
in backward), since the dense counts hold a TE module call as one. A plain torch call (a view,
``sum``, ``.to``, an autograd ``apply``) costs an eager PyTorch op,
:data:`sim.hardware.compute.EAGER_FWD_OP_CPU_S` (backward
:data:`~sim.hardware.compute.EAGER_BWD_OP_CPU_S`; published orders of magnitude); TE issue
#2053 measures a whole ``te.Linear`` forward at 2.7x a ``torch.nn.Linear`` one (99.7 vs 37.1 us
on GB200, 90.5 vs 33.2 us on GH200), the same order as an x86 TE call's 33.4 us (70.0 before
TE 2.11) against 10-13 us. No priced op gets
cheaper than its kernels at a module call each, as before. The per-expert objects are created
in C++ (``torch.split``'s views, ``tex.split_quantize``'s quantized tensors, ``torch.empty``;
TE issue #1499: "the CPU overheads of PyTorch ops, such as ``torch.split()`` and
``torch.empty()`` (2x ``num_gemms`` calls)") and cost a C++ call each
(:data:`sim.workload.block_pricing.CPP_LAUNCH_CPU_S`); the cuBLASLt GEMM call TE makes for each
expert (descriptors and heuristic query every call, nothing memoized) costs
:data:`sim.workload.block_pricing.CUBLASLT_CALL_CPU_S` on top.

The 25.11 container's Megatron-Core (``0d8e0714``) is taken to make 0.14's calls
(:data:`VERSIONS`): its ``token_dispatcher.py`` differs on the ``alltoall`` and ``flex``
paths only in process-group names, CUDA-graph attribute lists and the new HybridEP manager,
its ``router.py`` by an optional gate bias (inside the gating Function) and a global aux loss
these rows leave off (``git diff core_v0.14.0 0d8e0714``); ``experts.py`` (GPT-OSS's bias
loop) is counted at 0d8e0714.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

VERSIONS = ("core_v0.14.0", "0d8e0714")
"""Megatron-Core versions the tables stand for (the second assumed equal to the first)."""

# ------------------------------------------------ router (forward, backward)
# TopKRouter.forward, core_v0.14.0 router.py / moe_utils.py. Forward: Python-level torch calls;
# backward: autograd nodes (custom Functions: the calls in their backward).
ROUTER: dict[str, tuple[int, int]] = {
    # MoELayer calls self.router (module __call__) -> gating: RouterGatingLinearFunction.apply,
    # view, te_general_gemm, view; routing's logits.view. Backward: the Function's body
    # (2 views, weight .to, dgrad GEMM, input .to, wgrad GEMM, 2 .to, view) + the view's node.
    "gate": (6, 10),
    # topk_routing_with_score_function, softmax: topk, softmax, type_as, then zeros_like,
    # scatter (probs) and zeros_like, int, scatter, bool (map). Nodes: view, topk (gather),
    # softmax, type_as, scatter.
    "topk_softmax": (9, 5),
    # sigmoid with expert bias (DeepSeek-V3): float, sigmoid, type_as, add bias, topk, gather,
    # type_as, sum, add eps, div, the same 6 for probs/map, scaling mul. Nodes: 8.
    "topk_sigmoid": (17, 8),
    # group_limited_topk (node-limited routing): view, topk, sum, topk, zeros_like, scatter,
    # unsqueeze, expand, reshape, masked_fill, topk replace the plain topk: +10.
    "group_limited": (10, 3),
    # moe_router_fusion: TE's fused_topk_with_score_function (apply, the probs and map
    # allocations inside its forward); its backward one Function body (empty + kernel).
    "topk_fused": (3, 2),
    # apply_z_loss: logsumexp, square, mean, mul, MoEAuxLossAutoScaler.apply, the logged
    # z_loss / coeff, save_to_aux_losses_tracker (detach, index, +=). Nodes: the scaler's
    # backward (ones_like, mul) + logsumexp, square, mean, mul.
    "z_loss": (10, 6),
    # apply_router_token_dropping (probs policy): topk over tokens, zeros_like, scatter, bool,
    # logical_and (not when padding), mul. Node: the mul.
    "drop": (6, 1),
    "pad": (5, 1),
    # aux loss, unfused: compute_routing_scores_for_aux_loss (softmax, topk, zeros_like, int,
    # scatter, bool), _apply_aux_loss (routing_map.sum, reduce_from_tensor_model_parallel_region
    # apply), switch_load_balancing_loss_func (sum, mul, sum, mul), attach_and_log (the logged
    # loss / coeff, tracker's detach, index, +=, MoEAuxLossAutoScaler.apply). Nodes: scaler
    # (ones_like, mul), sum, mul, sum, mul, softmax, the region's identity backward.
    "aux": (17, 9),
    # with moe_router_fusion: fused_compute_score_for_moe_aux_loss (apply + 2 allocations) and
    # fused_moe_aux_loss (apply + allocation) replace softmax..bool and the 4 loss ops.
    "aux_fused": (12, 6),
    # moe_router_enable_expert_bias: local_tokens_per_expert += routing_map.sum(0) (no_grad).
    "expert_bias": (2, 0),
}

# ------------------------------------------------ alltoall dispatcher (token_dispatcher.py)
ALLTOALL: dict[str, tuple[int, int]] = {
    # preprocess (dropless, ep x tp > 1): sum, long, reshape, sum (input_splits), the count
    # gather's apply and output allocation, reshape, transpose, slice, contiguous, sum,
    # index, sum, sum, view; +1 sum with a capacity factor. Nodes: none (no grad).
    "preprocess": (15, 0),
    # drop_and_pad: two torch.full.
    "preprocess_pad": (2, 0),
    # dispatch_preprocess: view; _maybe_dtoh_and_synchronize at its d2h point: wait_stream,
    # the side stream's enter/exit, .to(cpu) of tokens_per_expert, input/output/output_tp splits
    # (each .to + .numpy), record_stream of the 4 on the side stream, record_event, and the
    # event's synchronize at the sync point. (drop_and_pad: the view only.)
    "dispatch_preprocess": (17, 1),
    # permute, moe_permute_fusion: TE's moe_permute_with_probs (apply, make_row_id_map's
    # three Triton launches, the permute launch, three allocations); backward: its Function
    # body (allocation, unpermute launch, probs launch).
    "permute_fused": (8, 3),
    # permute, unfused dropless (Megatron-Core since e19fbe2e, 2026-03-06: a fixed-shape
    # argsort where 0.14 had masked_select): bool, T, contiguous, reshape, argsort, slice,
    # remainder, T, contiguous, reshape, index, index_select. Nodes: index_select, index,
    # reshape, contiguous's clone, T.
    "permute": (12, 5),
    # unfused drop_and_pad: to, T, contiguous, argsort, slice, contiguous, view, T, contiguous,
    # view, arange, unsqueeze, view, mul, add, view, index_select x2. Nodes: 4.
    "permute_pad": (18, 4),
    # token_dispatch: two all_to_all wrappers (the _AllToAll apply and the output allocation
    # each; the collective itself is its own op). Backward: each node's body.
    "token_dispatch": (4, 4),
    # dispatch_postprocess with local experts > 1, fused: ravel, moe_sort_chunks_by_index_
    # with_probs (apply, make_chunk_sort_map launch, sort launch, two allocations). Unfused
    # sort_chunks_by_idxs: ravel; split_sizes.tolist, split, sorted_idxs.tolist, cat for the
    # tokens and again for the probs (nodes: two CatBackward, two SplitWithSizesBackward;
    # the split's views are :data:`CHUNK_VIEWS`). drop_and_pad: view, transpose,
    # contiguous, flatten for tokens and probs.
    "sort_fused": (6, 3),
    "sort": (9, 4),
    "sort_pad": (8, 4),
    # combine_preprocess's unsort: the same as the sort (tokens only): fused 5; unfused T,
    # ravel, two tolist, split, cat; drop_and_pad 4.
    "unsort_fused": (5, 2),
    "unsort": (6, 2),
    "unsort_pad": (4, 2),
    # token_combine: one all_to_all wrapper; combine_postprocess: unpermute (fused: apply,
    # launch, allocation; unfused: zeros, unsqueeze, expand, scatter_add_, to), view.
    "combine_fused": (6, 4),
    "combine": (8, 5),
}

CHUNK_VIEWS: dict[str, tuple[int, int]] = {"sort": (2, 2), "unsort": (1, 1)}
"""Views per (source rank, local expert) chunk of the unfused ``sort_chunks_by_idxs``
(forward, backward): each ``torch.split`` makes one a chunk (tokens and probs in the sort,
tokens in the unsort), each ``CatBackward`` narrows the gradient into one a chunk; priced at
:data:`sim.hardware.compute.VIEW_CPU_S` each."""

# ------------------------------------------------ flex dispatcher (DeepEP, _DeepepManager)
FLEX: dict[str, tuple[int, int]] = {
    # dispatch_preprocess: view; _initialize_metadata: reshape, expand, reshape, contiguous
    # for the map and the probs; setup_metadata: 2 reshapes, topk (+ eq, masked_fill with a
    # capacity factor).
    "dispatch_preprocess": (12, 2),
    # token_dispatch: probs .float(), fused_dispatch (apply, get_dispatch_layout, dispatch,
    # event bookkeeping, the received counts as a tensor). Backward: DeepEP's combine.
    "token_dispatch": (7, 4),
    # dispatch_postprocess: _indices_to_multihot (2 zeros, ne, index, arange, sum,
    # repeat_interleave, 2 index_put, index, bool), tokens_per_expert.sum().item(), permute.
    "postprocess": (13, 3),
    # combine: unpermute (combine_preprocess), fused_combine (apply, combine, event), view.
    "combine": (4, 4),
}

# ------------------------- flex dispatcher with the HybridEP backend (_HybridEPManager)
# Megatron-Core 23265d2d (Megatron-Bridge 74695a06d's submodule, the 26.04 rows)
# token_dispatcher.py MoEFlexTokenDispatcher + _HybridEPManager, fused_a2a.py
# HybridEPDispatch / HybridEPCombine, and deepseek-ai/DeepEP branch hybrid-ep a0d27f1
# deep_ep/hybrid_ep_buffer.py (dispatch_with_permute, combine_with_unpermute,
# update_template_config). The C++ runtime's calls count as one call each; the nine handle
# fields read and written through pybind per call are left out (attribute accesses).
HYBRIDEP: dict[str, tuple[int, int]] = {
    # dispatch_preprocess: view; _initialize_metadata: reshape, expand, reshape, contiguous
    # for the map and the probs; setup_metadata: the map's and the probs' reshape (dropless).
    # Nodes: the probs' view, expand, reshape copy and view.
    "dispatch_preprocess": (11, 4),
    # _HybridEPManager.dispatch: HybridEPDispatch.apply, dispatch_with_permute with its nvtx
    # range (push, pop), update_template_config (get_default_config, adjust_template,
    # is_valid, runtime.update_buffer), runtime.metadata_preprocessing (the routing-map
    # all-gather and its scan), runtime.dispatch_with_permute (its host wait when the permuted
    # count is unknown, the dispatch and permute launches), tokens_per_expert.sum(). Backward:
    # the Function body, combine_with_unpermute (its nvtx range, HandleImpl(), the runtime's
    # combine_with_unpermute).
    "token_dispatch": (11, 5),
    # "HybridEP only supports float32 probs": with bf16 probs (moe_router_dtype unset) the
    # manager logs a warning on every dispatch and casts them (.float()); node: the cast.
    "probs_cast": (2, 1),
    # dispatch_postprocess / combine_preprocess: the manager returns the dispatched tokens
    # and probs as they are (no multihot conversion, no permute): no calls.
    "postprocess": (0, 0),
    # token_combine: HybridEPCombine.apply, combine_with_unpermute (nvtx push, pop,
    # HandleImpl(), the runtime's combine); combine_postprocess: view. Backward: the
    # Function body's dispatch_with_permute with the cached handle (the same five) and the
    # view's node.
    "combine": (7, 6),
}

# ---------------------------------- allgather dispatcher (MoEAllGatherTokenDispatcher)
ALLGATHER: dict[str, tuple[int, int]] = {
    # dispatch_preprocess: three gather_from_sequence_parallel_region calls (routing map,
    # probs, tokens: apply + output allocation each; the gathers are their own ops); nodes:
    # the probs' and tokens' reduce-scatter bodies.
    "dispatch_preprocess": (6, 4),
    # dispatch_postprocess: slice + contiguous of the local map and probs, sum, long, .cpu()
    # (the host waits), tokens_per_expert.sum(), the probs' T, contiguous, map T, contiguous,
    # masked_select; nodes: the probs' slice, contiguous, masked_select, T, contiguous. Plus
    # the permutation (ALLTOALL's permute entries).
    "dispatch_postprocess": (13, 5),
    # token_combine: .to(probs dtype), the reduce-scatter's apply and allocation, .to back;
    # combine_postprocess: view. Nodes: the two casts, the gather body's two calls.
    "combine": (5, 4),
}

# ------------------------------------------------ TEGroupedMLP
EXPERTS: dict[str, tuple[int, int]] = {
    # TEGroupedMLP.forward: module call, tokens_per_expert.tolist(), probs unsqueeze, the two
    # GroupedLinear module calls (each: the module's forward and prepare_forward, the
    # _GroupedLinear apply, reshape, split/split_quantize, empty, general_grouped_gemm, view),
    # weighted_bias_swiglu_impl (apply + 2 views). Nodes: two _GroupedLinear bodies (contiguous,
    # view, split, empty, grouped dgrad, grouped wgrad), swiglu, unsqueeze.
    "mlp": (20, 16),
    # FP8: fp8_padding for tokens and probs, fp8_unpadding (module calls with their split /
    # cat); the quantizers' set_usage pass per GroupedLinear.
    "fp8": (8, 4),
    # bias (GPT-OSS, 0d8e0714 experts.py): fc2's per-expert bias is applied in a Python loop
    # over the experts' chunks (split, then cat and cast back); per expert PER_EXPERT_PY.
    "bias": (3, 1),
    # GPT-OSS's clamped gated activation (fused_bias_geglu.py's unfused path): clamp of the
    # gate and of the linear half, cat, the weighted activation instead of one fused
    # swiglu; nodes: the activation, two clamps, the chunk.
    "clamped_act": (2, 3),
}
# The moe_act recompute's CheckpointWithoutOutput calls are counted in one place,
# sim/workload/checkpoint_without_output.py (charged by the recompute builder).

# Per local expert, per GroupedLinear (fc1 and fc2), C++ objects and calls TE 2.7 makes
# (module/grouped_linear.py _GroupedLinear): forward: the input's split view (bf16) or
# split_quantize's quantized tensor, the weight's cast / get_weight_workspace, prepare_for_saving
# of input and weight; FP8 adds update_usage of both. Backward: main_grad_funcs' call, the
# grad's split view (or quantized tensor), handle_custom_ddp_from_mcore's torch.empty dummy
# wgrad, Megatron DDP's per-parameter grad hook (param_and_grad_buffer), restore_from_saved
# of the two saved tensors; FP8 adds update_usage.
PER_EXPERT: dict[str, tuple[int, int]] = {
    "bf16": (3, 6),
    "fp8": (5, 7),
}
# Per local expert, Python-level calls of the bias loop (GPT-OSS): forward the probs' mul and
# the bias add; backward the add's, the two muls' (bias, probs) nodes, the two sums, the bias
# grad's cast and its accumulation.
PER_EXPERT_PY: dict[str, tuple[int, int]] = {"bias": (2, 7)}

# SharedExpertMLP: a TE MLP, forward as PYTHON_OPS_TE's mlp_main (fc1, activation, fc2,
# bias-dropout-add, the module call); backward: each _Linear body calls general_gemm for its
# dgrad and its wgrad (2 calls each), the activation's node, the add's node.
SHARED = (5, 6)


# Module calls among the counts above, priced as a dense TE layer's calls are (the router
# module; TEGroupedMLP and its two GroupedLinear modules, whose backward is two _GroupedLinear
# bodies; the shared experts' MLP, counted as PYTHON_OPS_TE counts a dense MLP).
MODULES: dict[str, tuple[int, int]] = {"router": (1, 0), "experts": (3, 2), "shared": SHARED}
# Of the backward module calls, the Python bodies of Transformer Engine Functions (priced as
# :func:`sim.workload.megatron_host_ops.backward_host_s` prices them): the two _GroupedLinear
# bodies; the shared MLP's _LayerNormLinear / _Linear bodies, as TE_FUNCTION_BWD's mlp_main.
TE_FUNCTIONS_BWD: dict[str, int] = {"experts": 2, "shared": 2}


@dataclass(frozen=True)
class HostCalls:
    """Calls (forward, backward) of one component: plain torch-level calls, the module calls
    among them, and the per-expert C++ objects it builds (all local experts together)."""

    fwd: int
    bwd: int
    cpp_fwd: int = 0
    cpp_bwd: int = 0
    mod_fwd: int = 0
    mod_bwd: int = 0
    te_bwd: int = 0
    """Of ``mod_bwd``, Transformer Engine Function bodies (:data:`TE_FUNCTIONS_BWD`)."""
    views_fwd: int = 0
    """Views made in C++ by one call (the unfused chunk sort's splits, :data:`CHUNK_VIEWS`)."""
    views_bwd: int = 0
    fp8_linears: int = 0
    """Of the module calls, Transformer Engine linears run in FP8 (priced beyond their 16-bit
    cost: :func:`sim.workload.megatron_host_ops.fp8_linear_host_s`)."""

    @property
    def total(self) -> tuple[int, int]:
        """Python-level calls, module calls included (forward, backward)."""
        return self.fwd + self.mod_fwd, self.bwd + self.mod_bwd


@dataclass(frozen=True)
class MoEHostConfig:
    """What changes a Megatron MoE layer's host calls on one rank."""

    local_experts: int
    dispatcher: Literal["alltoall", "flex", "allgather"] = "alltoall"
    flex_backend: Literal["deepep", "hybridep"] = "deepep"
    router_fp32: bool = True
    """``moe_router_dtype: fp32``: the probs are fp32 already (HybridEP casts bf16 ones)."""
    fp8: bool = False
    router: str = "softmax"
    router_fusion: bool = True
    group_limited: bool = False
    aux_loss: bool = True
    z_loss: bool = False
    token_drop: Literal["drop", "pad"] | None = None
    permute_fusion: bool = True
    chunk_sources: int = 1
    """Ranks whose tokens the chunk sort orders (expert-TP x EP): the unfused sort splits
    ``chunk_sources x local_experts`` chunks."""
    bias: bool = False
    clamp: bool = False
    shared: bool = False


def _add(*parts: tuple[int, int]) -> tuple[int, int]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def router_calls(c: MoEHostConfig) -> tuple[int, int]:
    """``TopKRouter.forward`` with the options ``c`` sets (see :data:`ROUTER`)."""
    parts = [ROUTER["gate"]]
    if c.router_fusion:
        parts.append(ROUTER["topk_fused"])
    else:
        parts.append(ROUTER["topk_sigmoid" if c.router == "sigmoid" else "topk_softmax"])
        if c.group_limited:
            parts.append(ROUTER["group_limited"])
    if c.z_loss:
        parts.append(ROUTER["z_loss"])
    if c.token_drop is not None:
        parts.append(ROUTER[c.token_drop])
    if c.aux_loss:
        parts.append(ROUTER["aux_fused" if c.router_fusion else "aux"])
    if c.router == "sigmoid":
        parts.append(ROUTER["expert_bias"])
    return _add(*parts)


def dispatch_calls(c: MoEHostConfig) -> dict[str, tuple[int, int]]:
    """The dispatcher's calls on the router side (preprocess, permute, dispatch), the experts
    side (chunk sort and unsort) and the combine side."""
    pad = c.token_drop == "pad"
    if c.dispatcher == "allgather":
        perm = ALLTOALL["permute_fused" if c.permute_fusion else "permute"]
        unperm = (3, 2) if c.permute_fusion else (5, 3)   # unpermute without probs
        return {"router": ALLGATHER["dispatch_preprocess"],
                "ag_permute": _add(ALLGATHER["dispatch_postprocess"], perm),
                "experts": (0, 0), "ag_combine": unperm, "combine": ALLGATHER["combine"]}
    if c.dispatcher == "flex" and c.flex_backend == "hybridep":
        h = HYBRIDEP
        return {"router": _add(h["dispatch_preprocess"], h["token_dispatch"],
                               (0, 0) if c.router_fp32 else h["probs_cast"]),
                "experts": h["postprocess"], "combine": h["combine"]}
    if c.dispatcher == "flex":
        return {"router": _add(FLEX["dispatch_preprocess"], FLEX["token_dispatch"]),
                "experts": FLEX["postprocess"], "combine": FLEX["combine"]}
    fused = "_fused" if c.permute_fusion else ""
    pre = ALLTOALL["preprocess_pad"] if pad else _add(
        ALLTOALL["preprocess"], (1, 0) if c.token_drop == "drop" else (0, 0))
    dpre = (1, 1) if pad else ALLTOALL["dispatch_preprocess"]
    perm = ALLTOALL["permute_fused" if c.permute_fusion
                    else "permute_pad" if pad else "permute"]
    router = _add(pre, dpre, perm, ALLTOALL["token_dispatch"])
    experts = (0, 0)
    if c.local_experts > 1:
        kind = "_pad" if pad and not c.permute_fusion else fused
        experts = _add(ALLTOALL[f"sort{kind}"], ALLTOALL[f"unsort{kind}"])
    return {"router": router, "experts": experts,
            "combine": ALLTOALL["combine_fused" if c.permute_fusion else "combine"]}


def chunk_views(c: MoEHostConfig) -> tuple[int, int]:
    """Views (forward, backward) of the ``alltoall`` dispatcher's unfused chunk sort and
    unsort: none when fused, padded, or with one local expert (no sort).

    >>> chunk_views(MoEHostConfig(local_experts=8, permute_fusion=False, chunk_sources=16))
    (384, 384)
    """
    if (c.permute_fusion or c.dispatcher != "alltoall" or c.token_drop == "pad"
            or c.local_experts < 2):
        return 0, 0
    chunks = c.chunk_sources * c.local_experts
    return (chunks * (CHUNK_VIEWS["sort"][0] + CHUNK_VIEWS["unsort"][0]),
            chunks * (CHUNK_VIEWS["sort"][1] + CHUNK_VIEWS["unsort"][1]))


def moe_host_calls(c: MoEHostConfig) -> dict[str, HostCalls]:
    """Host calls per component of one MoE layer (``router``, ``experts``, ``combine``,
    ``shared``) on one rank, for one forward (and its backward)."""
    d = dispatch_calls(c)
    r = _add(router_calls(c), d["router"])
    parts = [EXPERTS["mlp"], d["experts"]]
    if c.fp8:
        parts.append(EXPERTS["fp8"])
    if c.bias:
        parts.append(EXPERTS["bias"])
        b = PER_EXPERT_PY["bias"]
        parts.append((b[0] * c.local_experts, b[1] * c.local_experts))
    if c.clamp:
        parts.append(EXPERTS["clamped_act"])
    e = _add(*parts)
    per = PER_EXPERT["fp8" if c.fp8 else "bf16"]
    # fc1 and fc2: each expert's C++ objects. The GroupedTensor path quantizes into one
    # grouped tensor, but its op builds per-expert split metadata on the host (TE issue 2995,
    # "Reduce CPU overheads in te Sequential GroupedLinear Op", open): priced as before.
    n = 2 * c.local_experts
    mr, me = MODULES["router"], MODULES["experts"]
    out = {"router": HostCalls(r[0] - mr[0], r[1] - mr[1], 0, 0, *mr),
           "experts": HostCalls(e[0] - me[0], e[1] - me[1], per[0] * n, per[1] * n, *me,
                                TE_FUNCTIONS_BWD["experts"], *chunk_views(c),
                                fp8_linears=2 if c.fp8 else 0),
           "combine": HostCalls(*d["combine"])}
    for k in ("ag_permute", "ag_combine"):
        if k in d:
            out[k] = HostCalls(*d[k])
    if c.shared:
        out["shared"] = HostCalls(0, 0, 0, 0, *MODULES["shared"], TE_FUNCTIONS_BWD["shared"],
                                  fp8_linears=2 if c.fp8 else 0)
    return out
