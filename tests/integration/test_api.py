"""The run phases of sim.api: progress reporting over a long simulation."""

from __future__ import annotations

from sim.api import simulate
from sim.engine.core import PROGRESS_EVERY
from sim.scenario import load_scenario


def test_progress_counts_every_op_of_every_step_once_and_in_order() -> None:
    sc = load_scenario("llama3.2-1b-ddp-8xh100")
    seen: list[tuple[int, int]] = []
    steps = 2
    result = simulate(sc, steps, progress=lambda done, total: seen.append((done, total)))
    total = len(result.program.ops) * steps
    assert all(t == total for _, t in seen)
    dones = [d for d, _ in seen]
    assert dones == sorted(dones)
    assert dones[-1] == total
    # one report per PROGRESS_EVERY finished ops, and the final one
    assert len(seen) == total // PROGRESS_EVERY + 1
