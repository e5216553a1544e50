"""Where the planner's builds and simulations run, and what a finished batch of simulations
returns (:mod:`sim.apps.plan.search`'s branch and bound hands them out)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.apps.executor import Pool, type_and_message
from sim.apps.plan.evaluate import Simulated, SimulateMany


@dataclass(frozen=True)
class _Workers:
    """Where builds and simulations run."""

    runner: Pool
    """Local processes: every build, and simulations without a hook."""
    sim_thread: Any
    """The one thread that calls ``simulate_many``, or None."""
    simulate_many: SimulateMany | None
    simulation_batch: int | None
    progress: Callable[[str, int, int], None] | None
    cache_dir: str | None = None
    """The simulation cache's folder, or None."""


def _also(cache_dir: str | None) -> tuple[str, ...]:
    # The cache argument only when there is one (tests replace the tasks with their own).
    return (cache_dir,) if cache_dir is not None else ()


def _batch_results(fut: Any, indices: list[int]) -> list[Simulated]:
    """The simulations of a finished batch, one per layout; a failed batch is its layouts'
    error, not the plan's."""
    try:
        outcome = fut.result()
        results = outcome if isinstance(outcome, list) else [outcome]
        if len(results) != len(indices):
            raise RuntimeError(f"the simulation backend returned {len(results)} "
                               f"results for {len(indices)} layouts")
    except Exception as exc:
        text = type_and_message(exc)
        results = [Simulated(None, text, 0.0) for _ in indices]
    return results
