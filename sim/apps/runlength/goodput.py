"""Goodput against the checkpoint interval: the curve the run's optimum is the top of.

:func:`goodput_curve` evaluates the whole run's expected ETTR (:func:`sim.apps.runlength.run_ettr`,
the renewal form of Daly 2006 eq. 11 segment by segment) over a log-spaced range of checkpoint
intervals around the optimum, with three marks: the scenario's interval, the optimum (the same
exhaustive search that gives the run object's ``optimal_checkpoint_interval_steps``) and Young's
first-order interval sqrt(2 x checkpoint cost x MTBF) (Young, CACM 17(9), 1974). The plot is
:func:`sim.outputs.plot.goodput.goodput_figure` (outputs draw, apps compute).

The curve counts unplanned interruptions only: a planned stop saves first and loses no work, so
it costs the same at every interval and moves the curve down, not its optimum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.api import RunResult
from sim.apps.runlength import optimal_interval, run_ettr, run_plan

__all__ = ["GoodputCurve", "goodput_curve"]

SPAN = 50.0
"""The curve runs from the optimum / SPAN to the optimum x SPAN (clipped to 1 step and the
whole run), and always takes in the scenario's interval and Young's: wide enough to show both
sides of the optimum and how flat its top is (a readability choice)."""


@dataclass(frozen=True)
class GoodputCurve:
    """Expected ETTR of the whole run at each checkpoint interval, and its marks."""

    interval_steps: np.ndarray
    """Checkpoint intervals (steps), increasing, the marks included."""
    ettr: np.ndarray
    """Expected ETTR at each interval (unplanned interruptions)."""
    step_s: float
    chosen_steps: int
    """The scenario's ``run.checkpoint_interval_steps``."""
    optimal_steps: int
    """The interval with the highest expected ETTR over every interval."""
    young_daly_steps: float | None
    """sqrt(2 x checkpoint cost x MTBF) in steps; None without unplanned interruptions."""
    checkpoint_blocking_s: float
    """Training stopped per save at the scenario's interval."""
    mtbf_hours: float | None

    def at(self, steps: float) -> float:
        """Expected ETTR at ``steps`` (interpolated on the curve's log-spaced points)."""
        return float(np.interp(np.log(steps), np.log(self.interval_steps), self.ettr))


def goodput_curve(result: RunResult, run: Mapping[str, Any] | None = None,
                  points: int = 240) -> GoodputCurve:
    """The goodput curve of a simulated step of a scenario with a ``run:`` block.

    ``run`` is the summary's run object (:func:`sim.apps.runlength.run_length`, taken from
    ``result.summary["run"]`` when not given): its ``downtime_minutes`` (restart plus the
    Monte Carlo's mean replacement wait) prices each interruption as the optimum did.
    """
    run = run if run is not None else result.summary.get("run")
    if run is None:
        raise ValueError("goodput_curve: the result has no run object (no run: block?)")
    plan = run_plan(result)
    downtime_s = float(run["downtime_minutes"]) * 60.0
    n = plan.steps_total
    optimum = optimal_interval(plan, downtime_s)
    yd = run.get("young_daly_interval_steps")
    marks = [plan.interval_steps, optimum] + ([yd] if yd else [])
    lo = max(1.0, min(optimum / SPAN, *marks))
    hi = min(float(n), max(optimum * SPAN, *marks))
    grid = np.geomspace(lo, hi, points) if hi > lo else np.array([lo])
    k = np.unique(np.concatenate([np.round(grid), [plan.interval_steps, optimum],
                                  np.round([yd]) if yd else []]))
    k = k[(k >= 1) & (k <= n)]
    return GoodputCurve(
        interval_steps=k, ettr=run_ettr(plan, k, downtime_s), step_s=plan.step_s,
        chosen_steps=plan.interval_steps, optimal_steps=optimum,
        young_daly_steps=float(yd) if yd else None,
        checkpoint_blocking_s=float(plan.blocking_s(plan.interval_steps)),
        mtbf_hours=run.get("mtbf_hours"))
