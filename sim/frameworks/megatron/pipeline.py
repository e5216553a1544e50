"""Megatron-Core's pipeline schedules with their point-to-point calls and wait points.

``megatron/core/pipeline_parallel/schedules.py`` moves activations and gradients between
stages with the calls of ``p2p_communication.py``. Every call ends up in ``_communicate``:

* Non-interleaved 1F1B (``forward_backward_pipelining_without_interleaving``) always runs
  with ``batch_p2p_comm`` (Megatron-LM's ``validate_args`` sets ``overlap_p2p_comm = False``
  without virtual stages, and ``batch_p2p_comm = not overlap_p2p_comm``): each call posts its
  sends and receives together (``torch.distributed.batch_isend_irecv``), waits for all of
  them (``req.wait()``) and, with ``batch_p2p_sync`` (default True), calls
  ``torch.cuda.synchronize()``: the host stops until every stream of the GPU is idle. The
  calls per stage: warm-up ``recv_forward``/``send_forward`` around each forward, then
  ``send_forward_recv_backward`` after each steady forward and
  ``send_backward_recv_forward`` after each steady backward (``send_backward`` after the
  last), cool-down ``recv_backward``/``send_backward``.
* Interleaved 1F1B (``forward_backward_pipelining_with_interleaving``) with Megatron-LM's
  default ``overlap_p2p_comm`` (``--no-overlap-p2p-communication`` turns it off): after each
  forward the send of its output and the receive of the next forward's input are posted
  without waiting (``send_forward_recv_forward(..., overlap_p2p_comm=True)``); the handles
  are waited for just before the next forward (``fwd_wait_handles``); backwards alike
  (``bwd_wait_handles``). The first forward's input is received blocking; the first
  backward's gradient receive is posted with the last warm-up forward. No synchronize.

A large NCCL send cannot finish before the peer has posted the matching receive (NCCL's
send/recv proxy moves data only into buffers the receiver has offered, ``NCCL_BUFFSIZE`` per
channel; activations are megabytes), so each transfer here is a rendezvous of both stages
(op kind ``recv`` on both sides, one key): a sender that must wait for its send stalls until
the receiver reaches its receive. Bubbles and stalls then come out of the simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.layout import Layout, layout_chunks, layout_vp
from sim.program.ir import HOST_WAIT_STREAM, NcclType, Op, Program, RankClass

Unit = tuple[str, int, int]
"""(F|B, model chunk, micro-batch) of one stage."""
Transfer = tuple[str, int, int]
"""(F|B, sending virtual stage, micro-batch): what ``pp/{kind}/{v}/{mb}`` carries."""


def schedule(kind: str, p: int, s: int, m: int, vp: int, extra_warmup: int = 0
             ) -> list[Unit]:
    """Stage ``s``'s order of (F|B, model chunk, micro-batch) units.

    1F1B with min(p - s - 1, m) warm-up forwards on stage s, interleaved 1F1B with ``vp``
    model chunks per stage ((p - s - 1) * 2 + (vp - 1) * p warm-up units,
    ``get_pp_rank_microbatches``), or GPipe (all forwards, then all backwards).
    ``extra_warmup``: more warm-up forwards (the combined 1F1B schedule's one,
    :mod:`sim.frameworks.megatron.a2a_overlap`).

    Examples
    --------
    1F1B on the first of 4 stages with 4 micro-batches: 3 warm-up forwards.

    >>> [f"{k}{i}" for k, _, i in schedule("1f1b", 4, 0, 4, 1)]
    ['F0', 'F1', 'F2', 'F3', 'B0', 'B1', 'B2', 'B3']
    >>> [f"{k}{i}" for k, _, i in schedule("1f1b", 4, 3, 4, 1)]
    ['F0', 'B0', 'F1', 'B1', 'F2', 'B2', 'F3', 'B3']
    """
    if kind == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    total = m * vp
    if vp == 1:
        warmup = min(p - s - 1 + extra_warmup, m)
    else:
        warmup = min((p - s - 1) * 2 + (vp - 1) * p + extra_warmup, total)

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * vp)) // p
        return c if forward else vp - 1 - c

    def micro(k: int) -> int:
        return (k // (p * vp)) * p + k % p if vp > 1 else k

    order: list[Unit] = []
    for k in range(warmup):
        order.append(("F", chunk(k, True), micro(k)))
    for k in range(total - warmup):
        f = warmup + k
        order.append(("F", chunk(f, True), micro(f)))
        order.append(("B", chunk(k, False), micro(k)))
    for k in range(total - warmup, total):
        order.append(("B", chunk(k, False), micro(k)))
    return order


def chunk_layers(layers: int, p: int, vp: int, embedding_counts: bool = False,
                 loss_counts: bool = False, first: int | None = None,
                 last: int | None = None, layout: Layout | None = None) -> list[list[int]]:
    """Transformer layers of each virtual pipeline chunk ``v`` (stage ``v % p``, model chunk
    ``v // p``), in Megatron-Core's order (``get_transformer_layer_offset``).

    With ``account_for_embedding_in_pipeline_split`` / ``..._loss_...`` the embedding (loss
    and output layer) counts as one layer: ``layers + 1 (+1)`` are split evenly and the first
    (last) chunk takes one transformer layer fewer. Llama 3.1 405B's 126 layers split over
    8 x 8 chunks this way (NeMo's recipe).

    Examples
    --------
    >>> chunk_layers(8, 4, 1)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> sizes = [len(c) for c in chunk_layers(126, 8, 8, True, True)]
    >>> sizes[:3], sizes[-2:], len(sizes)
    ([1, 2, 2], [2, 1], 64)

    With ``decoder_first_pipeline_num_layers`` / ``..._last_...`` (``first`` / ``last``)
    the first (last) stage builds that many layers, split evenly over its model chunks, and
    the other stages share the rest evenly (``get_num_layers_to_build`` and
    ``get_transformer_layer_offset``, megatron/core/transformer/transformer_block.py and
    transformer_layer.py). DeepSeek-V3's 61 layers over 16 stages, 4 first and 1 last:

    >>> [len(c) for c in chunk_layers(61, 16, 1, first=4, last=1)][::5]
    [4, 4, 4, 1]

    With a custom ``layout`` (``pipeline_model_parallel_layout``, one entry per virtual
    stage, :mod:`sim.frameworks.megatron.layout`) each stage builds its decoder entries;
    ``vp`` must be the layout's. Megatron-Bridge's DeepSeek-V3 layout on pp 8 x vp 4:

    >>> from sim.frameworks.megatron.layout import parse_layout
    >>> sizes = [len(c) for c in chunk_layers(61, 8, 4, layout=parse_layout("Et|(tt|)*30mL"))]
    >>> sizes[:2], sizes[-2:], len(sizes)
    ([1, 2], [2, 0], 32)
    """
    if layout is not None:
        if layout_vp(layout, p) != vp:
            raise ValueError(f"the layout's {len(layout)} stage entries are "
                             f"{len(layout) // p} virtual stages per rank, not vp = {vp}")
        return layout_chunks(layout, p, layers)
    if first is not None or last is not None:
        return _uneven_chunks(layers, p, vp, first, last)
    n = p * vp
    effective = layers + int(embedding_counts) + int(loss_counts)
    if effective % n:
        raise ValueError(f"{layers} layers do not split into pp x vp = {n} equal chunks")
    per = effective // n
    sizes = [per] * n
    if embedding_counts:
        sizes[0] -= 1
    if loss_counts:
        sizes[-1] -= 1
    out, start = [], 0
    for k in sizes:
        out.append(list(range(start, start + k)))
        start += k
    return out


def _uneven_chunks(layers: int, p: int, vp: int, first: int | None, last: int | None
                   ) -> list[list[int]]:
    """:func:`chunk_layers` with a given first and/or last stage (Megatron-Core's uneven
    pipeline split): each stage's count is split evenly over its ``vp`` chunks."""
    middle_stages = p - (first is not None) - (last is not None)
    middle = layers - (first or 0) - (last or 0)
    if middle < 0 or (middle_stages == 0 and middle) or \
            (middle_stages and middle % middle_stages):
        raise ValueError(f"{layers} layers do not split into {p} stages with "
                         f"{first} first and {last} last")
    per = middle // middle_stages if middle_stages else 0
    stage = [per] * p
    if first is not None:
        stage[0] = first
    if last is not None:
        stage[-1] = last
    if any(k % vp for k in stage):
        raise ValueError(f"stage layer counts {sorted(set(stage))} do not split into "
                         f"vp = {vp} chunks")
    out, start = [], 0
    for v in range(p * vp):
        k = stage[v % p] // vp
        out.append(list(range(start, start + k)))
        start += k
    return out


@dataclass(frozen=True)
class Placement:
    """Which pipeline stage runs each virtual stage ``v`` (0 .. p * vp - 1) and which model
    chunk of it ``v`` is.

    Megatron-Core's interleaved placement loops: stage ``v % p`` runs ``v``, activations flow
    from ``v`` to ``v + 1``. DualPipeV (``v_shape``, deepseek-ai/DualPipe ``dualpipev.py``)
    folds the 2p virtual stages into a V: rank ``s`` runs ``s`` and ``2p - 1 - s``, so the
    first and the last virtual stage (the embedding, and the output layer with the loss) are
    both on stage 0. DualPipe (``bidirectional``, ``dualpipe.py``) runs two pipelines of p
    stages in opposite directions on the same ranks: virtual stages ``0 .. p - 1`` are the
    forward direction on ranks ``0 .. p - 1``, ``p .. 2p - 1`` the reverse direction on ranks
    ``p - 1 .. 0``, each direction with its own embedding and loss and its own copy of the
    layers; nothing flows from ``p - 1`` to ``p``.

    Examples
    --------
    >>> loop, vee = Placement(4, 2), Placement(4, 2, v_shape=True)
    >>> [loop.stage(v) for v in range(8)], [vee.stage(v) for v in range(8)]
    ([0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 3, 2, 1, 0])
    >>> vee.virtual(1, 1), vee.last_stages
    (6, (0,))
    >>> dual = Placement(4, 2, bidirectional=True)
    >>> [v for v in range(8) if dual.is_first(v)], dual.last_stages
    ([0, 4], (0, 3))
    """

    p: int
    vp: int
    v_shape: bool = False
    bidirectional: bool = False

    @property
    def folded(self) -> bool:
        """Virtual stages ``p ..`` run on the ranks in reverse (DualPipe and DualPipeV)."""
        return self.v_shape or self.bidirectional

    def stage(self, v: int) -> int:
        """The stage running virtual stage ``v``."""
        if self.folded:
            return v if v < self.p else 2 * self.p - 1 - v
        return v % self.p

    def virtual(self, st: int, c: int) -> int:
        """The virtual stage that is model chunk ``c`` of stage ``st``."""
        if self.folded and c == 1:
            return 2 * self.p - 1 - st
        return c * self.p + st

    def stage_virtuals(self, st: int) -> list[int]:
        """Stage ``st``'s virtual stages, chunk 0 first."""
        return [self.virtual(st, c) for c in range(self.vp)]

    def is_first(self, v: int) -> bool:
        """Virtual stage ``v`` takes the batch's input (it holds an embedding)."""
        return v % self.p == 0 if self.bidirectional else v == 0

    def is_last(self, v: int) -> bool:
        """Virtual stage ``v`` ends a pipeline (it holds an output layer and the loss)."""
        return v % self.p == self.p - 1 if self.bidirectional else v == self.p * self.vp - 1

    def firsts(self, st: int) -> int:
        """How many of stage ``st``'s virtual stages take the input."""
        return sum(self.is_first(v) for v in self.stage_virtuals(st))

    def lasts(self, st: int) -> int:
        """How many of stage ``st``'s virtual stages end a pipeline."""
        return sum(self.is_last(v) for v in self.stage_virtuals(st))

    @property
    def last_stages(self) -> tuple[int, ...]:
        """The stages holding an output layer and the loss."""
        return tuple(st for st in range(self.p) if self.lasts(st))


@dataclass
class Step:
    """One item of a stage's program: run a unit, post transfers, wait for them, or run the
    oldest deferred weight gradients (DualPipe's ``_weight_chunk``)."""

    what: str
    """``unit``, ``post``, ``wait`` or ``weight``."""
    unit: Unit | None = None
    transfers: list[tuple[str, Transfer]] = field(default_factory=list)
    """(``send``|``recv``, transfer) posted or waited for."""
    sync: bool = False
    """A wait that ends with ``torch.cuda.synchronize()`` (the host waits for the GPU)."""
    paired: Unit | None = None
    """A unit step's backward issued together with its forward ``unit`` (the combined 1F1B
    schedule, :mod:`sim.frameworks.megatron.a2a_overlap`)."""
    zero_bubble: bool = False
    """A backward unit whose weight gradients wait for a later ``weight`` step (DualPipe's
    ``enable_zb``: ``WeightGradStore``, first in, first out)."""


def pipeline_steps(kind: str, p: int, s: int, m: int, vp: int, overlap: bool = True,
                   sync: bool = True, extra_warmup: int = 0) -> list[Step]:
    """Stage ``s``'s units with the point-to-point calls Megatron-Core issues between them.

    ``overlap``: the interleaved schedule's ``overlap_p2p_comm`` (posts and later waits);
    without it every call blocks. ``sync``: a blocking call ends with
    ``torch.cuda.synchronize()`` (``batch_p2p_comm`` with ``batch_p2p_sync``,
    ``p2p_communication.py`` ``_communicate``). ``extra_warmup``: as :func:`schedule`'s.

    Examples
    --------
    The middle stage of three, 1F1B, two micro-batches: blocking calls around each unit.

    >>> for st in pipeline_steps("1f1b", 3, 1, 2, 1)[:5]:
    ...     print(st.what, st.unit or [f"{r} {k}{v}.{i}" for r, (k, v, i) in st.transfers])
    post ['recv F0.0']
    wait ['recv F0.0']
    unit ('F', 0, 0)
    post ['send F1.0']
    wait ['send F1.0']
    """
    nv = p * vp

    def peer(u: Unit, role: str) -> tuple[str, Transfer] | None:
        k, c, mb = u
        v = c * p + s
        if role == "send":
            nxt = v + 1 if k == "F" else v - 1
            return ("send", (k, v, mb)) if 0 <= nxt < nv else None
        src = v - 1 if k == "F" else v + 1
        return ("recv", (k, src, mb)) if 0 <= src < nv else None

    steps: list[Step] = []

    def call(*parts: tuple[str, Transfer] | None) -> None:
        # One blocking _communicate: post everything, wait for everything, synchronize.
        ts = [x for x in parts if x is not None]
        if ts:
            steps.append(Step("post", transfers=ts))
            steps.append(Step("wait", transfers=ts, sync=sync))

    if vp == 1:
        F = [("F", 0, i) for i in range(m)]
        B = [("B", 0, i) for i in range(m)]
        warm = m if kind == "gpipe" else min(p - s - 1 + extra_warmup, m)
        for i in range(warm):
            call(peer(F[i], "recv"))
            steps.append(Step("unit", F[i]))
            call(peer(F[i], "send"))
        rest = m - warm
        if rest > 0:
            call(peer(F[warm], "recv"))
        for i in range(rest):
            steps.append(Step("unit", F[warm + i]))
            call(peer(F[warm + i], "send"), peer(B[i], "recv"))
            steps.append(Step("unit", B[i]))
            call(peer(B[i], "send"), None if i == rest - 1 else peer(F[warm + i + 1], "recv"))
        for i in range(rest, m):
            call(peer(B[i], "recv"))
            steps.append(Step("unit", B[i]))
            call(peer(B[i], "send"))
        return steps

    order = schedule("1f1b", p, s, m, vp, extra_warmup)
    if not overlap:
        _interleaved_blocking(order, p, s, m, vp, peer, call, steps, extra_warmup)
        return steps
    # Interleaved with overlap_p2p_comm: posts after units, waits before the next unit of the
    # same direction.
    post_after: dict[int, list[tuple[str, Transfer]]] = {}
    prev_same: dict[str, int] = {}
    last_send: dict[str, tuple[str, Transfer]] = {}
    # The first backward's receive is posted in the last warm-up iteration.
    warmup = min((p - s - 1) * 2 + (vp - 1) * p + extra_warmup, m * vp)
    for i, u in enumerate(order):
        r = peer(u, "recv")
        if r is not None:
            j = prev_same.get(u[0], i - 1 if u[0] == "F" else warmup - 1)
            post_after.setdefault(j, []).append(r)
        prev_same[u[0]] = i
    for r in post_after.get(-1, []):
        steps.append(Step("post", transfers=[r]))
    for i, u in enumerate(order):
        waits = [x for x in (last_send.pop(u[0], None), peer(u, "recv")) if x is not None]
        if waits:
            steps.append(Step("wait", transfers=waits))
        steps.append(Step("unit", u))
        posts = [x for x in (peer(u, "send"),) if x is not None] + post_after.get(i, [])
        if posts:
            steps.append(Step("post", transfers=posts))
        snd = peer(u, "send")
        if snd is not None:
            last_send[u[0]] = snd
    if last_send:
        steps.append(Step("wait", transfers=list(last_send.values())))
    return steps


def _interleaved_blocking(order: list[Unit], p: int, s: int, m: int, vp: int,
                          peer: Callable[[Unit, str], tuple[str, Transfer] | None],
                          call: Callable[..., None], steps: list[Step], extra_warmup: int = 0
                          ) -> None:
    """The interleaved schedule without ``overlap_p2p_comm`` (``schedules.py``, the
    ``not config.overlap_p2p_comm`` branches): a blocking ``recv_forward`` first; after each
    warm-up forward ``send_forward_recv_forward`` (the last one also receives the first
    backward's gradient: ``send_forward_backward_recv_forward_backward``); after each steady
    forward + backward pair one ``send_forward_backward_recv_forward_backward``; after each
    cool-down backward ``send_backward_recv_backward``."""
    F = [u for u in order if u[0] == "F"]
    B = [u for u in order if u[0] == "B"]
    total = m * vp
    warm = min((p - s - 1) * 2 + (vp - 1) * p + extra_warmup, total)
    rest = total - warm

    def nxt(units: list[Unit], i: int) -> tuple[str, Transfer] | None:
        return peer(units[i], "recv") if i < len(units) else None

    call(peer(F[0], "recv"))
    for i in range(warm):
        steps.append(Step("unit", F[i]))
        call(peer(F[i], "send"), nxt(F, i + 1),
             nxt(B, 0) if i == warm - 1 and rest > 0 else None)
    for k in range(rest):
        steps.append(Step("unit", F[warm + k]))
        steps.append(Step("unit", B[k]))
        call(peer(F[warm + k], "send"), peer(B[k], "send"),
             nxt(F, warm + k + 1), nxt(B, k + 1))
    if rest == 0:
        call(nxt(B, 0))
    for k in range(rest, total):
        steps.append(Step("unit", B[k]))
        call(peer(B[k], "send"), nxt(B, k + 1))


def p2p_modes(ctx: JobContext, overlap: bool | None, batch: bool | None, p: int, vp: int
              ) -> tuple[bool, bool]:
    """Effective (``overlap_p2p_comm``, ``batch_p2p_comm``). Megatron-LM: overlap on with
    virtual stages (``--no-overlap-p2p-communication``), forced off without
    (``validate_args``); ``batch_p2p_comm = not overlap_p2p_comm`` (``argument_utils.py``).
    Megatron-Bridge's ``CommOverlapConfig`` sets the same pair. ``schedules.py`` refuses
    overlap without interleaving and overlap together with batching."""
    ov = vp > 1 if overlap is None else overlap
    ba = not ov if batch is None else batch
    ctx.require(not (ov and vp == 1 and p > 1), "framework.overlap_p2p_comm",
                "non-interleaved pipeline parallelism does not support overlapping p2p "
                "communication (schedules.py)")
    ctx.require(ov or vp == 1 or p > 2, "framework.overlap_p2p_comm",
                "the interleaved schedule without p2p overlap needs pp > 2 (validate_args: "
                "several sends and receives between the same two ranks per batch)")
    ctx.require(not (ov and ba), "framework.batch_p2p_comm",
                "can not use both overlap_p2p_comm and batch_p2p_comm (schedules.py)")
    return ov, ba


@dataclass
class P2PLink:
    """How a transfer runs: the stage pair's ranks, bytes, host cost."""

    pairs: Callable[[int, int], tuple[tuple[int, int], ...]]
    """(source stage, destination stage) -> (source, destination) ranks of every member."""
    nbytes: float
    cpu_s: float
    p: int
    dtype: NcclType | None = None
    """NCCL type of the activations and gradients sent."""
    place: Placement | None = None
    """Which stage runs each virtual stage; None: Megatron-Core's loop."""

    def stage(self, v: int) -> int:
        """The stage running virtual stage ``v``."""
        return (self.place or Placement(self.p, 1)).stage(v)

    def stream(self, d: str, role: str, src: int, dst: int) -> str:
        """The transfer's stream: one per direction and role; under a folded placement
        (DualPipe, DualPipeV) also per peer (a stage sends activations both up and down the
        pipeline, and PyTorch runs each peer pair's sends and receives on that pair's own NCCL
        communicator and stream)."""
        if self.place is None or not self.place.folded:
            return f"pp-{d}-{role}"
        return f"pp-{d}-{role}-{'up' if dst > src else 'down'}"


def add_stage(program: Program, cls: RankClass, st: int, steps: list[Step],
              run_unit: Callable[[Unit], tuple[Op | None, Op | None]], link: P2PLink,
              last_on_stream: dict[str, Op],
              run_pair: Callable[[Unit, Unit], tuple[Op | None, Op | None]] | None = None,
              run_weight: Callable[[], tuple[Op | None, Op | None]] | None = None
              ) -> None:
    """Add stage ``st``'s program: units (``run_unit`` adds their ops and returns the first
    and last; ``run_pair`` a paired step's two units; ``run_weight`` a ``weight`` step's
    deferred weight gradients), and each transfer as a rendezvous op
    on a stream per direction and role (the streams of the two stages carry their transfers
    in the same order, as NCCL's matching sends and receives must be). A unit waits for its
    transfers; a synchronizing wait also for the last op on every stream of the stage
    (``torch.cuda.synchronize``)."""
    posted: dict[Transfer, Op] = {}
    pending: list[Op] = []     # waits whose op must gate the next unit
    last: Op | None = None

    def add(op: Op) -> Op:
        program.add(cls, op)
        last_on_stream[op.stream] = op
        return op

    for step in steps:
        if step.what in ("unit", "weight"):
            if step.what == "weight":
                assert run_weight is not None
                first, end = run_weight()
            elif step.paired is not None:
                assert run_pair is not None
                assert step.unit is not None
                first, end = run_pair(step.unit, step.paired)
            else:
                assert step.unit is not None
                first, end = run_unit(step.unit)
            if first is not None and pending:
                first.deps = list(first.deps) + pending
            pending = []
            last = end or last
        elif step.what == "post":
            for role, tr in step.transfers:
                k, v, mb = tr
                nxt = v + 1 if k == "F" else v - 1
                src, dst = link.stage(v), link.stage(nxt)
                what = "act" if k == "F" else "grad"
                d = "fwd" if k == "F" else "bwd"
                posted[tr] = add(Op(
                    name=f"{role} {what} v{v}->v{nxt} mb{mb}", kind="recv",
                    stream=link.stream(d, role, src, dst), phase="comm",
                    deps=[last] if last else [],
                    pairs=link.pairs(src, dst), nbytes=link.nbytes, dtype=link.dtype,
                    key=f"pp/{k}/{v}/{mb}",
                    category="send_recv", micro_batch=mb, cpu_s=link.cpu_s))
        else:
            deps = [posted[tr] for _, tr in step.transfers]
            if step.sync:
                deps += [o for o in last_on_stream.values() if o not in deps]
            # synchronize: the host's own wait (HOST_WAIT_STREAM); otherwise the compute
            # stream waits for the transfers' events (no kernel either way).
            wait = add(Op(name="wait p2p" + (" + synchronize" if step.sync else ""),
                          kind="compute",
                          stream=HOST_WAIT_STREAM if step.sync else "compute",
                          phase="comm", kernels=0, deps=deps, host_sync=step.sync,
                          category="sync"))
            pending = [wait]
            last = wait
