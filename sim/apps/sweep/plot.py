"""The sweep's plot: step time and $ per million tokens (and the run's goodput, with a ``run:``
block) against the first numeric grid key, or a fault list's factor (``faults.slow_gpus``).

Part of :mod:`sim.apps.sweep` (which re-exports every public name here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.scenario import ScenarioError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def is_number(x: Any) -> bool:
    """An int or a float, not a bool: a value a plot axis can take."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def axis_value(x: Any) -> float | None:
    """A grid value as a position on the x axis: a number as itself; a fault list
    (``faults.slow_gpus``, ``slow_nodes``, ``slow_links``: mappings with a ``factor``) as its
    factors' product, 1 for none (no fault); anything else None.

    Examples
    --------
    >>> axis_value(400), axis_value([]), axis_value([{"rank": 3, "factor": 1.1}])
    (400.0, 1.0, 1.1)
    >>> axis_value("fsdp2") is None, axis_value([{"node": 0, "nic": 1}]) is None
    (True, True)
    """
    if is_number(x):
        return float(x)
    if isinstance(x, list) and all(isinstance(f, dict) and is_number(f.get("factor"))
                                   for f in x):
        out = 1.0
        for f in x:
            out *= float(f["factor"])
        return out
    return None


def plot_axis(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> str | None:
    """The first grid key whose values all have an :func:`axis_value` (the plot's x axis:
    numbers, or fault lists by their factor), or None."""
    for k in keys:
        if all(axis_value(r[k]) is not None for r in rows):
            return k
    return None


def sweep_figure(rows: Sequence[dict[str, Any]], keys: Sequence[str], title: str = ""
                 ) -> Figure:
    """Step time and $ per million tokens against the first numeric grid key, one line per
    combination of the other grid keys (per value of the second key when there are two).

    With a ``run:`` block (rows with ``run.ettr``) a third panel draws the run's goodput.
    Failed variants are left out; variants that run out of memory are circled in red."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    x_key = plot_axis(keys, rows)
    if x_key is None:
        raise ScenarioError("--plot: no grid key with only numeric values for the x axis")
    others = [k for k in keys if k != x_key]
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(value_label(r[k]) for k in others), []).append(r)
    with_run = any(r.get("run.ettr") is not None for r in rows if r.get("error") is None)
    fig = Figure(figsize=(17 if with_run else 12, 4.6), layout="constrained")
    axs = fig.subplots(1, 3 if with_run else 2)
    ax_t, ax_c = axs[0], axs[1]
    panels = [(ax_t, "step_time_s", "step time (s)"),
              (ax_c, "cost.usd_per_million_tokens", "$ per million tokens")]
    if with_run:
        panels.append((axs[2], "run.ettr", "run goodput (ETTR)"))
    # Every row has one (plot_axis chose the key so).
    x: dict[int, float] = {id(r): axis_value(r[x_key]) or 0.0 for r in rows}
    oom_shown = False
    for label, members in groups.items():
        ok = sorted((r for r in members if r.get("error") is None), key=lambda r: x[id(r)])
        if not ok:
            continue
        name = ", ".join(label) or None   # the legend's title names the keys
        for ax, col, _ in panels:
            line, = ax.plot([x[id(r)] for r in ok], [r[col] for r in ok], marker="o",
                            label=name)
            oom = [r for r in ok if r.get("oom")]
            if oom:
                ax.scatter([x[id(r)] for r in oom], [r[col] for r in oom], s=110,
                           facecolors="none", edgecolors="tab:red", zorder=3,
                           label=None if oom_shown else "out of GPU memory")
                oom_shown = True
    numeric = all(is_number(r[x_key]) for r in rows)
    for ax, _, ylabel in panels:
        ax.set_xlabel(x_key if numeric else f"{x_key} (factor)")
        ax.set_ylabel(ylabel)
        if ax is not panels[-1][0] or not with_run:
            ax.set_ylim(bottom=0)   # goodput differs by tenths of a percent: its own range
        ax.grid(True, alpha=0.3)
    if others or oom_shown:
        panels[-1][0].legend(title=", ".join(others) or None, fontsize="small")
    fig.suptitle(f"{title} — sweep over {x_key}" if title else f"sweep over {x_key}")
    return fig


def value_label(value: Any) -> str:
    """A grid value as a legend or table shows it (strings as written, others as JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def write_plot(path: Path, rows: Sequence[dict[str, Any]], keys: Sequence[str],
               title: str = "") -> None:
    """Save :func:`sweep_figure` to ``path`` (PNG, SVG or PDF by suffix)."""
    fig = sweep_figure(rows, keys, title)
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)

