"""The exact advance of a steady phase: a shorter run with its period played again (issue 13,
item 3; ``docs/performance.md`` item 11).

A pipeline's steady phase, or gradient accumulation, repeats the same ops micro-batch after
micro-batch (:func:`sim.program.periods.steady_period`), and on the engine's time grid
(:mod:`sim.engine.time_grid`) the simulation of it repeats to the bit. So the run of a step of
``N`` micro-batches is the run of the same job with ``K`` periods fewer (the *short* program,
which its builder makes with fewer micro-batches) with one period of it played ``K`` more
times. No generator has to jump: the short run is simulated whole, with a :class:`LogTap`
keeping every report the engine and the network make (ops, memory, collectives, rates,
transfers, each change of the byte totals) in order; :func:`find_cut` finds two cuts one
period apart where the run is the same, relative to the cut; :func:`splice` replays the
reports into the real recorder in the order the long run would make them: the short run up to
the second cut, the period ``K`` more times (times ``+ j P``, each op the one ``j`` periods on in
the long program), then the rest of the short run shifted by ``K`` periods.

Why the cuts are exact, not a fit. The engine is deterministic, so if its whole state at two
cuts is the same up to the shift (times ``+ P``, each op the one a period on), every event after
the second cut repeats the events after the first, as long as the program ahead repeats (it
does, inside the steady stretch). The state is not copied but witnessed: each part of it is a
value some report carries, or a function of reports since a known time. :func:`find_cut`
accepts a cut only where every report from the start of the window ``lo`` to past the end of
the ops in flight matches the report one period on, and

- every op in flight at the cut that has started started after ``lo`` (a compute op's work
  left and a flow's bytes left are functions of the events since it started, every one
  reported: ops, rate changes and each byte-total change, with its time);
- each op's issue time, ready and start are in its report, and with it the running sums of
  its class (:meth:`Engine.accumulators`), floats that need not come back alike;
- the host clock's last issue and the ends it will wait for before its next issues
  (:func:`sim.engine.host_clock.host_issues`) are reports inside the window.

Rates (:data:`sim.fabric.maxmin.RATE_GRID_BITS`) and times are on exact grids, so the shifted
sums are the same bits. The byte totals are summed again in the long run's order from the
same increments, so they match to the last bit too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.engine.core import EngineObserver
from sim.engine.host_clock import host_issues, issue_order
from sim.engine.report_log import (
    COLL,
    MEM,
    OP,
    RATES,
    XFER,
    Entry,
    LinkRatesReplay,
    LogTap,
    link_rates_repeat,
)
from sim.program.ir import Op, Program, RankClass
from sim.program.periods import ClassOrder, SteadyPeriod, op_signature, steady_period

if TYPE_CHECKING:
    from sim.engine.core import Engine


@dataclass(frozen=True)
class Cut:
    """Two cuts one period apart in a run's reports (:func:`find_cut`)."""

    first: int
    """Index of the first report of the period (the first cut)."""
    entries: int
    """Reports per period (the second cut is ``first + entries``)."""
    period_s: float
    """Simulated seconds per period."""
    solves: int
    """Rate solves per period."""


class ShortRun:
    """The short program's ops by position: per rank class its issue order, and for each op
    its (class, position)."""

    def __init__(self, program: Program) -> None:
        self.order: dict[int, list[Op]] = {c.id: issue_order(c) for c in program.classes}
        self.where: dict[int, tuple[int, int]] = {
            id(op): (cid, i) for cid, ops in self.order.items() for i, op in enumerate(ops)}
        # The ops whose ends the host reads before issuing each op (sync and launch heads).
        self.heads: dict[int, tuple[Op, ...]] = {}
        for cls in program.classes:
            for op, sync, launches in host_issues(self.order[cls.id]):
                self.heads[id(op)] = launches + ((sync,) if sync is not None else ())
        self._sigs: dict[int, tuple[Hashable, ...]] = {}
        # (id, id) -> (the two tuples, kept so that the ids stay theirs; equal)
        self._tuples: dict[tuple[int, int], tuple[Any, Any, bool]] = {}

    def signature(self, op: Op) -> tuple[Hashable, ...]:
        """``op_signature`` of one of the short program's ops (remembered)."""
        got = self._sigs.get(id(op))
        if got is None:
            got = self._sigs[id(op)] = op_signature(op)
        return got

    def alike(self, op: Op, other: Op) -> bool:
        """Whether ``other``, an op of another program, reads as ``op`` does: their
        signatures by value, a pair of rank tuples compared once (builders share them)."""
        for x, y in zip(op_signature(op, True), op_signature(other, True), strict=True):
            if x is y:
                continue
            if isinstance(x, tuple) and isinstance(y, tuple):
                key = (id(x), id(y))
                same = self._tuples.get(key)
                if same is None:
                    same = self._tuples[key] = (x, y, x == y)
                if not same[2]:
                    return False
            elif x != y:
                return False
        return True


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and np.array_equal(a, b))
    if isinstance(a, tuple) and isinstance(b, tuple):   # a change of link rates
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _alike(a: Entry, b: Entry, period_s: float, short: ShortRun,
           lengths: dict[int, int]) -> bool:
    """Whether report ``b`` is report ``a`` one period on."""
    if a[0] != b[0] or a[2] != b[2] or b[1] != a[1] + period_s:
        return False
    oa, ob = a[3], b[3]
    if oa is None or ob is None:
        if oa is not ob:
            return False
    else:
        wa, wb = short.where.get(id(oa)), short.where.get(id(ob))
        if (wa is None or wb is None or wa[0] != wb[0] or wb[1] != wa[1] + lengths[wa[0]]
                or short.signature(oa) != short.signature(ob)):
            return False
    pa, pb = a[4], b[4]
    if a[0] == OP:
        return (pb[0] == pa[0] + period_s and pb[1] == pa[1] + period_s
                and (pb[2] == pa[2] + period_s or _host_ahead(pa, pb))
                and pb[3] == pa[3] and pb[4] == pa[4] and pb[5] == pa[5])
    return len(pa) == len(pb) and all(_same(x, y) for x, y in zip(pa, pb, strict=True))


def _host_ahead(pa: tuple[Any, ...], pb: tuple[Any, ...]) -> bool:
    """Whether an op and its twin a period on were both issued before they were ready (their
    dependencies, not the host, set when they start) with the host as far ahead or further
    the second time: a host that gains on the GPU each period (its CPU seconds a period below
    the period) issues at other times every period, yet no GPU time depends on them."""
    return pa[2] < pa[0] and pb[2] < pb[0] and pb[0] - pb[2] >= pa[0] - pa[2]


def find_cut(entries: list[Entry], short: ShortRun, lengths: dict[int, int],
             anchor: tuple[int, int], ends: dict[int, int] | None = None) -> Cut | None:
    """Two cuts one period apart where the run's state is the same up to the shift, as the
    module docstring says; None if the reports show none.

    Parameters
    ----------
    entries
        A run's reports (:attr:`LogTap.entries`).
    short
        Its program's ops by position.
    lengths
        Ops per period of each rank class.
    anchor
        (rank class, position) of an op inside the steady stretch with the op a period on
        inside it too: the period's length in reports and seconds is measured there.
    ends
        Each op's report index (by ``id``), where the caller tries several anchors.
    """
    if ends is None:
        ends = _op_reports(entries)
    cls0, q0 = anchor
    order = short.order[cls0]
    if q0 + lengths[cls0] >= len(order):
        return None
    i0, i1 = ends[id(order[q0])], ends[id(order[q0 + lengths[cls0]])]
    span = i1 - i0
    if span <= 0:
        return None
    period_s = entries[i1][1] - entries[i0][1]
    solves = entries[i1][5] - entries[i0][5]
    n = len(entries)

    def match(i: int) -> bool:
        a, b = entries[i], entries[i + span]
        return b[5] - a[5] == solves and _alike(a, b, period_s, short, lengths)

    if period_s <= 0 or not match(i0):
        return None
    lo = i0
    while lo > 0 and match(lo - 1):
        lo -= 1
    hi = i0 + 1
    while hi + span < n and match(hi):
        hi += 1
    if hi - lo < span:
        # Reports in [hi, lo + span) would pair with neither neighbour: the window must hold a
        # whole period for every report of the cut's period to be witnessed.
        return None
    # Every report in [lo, hi + span) now pairs with the one a period before or after it.
    witness = _Witness(entries, short, ends)
    # A host running ahead by more each period (_host_ahead): its issue times are not a
    # state that repeats, but one that only moves further ahead. Nothing after the cut may
    # then wait for the host: the long run's host, K periods further ahead, would issue it
    # earlier. Otherwise the host's state is witnessed like the rest.
    drift = witness.drifting(lo, hi, span, period_s)
    for first in range(lo + 1, hi + 1, max(1, span // 16)):
        if drift.any() and not witness.host_never_waited(first, drift):
            continue
        if (witness.holds(first, first + span, lo, hi, drift)
                and link_rates_repeat(entries, first - 1, span)):
            return Cut(first, span, period_s, solves)
    return None


def _op_reports(entries: list[Entry]) -> dict[int, int]:
    """Each op's report index, by the op's ``id``."""
    return {id(e[3]): i for i, e in enumerate(entries) if e[0] == OP}


class _Witness:
    """The short run's ops as arrays, to check that the reports witness the state at a cut."""

    def __init__(self, entries: list[Entry], short: ShortRun, ends: dict[int, int]) -> None:
        self.times = np.array([e[1] for e in entries])
        self.op_at = np.array([i for i, e in enumerate(entries) if e[0] == OP],
                              dtype=np.int64)
        self.issue = np.array([entries[i][4][2] for i in self.op_at])
        self.ready = np.array([entries[i][4][0] for i in self.op_at])
        self.start = np.array([entries[i][4][1] for i in self.op_at])
        self.cls = np.array([entries[i][2] for i in self.op_at], dtype=np.int64)
        self.where = np.full(len(entries), -1, dtype=np.int64)
        self.where[self.op_at] = np.arange(len(self.op_at))
        self.short, self.ends = short, ends
        # Per class, its ops' issue times in issue order (never decreasing: the host issues
        # in that order) and their reports' indices.
        self.class_issue: dict[int, np.ndarray] = {}
        self.class_end: dict[int, np.ndarray] = {}
        for cid, order in short.order.items():
            at = np.array([ends[id(op)] for op in order], dtype=np.int64)
            self.class_end[cid] = at
            self.class_issue[cid] = np.array([entries[i][4][2] for i in at])

    def drifting(self, lo: int, hi: int, span: int, period_s: float) -> np.ndarray:
        """A mask over rank class ids: the classes whose host issues some op of the window
        [lo, hi) other than a period before its twin (:func:`_host_ahead`)."""
        at = self.op_at[(self.op_at >= lo) & (self.op_at < hi)]
        j = self.where[at]
        off = self.issue[self.where[at + span]] - self.issue[j] != period_s
        mask = np.zeros(int(self.cls.max()) + 1 if len(self.cls) else 0, dtype=bool)
        mask[self.cls[j[off]]] = True
        return mask

    def host_never_waited(self, first: int, drift: np.ndarray) -> bool:
        """Whether every op of the ``drift`` classes reported from ``first`` on was issued
        before it was ready."""
        k = int(np.searchsorted(self.op_at, first))
        mine = drift[self.cls[k:]]
        return bool(np.all(self.issue[k:][mine] < self.ready[k:][mine]))

    def holds(self, first: int, second: int, lo: int, hi: int, drift: np.ndarray) -> bool:
        """Whether the reports [lo, hi + period) witness the state at report ``first``
        (``drift``: the classes whose host runs ahead with nothing waiting for it, whose host
        state is not needed)."""
        t_cut, t_lo = self.times[first], self.times[lo]
        k = int(np.searchsorted(self.op_at, first))
        # Ops issued by the cut and not finished: those that have started are reported
        # inside the window and started after its beginning; those waiting are reported
        # inside it too, unless the host is ahead and they wait for their dependencies only.
        live = np.flatnonzero(self.issue[k:] <= t_cut) + k
        held = (self.start[live] <= t_cut) | ~drift[self.cls[live]]
        if np.any(held) and (self.op_at[live[held]].max() >= hi or np.any(
                (self.start[live[held]] <= t_cut) & (self.start[live[held]] <= t_lo))):
            return False
        t_second = self.times[min(second, len(self.times) - 1)]
        for cid, issued in self.class_issue.items():
            if cid < len(drift) and drift[cid]:
                continue
            # The host clock's last issue before the cut is a report in the window ...
            last = int(np.searchsorted(issued, t_cut, side="right")) - 1
            if last >= 0 and self.class_end[cid][last] < lo:
                return False
            # ... and so are the ends it reads before each issue of the period.
            upto = int(np.searchsorted(issued, t_second, side="right"))
            order = self.short.order[cid]
            for pos in range(last + 1, upto):
                for head in self.short.heads.get(id(order[pos]), ()):
                    if self.ends[id(head)] < lo:
                        return False
        return True


def _alike_op(op: Op, target: Op, shift: int, short: ShortRun,
              long_order: dict[int, list[Op]], period: SteadyPeriod) -> bool:
    """Whether ``target`` (of the long program) is alike ``op`` (of the short one) ``shift``
    periods on: signature and dependencies."""
    return short.alike(op, target) and _deps_map(op, target, shift, short, long_order, period)


def _deps_map(op: Op, target: Op, shift: int, short: ShortRun,
              long_order: dict[int, list[Op]], period: SteadyPeriod) -> bool:
    """Whether each dependency of ``target`` is the counterpart of ``op``'s, ``shift``
    periods on, or (a dependency both share, before the steady stretch) the same one."""
    if len(op.deps) != len(target.deps):
        return False
    for d, t in zip(op.deps, target.deps, strict=True):
        cid, pos = short.where[id(d)]
        order = long_order[cid]
        length = period.classes[cid].length
        on = pos + shift * length
        if not ((on < len(order) and t is order[on]) or (pos < len(order) and t is order[pos])):
            return False
    return True


@dataclass(frozen=True)
class Spliced:
    """What the long run's engine and network would hold at its end."""

    class_bytes: np.ndarray
    """Bytes per link class (``FlowNetwork.class_bytes``)."""
    ops: int
    """Ops finished (``Engine.events_processed``)."""
    solves: int
    """Rate solves (``FlowNetwork.solves``)."""
    duration_s: float
    """The step's duration."""


def splice(entries: list[Entry], cut: Cut, extra: int, short: ShortRun,
           period: SteadyPeriod, long_order: dict[int, list[Op]],
           classes: dict[int, RankClass], observer: EngineObserver, duration_s: float,
           solves: int, n_kinds: int) -> Spliced | None:
    """Replay the short run's reports into ``observer`` as the long run (``extra`` periods
    more) would make them; None, with nothing replayed, if some report's op has no
    counterpart alike in the long program or the long program's ops are not each reported
    once.

    Parameters
    ----------
    entries, cut
        The short run's reports and its cuts (:func:`find_cut`).
    extra
        Periods the long program has beyond the short one.
    short
        The short program's ops by position.
    period
        The long program's steady period (:func:`sim.program.periods.steady_period`).
    long_order
        The long program's ops by class, in issue order.
    classes
        The long program's rank classes by id.
    observer
        Where the reports go (the run's recorder).
    duration_s, solves
        The short run's step duration and rate solves.
    n_kinds
        Link classes of the byte totals.
    """
    a, b = cut.first, cut.first + cut.entries
    segments = [(0, b, 0)] + [(a, b, j) for j in range(1, extra + 1)] + \
        [(b, len(entries), extra)]
    lengths = {cid: cp.length for cid, cp in period.classes.items()}
    # Each report once, resolved: (kind, time, class, its ops in the long program, position,
    # ops per period, what else); the op j periods on is order[pos + j * length].
    none: list[Op] = []
    resolved = []
    for kind, t, cid, op, what, _ in entries:
        if op is None:
            resolved.append((kind, t, classes.get(cid), none, 0, 0, what))
        else:
            oc, pos = short.where[id(op)]
            resolved.append((kind, t, classes.get(cid), long_order[oc], pos, lengths[oc], what))
    if not _counterparts_alike(entries, resolved, segments, short, period, long_order):
        return None
    sums = np.zeros(n_kinds)
    ops = 0
    # Link rates are reported as changes; the cut has the same rates at both ends
    # (link_rates_repeat), so each repeat of the period plays on from the last.
    links = LinkRatesReplay()
    for lo, hi, j in segments:
        shift = j * cut.period_s
        for kind, t, cls, order, pos, length, what in resolved[lo:hi]:
            target = order[pos + j * length] if order else None
            if kind == OP:
                ready, start, _, step, _, held = what
                assert cls is not None and target is not None
                observer.on_op(cls, target, ready + shift, start + shift, t + shift, step, held)
                ops += 1
            elif kind == MEM:
                assert cls is not None
                observer.on_memory(cls, t + shift, what[0], what[1], target)
            elif kind == COLL:
                assert target is not None
                observer.on_collective(target, what[0])
            elif kind == RATES and what[1] is not None:
                observer.on_rates_changed(t + shift, what[0], links.apply(what[1]), what[1][0])
            elif kind == RATES:
                observer.on_rates(t + shift, what[0], links.apply(None))
            elif kind == XFER:
                observer.on_transfer_end(t + shift, target, what[0])
            else:   # the byte totals, summed again in the long run's order
                sums += what[0]
    return Spliced(class_bytes=sums, ops=ops, solves=solves + extra * cut.solves,
                   duration_s=duration_s + extra * cut.period_s)


def _counterparts_alike(entries: list[Entry], resolved: list[tuple[Any, ...]],
                        segments: list[tuple[int, int, int]], short: ShortRun,
                        period: SteadyPeriod, long_order: dict[int, list[Op]]) -> bool:
    """Whether every report's op has a counterpart alike (signature and dependencies) in the
    long program, and the long program's every op is reported once. Checked per op and
    segment kind, not per report: the copies' counterparts ``j = 1..K`` are checked at ``j =
    1`` and lie in the long program's stretch, whose ops are alike the op a period on."""
    extra = segments[-1][2]
    stretch = {cid: (cp.start, cp.start + cp.periods * cp.length)
               for cid, cp in period.classes.items()}
    checked: set[tuple[int, int]] = set()
    copies = segments[1][:2] if extra else None
    for lo, hi, j in segments[:2] + segments[-1:]:
        for i in range(lo, hi):
            op = entries[i][3]
            if op is None or (id(op), j) in checked:
                continue
            checked.add((id(op), j))
            order, pos, length = resolved[i][3], resolved[i][4], resolved[i][5]
            if pos + (extra if j else 0) * length >= len(order):
                return False
            if (lo, hi) != copies:
                if not _alike_op(op, order[pos + j * length], j, short, long_order, period):
                    return False
                continue
            # A copy: each counterpart up to the long program's stretch checked, the rest
            # alike those by the stretch (each op alike the op a period on).
            first, end = stretch[short.where[id(op)][0]]
            on = 1
            while True:
                if not _alike_op(op, order[pos + on * length], on, short, long_order, period):
                    return False
                if pos + on * length >= first or on == extra:
                    break
                on += 1
            if pos + (extra - 1) * length >= end and on < extra:
                return False
    # Each op of the long program reported once: the counterparts' indices all differ.
    offset: dict[int, int] = {}
    flat: list[int] = []
    for cid, order in long_order.items():
        offset[cid] = len(flat)
        flat.extend(op.index for op in order)
    index = np.array(flat, dtype=np.int64)

    def positions(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The op reports' places in ``index`` (before any shift) and their periods' length."""
        at = [i for i in range(lo, hi) if entries[i][0] == OP]
        base = [offset[short.where[id(entries[i][3])][0]] + resolved[i][4] for i in at]
        return (np.array(base, dtype=np.int64),
                np.array([resolved[i][5] for i in at], dtype=np.int64))

    targets = []
    for lo, hi, j in (segments[0], segments[-1]):
        base, step = positions(lo, hi)
        targets.append(index[base + j * step])
    if extra:
        base, step = positions(*segments[1][:2])
        targets.extend(index[base + j * step] for j in range(1, extra + 1))
    got = np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)
    return len(got) == len(index) and len(np.unique(got)) == len(got)


# These three are choices of cost, not physics: none changes a simulated number (a run
# that cannot be spliced with them is simulated whole). Chosen on the cases of
# docs/performance.md item 11, where 4 periods of 4 and 10 of 1 micro-batch showed a cut;
# 3 and 4 since an interleaved pipeline of 8 stages at 128 micro-batches (NeMo's DeepSeek-V3
# on 1,024 H100) kept only 9 of its 16 periods whole (the pipeline's sends and receives at
# each class's stretch ends): at 4 and 6 it was never spliced (75 s; 54 s then, 11 periods
# and 46 s since sim.program.periods' key rule of the fortieth session).
SHORT_MICRO_BATCHES = 10
"""Steady micro-batches the short program keeps, in whole periods (at least
:data:`MIN_SHORT_PERIODS`): room for the window of reports that witnesses the cut (the host
clock runs up to its launch queue ahead, a few micro-batches) and the period itself. Where
no cut shows, the short program is tried once more with twice as many periods, or with the
longest wait of an op between its issue and its start (in periods: the host's lead, and at a
deep pipeline the fill's waits) and two more where that is larger, if it then has at most
half the long one's micro-batches."""
MIN_SHORT_PERIODS = 3
"""Fewest steady periods the short program keeps (the window, the period, room after it)."""
MIN_EXTRA_PERIODS = 4
"""Fewest periods the long program must have beyond the short one's for a splice to be
tried: below it the short run and the replay cost about what the whole run does."""


def run_spliced(program: Program, shorter: Callable[[int], Program | None],
                make_engine: Callable[[EngineObserver], Engine], observer: EngineObserver,
                keep_link_rates: bool = False) -> Spliced | None:
    """Run one step of ``program`` as a shorter one with its steady period played again
    (module docstring), reporting to ``observer`` exactly what running it would; None, with
    nothing reported, where the program has no steady stretch long enough or the short run
    shows no cut it can witness (the caller then runs it whole).

    Parameters
    ----------
    program
        The long program (one step).
    shorter
        Builds the same job with the given number of micro-batches (None: it cannot).
    make_engine
        A fresh engine on the run's fabric, reporting to the given observer.
    observer
        The run's recorder.
    keep_link_rates
        Whether the observer keeps per-link rates.
    """
    if program.background_streams:
        return None
    period = None
    seen: dict[int, ClassOrder] = {}
    for per in (1, program.pipeline_stages):
        # Too few micro-batches for the periods a splice needs: no search (the planner runs
        # thousands of small steps).
        if program.micro_batches >= (MIN_SHORT_PERIODS + MIN_EXTRA_PERIODS) * per:
            period = steady_period(program, per, seen)
        if period is not None or program.pipeline_stages == 1:
            break
    if period is None:
        return None
    keep = max(MIN_SHORT_PERIODS, -(-SHORT_MICRO_BATCHES // period.micro_batches))
    for attempt in range(2):
        extra = period.periods - keep
        if extra < MIN_EXTRA_PERIODS or (
                attempt and 2 * extra * period.micro_batches < program.micro_batches):
            break   # too little to gain, or a second short run of more than half the long one
        got = _short_run(program, shorter(program.micro_batches - extra * period.micro_batches),
                         period, keep, make_engine, keep_link_rates)
        if isinstance(got, tuple):
            tap, short, cut, engine = got
            return splice(tap.entries, cut, extra, short, period,
                          {c.id: issue_order(c) for c in program.classes},
                          {c.id: c for c in program.classes}, observer,
                          engine.env.now, engine.net.solves, len(engine.net.class_bytes))
        # No cut: once more with twice the periods, or with room for the longest wait between
        # an op's issue and its start where that is longer (ops issued by a cut wait beyond
        # a window shorter than it: a host far ahead of a slow GPU, or at a deep pipeline
        # (PP 64) the fill's waits, which that measure also holds).
        lead = got if got is not None else 0.0
        keep = max(2 * keep, keep + math.ceil(lead) + 2)
    return None


def _short_run(program: Program, short_program: Program | None, period: SteadyPeriod,
               keep: int, make_engine: Callable[[EngineObserver], Engine],
               keep_link_rates: bool) -> tuple[LogTap, ShortRun, Cut, Engine] | float | None:
    """Run the short program keeping ``keep`` steady periods; its reports and their cut;
    where it shows no cut, the longest an op waited between its issue and becoming ready, in
    periods (a float); None where it cannot stand for the long one."""
    if short_program is None or [(c.id, c.members) for c in short_program.classes] != [
            (c.id, c.members) for c in program.classes]:
        return None
    tap = LogTap(keep_link_rates)
    engine = make_engine(tap)
    tap.attach(engine)
    engine.run_step(short_program)
    if tap.background:
        return None
    short = ShortRun(short_program)
    lengths = {cid: cp.length for cid, cp in period.classes.items()}
    first = program.classes[0].id
    cp = period.classes[first]
    # The anchor half-way into the kept periods, then later ones: where the host gains on the
    # GPU for a while after the pipeline fills, the timing settles some periods after the
    # ops' pattern does (the one before the last still has a period after it).
    ends = _op_reports(tap.entries)
    for k in range(keep // 2, keep - 1):
        cut = find_cut(tap.entries, short, lengths, (first, cp.start + k * cp.length), ends)
        if cut is not None:
            return tap, short, cut, engine
    order = short.order[first]
    at = cp.start + (keep // 2) * cp.length
    period_s = tap.entries[ends[id(order[at + cp.length])]][1] - tap.entries[ends[id(order[at])]][1]
    lead = max((e[4][0] - e[4][2] for e in tap.entries if e[0] == OP), default=0.0)
    return lead / period_s if period_s > 0 else 0.0
