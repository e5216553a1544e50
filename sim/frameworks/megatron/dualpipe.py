"""DeepSeek's DualPipe and DualPipeV pipeline schedules (``framework.pipeline_schedule:
dualpipe | dualpipev``).

DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.1) feeds micro-batches
from both ends of the pipeline, overlaps a forward chunk with a backward chunk ("F&B") so
that each one's all-to-alls and pipeline sends hide under the other's compute, and defers
some weight gradients to fill the bubble (zero bubble, arXiv 2401.10241). DualPipeV, its
"cut-in-half" form (Sea AI Lab; deepseek-ai/DualPipe ``dualpipe/dualpipev.py`` @ 3da1bbe),
has the same bubble, (PP/2 - 1)(F&B + B - 3W) for PP stages, on half the ranks: the model is
cut into 2p virtual stages folded into a V (rank ``s`` runs virtual stages ``s`` and
``2p - 1 - s``, :class:`~sim.frameworks.megatron.pipeline.Placement`), every micro-batch goes
down the ranks through chunk 0 and back up through chunk 1, and the loss is on rank 0.

:func:`dualpipev_steps` transcribes ``DualPipeV.step``'s eight phases for one rank, with its
communication as the code issues it: receives and sends are queued (``comm.append_irecv`` /
``append_isend``) and posted together, then waited for, just before the next compute chunk
(``_commit_and_wait_comm``: ``batch_isend_irecv`` and ``req.wait()``, a stream wait, no
device synchronize), so a chunk's output leaves when the rank starts its next chunk. The
last rank hands chunk 0's output to its chunk 1 (and the gradient back) without a transfer.

What each chunk runs here: the rank's Megatron-Core layers (this framework's units). A lone
forward or backward runs as the plain module does; an F&B pair runs the forward and the
backward one after the other, or, with ``framework.moe_a2a_overlap``, interleaved layer by
layer with the all-to-alls on a second stream as Megatron-Core's combined 1F1B does
(:func:`sim.frameworks.megatron.a2a_overlap.issue_pair`: DeepSeek's own
``overlapped_forward_backward`` is not public; the report's Figure 4 shows the same split of
attention, dispatch, MLP and combine). A zero-bubble backward (``enable_zb``) leaves its
weight-gradient GEMMs (the Transformer Engine linears' wgrads,
:mod:`sim.frameworks.megatron.delay_wgrad`) to the ``weight`` step that pops it, first in,
first out; their saved inputs stay allocated until then.

DualPipe itself (``framework.pipeline_schedule: dualpipe``, ``dualpipe/dualpipe.py``): two
pipelines of ``p`` stages in opposite directions on the same ``p`` ranks, half the
micro-batches fed from each end, so rank ``s`` holds stage ``s`` of the forward direction and
stage ``p - 1 - s`` of the reverse one, a second copy of every stage's parameters, gradients
and optimizer state (:class:`~sim.frameworks.megatron.pipeline.Placement` ``bidirectional``).
:func:`dualpipe_steps` transcribes ``DualPipe.step`` as :func:`dualpipev_steps` does
``DualPipeV.step``, its phases mapped to the rank's chunks as the code maps them (``phase ^=
is_in_second_half``). The two copies' gradients are summed across each rank pair ``s``,
``p - 1 - s`` after the backward (the repository's example adds the peer's gradients,
``examples/example_dualpipe.py``): here one all-reduce of the rank's gradient shard over the
pair, after the data-parallel reduce.
"""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.pipeline import Step, Transfer, Unit
from sim.scenario import MegatronOptions


class _RankSteps:
    """One rank's steps as DualPipe's helpers build them (``_forward_chunk``,
    ``_backward_chunk``, ``_forward_backward_chunk``, ``_weight_chunk``): transfers queued by
    ``_recv_*`` / ``_send_*`` and posted, then waited for, at the next ``commit``.

    ``v_of[c]``: the rank's virtual stage of chunk ``c``; ``starts[c]``: chunk ``c`` takes its
    forward input (and leaves its input gradient) on the rank, from the batch or a chunk of its
    own; ``ends[c]``: chunk ``c``'s output stays on the rank (the loss, or a chunk of its own);
    ``flip``: the code's phases are the rank's chunks swapped (DualPipe's second half of the
    ranks, ``phase ^= is_in_second_half``)."""

    def __init__(self, v_of: tuple[int, int], starts: tuple[bool, bool],
                 ends: tuple[bool, bool], flip: bool = False) -> None:
        self.v_of, self.starts, self.ends, self.flip = v_of, starts, ends, flip
        self.ids = {"F": [0, 0], "B": [0, 0]}
        self.moved = {(role, k): [0, 0] for role in ("send", "recv") for k in "FB"}
        self.pending: list[tuple[str, Transfer]] = []
        self.steps: list[Step] = []

    def _queue(self, role: str, kind: str, ph: int) -> None:
        c = ph ^ self.flip
        local = self.starts[c] if (role == "recv") == (kind == "F") else self.ends[c]
        if local:
            return
        v = self.v_of[c]
        sender = v if role == "send" else (v - 1 if kind == "F" else v + 1)
        n = self.moved[(role, kind)]
        self.pending.append((role, (kind, sender, n[c])))
        n[c] += 1

    def recv_forward(self, ph: int) -> None:
        self._queue("recv", "F", ph)

    def send_forward(self, ph: int) -> None:
        self._queue("send", "F", ph)

    def recv_backward(self, ph: int) -> None:
        self._queue("recv", "B", ph)

    def send_backward(self, ph: int) -> None:
        self._queue("send", "B", ph)

    def commit(self) -> None:
        if self.pending:
            self.steps.append(Step("post", transfers=list(self.pending)))
            self.steps.append(Step("wait", transfers=list(self.pending)))
            self.pending.clear()

    def _take(self, kind: str, ph: int) -> Unit:
        c = ph ^ self.flip
        ids = self.ids[kind]
        ids[c] += 1
        return (kind, c, ids[c] - 1)

    def forward(self, ph: int, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_forward(ph)
        self.commit()
        self.steps.append(Step("unit", self._take("F", ph)))
        if send:
            self.send_forward(ph)

    def backward(self, ph: int, zb: bool = False, recv: bool = True, send: bool = True
                 ) -> None:
        if recv:
            self.recv_backward(ph)
        self.commit()
        self.steps.append(Step("unit", self._take("B", ph), zero_bubble=zb))
        if send:
            self.send_backward(ph)

    def forward_backward(self, ph0: int, ph1: int, recv0: bool = True) -> None:
        if recv0:
            self.recv_forward(ph0)
        self.recv_backward(ph1)
        self.commit()
        self.steps.append(Step("unit", self._take("F", ph0), paired=self._take("B", ph1)))
        self.send_forward(ph0)
        self.send_backward(ph1)

    def weight(self) -> None:
        self.commit()
        self.steps.append(Step("weight"))

    def main(self, n3: int, n4: int, lone_first: bool) -> None:
        """Steps 3 and 4, the same in both schedules: ``n3`` nB1W1F1 (zero bubble), then
        ``n4`` nF0B1F1B0; with ``lone_first`` (the rank that turns the micro-batches around)
        the first F0 and B1 run one after the other, "to further reduce bubble size"."""
        for _ in range(n3):                               # step 3: nB1W1F1 (zero bubble)
            self.backward(1, zb=True)
            self.recv_forward(1)
            self.weight()
            self.forward(1, recv=False)
        for i in range(n4):                               # step 4 (main): nF0B1F1B0
            if i == 0 and lone_first:
                self.forward(0, recv=False, send=False)
                self.send_forward(1)
                self.backward(1, send=False)
                self.send_forward(0)
                self.send_backward(1)
            else:
                self.forward_backward(0, 1, recv0=i > 0)
            self.forward_backward(1, 0)

    def cooldown(self, n3: int, n6: int, parity: int) -> list[Step]:
        """Steps 5 to 8, the same in both schedules: ``n3`` nB1F1B0, ``n6`` nB1B0 with the
        second half zero bubble (where it starts depends on ``parity``), ``n3`` nWB0, then
        ``n6`` nW."""
        for _ in range(n3):                               # step 5: nB1F1B0
            self.backward(1)
            self.forward_backward(1, 0)
        zb = False                                        # step 6: nB1B0
        for i in range(n6):
            if i == n6 // 2 and parity % 2 == 1:
                zb = True
            self.backward(1, zb=zb)
            if i == n6 // 2 and parity % 2 == 0:
                zb = True
            self.backward(0, zb=zb)
        for _ in range(n3):                               # step 7: nWB0 (zero bubble)
            self.weight()
            self.backward(0, zb=True)
        for _ in range(n6):                               # step 8: nW
            self.weight()
        self.commit()
        return self.steps


def dualpipev_steps(p: int, s: int, m: int) -> list[Step]:
    """Rank ``s``'s program under DualPipeV with ``p`` ranks (2p virtual stages) and ``m``
    micro-batches: units ``(F|B, chunk, micro-batch)``, paired F&B steps, the pending
    transfers posted and waited for before each compute step, and ``weight`` steps.

    Examples
    --------
    Every rank runs each of its two chunks' forward and backward once a micro-batch, and pops
    as many weight steps as it deferred backwards:

    >>> steps = dualpipev_steps(4, 1, 8)
    >>> units = [u for st in steps if st.what == "unit" for u in (st.unit, st.paired) if u]
    >>> len(units), len(set(units))
    (32, 32)
    >>> sum(st.zero_bubble for st in steps) == sum(st.what == "weight" for st in steps)
    True

    The last rank's first steps: micro-batch 0's forward through chunk 0, whose output goes
    to chunk 1 on the rank; but before chunk 1 runs, the rank posts and waits for the next
    micro-batch's input, queued in between (``_forward_chunk`` commits whatever is queued).

    >>> for st in dualpipev_steps(4, 3, 8)[2:6]:
    ...     print(st.what, st.unit or st.transfers)
    unit ('F', 0, 0)
    post [('recv', ('F', 2, 1))]
    wait [('recv', ('F', 2, 1))]
    unit ('F', 1, 0)
    """
    first, last = s == 0, s == p - 1
    # Chunk 0 of the first rank takes the batch; the last rank hands chunk 0's output to its
    # chunk 1 (and the gradient back) without a transfer; chunk 1 of the first rank ends in
    # the loss.
    r = _RankSteps((s, 2 * p - 1 - s), starts=(first, last), ends=(last, first))
    for _ in range((p - s - 1) * 2):                  # step 1: nF0
        r.forward(0)
    r.recv_forward(0)                                 # step 2: nF0F1
    for i in range(s + 1):
        r.forward(0, recv=False, send=False)
        r.recv_forward(0)
        r.forward(1, send=(not last) or i < s)
        r.send_forward(0)
    r.main(p - s - 1, m - 2 * p + s + 1, lone_first=last)
    return r.cooldown(p - s - 1, s + 1, s)


def dualpipe_steps(p: int, s: int, m: int) -> list[Step]:
    """Rank ``s``'s program under DualPipe with ``p`` ranks and ``m`` micro-batches (``m / 2``
    a direction): units ``(F|B, chunk, micro-batch)`` with chunk 0 the forward direction's
    stage ``s`` (virtual stage ``s``) and chunk 1 the reverse direction's stage ``p - 1 - s``
    (virtual stage ``2p - 1 - s``), micro-batches numbered per direction.

    Examples
    --------
    >>> steps = dualpipe_steps(4, 1, 8)
    >>> units = [u for st in steps if st.what == "unit" for u in (st.unit, st.paired) if u]
    >>> sorted(units) == sorted((k, c, i) for k in "FB" for c in (0, 1) for i in range(4))
    True
    >>> [f"{k}{c}.{i}" for k, c, i in units[:6]]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1', 'F0.2', 'B1.0']
    """
    half = p // 2
    hr = min(s, p - 1 - s)
    middle = s in (half - 1, half)
    v_of = (s, 2 * p - 1 - s)
    r = _RankSteps(v_of, starts=(v_of[0] % p == 0, v_of[1] % p == 0),
                   ends=(v_of[0] % p == p - 1, v_of[1] % p == p - 1), flip=s >= half)
    for _ in range((half - hr - 1) * 2):              # step 1: nF0
        r.forward(0)
    r.recv_forward(0)                                 # step 2: nF0F1
    for i in range(hr + 1):
        r.forward(0, recv=False, send=middle)
        r.recv_forward(0)
        r.forward(1, send=(not middle) or i < hr)
        if not middle:
            r.send_forward(0)
    r.main(half - hr - 1, m // 2 - p + hr + 1, lone_first=middle)
    return r.cooldown(half - hr - 1, hr + 1, hr)


def deepseek_steps(kind: str, p: int, s: int, m: int) -> list[Step]:
    """Rank ``s``'s steps under ``dualpipe`` or ``dualpipev``."""
    return dualpipe_steps(p, s, m) if kind == "dualpipe" else dualpipev_steps(p, s, m)


def deepseek_order(kind: str, p: int, s: int, m: int) -> list[Unit]:
    """Rank ``s``'s units in the order it runs them (each F&B pair forward first).

    >>> [f"{k}{c}.{i}" for k, c, i in deepseek_order("dualpipev", 2, 1, 4)[:6]]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1', 'F0.2', 'B1.0']
    """
    return [u for st in deepseek_steps(kind, p, s, m) if st.what == "unit"
            for u in (st.unit, st.paired) if u is not None]


def check_dualpipe(ctx: JobContext, o: MegatronOptions, p: int, vp: int, m: int) -> None:
    """Refuse what DualPipe or DualPipeV cannot run, one line naming the key. DualPipeV: two
    model chunks a rank (``parallelism.vp: 2``), at least two ranks and 2p micro-batches
    (``DualPipeV.step``: ``num_chunks >= num_ranks * 2``). DualPipe: no virtual stages (its
    second chunk is the reverse direction's stage), an even number of ranks and of
    micro-batches, at least 2p (``DualPipe.step``'s asserts). Neither with the options whose
    modelled form assumes Megatron-Core's own schedules."""
    kind = o.pipeline_schedule
    if kind == "dualpipev":
        ctx.require(vp == 2, "parallelism.vp",
                    "pipeline_schedule dualpipev runs two model chunks a rank (a V of 2 x pp "
                    "virtual stages): set parallelism.vp: 2")
        ctx.require(p >= 2, "parallelism.pp", "pipeline_schedule dualpipev needs pp >= 2")
    else:
        ctx.require(vp == 1, "parallelism.vp",
                    "pipeline_schedule dualpipe runs each rank's stage in both directions, "
                    "not virtual stages: set parallelism.vp: 1")
        ctx.require(p >= 2 and p % 2 == 0, "parallelism.pp",
                    f"DualPipe needs an even pp >= 2, not {p} (dualpipe.py: num_ranks % 2 == 0)")
        ctx.require(m % 2 == 0, "training.global_batch_size",
                    f"DualPipe feeds half the micro-batches from each end: {m} a step is odd")
    ctx.require(m >= 2 * p, "training.global_batch_size",
                f"{'DualPipeV' if kind == 'dualpipev' else 'DualPipe'} needs at least "
                f"2 x pp = {2 * p} micro-batches a step, not {m} "
                "(num_chunks >= num_ranks * 2)")
    for key, on in (("delay_wgrad_compute", o.delay_wgrad_compute),
                    ("fine_grained_activation_offloading",
                     o.fine_grained_activation_offloading),
                    ("overlap_param_gather_with_optimizer_step",
                     o.overlap_param_gather_with_optimizer_step)):
        ctx.require(not on, f"framework.{key}",
                    f"{key} is not modelled with pipeline_schedule {kind} (DualPipe "
                    "defers its own weight gradients and runs its own chunk order)")
