"""Finding a step program's steady period (:mod:`sim.program.periods`, issue 13 item 3).

Independent truths: the schedules' own structure (Megatron-Core's 1F1B runs ``pp - s - 1``
warm-up forwards on stage ``s``, then one forward and one backward per micro-batch; the
interleaved schedule switches model chunks every ``pp`` micro-batches), read off the op names,
which the period search never looks at.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from sim.config.load import load_scenario
from sim.frameworks import JobContext, build_program
from sim.program.ir import Program
from sim.program.periods import ClassPeriod, SteadyPeriod, _cut, class_order, steady_period

TINY = Path(__file__).resolve().parents[2] / "integration" / "golden" / "scenarios" / "tiny.yaml"
ONE_F_ONE_B = ["framework.name=megatron", "parallelism.pp=4", "parallelism.tp=2",
               "training.global_batch_size=64"]          # 64 micro-batches a stage


def _program(sets: list[str]) -> Program:
    return build_program(JobContext.from_scenario(load_scenario(str(TINY), sets)))


def _base(name: str) -> str:
    return re.sub(r"mb\d+", "mb", name)


def _assert_maps_to_next(program: Program, period: SteadyPeriod) -> None:
    """Each op of every stretch maps onto the same op (by name, which the search never reads)
    ``period.micro_batches`` micro-batches later, or onto an op of no micro-batch of the same
    name (a wait)."""
    for cls in program.classes:
        cp = period.classes[cls.id]
        order = class_order(cls)
        for k in range(cp.start, cp.start + cp.periods * cp.length):
            a, b = order[k], order[k + cp.length]
            assert _base(a.name) == _base(b.name)
            assert (a.micro_batch is None) == (b.micro_batch is None)
            if a.micro_batch is not None:
                assert b.micro_batch == a.micro_batch + period.micro_batches


def test_1f1b_repeats_one_micro_batch_on_over_its_steady_phase() -> None:
    program = _program(ONE_F_ONE_B)
    period = steady_period(program)
    assert period is not None and period.micro_batches == 1
    _assert_maps_to_next(program, period)
    # The steady phase holds 64 - (pp - s - 1) pairs on stage s; the stretch lies inside the
    # shortest (61, stage 0) with a few micro-batches at each end where peers are unsteady.
    assert 50 <= period.periods <= 61


def test_the_interleaved_schedule_repeats_every_pp_micro_batches_and_not_every_one() -> None:
    sets = ["framework.name=megatron", "parallelism.pp=2", "parallelism.vp=2",
            "parallelism.tp=2", "parallelism.sequence_parallel=true",
            "training.global_batch_size=128"]
    program = _program(sets)
    assert steady_period(program, 1) is None
    period = steady_period(program, 2)
    assert period is not None and period.periods >= 20 and period.micro_batches == 2
    _assert_maps_to_next(program, period)


def test_gradient_accumulation_repeats_too() -> None:
    # DDP with 8 micro-batches a replica: forward and backward per micro-batch, the bucket
    # all-reduces only after the last.
    program = _program(["training.global_batch_size=64"])
    period = steady_period(program)
    assert period is not None and period.periods >= 4


def test_an_op_unlike_its_twin_breaks_the_period_there() -> None:
    program = _program(ONE_F_ONE_B)
    whole = steady_period(program)
    assert whole is not None
    cls = program.classes[0]
    cp = whole.classes[cls.id]
    order = class_order(cls)
    # A compute op a quarter of the way in (the search grows its stretch from the middle).
    middle = next(i for i in range(cp.start + (cp.periods // 4) * cp.length, len(order))
                  if order[i].kind == "compute" and order[i].duration > 0)
    odd = order[middle]
    stream = cls.streams[odd.stream]
    stream[stream.index(odd)] = changed = replace(odd, duration=odd.duration * 1.01)
    for ops in (o for c in program.classes for o in c.streams.values()):
        for op in ops:
            op.deps = [changed if d is odd else d for d in op.deps]
    cut = steady_period(program)
    assert cut is not None and cut.periods < whole.periods
    c0 = cut.classes[cls.id]
    # No mapped pair compares the changed op with an unchanged twin.
    assert not (c0.start <= middle - c0.length < c0.start + c0.periods * c0.length
                or c0.start <= middle < c0.start + c0.periods * c0.length)


def test_keys_that_do_not_map_one_to_one_cut_the_stretch() -> None:
    # Stage 1 gives one of its collectives the key of the next micro-batch's: the peers would
    # no longer meet where the period says, so the stretches stop short of it.
    program = _program(ONE_F_ONE_B)
    whole = steady_period(program)
    assert whole is not None
    cls = program.classes[1]
    order = class_order(cls)
    cp = whole.classes[cls.id]
    k = next(i for i in range(cp.start + 20 * cp.length, len(order)) if order[i].key)
    order[k].key = order[k + cp.length].key
    cut = steady_period(program)
    assert cut is None or cut.periods < whole.periods


def test_one_micro_batch_has_no_period() -> None:
    assert steady_period(_program(["training.global_batch_size=8"])) is None


def test_a_cut_keeps_the_whole_periods_between_the_bad_ops_wherever_they_start() -> None:
    # 10 periods of 10 ops; ops 3 and 98 may not be copied. Between them lie ops 4..97: 94
    # ops, 9 whole periods from op 4 (a grid from op 0 keeps only periods 1..8).
    cut = _cut(ClassPeriod(0, 10, 10), [3, 98])
    assert (cut.start, cut.periods) == (4, 9)
    # Nothing bad: the stretch as it was; bad ops outside it do not count.
    assert _cut(ClassPeriod(5, 10, 4), [0, 45, 99]) == ClassPeriod(5, 10, 4)


def test_an_interleaved_ring_keeps_all_but_its_fill_and_drain() -> None:
    # pp 4 x vp 2, 128 micro-batches: 32 periods of 4 micro-batches, 8 model chunks each. A
    # stage's fill (Megatron-Core's interleaved warm-up) is at most (pp - 1) x 2 + (vp - 1)
    # x pp = 10 chunks, its drain as many: 1.25 periods each side. The keys at a stretch's
    # ends (a send whose receive lies past the next stage's stretch) may cost each end one
    # period more: at least 32 - 2.5 - 2 = 27.5 periods stay, 27 whole. (Until the fortieth
    # session the image of a key broken at the front cut a period more: 26.)
    program = _program(["framework.name=megatron", "parallelism.pp=4", "parallelism.vp=2",
                        "parallelism.tp=2", "model.layers=16",
                        "training.global_batch_size=128"])
    period = steady_period(program, 4)
    assert period is not None
    _assert_maps_to_next(program, period)
    assert period.periods >= 27
