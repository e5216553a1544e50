"""The planner's progress callback reports every phase, builds included (the live
"N built" counter of ``fabricsim plan`` stayed at 0 while builds were skipped)."""

from __future__ import annotations

from sim.apps.plan import search
from sim.scenario import load_scenario


def test_progress_counts_every_build_and_simulation() -> None:
    seen: list[tuple[str, int, int]] = []
    r = search(load_scenario("llama3.2-1b-ddp-8xh100"), "time", workers=1, max_simulations=2,
               progress=lambda phase, done, total: seen.append((phase, done, total)))
    last = {phase: done for phase, done, _ in seen}
    assert last["build"] == len(r.built) > 0
    assert last["simulate"] == len(r.simulated)
    # Counts only grow, one report per settled piece of work.
    builds = [done for phase, done, _ in seen if phase == "build"]
    assert builds == sorted(builds) and builds[0] == 1
