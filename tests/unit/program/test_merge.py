"""sim/program/merge.py: several jobs' programs as one (ranks moved, keys and classes kept
apart, start offsets, steps)."""

from __future__ import annotations

import pytest

from sim.program.ir import CPU_STREAM, Op, Program, RankClass
from sim.program.merge import START_WAIT, STEP_BARRIER, JobPart, merge
from sim.program.traffic import traffic_program


def two_rank_job() -> Program:
    """A 2-rank data-parallel step: forward, then an all-reduce over both ranks, then a send."""
    c = RankClass(id=0, members=(0, 1), label="all ranks")
    p = Program([c], n_ranks=2, tokens_per_step=10.0, model_flops_per_step=5.0,
                hw_flops_per_step=6.0)
    group = (0, 1)
    f = p.add(c, Op("fwd", "compute", "compute", "fwd", duration=1.0))
    p.add(c, Op("ar", "collective", "comm", "comm", deps=[f], collective="all_reduce",
                group=group, nbytes=8.0, key="ar/0"))
    p.add(c, Op("ar2", "collective", "comm", "comm", collective="all_reduce", group=group,
                nbytes=8.0, key="ar/1"))
    p.add(c, Op("send", "send", "pp", "comm", pairs=((0, 1),), nbytes=4.0, key="s/0"))
    return p


def test_merge_moves_ranks_and_keeps_jobs_apart():
    # 2 GPUs per node, 3 nodes: job a on node 2, job b on node 0; node 1 idle.
    a, b = two_rank_job(), two_rank_job()
    merged, slices = merge([JobPart("a", a, (2,)), JobPart("b", b, (0,))], 6, 2)
    assert [c.members for c in merged.classes] == [(4, 5), (0, 1), (2, 3)]
    assert [c.id for c in merged.classes] == [0, 1, 2]
    assert [c.label for c in merged.classes] == ["a/all ranks", "b/all ranks", "idle"]
    ars = [op for op in merged.ops if op.collective == "all_reduce"]
    assert [op.key for op in ars] == ["a:ar/0", "a:ar/1", "b:ar/0", "b:ar/1"]
    assert ars[0].group == (4, 5) and ars[2].group == (0, 1)
    # One tuple shared by two ops stays one tuple (the engine caches by identity).
    assert ars[0].group is ars[1].group
    sends = [op for op in merged.ops if op.kind == "send"]
    assert [op.pairs for op in sends] == [((4, 5),), ((0, 1),)]
    assert [op.index for op in merged.ops] == list(range(len(merged.ops)))
    assert merged.tokens_per_step == 20.0
    assert [s.ranks for s in slices] == [(4, 5), (0, 1)]


def test_start_offset_is_a_leading_synchronising_host_wait():
    merged, slices = merge([JobPart("late", two_rank_job(), (0,), start_s=0.5)], 2, 2)
    cls = merged.classes[0]
    wait = cls.streams[CPU_STREAM][0]
    assert (wait.name, wait.kind, wait.duration, wait.host_sync) == (START_WAIT, "host", 0.5,
                                                                     True)
    assert wait.index == 0      # first in the class's issue order
    assert slices[0].waits == [wait] and wait not in slices[0].ops


def test_steps_follow_a_barrier_on_the_previous_step():
    merged, slices = merge([JobPart("j", two_rank_job(), (0,), more=[two_rank_job()])], 2, 2)
    cls = merged.classes[0]
    assert len(cls.streams["compute"]) == 2 and len(cls.streams["comm"]) == 4
    barrier = cls.streams[CPU_STREAM][0]
    assert barrier.name == STEP_BARRIER and barrier.host_sync
    # It waits for the last op of every stream of step 1, and comes before step 2's ops.
    assert {d.name for d in barrier.deps} == {"fwd", "ar2", "send"}
    assert barrier.index < min(op.index for op in cls.streams["compute"][1:])
    assert [op.key for op in cls.streams["comm"]] == ["j:ar/0", "j:ar/1", "j:1:ar/0",
                                                      "j:1:ar/1"]
    assert slices[0].steps == 2


def test_overlapping_jobs_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        merge([JobPart("a", two_rank_job(), (0,)), JobPart("b", two_rank_job(), (0,))], 4, 2)


def test_traffic_program_paces_its_sends():
    p = traffic_program(2, 2, 1e6, 0.1, 3, "chain")
    sends = [op for op in p.ops if op.kind == "send"]
    ticks = p.classes[0].streams[CPU_STREAM]
    assert [op.pairs for op in sends][0] == ((0, 2), (1, 3))
    assert [op.deps for op in sends] == [[], [ticks[0]], [ticks[1]]]
    assert all(t.duration == 0.1 for t in ticks)
