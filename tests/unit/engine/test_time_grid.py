"""The engine's time grid (:mod:`sim.engine.time_grid`): intervals exact wherever they fall.

Issue 13 item 3 (advance a steady pipeline phase arithmetically, equal to the full run to the
last bit) needs a step's periods to repeat to the bit. Off the grid they do not (``t + p + p`` is
not ``t + 2p`` in doubles; a 1F1B steady phase at pp 4 showed seven different periods); on it
every event time is a whole number of quanta and every difference is exact.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import simpy
from hypothesis import given
from hypothesis import strategies as st

from sim.api import simulate
from sim.config.load import load_scenario
from sim.engine.time_grid import QUANTUM_S, GridEnvironment, on_grid

TINY = Path(__file__).resolve().parents[2] / "integration" / "golden" / "scenarios" / "tiny.yaml"

delays = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
# Grid points below 2**20 s: a double holds every multiple of the quantum there.
grid_times = st.integers(min_value=0, max_value=2 ** 52).map(lambda k: k * QUANTUM_S)


@given(delays)
def test_a_delay_rounds_up_by_less_than_a_quantum_to_a_whole_number_of_quanta(d: float) -> None:
    g = on_grid(d)
    assert d <= g <= d + QUANTUM_S
    assert (g / QUANTUM_S).is_integer()


@given(grid_times, delays)
def test_a_delay_lasts_the_same_wherever_it_starts(t: float, d: float) -> None:
    # The property a period needs: (t + d) - t is d itself on the grid, for any t.
    g = on_grid(d)
    assert (t + g) - t == g
    assert (t + g + g) == t + 2 * g


def test_every_event_falls_on_the_grid() -> None:
    env = GridEnvironment()
    seen: list[float] = []

    def walker() -> simpy.events.ProcessGenerator:
        for d in (1e-9, 0.1, 1 / 3, 2.5e-6, 0.0, 7.77):
            yield env.timeout(d)
            seen.append(env.now)

    env.process(walker())
    env.run()
    assert all((t / QUANTUM_S).is_integer() for t in seen)
    # Each rounding adds less than a quantum: six delays, six quanta at most.
    assert 0 <= seen[-1] - (1e-9 + 0.1 + 1 / 3 + 2.5e-6 + 7.77) < 6 * QUANTUM_S


def _steady_repeats(sets: list[str], period_mbs: int) -> tuple[int, int]:
    """(ops whose timings repeat exactly from micro-batch to micro-batch ``period_mbs`` later
    across the middle half of the step, ops whose timings do not)."""
    r = simulate(load_scenario(str(TINY), sets))
    times: dict[tuple[int, str, str], dict[int, list[tuple[float, float, float]]]] = \
        defaultdict(lambda: defaultdict(list))
    for rec in r.recorder.ops:
        if rec.op.micro_batch is not None:
            name = re.sub(r"mb\d+", "", rec.op.name)
            times[(rec.cls, rec.op.stream, name)][rec.op.micro_batch].append(
                (rec.ready, rec.start, rec.end))
    same = differ = 0
    for by_mb in times.values():
        mbs = sorted(by_mb)
        middle = mbs[len(mbs) // 4: 3 * len(mbs) // 4]
        shifts = {tuple(b - a for a, b in zip(x, y, strict=True))
                  for m, n in zip(middle, middle[period_mbs:], strict=False)
                  for x, y in zip(by_mb[m], by_mb[n], strict=True)}
        if len(shifts) == 1:
            same += 1
        else:
            differ += 1
    return same, differ


def test_a_steady_1f1b_phase_repeats_to_the_bit() -> None:
    # Megatron's 1F1B at pp 4 over 64 micro-batches: in the steady phase every op of every
    # stage (compute, TP all-reduces, pipeline sends) starts, readies and ends one period
    # after its twin of the previous micro-batch, the same period for all.
    same, differ = _steady_repeats(["framework.name=megatron", "parallelism.pp=4",
                                    "parallelism.tp=2", "training.global_batch_size=64"], 1)
    assert same > 40 and differ == 0


def test_an_interleaved_phase_repeats_every_pp_micro_batches() -> None:
    # The interleaved schedule switches chunks every pp micro-batches: its period is pp of
    # them (Megatron-Core's schedules.py get_model_chunk_id), and it too repeats exactly.
    sets = ["framework.name=megatron", "parallelism.pp=2", "parallelism.vp=2",
            "parallelism.tp=2", "parallelism.sequence_parallel=true",
            "training.global_batch_size=128"]
    same, differ = _steady_repeats(sets, 2)
    assert same > 100 and differ == 0
    # A period of one micro-batch is not one: the check can fail.
    same, differ = _steady_repeats(sets, 1)
    assert differ > 0


def test_identical_steps_take_identical_times() -> None:
    # Three steps of one data-parallel program start at different times (0, then the ends of
    # the previous steps); on the grid they last the same to the last bit.
    r = simulate(load_scenario(str(TINY), []), steps=3)
    ends: dict[int, float] = {}
    for rec in r.recorder.ops:
        ends[rec.step] = max(ends.get(rec.step, 0.0), rec.end)
    durations = [ends[0], ends[1] - ends[0], ends[2] - ends[1]]
    assert durations[0] == durations[1] == durations[2]
