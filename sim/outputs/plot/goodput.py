"""What-if plots of a whole run: goodput against the checkpoint interval, and a straggler's cost.

Part of :mod:`sim.outputs.plot`. The figures draw numbers computed elsewhere (outputs never import
the apps): the goodput curve from :func:`sim.apps.runlength.goodput.goodput_curve`, the step
times from simulated variants (``fabricsim compare`` / ``sweep`` over ``faults.slow_gpus``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

from sim.outputs.plot.common import save_png

OPTIMUM_COLOR = "#E45756"
YOUNG_DALY_COLOR = "#4C78A8"
CHOSEN_COLOR = "#54A24B"


def goodput_figure(interval_steps: ArrayLike, ettr: ArrayLike, *,
                   optimal_steps: float, young_daly_steps: float | None = None,
                   chosen_steps: float | None = None, step_s: float | None = None,
                   title: str = "") -> Figure:
    """Expected ETTR (goodput) against the checkpoint interval, log x axis, with the optimum,
    Young/Daly's interval and the scenario's own interval marked (each with its ETTR).

    ``step_s`` adds the interval in hours on a top axis."""
    k = np.asarray(interval_steps, dtype=float)
    y = np.asarray(ettr, dtype=float)
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(k, y * 100, color="#333333", lw=1.8, label="expected goodput (ETTR)")

    def mark(steps: float, color: str, name: str, style: str) -> None:
        at = float(np.interp(np.log(steps), np.log(k), y)) if k.size > 1 else float(y[0])
        ax.axvline(steps, color=color, ls=style, lw=1.2,
                   label=f"{name}: {steps:,.0f} steps, ETTR {at:.2%}")
        ax.plot([steps], [at * 100], "o", color=color, ms=5)

    mark(optimal_steps, OPTIMUM_COLOR, "optimum", "-")
    if young_daly_steps is not None:
        mark(young_daly_steps, YOUNG_DALY_COLOR, "Young/Daly √(2·C·MTBF)", "--")
    if chosen_steps is not None:
        mark(chosen_steps, CHOSEN_COLOR, "scenario", ":")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("goodput, ETTR (%)")
    lo = float(np.nanmin(y)) * 100
    ax.set_ylim(max(0.0, lo - 0.1 * (100 - lo)), min(100.0, float(np.nanmax(y)) * 100 + 1))
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize="small", loc="lower center")
    if step_s:
        hours = 3600.0 / step_s      # steps per hour of training

        def to_hours(x: Any) -> Any:
            return np.asarray(x, dtype=float) / hours

        def to_steps(x: Any) -> Any:
            return np.asarray(x, dtype=float) * hours

        top = ax.secondary_xaxis("top", functions=(to_hours, to_steps))
        top.set_xlabel("checkpoint interval (hours of training)")
    ax.set_title(f"{title} — goodput vs checkpoint interval" if title
                 else "goodput vs checkpoint interval", fontsize="medium")
    return fig


def goodput(path: Path, interval_steps: ArrayLike, ettr: ArrayLike, *,
            optimal_steps: float, young_daly_steps: float | None = None,
            chosen_steps: float | None = None, step_s: float | None = None,
            title: str = "") -> None:
    """Write :func:`goodput_figure` as a PNG."""
    save_png(goodput_figure(interval_steps, ettr, optimal_steps=optimal_steps,
                            young_daly_steps=young_daly_steps, chosen_steps=chosen_steps,
                            step_s=step_s, title=title), path)


def straggler_figure(factors: ArrayLike, step_times_s: ArrayLike, *,
                     compute_s: float | None = None, usd_per_day: float | None = None,
                     title: str = "") -> Figure:
    """Step time against one GPU's slowdown factor (1 = no straggler), and the slowdown in
    percent on a second axis.

    ``compute_s`` (the healthy step's compute time) adds the closed form of a synchronous job:
    every rank waits for the slow one at each collective, so the step grows by
    ``(factor - 1) x compute``. ``usd_per_day`` (the healthy run's) labels each point with what
    the straggler costs per day: the same work takes ``step / step_0`` as long."""
    f = np.asarray(factors, dtype=float)
    t = np.asarray(step_times_s, dtype=float)
    order = np.argsort(f)
    f, t = f[order], t[order]
    base = float(t[0]) if f[0] == 1.0 else None
    fig = Figure(figsize=(8.5, 4.6), layout="constrained")
    ax = fig.subplots()
    ax.plot(f, t, "o-", color="#E45756", label="simulated step")
    if compute_s is not None and base is not None:
        ax.plot(f, base + (f - 1.0) * compute_s, "--", color="#888888",
                label="closed form: step₀ + (factor − 1) × compute")
    if base is not None:
        for x, s in zip(f[1:], t[1:], strict=True):
            text = f"+{s / base - 1:.1%}"
            if usd_per_day is not None:
                text += f"\n${usd_per_day * (s / base - 1):,.0f}/day"
            ax.annotate(text, (x, s), textcoords="offset points", xytext=(4, -24),
                        fontsize="x-small")
        healthy = base

        def to_percent(x: Any) -> Any:
            return (np.asarray(x, dtype=float) / healthy - 1.0) * 100.0

        def to_seconds(x: Any) -> Any:
            return healthy * (1.0 + np.asarray(x, dtype=float) / 100.0)

        right = ax.secondary_yaxis("right", functions=(to_percent, to_seconds))
        right.set_ylabel("slower than healthy (%)")
    ax.set_xlabel("slow GPU's factor (its kernels take factor × as long)")
    ax.set_ylabel("step time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    ax.set_title(f"{title} — one straggler's cost" if title else "one straggler's cost",
                 fontsize="medium")
    return fig


def straggler(path: Path, factors: ArrayLike, step_times_s: ArrayLike, *,
              compute_s: float | None = None, usd_per_day: float | None = None,
              title: str = "") -> None:
    """Write :func:`straggler_figure` as a PNG."""
    save_png(straggler_figure(factors, step_times_s, compute_s=compute_s,
                              usd_per_day=usd_per_day, title=title), path)
