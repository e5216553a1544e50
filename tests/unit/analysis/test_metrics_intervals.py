"""The run analysis in sim.analysis.metrics: interval arithmetic against brute force, exposed
communication and bubbles against hand-worked timelines, and, on a simulated pipeline, the
conservation the definitions imply (busy + exposed + idle = the step, on every rank class;
on the critical one they are the summary's numbers). The outputs draw these from one home:
sim.outputs.plot re-exports the same functions."""

from __future__ import annotations

import random

import pytest
from helpers import megatron_pipeline

from sim.analysis import metrics
from sim.analysis.metrics import (
    Interval,
    bubble_intervals,
    critical_class,
    exposed_comm_intervals,
    host_bound_intervals,
    merge_intervals,
    records_by_class,
    step_spans,
    subtract_intervals,
    union_length,
)
from sim.api import RunResult, simulate
from sim.engine.recorder import OpRecord
from sim.outputs import plot
from sim.program.ir import Op

FWD = Op("forward", "compute", "compute", "fwd")
COPY = Op("offload", "copy", "d2h", "fwd")
AR = Op("all-reduce", "collective", "comm", "bwd")
SEND = Op("send", "send", "pp-fwd", "fwd")


def _cells(intervals: list[Interval]) -> set[int]:
    """Unit cells [i, i+1) covered by integer intervals: the brute-force truth."""
    return {i for a, b in intervals for i in range(int(a), int(b))}


def _random_intervals(rng: random.Random, n: int) -> list[Interval]:
    out = []
    for _ in range(n):
        a = rng.randint(0, 60)
        out.append((float(a), float(a + rng.randint(0, 12))))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_interval_arithmetic_matches_counting_cells(seed: int) -> None:
    rng = random.Random(seed)
    a, b = _random_intervals(rng, rng.randint(0, 15)), _random_intervals(rng, rng.randint(0, 15))
    merged = merge_intervals(a)
    assert all(s < e for s, e in merged)
    assert all(e0 < s1 for (_, e0), (s1, _) in zip(merged, merged[1:], strict=False))
    assert _cells(merged) == _cells(a)
    assert union_length(a) == len(_cells(a))
    rest = subtract_intervals(a, b)
    assert _cells(rest) == _cells(a) - _cells(b)
    assert merge_intervals(rest) == rest
    assert union_length(rest) == len(_cells(a) - _cells(b))


@pytest.mark.parametrize("seed", range(6))
def test_merging_many_intervals_on_arrays_gives_the_loops_values(seed: int) -> None:
    # Above metrics._MERGE_BY_ARRAY intervals the merge runs on numpy: the same values as
    # the loop (sorted by start then end, joined within the gap), ties and gaps included.
    rng = random.Random(seed)
    n = metrics._MERGE_BY_ARRAY * 4
    spans = [(a, a + rng.choice([0.0, -0.5, rng.random()]))
             for a in (rng.choice([rng.random() * 50, float(rng.randint(0, 50))])
                       for _ in range(n))]
    for gap in (0.0, 0.01, 0.3):
        loop: list[Interval] = []
        for a, b in sorted((a, b) for a, b in spans if b > a):
            if loop and a <= loop[-1][1] + gap:
                loop[-1] = (loop[-1][0], max(loop[-1][1], b))
            else:
                loop.append((a, b))
        assert merge_intervals(spans, gap) == loop


def test_union_length_adds_left_to_right() -> None:
    # Lengths 1e16, 1, 1 in time order. Adding left to right in doubles gives 1e16 (each +1 is
    # a tie at spacing 2, rounded to even), the value the goldens were made with; a
    # compensated sum (math.fsum, or sum() from Python 3.12) would give 1e16 + 2.
    assert union_length([(-1e16, 0.0), (1.0, 2.0), (3.0, 4.0)]) == 1e16


def test_exposed_communication_is_what_no_compute_or_copy_covers() -> None:
    # compute 0-2; a copy on another stream 4-5; an all-reduce 1-6 and a send 7-8.
    recs = [OpRecord(0, FWD, 0.0, 0.0, 2.0, 0), OpRecord(0, COPY, 4.0, 4.0, 5.0, 0),
            OpRecord(0, AR, 1.0, 1.0, 6.0, 0), OpRecord(0, SEND, 7.0, 7.0, 8.0, 0),
            # another class whose all-reduce sits wholly under its compute: nothing exposed
            OpRecord(1, FWD, 0.0, 0.0, 8.0, 0), OpRecord(1, AR, 1.0, 1.0, 3.0, 0)]
    assert exposed_comm_intervals(recs) == {0: {"comm": [(2.0, 4.0), (5.0, 6.0)],
                                                "pp-fwd": [(7.0, 8.0)]}}


def test_exposed_communication_starts_when_all_members_arrived() -> None:
    # Ready at 1 s, peers arrive at 3 s: only 3-4 s is communication, and it is exposed.
    recs = [OpRecord(0, FWD, 0.0, 0.0, 1.0, 0), OpRecord(0, AR, 1.0, 3.0, 4.0, 0)]
    assert exposed_comm_intervals(recs) == {0: {"comm": [(3.0, 4.0)]}}


def test_bubbles_are_the_step_less_everything_a_class_ran() -> None:
    # Two steps of 4 s. Class 0 computes 0-1 and 5-6, sends 1-1.5; class 1 sets the steps.
    recs = [OpRecord(0, FWD, 0.0, 0.0, 1.0, 0), OpRecord(0, SEND, 1.0, 1.0, 1.5, 0),
            OpRecord(1, FWD, 0.0, 0.0, 4.0, 0),
            OpRecord(0, FWD, 5.0, 5.0, 6.0, 1), OpRecord(1, FWD, 4.0, 4.0, 8.0, 1)]
    assert step_spans(recs) == [(0.0, 4.0), (4.0, 8.0)]
    assert bubble_intervals(recs) == {0: [(1.5, 5.0), (6.0, 8.0)], 1: []}
    assert critical_class(recs) == 1


@pytest.mark.parametrize("seed", range(20))
def test_host_bound_time_is_idle_time_an_issued_late_op_waited_through(seed: int) -> None:
    # Random integer timelines of one class in one 80 s step: compute, copies, collectives
    # and ops the host held (ready - held to ready). Counted cell by cell, the host-bound
    # time is the cells no op runs in and some held op was waiting in: never more than the
    # idle time, never outside a wait.
    rng = random.Random(seed)
    recs = [OpRecord(0, FWD, 0.0, 0.0, 80.0, 0)] if seed == 0 else []
    for _ in range(rng.randint(1, 12)):
        op = rng.choice([FWD, COPY, AR, SEND])
        start = float(rng.randint(0, 70))
        end = start + rng.randint(1, 8)
        held = float(rng.choice([0, 0, rng.randint(1, int(start) + 1)]))
        held = min(held, start)
        recs.append(OpRecord(0, op, start, start, end, 0, held))
    recs.append(OpRecord(0, FWD, 79.0, 79.0, 80.0, 0))
    span = [(0.0, 80.0)]
    ran = set().union(*(_cells([(r.start, r.end)]) for r in recs))
    waited = set().union(*(_cells([(r.ready - r.held, r.ready)]) for r in recs))
    got = host_bound_intervals(span, recs)
    assert _cells(got) == (set(range(80)) - ran) & waited
    assert union_length(got) <= union_length(metrics.class_idle(span, recs))


def test_critical_class_ties_go_to_the_lowest_id() -> None:
    recs = [OpRecord(2, FWD, 0.0, 0.0, 3.0, 0), OpRecord(1, FWD, 0.0, 0.0, 3.0, 0),
            OpRecord(0, FWD, 0.0, 0.0, 2.0, 0)]
    assert critical_class(recs) == 1
    assert list(records_by_class(recs)) == [2, 1, 0]


@pytest.fixture(scope="module")
def pp4() -> RunResult:
    """Megatron-LM 1F1B, 4 stages on one node, 8 micro-batches, a narrow model."""
    return simulate(megatron_pipeline(4, 8, 8))


def test_busy_exposed_and_idle_partition_every_stages_step(pp4: RunResult) -> None:
    ops = pp4.recorder.ops
    step = pp4.summary["step_time_s"]
    exposed = exposed_comm_intervals(ops)
    idle = bubble_intervals(ops)
    assert len(idle) == 4
    for cls, recs in records_by_class(ops).items():
        busy = metrics.busy_intervals(recs)
        out = [iv for ivs in exposed.get(cls, {}).values() for iv in ivs]
        # Disjoint: exposed lies outside busy; idle outside both.
        assert union_length(busy + out) == pytest.approx(union_length(busy) + union_length(out),
                                                         rel=1e-12)
        total = union_length(busy) + union_length(out) + union_length(idle[cls])
        assert union_length(busy + out + idle[cls]) == pytest.approx(total, rel=1e-12)
        assert total == pytest.approx(step, rel=1e-12)
    crit = critical_class(ops)
    # The summary's numbers are these intervals on the critical stage, measured the same way
    # (one computation, so equal to the last bit; one step, so step is the run's time).
    assert union_length(iv for ivs in exposed.get(crit, {}).values() for iv in ivs) \
        == pp4.summary["exposed_comm_s"]
    assert union_length(idle[crit]) / step == pp4.summary["bubble_fraction"]
    assert pp4.summary["bubble_fraction"] > 0.1   # 1F1B with p = 4, m = 8 has a real bubble


def test_plots_draw_from_the_one_home() -> None:
    for name in ("merge_intervals", "subtract_intervals", "total_length", "step_spans",
                 "exposed_comm_intervals", "bubble_intervals", "critical_class",
                 "BUSY_KINDS", "COMM_KINDS"):
        assert getattr(plot, name) is getattr(metrics, name), name
