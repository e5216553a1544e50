"""Megatron-Core's CUDA graphs (``--cuda-graph-impl``, ``--cuda-graph-scope``): which parts of
a layer are captured, what the host then pays to issue them, and which combinations Megatron
refuses.

What Megatron-Core captures (``megatron/core/transformer/cuda_graphs.py`` and
``transformer_config.py`` ``__post_init__``, core_v0.16.0; core_v0.14 / v0.15 know only the
scopes ``full`` and ``attn``, and the deprecated ``--enable-cuda-graph`` (= ``local``) /
``--external-cuda-graph`` (= ``transformer_engine``) that Megatron-Bridge's 25.09 scripts set;
its 25.11 scripts already pass scope lists):

* ``local``: ``CudaGraphManager`` records each ``TransformerLayer`` call (forward graph, and
  a backward graph replayed by its autograd node), one ``_CudaGraphRunner`` per layer and
  micro-batch in flight (runners are reused across micro-batches, ``reuse_cudagraphs``); the
  scope ``full_iteration`` instead captures the whole forward-backward schedule
  (``FullCudaGraphWrapper``; the optimizer step stays eager).
* ``transformer_engine``: ``TECudaGraphHelper`` hands every layer of every virtual stage,
  for every micro-batch, to Transformer Engine's ``make_graphed_callables``; each graphed
  callable's forward and backward are one graph replay each.
* The scope list picks the part of a layer: an empty list (``full``) the whole layer,
  ``attn`` the attention block (``_forward_attention``), ``mlp`` a dense layer's MLP,
  ``moe`` the whole MoE block (drop-and-pad only: its sizes are fixed by capacity),
  ``moe_router`` the pre-MLP norm and router, ``moe_preprocess`` also the dispatcher's
  preprocess (the permutation; the builder prices router and permutation as one op, so
  ``moe_router`` alone under ``transformer_engine`` graphs the permutation too, as every
  Megatron-Bridge script that sets it also sets ``moe_preprocess``). A dropless MoE reads
  the tokens per expert on the host (``cuda_sync_point``), which no graph can hold: only its
  router and preprocess can be captured, unless HybridEP runs with a rank budget
  (``moe_expert_rank_capacity_factor``: static shapes, no host read), as Megatron-Bridge's
  26.06 Blackwell scripts do under ``cuda_graph_impl="full_iteration"``.

The host cost: one captured region replays as one call into the graphed callable (a Python
autograd function that copies the fresh input into the graph's static input buffer, then
``CUDAGraph.replay``) instead of one Python call per kernel. Its ops keep their GPU time:
this simulator prices kernels without inter-kernel launch gaps on the GPU (a kernel queued
behind another starts when it ends, :mod:`sim.hardware.compute`), so the gaps a graph closes
are already absent; what graphs save here is host time, which matters where the host, not
the GPU, sets the pace (small micro-batches, many small kernels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.options import MegatronOptions
from sim.program.ir import Op, Program

GRAPH_LAUNCH_CPU_S = 2.5e-6
"""Driver seconds of one ``cudaGraphLaunch`` of a straight-line graph: constant in the number
of nodes since CUDA 12.6, about 2.5 us (NVIDIA technical blog "Constant Time Launch for
Straight-Line CUDA Graphs and Other Performance Enhancements", 2024, launch-time figure)."""

REPLAY_PY_CALLS = 2
"""Python-level torch calls of one replay: the graphed callable's autograd ``Function``
(TE ``make_graphed_callables``' ``Graphed.forward`` / ``backward``; Megatron's
``_CudagraphReplayNode``) and the ``copy_`` of the new input (forward) or output gradient
(backward) into the graph's static buffer."""

KEY = "framework.cuda_graph_scope"

SCOPES = ("full", "full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess")

_NAME = re.compile(r"\b(fwd|bwd|recompute) (attn|mlp|moe) L(\d+) mb(\d+)(.*)$")


@dataclass(frozen=True)
class GraphPlan:
    """The scopes in force, normalised as Megatron-Core does (``full`` -> the whole layer)."""

    impl: str
    layer: bool
    """The whole transformer layer is one graph (``full`` or an empty scope list)."""
    scopes: frozenset[str]
    iteration: bool = False


def check_cuda_graphs(ctx: JobContext, opts: MegatronOptions) -> GraphPlan | None:
    """Refuse what Megatron-Core's ``TransformerConfig.__post_init__`` refuses (core_v0.16.0)
    and what cannot be captured; return the plan, or None without CUDA graphs."""
    impl = opts.cuda_graph_impl
    if impl == "none":
        return None
    scope = list(opts.cuda_graph_scope or [])
    if impl == "full_iteration":
        # Megatron-Core 2026: the implementation of its own, its module list left empty.
        ctx.require(not scope, KEY, 'cuda_graph_scope must be empty when cuda_graph_impl is '
                    '"full_iteration"')
        impl, scope = "local", ["full_iteration"]
    s, m = ctx.scenario, ctx.model
    moe = m.moe
    ctx.require("full" not in scope or scope == ["full"], KEY,
                "full scope cannot be used with other scopes")
    layer = scope in ([], ["full"])
    sc = frozenset(scope) - {"full"}
    if impl == "local" and sc & {"moe_router", "moe_preprocess"}:
        sc |= {"moe_router", "moe_preprocess"}   # local does not tell them apart
    ctx.require(impl == "local" or "full_iteration" not in sc, "framework.cuda_graph_impl",
                "full_iteration needs cuda_graph_impl local, not transformer_engine")
    ctx.require("full_iteration" not in sc or sc == {"full_iteration"}, KEY,
                "full_iteration cannot be combined with other scopes")
    ctx.require(not ({"moe", "moe_router"} <= sc), KEY,
                "cuda_graph_scope must not contain both moe and moe_router")
    ctx.require("moe_preprocess" not in sc or "moe_router" in sc, KEY,
                "moe_preprocess cuda graph is only supported with moe_router cuda graph")
    ctx.require(moe is not None or not (sc & {"moe", "moe_router"}), KEY,
                "moe cuda graph is only supported for MoE")
    dropless = moe is not None and not (moe.capacity_factor is not None
                                        and opts.moe_pad_expert_input_to_capacity)
    # A rank budget (HybridEP) fixes every shape on the device: nothing for the host to read.
    host_read = dropless and opts.moe_expert_rank_capacity_factor is None
    if moe is not None:
        ctx.require("mlp" not in sc or moe.first_k_dense > 0, KEY,
                    "mlp cuda graph is only supported for dense layers, but not found in "
                    "the model")
        ctx.require("moe" not in sc or not dropless, KEY,
                    "moe cuda graph is only supported with drop-padding MoE "
                    "(model capacity_factor and moe_pad_expert_input_to_capacity)")
        ctx.require("moe_preprocess" not in sc or not dropless
                    or opts.moe_token_dispatcher_type != "alltoall"
                    or moe.capacity_factor is None, KEY,
                    "moe_preprocess cuda graph is not supported when there are DtoH copies "
                    "and synchronizations in the preprocess step")
        # Not a config assert, but capture fails: the dropless dispatcher's host read of the
        # tokens per expert (cuda_sync_point) cannot run inside a graph.
        ctx.require(not ((layer or "full_iteration" in sc) and host_read), KEY,
                    "a dropless MoE layer cannot be captured whole (the host reads its "
                    "tokens per expert); use attn, moe_router, moe_preprocess, or give "
                    "HybridEP a rank budget (moe_expert_rank_capacity_factor)")
    ac = s.training.activation_checkpointing
    ctx.require(ac != "full" or sc == {"full_iteration"}, KEY,
                "full recompute is only supported with full iteration CUDA graph")
    ctx.require(not (impl == "transformer_engine" and ac == "selective"
                     and "moe" in (opts.recompute_modules or []) and "moe_router" in sc), KEY,
                "moe recompute is not supported with moe_router CUDA graph with "
                "cuda_graph_impl transformer_engine")
    return GraphPlan(impl, layer, sc, iteration="full_iteration" in sc)


def _region(plan: GraphPlan, block: str, rest: str) -> str | None:
    """Which captured region an op of ``block`` (attn, mlp, moe; ``rest``: the name after
    the layer and micro-batch) belongs to, or None when it runs eagerly."""
    if plan.layer:
        return "layer"
    if block in plan.scopes and block in ("attn", "mlp", "moe"):
        return block
    if block == "moe" and "moe_router" in plan.scopes:
        # The router op holds the pre-MLP norm, the router and the permutation (the
        # dispatcher's preprocess); the aux-loss count reduce sits in the router's graph.
        if rest.strip() in ("router", "aux-loss count all_reduce"):
            return "router"
    return None


def apply_cuda_graphs(program: Program, plan: GraphPlan, cpu_call: float,
                      hidden_bytes: float, vp: int) -> int:
    """Set the host seconds of every captured op: the first op of each region (rank class,
    pass, layer, micro-batch, region) pays one replay, :func:`replay_cpu_s`, the others
    nothing (their kernels and NCCL calls are in the graph); add each class's graph memory
    (:func:`graph_memory`, ``hidden_bytes``: one micro-batch's hidden states on a rank).
    Returns the regions."""
    first: dict[tuple[object, ...], Op] = {}
    captured: dict[int, list[Op]] = {}
    cls_of = {id(op): c.id for c in program.classes for ops in c.streams.values()
              for op in ops}
    for op in program.ops:
        if op.kind == "host":
            continue
        if plan.iteration:
            if op.category == "optimizer" or op.phase == "optimizer":
                continue
            key: tuple[object, ...] = (cls_of.get(id(op)), "iteration")
        else:
            mt = _NAME.search(op.name)
            if mt is None:
                continue
            region = _region(plan, mt.group(2), mt.group(5))
            if region is None:
                continue
            # Recomputation runs inside the backward graph of its region.
            bwd = mt.group(1) != "fwd"
            key = (cls_of.get(id(op)), bwd, int(mt.group(3)), int(mt.group(4)), region)
        if key not in first:
            first[key] = op
            op.cpu_s = replay_cpu_s(cpu_call, key[1] is True)
        else:
            op.cpu_s = 0.0
        captured.setdefault(cls_of.get(id(op), -1), []).append(op)
    for c in program.classes:
        ops = captured.get(c.id, [])
        if ops:
            # Held from graph capture on: buffers before the step starts.
            c.initial_memory["buffers"] = (c.initial_memory.get("buffers", 0.0)
                                           + graph_memory(ops, plan, hidden_bytes, vp))
    return len(first)


def graph_memory(ops: list[Op], plan: GraphPlan, hidden_bytes: float, vp: int) -> float:
    """Bytes one rank's graphs hold beyond eager execution, as Megatron-Core lays them out.

    A graph's temporaries live in its private memory pool and are not returned to the
    caching allocator. ``local`` (``CudaGraphManager`` in reuse mode) gives each virtual
    stage one forward pool per micro-batch in flight (``fwd_mempools[vpp_rank][runner]``)
    and every backward graph one shared pool (``bwd_mempool``); Transformer Engine's
    ``make_graphed_callables`` captures all callables into one shared pool. Each pool holds
    the largest transient peak of the captured ops it runs. Static buffers: consecutive
    layers share their hidden-state input/output buffers
    (``optimize_transformer_layer_graph_buffers``), so a runner adds one static input, and the
    backward graphs one static output gradient, of ``hidden_bytes`` each."""
    fwd = [o for o in ops if o.phase == "fwd"]
    bwd = [o for o in ops if o.phase in ("bwd", "recompute")]
    pools = 1.0
    if plan.impl == "local" and not plan.iteration:
        pools = vp * _mean_in_flight(ops)
    peak_f = max((o.transient for o in fwd), default=0.0)
    peak_b = max((o.transient for o in bwd), default=0.0)
    return pools * (peak_f + hidden_bytes) + peak_b + hidden_bytes


def _mean_in_flight(ops: list[Op]) -> float:
    """Micro-batches whose forward of a layer has run and whose backward has not, at most,
    averaged over the captured layers (a virtual stage's layers share one count): the
    runners ``CudaGraphManager`` keeps per layer."""
    live: dict[int, set[int]] = {}
    most: dict[int, int] = {}
    for o in ops:
        if o.layer is None or o.micro_batch is None:
            continue
        cur = live.setdefault(o.layer, set())
        if o.phase == "fwd":
            cur.add(o.micro_batch)
        elif o.phase == "bwd":
            cur.discard(o.micro_batch)
        most[o.layer] = max(most.get(o.layer, 0), len(cur))
    return sum(most.values()) / len(most) if most else 1.0


def replay_cpu_s(cpu_call: float, backward: bool) -> float:
    """Host seconds of one graph replay: :data:`REPLAY_PY_CALLS` Python calls (a backward
    autograd node's at half a forward call's, as the builder prices eager backward ops)
    and one :data:`GRAPH_LAUNCH_CPU_S`."""
    return REPLAY_PY_CALLS * (cpu_call / 2 if backward else cpu_call) + GRAPH_LAUNCH_CPU_S
