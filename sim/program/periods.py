"""Where a step program repeats: a steady phase as a period of ops (issue 13, item 3).

A pipeline schedule's steady phase issues the same ops micro-batch after micro-batch (1F1B: one
forward and one backward; the interleaved schedule: a group of ``pp`` micro-batches per model
chunk switch, Megatron-Core ``schedules.py`` ``get_model_chunk_id``), as does gradient
accumulation without a pipeline. :func:`steady_period` finds that repetition in the program
itself: per rank class, a stretch of its ops in issue order (program order, as
:func:`sim.engine.host_clock.issue_order` has it) in which every op is *alike* the op ``length``
places later, so that, run from the same state, the two behave the same:

- every field the engine, the host clock, the network or the memory accounting reads is equal
  (kind, stream, durations, CPU seconds and kernel launches, collective and its groups or
  pairs, bytes and per-peer bytes, memory allocated and freed, FLOPs, ...); only the name,
  the micro-batch, the index and the collective's key may differ;
- each dependency maps alike: the op ``length`` places after op ``i`` depends on the ops
  ``length`` places after those ``i`` depends on (the class's ``length``; dependencies stay in
  their rank class), or on the very same op, which then lies before the stretch (Megatron's
  waits on the first forward's parameter all-gathers);
- collective keys map one to one: wherever key ``k`` is shifted, in every class, it becomes the
  same key ``k'``, so the peers that meet at ``k`` meet at ``k'``.

This is what an exact advance of the steady phase needs of the program (with the state at two
cuts compared, ``docs/performance.md`` item 11); the module reads the program only and holds no
engine state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sim.program.ir import Op, Program, RankClass

# Tuples longer than this stand in a signature by identity: a 16,384-rank group hashed at every
# op would cost more than the search, and builders hand every micro-batch the same tuple object
# (an op they do not share only goes unmatched: a shorter period, never a wrong one).
_BY_IDENTITY = 64


@dataclass(frozen=True)
class ClassPeriod:
    """One rank class's repeating stretch, in positions of its issue order."""

    start: int
    """The first op that maps onto the op ``length`` places later."""
    length: int
    """Ops per period."""
    periods: int
    """Whole periods from ``start`` whose every op maps alike (ops ``start`` to
    ``start + periods * length - 1`` each map onto the op ``length`` places later)."""


@dataclass(frozen=True)
class SteadyPeriod:
    """A period common to every rank class of a program (:func:`steady_period`)."""

    micro_batches: int
    """Micro-batches one period advances."""
    classes: dict[int, ClassPeriod]
    """Each rank class's stretch, by class id."""

    @property
    def periods(self) -> int:
        """Whole periods every class repeats at once."""
        return min(c.periods for c in self.classes.values())


def _part(x: object) -> Hashable:
    if isinstance(x, tuple) and len(x) > _BY_IDENTITY:
        return ("id", id(x))
    return x  # type: ignore[return-value]


def op_signature(op: Op, by_value: bool = False) -> tuple[Hashable, ...]:
    """Everything about ``op`` that the simulation reads, but its name, micro-batch, index,
    key and dependencies (:func:`steady_period` maps those separately). A rank tuple longer
    than ``_BY_IDENTITY`` stands by its identity (within one program), or as itself with
    ``by_value`` (to compare ops of two programs)."""
    part = (lambda x: x) if by_value else _part
    return (op.kind, op.stream, op.phase, op.duration, op.cpu_s, op.kernels, op.host_sync,
            op.collective, part(op.group), part(op.groups), part(op.pairs), op.nbytes,
            op.alloc, op.free, op.transient, op.transient_parts, op.alloc_parts, op.layer,
            op.flops, op.hw_flops, op.category, op.host_transfer, part(op.peer_bytes),
            op.sm_ctas, op.fused_kernel, op.side_kernel, op.launch_behind_compute, op.dtype,
            len(op.deps))


class ClassOrder(NamedTuple):
    """A rank class's ops in issue order, their signatures and positions (by ``id``)."""

    order: list[Op]
    sigs: list[tuple[Hashable, ...]]
    pos: dict[int, int]


def class_order(cls: RankClass) -> list[Op]:
    """The class's ops in issue order: program order, the rule of
    :func:`sim.engine.host_clock.issue_order` (the engine layer's home of it)."""
    return sorted((o for ops in cls.streams.values() for o in ops), key=lambda o: o.index)


def _period_length(order: list[Op], micro_batches: int) -> tuple[int, int] | None:
    """(position of the first op of a middle micro-batch, ops between it and the first op of
    the micro-batch ``micro_batches`` later), None where the class has no such pair."""
    first: dict[int, int] = {}
    for i, op in enumerate(order):
        if op.micro_batch is not None and op.micro_batch not in first:
            first[op.micro_batch] = i
    mbs = sorted(first)
    if len(mbs) <= 2 * micro_batches:
        return None
    mid = mbs[len(mbs) // 2 - micro_batches // 2]
    later = mid + micro_batches
    if later not in first or first[later] <= first[mid]:
        return None
    return first[mid], first[later] - first[mid]


def _stretch(order: list[Op], length: int, sigs: list[tuple[Hashable, ...]],
             pos: dict[int, int], anchor: int) -> tuple[int, int]:
    """The longest run of positions around ``anchor`` whose ops are alike the op ``length``
    later (signature and dependencies), as (start, end) with end exclusive."""
    n = len(order)

    def alike(i: int) -> bool:
        j = i + length
        if j >= n or sigs[i] != sigs[j]:
            return False
        a, b = order[i], order[j]
        for da, db in zip(a.deps, b.deps, strict=True):
            pa, pb = pos.get(id(da)), pos.get(id(db))
            if pa is None or pb is None or (pb != pa + length and pb != pa):
                return False
        return True

    if not alike(anchor):
        return anchor, anchor
    start = anchor
    while start > 0 and alike(start - 1):
        start -= 1
    end = anchor + 1
    while alike(end):
        end += 1
    return start, end


def steady_period(program: Program, micro_batches: int = 1,
                  seen: dict[int, ClassOrder] | None = None) -> SteadyPeriod | None:
    """The stretch over which every rank class repeats itself ``micro_batches`` micro-batches
    on, with keys mapping one to one; None if some class has none.

    Parameters
    ----------
    program
        A step program (:func:`sim.frameworks.build_program`).
    micro_batches
        Micro-batches per period: 1 for 1F1B and gradient accumulation, the pipeline size for
        Megatron's interleaved schedule.
    seen
        Each class's issue order and op signatures from an earlier call on the same program
        (filled here): they do not depend on ``micro_batches``, and a search that tries two
        periods pays for them once.

    Examples
    --------
    >>> from sim.program.ir import Op, Program, RankClass
    >>> cls = RankClass(0, (0,))
    >>> p = Program([cls], 1, 1.0, 1.0, 1.0, micro_batches=8)
    >>> for m in range(8):
    ...     for part in ("fwd", "bwd"):
    ...         _ = p.add(cls, Op(f"{part} mb{m}", "compute", "compute", part, duration=1e-3,
    ...                           micro_batch=m))
    >>> period = steady_period(p)
    >>> period.classes[0].length, period.classes[0].periods
    (2, 7)
    """
    regions: dict[int, tuple[list[Op], ClassPeriod]] = {}
    seen = {} if seen is None else seen
    for cls in program.classes:
        known = seen.get(cls.id)
        order = class_order(cls) if known is None else known.order
        measured = _period_length(order, micro_batches)
        if measured is None:
            return None
        if known is None:
            known = seen[cls.id] = ClassOrder(order, [op_signature(op) for op in order],
                                              {id(op): i for i, op in enumerate(order)})
        anchor, length = measured
        sigs, pos = known.sigs, known.pos
        start, end = _stretch(order, length, sigs, pos, anchor)
        # A dependency both ops share (Megatron's wait on the first forward's parameter
        # all-gather) must lie before the stretch: start after the last such one.
        fixed = max((pos[id(d)] for op in order[start:end] for d in op.deps
                     if any(d is e for e in order[pos[id(op)] + length].deps)), default=-1)
        if fixed >= start:
            skip = -(-(fixed + 1 - start) // length) * length
            start = min(start + skip, end)
        regions[cls.id] = (order, ClassPeriod(start, length, (end - start) // length))
    return _whole_keys(program, micro_batches, regions)


def _whole_keys(program: Program, micro_batches: int,
                regions: dict[int, tuple[list[Op], ClassPeriod]]) -> SteadyPeriod | None:
    """Cut the stretches where keys do not map one to one and whole: every op carrying a key
    the period maps lies inside its class's stretch of alike ops, so that peers meeting at
    ``k`` in one period meet at ``k'`` in the next. One pass over the stretches as found, not
    a pass per cut: an op a cut leaves out is still alike the op a period on, so its key still
    maps where it did (cutting again at its peers would shave an interleaved pipeline's ring
    of stages, whose last stage feeds the first one's next model chunk, one period per trip
    round it, down to nothing). Keys are numbered once; numpy.

    An image ``k'`` only some of whose ops are images (its key ``k`` broken: a peer of ``k``
    before its class's stretch) is not cut for that: the splice copies a period forward from
    its cut, so what it needs of ``k'`` is that ``k'`` maps whole onward, which the rule on
    ``k'`` itself checks. Cutting it too cost each class a period more at the front (NeMo's
    DeepSeek-V3 layout on 1,024 H100, pp 8 x vp 4: 9 of 13 periods kept, now 11)."""
    ids: dict[str, int] = {}
    every = Counter(ids.setdefault(op.key, len(ids)) for cls in program.classes
                    for ops in cls.streams.values() for op in ops if op.key)
    n = max(len(ids), 1)
    total = np.zeros(n, dtype=np.int64)
    for k, c in every.items():
        total[k] = c
    keyed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for cid, (order, cp) in regions.items():
        rows = [(k, ids.get(order[k].key, -1), ids.get(order[k + cp.length].key, -1))
                for k in range(cp.start, cp.start + cp.periods * cp.length)
                if order[k].key or order[k + cp.length].key]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
        keyed[cid] = (arr[:, 0], arr[:, 1], arr[:, 2])
    live = {cid: (pos >= cp.start) & (pos < cp.start + cp.periods * cp.length)
            for cid, (_, cp) in regions.items() for pos in (keyed[cid][0],)}
    src = np.concatenate([keyed[c][1][m] for c, m in live.items()])
    dst = np.concatenate([keyed[c][2][m] for c, m in live.items()])
    whole = (src >= 0) & (dst >= 0)
    pairs = np.unique(src[whole] * n + dst[whole])
    bad = np.zeros(n, dtype=bool)
    bad[np.flatnonzero(np.bincount(pairs // n, minlength=n) > 1)] = True   # k -> k', k''
    bad[np.flatnonzero(np.bincount(pairs % n, minlength=n) > 1)] = True    # k, k'' -> k'
    mapped = np.bincount(src[whole], minlength=n)
    bad |= (mapped > 0) & (mapped != total)                               # not all of k
    for cid, (order, cp) in regions.items():
        pos, a, b = keyed[cid]
        hit = live[cid] & ((a < 0) | (b < 0) | bad[np.maximum(a, 0)] | bad[np.maximum(b, 0)])
        regions[cid] = (order, _cut(cp, pos[hit].tolist()))
    if any(cp.periods < 1 for _, cp in regions.values()):
        return None
    return SteadyPeriod(micro_batches, {cid: cp for cid, (_, cp) in regions.items()})


def _cut(cp: ClassPeriod, bad_at: list[int]) -> ClassPeriod:
    """The most whole periods of ``cp`` that fit between the positions ``bad_at``: the
    longest run of ops holding none of them, its periods counted from its first op (any op
    of the stretch can start a period, not only those a whole number of periods from
    ``cp.start``: on that grid a bad op a little way into a period cost the whole period)."""
    lo, hi = cp.start, cp.start + cp.periods * cp.length
    bad = sorted({k for k in bad_at if lo <= k < hi})
    if not bad:
        return cp
    best_at, best = lo, 0
    at = lo
    for k in [*bad, hi]:
        if (k - at) // cp.length > best:
            best_at, best = at, (k - at) // cp.length
        at = k + 1
    return ClassPeriod(best_at, cp.length, best)
