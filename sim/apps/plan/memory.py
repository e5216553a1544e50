"""How much memory a layout needs, estimated from its built program, and what that prunes.

:func:`memory_estimate` replays a program's allocations and frees in program order and on
the earliest schedule (:func:`sim.apps.plan.bound._earliest_schedule`); :class:`MemoryPruning`
keeps what the built layouts taught, so that layouts needing more memory than one that did not
fit are dropped unbuilt. Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sim.apps.plan.bound import _Schedule
from sim.apps.plan.layouts import Layout
from sim.apps.plan.recompute import RECOMPUTE_RANK, covers, recomputed

__all__ = ["RECOMPUTE_RANK", "MemoryPruning", "memory_estimate", "memory_on_schedule",
           "memory_program_order"]


def memory_program_order(program: Any) -> dict[int, float]:
    """Peak bytes of each rank class replaying its ops one at a time in program order."""
    class_of_op: dict[int, int] = {}
    for cls in program.classes:
        for stream in cls.streams.values():
            for op in stream:
                class_of_op[op.index] = cls.id
    cur = {c.id: sum(c.initial_memory.values()) for c in program.classes}
    peak = dict(cur)
    for op in program.ops:
        c = class_of_op[op.index]
        if op.alloc:
            cur[c] += sum(b for _, b in op.alloc)
        top = cur[c] + op.transient
        if top > peak[c]:
            peak[c] = top
        if op.free:
            cur[c] -= sum(b for _, b in op.free)
    return peak


def memory_on_schedule(program: Any, sched: _Schedule) -> dict[int, float]:
    """Peak bytes of each rank class on the earliest schedule: allocations at an op's start,
    transients while it runs, frees at its end. At equal times frees count first: an op
    that starts the instant another ends is almost always waiting for it (same stream or a
    dependency), and the engine frees when an op ends before the next one starts."""
    out: dict[int, float] = {}
    for cls in program.classes:
        events: list[tuple[float, int, float]] = []
        for stream in cls.streams.values():
            for op in stream:
                a = sum(b for _, b in op.alloc)
                f = sum(b for _, b in op.free)
                tr = op.transient if op.kind in ("compute", "copy") else 0.0
                if a + tr:
                    events.append((sched.start[op.index], 1, a + tr))
                if f + tr:
                    events.append((sched.end[op.index], 0, -(f + tr)))
        events.sort()
        cur = sum(cls.initial_memory.values())
        peak = cur
        for _, _, d in events:
            cur += d
            if cur > peak:
                peak = cur
        out[cls.id] = peak
    return out


def memory_estimate(program: Any, sched: _Schedule | None) -> dict[int, float]:
    """Upper estimate of each rank class's peak bytes, without the engine.

    The larger of two replays of the program's allocations and frees (``Op.alloc`` at an
    op's start, ``Op.transient`` while it runs, ``Op.free`` at its end, from
    ``RankClass.initial_memory``): in program order one op at a time, and on the earliest
    schedule (:func:`_earliest_schedule`), where communication runs at its fastest and so
    as far ahead of computation as the program's dependencies and the host clock let it:
    prefetched gathers hold their buffers longest there. It is an estimate, not a proof:
    the engine's communication is slower, which lets less run ahead but also keeps some
    buffers longer. ``tests/integration/test_plan.py`` checks it against simulated peaks (at most a
    few % below). The program-order replay alone falls far short where communication
    streams run ahead (FairScale 70B on 64 H100: 33 GiB, simulated 106 GiB).
    """
    order = memory_program_order(program)
    if sched is None:
        return order
    timed = memory_on_schedule(program, sched)
    return {c: max(order[c], timed.get(c, 0.0)) for c in order}


class MemoryPruning:
    """What the built layouts of each family (layouts that differ only in micro-batch size
    and recomputation, ``Candidate.family``) taught about memory.

    A family whose model states (parameters, gradients, optimizer states: the same for
    every micro-batch size and recomputation) exceed the GPU's usable memory fits with no
    layout; a layout whose estimate exceeds it means every layout of its family with at
    least its micro-batch size and at most its recomputation does not fit either
    (activations only grow with the micro-batch and shrink with recomputation). "At most"
    is :func:`~sim.apps.plan.recompute.covers`: a setting recomputing only some of what the
    one that did not fit recomputes (none < selective < full; Megatron's ``[moe_act]`` <
    ``[layernorm, moe_act]``); a selection that recomputes something else (``[moe_act]``
    beside the ``core_attn`` default) is not ruled out by it.

    For a mixture-of-experts model the expert layout ``(ep, etp)`` ends the family key; a
    family whose model states do not fit rules out the same layout with no more expert
    parallelism (``ep' <= ep`` and ``etp' <= etp``): each rank then holds at least as many
    expert parameters and gradients (``1 / (ep x etp)`` of each stage's experts), and the
    expert optimizer states are ``1 / (etp x ep x expert-dp x pp)`` = 1/world of them
    with the distributed optimizer, ``1 / (etp x ep x pp)`` without.
    """

    def __init__(self, usable_bytes: float) -> None:
        self.usable = usable_bytes
        self.states_oom: set[tuple[Any, ...]] = set()
        """Families whose model states alone do not fit."""
        self.oom_points: dict[tuple[Any, ...], list[tuple[int, frozenset[str]]]] = \
            defaultdict(list)
        """(micro-batch size, what it recomputes: :func:`~sim.apps.plan.recompute.
        recomputed`) of each family's layouts that did not fit by their estimate."""

    def dominated(self, family: tuple[Any, ...], layout: Layout) -> str | None:
        """Why the layout cannot fit, by what its family taught so far; None if it may."""
        if family in self.states_oom:
            return "model states (another micro-batch size or recomputation)"
        if layout.moe and any(f[:-1] == family[:-1] and layout.ep <= f[-1][0]
                              and layout.etp <= f[-1][1] for f in self.states_oom):
            return "model states (more expert parallelism does not fit)"
        mine = recomputed(layout)
        for mbs, r in self.oom_points.get(family, ()):
            if layout.micro_batch_size >= mbs and covers(r, mine):
                return "implied (a smaller micro-batch or more recomputation does not fit)"
        return None

    def verdict(self, family: tuple[Any, ...], layout: Layout, states_bytes: float,
                memory_bytes: float) -> str | None:
        """Why a built layout does not fit (``model states`` or ``estimate``), remembered for
        its family; None if it fits."""
        if states_bytes > self.usable:
            self.states_oom.add(family)
            return "model states"
        if memory_bytes > self.usable:
            self.oom_points[family].append((layout.micro_batch_size, recomputed(layout)))
            return "estimate"
        return None
