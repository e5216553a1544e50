"""The sweep's plot: step time and $ per million tokens against the first numeric grid key.

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


def plot_axis(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> str | None:
    """The first grid key whose values are all numbers (the plot's x axis), or None."""
    for k in keys:
        if all(is_number(r[k]) for r in rows):
            return k
    return None


def sweep_figure(rows: Sequence[dict[str, Any]], keys: Sequence[str], title: str = ""
                 ) -> Figure:
    """Step time and $ per million tokens against the first numeric grid key, one line per
    combination of the other grid keys (per value of the second key when there are two).

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
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_t, ax_c = fig.subplots(1, 2)
    panels = ((ax_t, "step_time_s", "step time (s)"),
              (ax_c, "cost.usd_per_million_tokens", "$ per million tokens"))
    oom_shown = False
    for label, members in groups.items():
        ok = sorted((r for r in members if r.get("error") is None), key=lambda r: r[x_key])
        if not ok:
            continue
        name = ", ".join(label) or None   # the legend's title names the keys
        for ax, col, _ in panels:
            line, = ax.plot([r[x_key] for r in ok], [r[col] for r in ok], marker="o",
                            label=name)
            oom = [r for r in ok if r.get("oom")]
            if oom:
                ax.scatter([r[x_key] for r in oom], [r[col] for r in oom], s=110,
                           facecolors="none", edgecolors="tab:red", zorder=3,
                           label=None if oom_shown else "out of GPU memory")
                oom_shown = True
    for ax, _, ylabel in panels:
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    if others or oom_shown:
        ax_c.legend(title=", ".join(others) or None, fontsize="small")
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

