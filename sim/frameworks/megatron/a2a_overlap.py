"""Megatron-Core's ``--overlap-moe-expert-parallel-comm``: the combined 1F1B schedule.

Megatron-Bridge's ``moe_a2a_overlap`` sets it. In the steady phase one micro-batch's forward
and another's backward are issued together, layer by layer, so that each one's expert
all-to-alls run on a communication stream while the other's compute runs
(NVIDIA/Megatron-LM @ d98e8a6, 2026-08):

* ``models/gpt/fine_grained_callables.py`` (``build_transformer_layer_callables``) cuts a
  layer into nodes: ``pre_dispatch_computation`` (attention, pre-MLP norm, shared experts,
  router, dispatch preprocess: the permutation and the token-count all-gather),
  ``moe_dispatch`` (the token and probs all-to-alls), ``mlp`` (dispatch postprocess with the
  expert-TP gather, the grouped experts, the combine preprocess with the expert-TP
  reduce-scatter), ``moe_combine`` (the combine all-to-all, the unpermutation and the residual
  add) and, for an MTP layer, ``mtp_post_process`` (its head and loss). Dense layers have
  only the first and the third.
* ``models/common/model_chunk_schedule_plan.py``: ``TransformerLayerSchedulePlan`` puts the
  dispatch and combine nodes on the communication stream (``get_comm_stream``), the others on
  the compute stream. Every node of one micro-batch's chunk waits for the chunk's one CUDA
  event and records it when done (``ScheduleNode.stream_acquire_context``,
  ``pipeline_parallel/utils.py``), so a micro-batch's nodes run one after another across the
  two streams while the other micro-batch's nodes fill the gaps. ``run`` issues, for forward
  layer ``i`` and backward layer ``L - 1 - i``: b mtp_post_process, b combine (comm), f
  pre_dispatch (comp), b mlp (comp), f dispatch (comm), b dispatch (comm), f mlp (comp),
  f combine (comm), b pre_dispatch (comp), f mtp_post_process; the host issues in that order.
  Under full recomputation (Megatron-LM's dev branch since PR 6311, 1ea5c3472e; main's PR
  6429 is the same change) the forward runs without keeping its activations and ``run``
  first replays the backward layer's forward (``RecomputeSegment.recompute``: its nodes on
  their usual streams, one after another on the backward's chain), so the replay and its
  all-to-alls have nothing of the forward micro-batch beside them; Megatron-Core's main
  branch still refuses the pair (``transformer_config.py`` at d98e8a6).
* ``TransformerModelChunkSchedulePlan.run``: after the pipeline waits, the forward's
  embedding and the backward's output layer, then the overlapped layers, the backward's and
  then the forward's remaining layers alone, the point-to-point sends, the forward's output
  layer, the backward's embedding, and the compute stream waits for both chunks' events.
* ``pipeline_parallel/combined_1f1b.py`` and ``schedules.py``: without pipelining the first
  forward runs alone, then (forward i + 1, backward i) pairs, then the last backward; the
  interleaved schedule runs one more warm-up forward (``get_pp_rank_microbatches``: "to
  ensure the forward and backward computations are independent in all 1f1b steps") and
  waits for both the forward's and the backward's receive before a pair.

With ``delay_wgrad_compute`` each backward layer's two ``backward_dw`` calls issue the weight
gradients split out of it (:mod:`sim.frameworks.megatron.delay_wgrad`): the mlp node's after
the forward's dispatch, before the backward's; the pre_dispatch node's after the forward's
mtp_post_process, the chunk's first layer's after every layer.

What this does not model: the high-priority communication stream
(``high_priority_a2a_comm_stream``) and the forward's pipeline send starting at the forward's
last node (here it waits for the whole pair, a little late). ``CUDA_DEVICE_MAX_CONNECTIONS``
(Megatron-LM only warns) is modelled when it is 1 (:func:`single_queue_emit`): every stream's
work then goes through one hardware queue in the host's issue order.

With more than one connection on Hopper (and Blackwell, whose GEMMs are persistent too:
:mod:`sim.engine.launch_wait`), a communication kernel launched while compute holds
every SM starts only when that compute ends (Megatron-Bridge's launch script, ``perf_plugins.py``
@ da98070: "communication kernel will be pushed to the end of the GEMM kernel, failing to
overlap"; it still sets 8, 32 with DeepEP, under ``moe_a2a_overlap``): the communication
stream's all-to-alls are marked ``Op.launch_behind_compute`` and the engine holds them behind
the compute ops running when they become ready (:mod:`sim.engine.launch_wait`). Stream
priority (``TORCH_NCCL_HIGH_PRIORITY=1``, DeepEP's high-priority pool stream) orders pending
blocks, it does not evict resident ones.

Each schedule node's own wrapper (event wait and record, stream switch, detach, a separate
``run_backward`` per backward node) costs host time (:mod:`sim.frameworks.megatron.
schedule_nodes`); at core_v0.14.0 a MoE layer's attention and ``post_attn`` are two nodes.

What runs on the communication stream besides the all-to-alls, so that it waits for them and
they for it: the combine node's unpermutation (``combine_postprocess``), the shared experts'
add and the residual add (``mlp_bda``), and their backward. Their kernels take the GPU's SMs
in turn with the compute stream's (``Op.side_kernel``), not beside them. The host's wait for
the token counts is in the dispatch node (:func:`dispatch_wait`), after the host has issued
the backward's mlp node. The all-to-alls' own SMs (NCCL's channels, DeepEP's
``Op.sm_ctas``) slow the compute beside them through the engine's interference model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.pipeline import Step, Unit
from sim.frameworks.megatron.schedule_nodes import NodeHost
from sim.frameworks.megatron.shape import MegatronShape
from sim.program.ir import HOST_WAIT_STREAM, Op

if TYPE_CHECKING:
    from sim.frameworks.megatron.delay_wgrad import LayerWgrad

COMM_STREAM = "moe_a2a"
"""The combined schedule's communication stream (``set_streams``' ``_COMM_STREAM``)."""
KEY = "framework.moe_a2a_overlap"


def check_a2a_overlap(ctx: JobContext, s: MegatronShape) -> None:
    """Refuse what Megatron-Core refuses with ``overlap_moe_expert_parallel_comm``
    (``TransformerConfig.__post_init__``, transformer_config.py), with one line naming the
    key."""
    o, par = s.opts, ctx.scenario.parallelism
    ctx.require(ctx.model.moe is not None and par.ep > 1, KEY,
                "overlap_moe_expert_parallel_comm is only supported with expert model "
                "parallelism (a mixture-of-experts model and parallelism.ep > 1)")
    ctx.require(o.moe_token_dispatcher_type in ("alltoall", "flex"), KEY,
                "overlap_moe_expert_parallel_comm is supported with the alltoall or flex "
                "token dispatcher, not allgather")
    ctx.require(s.p == 1 or s.vp > 1, KEY,
                "with pipeline parallelism the combined 1F1B schedule needs virtual stages "
                "(parallelism.vp > 1: virtual_pipeline_model_parallel_size must be specified "
                "when pipeline_model_parallel_size > 1)")
    ctx.require(o.pipeline_schedule in ("1f1b", "dualpipe", "dualpipev"), KEY,
                "the combined schedule replaces 1F1B (pipeline_schedule: 1f1b); DualPipe "
                "overlaps its F&B pairs with it (pipeline_schedule: dualpipe or dualpipev)")
    if s.ac == "full":
        # Megatron-LM's dev branch replays each layer before its backward (PR 6311); the two
        # features its replay cannot pair with are refused there (transformer_config.py).
        ctx.require(not o.moe_paged_stash, KEY,
                    "overlap_moe_expert_parallel_comm full recompute is not yet supported "
                    "together with moe_paged_stash")
        ctx.require(not o.fine_grained_activation_offloading, KEY,
                    "overlap_moe_expert_parallel_comm full recompute is not yet supported "
                    "together with fine_grained_activation_offloading")
    ctx.require(not o.moe_shared_expert_overlap, KEY,
                "disable moe_shared_expert_overlap when enabling "
                "overlap_moe_expert_parallel_comm")
    ctx.require(ctx.model.mtp_layers <= 1, KEY,
                "MTP supports at most one layer with overlap_moe_expert_parallel_comm")


# ---------------------------------------------------------------------- one unit's nodes
@dataclass
class LayerNodes:
    """One layer's ops in one unit, cut into Megatron's schedule nodes (issue order of that
    pass); ``dispatch`` and ``combine`` are empty in a dense layer."""

    pre: list[Op] = field(default_factory=list)
    dispatch: list[Op] = field(default_factory=list)
    mlp: list[Op] = field(default_factory=list)
    combine: list[Op] = field(default_factory=list)
    post: list[Op] = field(default_factory=list)
    """``mtp_post_process`` (an MTP layer's head and loss), or ops before the combine."""
    replay: LayerNodes | None = None
    """Under full recomputation, a backward layer's forward replayed before its backward
    (``RecomputeSegment.recompute``), cut as a forward's nodes; None otherwise."""


def _a2a(op: Op, which: str) -> bool:
    return op.collective == "all_to_all" and which in op.name


def _index(ops: list[Op], pred: Callable[[Op], bool], start: int = 0) -> int:
    return next((i for i in range(start, len(ops)) if pred(ops[i])), len(ops))


def _run_end(ops: list[Op], i: int, which: str) -> int:
    while i < len(ops) and _a2a(ops[i], which):
        i += 1
    return i


def _layer(n: LayerNodes) -> int:
    """The layer number of a layer's nodes."""
    return next((o.layer for o in (*n.pre, *n.mlp, *n.combine, *n.post) if o.layer is not None),
                -1)


def _unpermute(op: Op) -> bool:
    return op.kind == "compute" and op.name.endswith(" combine")


def forward_nodes(ops: list[Op]) -> LayerNodes:
    """A layer's forward ops as nodes: pre_dispatch up to the dispatch all-to-alls, mlp up to
    the combine all-to-all, combine with the unpermutation, then the MTP head."""
    d = _index(ops, lambda o: _a2a(o, "dispatch"))
    if d == len(ops):       # dense: attention, then the MLP block
        m = _index(ops, lambda o: " mlp L" in o.name)
        return LayerNodes(pre=ops[:m], mlp=ops[m:])
    de = _run_end(ops, d, "dispatch")
    c = _index(ops, lambda o: _a2a(o, "combine"), de)
    ce = c + 1
    while ce < len(ops) and _unpermute(ops[ce]):
        ce += 1
    return LayerNodes(pre=ops[:d], dispatch=ops[d:de], mlp=ops[de:c], combine=ops[c:ce],
                      post=ops[ce:])


def backward_nodes(ops: list[Op], replays: bool = False) -> LayerNodes:
    """A layer's backward ops as nodes: the MTP head's backward, combine (the unpermutation's
    backward and the combine's reverse all-to-all), mlp, the dispatch's reverse all-to-alls,
    then pre_dispatch (shared experts, router, attention). ``replays`` (full recomputation):
    the layer's replayed forward, its leading ``recompute`` ops, becomes
    :attr:`LayerNodes.replay`; a selective module recomputation (``recompute_modules``) stays
    in the backward node it belongs to."""
    r = _index(ops, lambda o: not o.name.startswith("recompute ")) if replays else 0
    if r:
        nodes = backward_nodes(ops[r:])
        nodes.replay = forward_nodes(ops[:r])
        return nodes
    c = _index(ops, lambda o: _a2a(o, "combine"))
    if c == len(ops):       # dense: the MLP block, then attention
        a = _index(ops, lambda o: " attn L" in o.name)
        return LayerNodes(mlp=ops[:a], pre=ops[a:])
    cs = c - 1 if c > 0 and _unpermute(ops[c - 1]) else c
    d = _index(ops, lambda o: _a2a(o, "dispatch"), c + 1)
    de = _run_end(ops, d, "dispatch")
    return LayerNodes(post=ops[:cs], combine=ops[cs:c + 1], mlp=ops[c + 1:d],
                      dispatch=ops[d:de], pre=ops[de:])


def split_unit(ops: list[Op], forward: bool, replays: bool = False
               ) -> tuple[list[Op], list[LayerNodes], list[Op]]:
    """A unit's ops as (ops before its first layer, each layer's nodes in the unit's order,
    ops after its last layer). Ops without a layer between two layers' stay with the one
    before. ``replays``: a backward unit under full recomputation (:func:`backward_nodes`)."""
    first = _index(ops, lambda o: o.layer is not None)
    last = max((i for i, o in enumerate(ops) if o.layer is not None), default=-1)
    runs: list[list[Op]] = []
    prev: int | None = None
    for op in ops[first:last + 1]:
        if op.layer is not None and op.layer != prev:
            runs.append([])
            prev = op.layer
        runs[-1].append(op)
    nodes = [forward_nodes(r) if forward else backward_nodes(r, replays) for r in runs]
    return ops[:first], nodes, ops[last + 1:]


# ---------------------------------------------------------------------- the host's wait
def dispatch_wait(n: LayerNodes, label: str) -> Op | None:
    """Move the host's wait for a forward MoE layer's token counts from the pre_dispatch node
    to the start of its dispatch node, as Megatron-Core's dispatchers wait there: the host has
    issued the other micro-batch's node between them before it blocks. Returns the new wait
    (None in a dense layer or without a wait).

    * ``alltoall`` (``MoEAlltoAllTokenDispatcher``): ``dispatch_preprocess`` (in
      pre_dispatch) starts the counts' copy to the host on a side stream that waits for the
      compute stream (``cuda_dtoh_point`` "before_permutation_1"); ``token_dispatch`` (in
      moe_dispatch) waits for it (``cuda_sync_point`` "before_ep_alltoall",
      ``d2h_event.synchronize``): the wait follows the count all-gather.
    * ``flex`` with DeepEP (``fused_dispatch``, ``fused_a2a.py``: "the CPU will wait for
      GPU's signal to arrive"): ``Buffer.dispatch`` spins on the received counts its notify
      kernel writes, and that kernel waits for the communication stream's event at the
      node's start (``previous_event``), so the wait is the first op of the node on the
      communication stream: after the chunk's previous node and the other micro-batch's
      earlier communication on that stream.
    """
    sync = next((o for o in n.pre if o.host_sync), None)
    if sync is None or not n.dispatch:
        return None
    sync.host_sync = False
    deepep = any(o.sm_ctas for o in n.dispatch)
    return Op(name=f"{label} {sync.name.split(' token count')[0]} token count wait",
              kind="compute", stream=COMM_STREAM if deepep else HOST_WAIT_STREAM, phase="comm",
              kernels=0, category="sync", host_sync=True,
              deps=[] if deepep else [sync], layer=sync.layer, micro_batch=sync.micro_batch)


# ---------------------------------------------------------------------- one hardware queue
def single_queue_emit(emit: Callable[[Op], None]) -> Callable[[Op], None]:
    """``emit`` as the GPU sees the pair's ops when ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one
    hardware work queue (one "connection") holds every stream's kernels and event waits in
    the host's issue order, and an operation is dispatched from it only when the preceding
    calls in its stream have completed and the preceding calls in the queue have been
    dispatched (NVIDIA, "CUDA C/C++ Streams and Concurrency", S. Rennich, 2011, "Stream
    Scheduling"; NVIDIA/cuda-samples ``simpleHyperQ``: without Hyper-Q's separate queues two
    streams' kernels overlap only at the boundary between one's last and the other's first
    kernel, the false dependencies Hyper-Q removes). So an op launches no earlier
    than the op issued before it: beside a single-kernel op (an all-to-all, a marker) as soon
    as that one could launch, but after a multi-kernel op only once that op's last kernel has
    launched, taken here as its end (the last kernel is a small part of a block's work).

    Consequence in the combined schedule: a communication node issued after the other
    micro-batch's compute node (the forward's dispatch after the backward's mlp) and a compute
    node queued behind a communication node whose stream is still busy (the forward's mlp
    behind the backward's dispatch) no longer overlap; the nodes issued just before the other
    chain's compute (the backward's combine before the forward's pre_dispatch, the forward's
    combine before the backward's pre_dispatch) still do. Host-side waits take no queue slot.
    """
    gate: list[Op] = []       # what the op issued next must wait to finish before launching
    last: dict[str, Op] = {}  # the previous op on each stream, within the pair

    def put(op: Op) -> None:
        nonlocal gate
        if op.stream == HOST_WAIT_STREAM:
            emit(op)
            return
        extra = [g for g in gate if g is not op and g not in op.deps]
        if extra:
            op.deps = [*op.deps, *extra]
        if op.kernels > 1:
            gate = [op]
        else:
            prev = last.get(op.stream)
            gate = list(dict.fromkeys([*op.deps, *([prev] if prev is not None else [])]))
        last[op.stream] = op
        emit(op)
    return put


def pre_nodes(n: LayerNodes) -> int:
    """Schedule nodes in a layer's ``pre`` ops at core_v0.14.0: ``attn`` and, in a MoE
    layer, ``post_attn`` (``TransformerLayerSchedulePlan._build_callable_nodes``; a dense
    layer's ``post_attn`` is a ``NoopScheduleNode``). Later cores merge them into one
    ``pre_dispatch_computation`` node."""
    return 2 if n.dispatch else 1


# ---------------------------------------------------------------------- issue one pair
def issue_pair(f_ops: list[Op], b_ops: list[Op], emit: Callable[[Op], None],
               label: str, wgrad: Mapping[int, LayerWgrad] | None = None,
               single_queue: bool = False,
               node_cpu: NodeHost | None = None,
               full_recompute: bool = False) -> tuple[Op, Op]:
    """Issue a forward unit's and a backward unit's ops as Megatron-Core's combined step does
    (see the module docstring) through ``emit`` (which adds an op to the stage's program);
    return the (first, last) ops the pipeline's waits and sends attach to: a start marker
    after the waits that both micro-batches' first nodes wait for, and an end marker at which
    the compute stream waits for both (``wait_current_stream``). ``wgrad``: the backward
    layers' delayed weight gradients by layer (``delay_wgrad_compute``), issued on the
    compute stream outside the backward's chain of nodes. ``single_queue``:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (:func:`single_queue_emit`). ``node_cpu``: the host
    seconds of each schedule node's own machinery (:func:`sim.frameworks.megatron.
    schedule_nodes.node_host`), spent before the node's first op. ``full_recompute``: the
    backward layers' forwards are replayed first (``activation_checkpointing: full``)."""
    host = node_cpu if node_cpu is not None else NodeHost(0.0, 0.0)
    if single_queue:
        emit = single_queue_emit(emit)
    f_head, f_layers, f_tail = split_unit(f_ops, True)
    b_head, b_layers, b_tail = split_unit(b_ops, False, full_recompute)
    start = Op(name=f"combined 1f1b {label} start", kind="compute", stream="compute",
               phase="comm", kernels=0, category="sync")
    emit(start)
    prev: dict[str, Op] = {"f": start, "b": start}

    def node(chain: str, ops: list[Op], comm: bool = False, nodes: int = 1) -> None:
        """Issue one node: on the communication stream when ``comm``; its first op waits for
        the chain's previous node (the chunk's event)."""
        if not ops:
            return
        # The node's own host calls (event wait and record, stream switch, detach, its own
        # autograd call in backward) before its first op is issued.
        ops[0].cpu_s += nodes * host.node_s(chain == "f")
        if ops[0] is not prev[chain] and prev[chain] not in ops[0].deps:
            ops[0].deps = [*ops[0].deps, prev[chain]]
        for op in ops:
            if comm and op.stream == "compute":
                op.stream = COMM_STREAM
                # Its elementwise kernels take the SMs in turn with the compute stream's.
                op.side_kernel = op.kind == "compute" and op.duration > 0
            if comm and op.kind == "collective" and not single_queue:
                # Its own hardware queue: launched when ready, behind a running GEMM.
                op.launch_behind_compute = True
            emit(op)
        # The chunk's event is recorded on the node's stream: a host copy beside it
        # (activation offloading's D2H and H2D streams) is not part of the chain.
        prev[chain] = next((o for o in reversed(ops) if o.host_transfer is None), ops[-1])

    def dispatch(n: LayerNodes, chain: str = "f") -> None:
        """A forward's dispatch node, the host waiting in it for the token counts."""
        wait = dispatch_wait(n, f"combined 1f1b {label}")
        if wait is not None and wait.stream == HOST_WAIT_STREAM:
            emit(wait)      # the counts' copy, not the chunk's event
            wait = None
        node(chain, [wait, *n.dispatch] if wait is not None else n.dispatch, True)

    def replay(n: LayerNodes) -> None:
        """Full recomputation (Megatron-LM dev, PR 6311): the backward layer's forward is
        replayed, node by node on its usual streams, before anything else of the pair is
        issued (``TransformerLayerSchedulePlan.run``: ``recompute_segment.recompute`` first),
        so nothing of the forward micro-batch is there to overlap it."""
        r = n.replay
        if r is None:
            return
        node("b", r.pre, nodes=pre_nodes(r))
        dispatch(r, "b")
        node("b", r.mlp)
        node("b", r.combine, True)
        node("b", r.post)

    last_b = b_layers[-1] if b_layers else None

    def dw(n: LayerNodes, which: str) -> None:
        """``backward_dw`` of node ``which`` of backward layer ``n``: no event, so the
        backward's next node does not wait for it; the chunk's first layer's pre_dispatch
        one waits until after every layer."""
        if wgrad is None or (which == "pre" and n is last_b):
            return
        w = wgrad.get(_layer(n))
        for op in (w.mlp if which == "mlp" else w.pre) if w is not None else ():
            emit(op)

    def alone_b(n: LayerNodes) -> None:
        replay(n)
        node("b", n.post)
        node("b", n.combine, True)
        node("b", n.mlp)
        dw(n, "mlp")
        node("b", n.dispatch, True)
        node("b", n.pre, nodes=pre_nodes(n))
        dw(n, "pre")

    def alone_f(n: LayerNodes) -> None:
        node("f", n.pre, nodes=pre_nodes(n))
        dispatch(n)
        node("f", n.mlp)
        node("f", n.combine, True)
        node("f", n.post)

    node("f", f_head)
    node("b", b_head)
    both = min(len(f_layers), len(b_layers))
    for fn, bn in zip(f_layers[:both], b_layers[:both], strict=True):
        replay(bn)
        node("b", bn.post)
        node("b", bn.combine, True)
        node("f", fn.pre, nodes=pre_nodes(fn))
        node("b", bn.mlp)
        dispatch(fn)
        dw(bn, "mlp")
        node("b", bn.dispatch, True)
        node("f", fn.mlp)
        node("f", fn.combine, True)
        node("b", bn.pre, nodes=pre_nodes(bn))
        node("f", fn.post)
        dw(bn, "pre")
    for bn in b_layers[both:]:
        alone_b(bn)
    for fn in f_layers[both:]:
        alone_f(fn)
    if wgrad is not None and last_b is not None:
        w = wgrad.get(_layer(last_b))
        for op in w.pre if w is not None else ():
            emit(op)
    node("f", f_tail)
    node("b", b_tail)
    end = Op(name=f"combined 1f1b {label} end", kind="compute", stream="compute",
             phase="comm", kernels=0, category="sync", deps=[prev["f"], prev["b"]])
    emit(end)
    return start, end


# ---------------------------------------------------------------------- the schedule
def combined_warmup(p: int, s: int, m: int, vp: int) -> int:
    """Warm-up forwards of stage ``s`` in the combined schedule: plain 1F1B's plus one
    (``get_pp_rank_microbatches`` with ``overlap_moe_expert_parallel_comm``; without
    pipelining the first forward runs alone, ``combined_1f1b_schedule_for_no_pipelining``).

    >>> combined_warmup(1, 0, 8, 1), combined_warmup(4, 0, 8, 2), combined_warmup(4, 3, 8, 2)
    (1, 11, 5)
    """
    if vp == 1:
        return min(p - s - 1 + 1, m)
    return min((p - s - 1) * 2 + (vp - 1) * p + 1, m * vp)


def pair_steps(steps: list[Step], order: list[Unit], warmup: int) -> list[Step]:
    """Merge each steady (forward, backward) pair of a stage's ``steps`` into one step (its
    ``unit`` the forward, ``paired`` the backward), ``order`` being the stage's unit order
    with ``warmup`` warm-up forwards (one more than plain 1F1B's with virtual stages). The
    waits between the two units move before the pair and the posts after it, as
    ``pp_pre_forward`` and ``pp_pre_backward`` wait before the combined step and
    ``pp_post_forward`` / ``pp_post_backward`` post after it (schedules.py)."""
    pairs = {order[i]: order[i + 1] for i in range(warmup, len(order) - 1, 2)
             if order[i][0] == "F" and order[i + 1][0] == "B"}
    out: list[Step] = []
    i = 0
    while i < len(steps):
        st = steps[i]
        if st.what != "unit" or st.unit not in pairs:
            out.append(st)
            i += 1
            continue
        b = pairs[st.unit]
        j = next(k for k in range(i + 1, len(steps))
                 if steps[k].what == "unit" and steps[k].unit == b)
        between = steps[i + 1:j]
        out += [x for x in between if x.what == "wait"]
        out.append(Step("unit", st.unit, paired=b))
        out += [x for x in between if x.what == "post"]
        i = j + 1
    return out
