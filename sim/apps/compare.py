"""Variants of a scenario side by side, with their deltas (``fabricsim compare``).

Variants come from one scenario and ``--what-if KEY=V1,V2[,...]`` (one variant per value, the
scenario loaded with ``KEY=V`` as a ``--set`` override, labelled ``KEY=V``), or from two or
more scenario files (labelled as given on the command line). ``--set`` overrides apply to every
variant. Each variant is simulated with :func:`sim.api.simulate`.

Errors: a variant that cannot be loaded (unknown key, a value of the wrong type, an impossible
layout, an unknown or mismatched ``pricing.instance``) is bad input and stops the comparison
with one line (exit 2). A variant that loads but whose simulation fails (a framework refusing
the layout through ``ctx.require``, an internal error) is recorded with its error and the
others still run; if every variant fails that way, the first error is reported as bad input.

JSON (``fabricsim compare --json`` and ``compare.json``)::

    {
      "baseline": "cluster.nic_gbps=100",   # label of the variant the deltas are taken
                                            # against: the first variant that ran
      "variants": [                         # every variant, in order
        {"label": "cluster.nic_gbps=100",
         "summary": {...},                  # the `fabricsim run --json` object, null if failed
         "error": null}                     # one line when the variant failed, else null
      ],
      "deltas": [                           # one per variant that ran, baseline excluded
        {"label": "cluster.nic_gbps=400",
         "step_time_s": {"abs": -0.81, "rel": -0.35},
         "bytes.network": {"abs": 0.0, "rel": 0.0},
         "cost.usd_per_day": {"abs": ..., "rel": ...},
         ...}                               # every metric of METRICS, by dotted summary path
      ]
    }

``abs`` is variant minus baseline; ``rel`` is ``abs / baseline``, 0 when both are 0 and null
when only the baseline is 0. A metric that is null in either summary (``cost.run_usd``
without ``training.tokens_total``) is left out of that variant's deltas.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from rich.table import Table  # noqa: E402

from sim.analysis.cost import resolve_pricing  # noqa: E402
from sim.analysis.summary import Summary  # noqa: E402
from sim.apps.executor import Task, simulate_task  # noqa: E402
from sim.apps.sweep.grid import split_values  # noqa: E402
from sim.outputs.folder import staged_folder  # noqa: E402
from sim.scenario import Scenario, ScenarioError, load_scenario  # noqa: E402


@dataclass(frozen=True)
class Metric:
    """One compared figure: a dotted path into the summary, a row name and a unit."""

    path: str
    name: str
    unit: str
    """How to print it: s, tok/s, frac, GiB, bytes, usd, GB, h, d (days), count."""
    in_table: bool = True
    """Shown as a row of the table (every metric is in the JSON deltas)."""
    optional: bool = False
    """A row only when some variant has it (the ``run`` object of a ``run:`` block)."""


METRICS: tuple[Metric, ...] = (
    Metric("step_time_s", "step time", "s"),
    Metric("tokens_per_s_per_gpu", "tokens / s / GPU", "tok/s"),
    Metric("tokens_per_s", "tokens / s", "tok/s", in_table=False),
    Metric("mfu", "MFU", "frac"),
    Metric("hfu", "HFU", "frac", in_table=False),
    Metric("compute_time_s", "compute", "s"),
    Metric("comm_time_s", "communication", "s", in_table=False),
    Metric("exposed_comm_s", "exposed comm", "s"),
    Metric("overlap_fraction", "comm hidden", "frac", in_table=False),
    Metric("bubble_fraction", "pipeline bubble", "frac"),
    Metric("peak_memory_gib", "peak memory", "GiB"),
    Metric("bytes.nvlink", "bytes · nvlink", "bytes"),
    Metric("bytes.pcie", "bytes · pcie", "bytes"),
    Metric("bytes.network", "bytes · network", "bytes"),
    Metric("bytes.cross_az", "bytes · cross_az", "bytes"),
    Metric("bytes.cross_region", "bytes · cross_region", "bytes"),
    Metric("cost.gpu_hour_usd", "$ / GPU-hour", "usd", in_table=False),
    Metric("cost.usd_per_hour", "$ / hour", "usd", in_table=False),
    Metric("cost.usd_per_step", "$ / step", "usd"),
    Metric("cost.egress_usd_per_step", "egress $ / step", "usd", in_table=False),
    Metric("cost.usd_per_million_tokens", "$ / M tokens", "usd"),
    Metric("cost.usd_per_day", "$ / day", "usd"),
    Metric("cost.egress_gb_per_day", "egress GB / day", "GB", in_table=False),
    Metric("cost.egress_usd_per_day", "egress $ / day", "usd"),
    Metric("cost.run_hours", "run hours", "h", in_table=False),
    Metric("cost.run_usd", "run cost", "usd"),
    Metric("gpus", "GPUs", "count", in_table=False),
    # The whole run, only for scenarios with a `run:` block (sim.apps.runlength): what a
    # straggler, a slow link or a checkpoint interval costs over the run, not per step.
    Metric("run.ettr", "goodput (ETTR)", "frac", optional=True),
    Metric("run.expected_days", "run days", "d", optional=True),
    Metric("run.expected_usd", "run $", "usd", optional=True),
    Metric("run.interruptions_expected", "interruptions", "count", optional=True),
    Metric("run.optimal_checkpoint_interval_steps", "best ckpt interval", "count",
           optional=True),
    Metric("run.checkpoint_blocking_s", "ckpt stop", "s", in_table=False, optional=True),
    Metric("run.days_p95", "run days p95", "d", in_table=False, optional=True),
    # With run.zone_outage (sim.apps.runlength.zones): what the outages cost, per policy.
    Metric("run.zone_outages_expected", "zone outages", "count", optional=True),
    Metric("run.zone_outage_days_lost", "zone outage days", "d", optional=True),
    Metric("run.shrunk_step_time_s", "shrunk step", "s", in_table=False, optional=True),
)


@dataclass
class Variant:
    """One column of the comparison: what was asked for and what came out."""

    label: str
    scenario: Scenario
    origin: str
    summary: Summary | None = None
    error: str | None = None


# --------------------------------------------------------------------------- variants
def parse_what_if(what_if: str) -> tuple[str, list[str]]:
    """Split ``KEY=V1,V2,...`` into the key and the raw values (each a YAML scalar).

    Examples
    --------
    >>> parse_what_if("cluster.nic_gbps=100,400")
    ('cluster.nic_gbps', ['100', '400'])
    >>> parse_what_if("faults.slow_gpus=[],[{rank: 3, factor: 1.1}]")
    ('faults.slow_gpus', ['[]', '[{rank: 3, factor: 1.1}]'])
    """
    if "=" not in what_if:
        raise ScenarioError(f"--what-if {what_if}: expected KEY=V1,V2[,...]")
    key, raw = what_if.split("=", 1)
    key = key.strip()
    # Commas inside brackets, braces or quotes belong to a value: a list-valued key such as
    # faults.slow_gpus=[],[{rank: 3, factor: 1.1}] (split as a sweep's --grid splits).
    values = split_values(raw)
    if not key:
        raise ScenarioError(f"--what-if {what_if}: empty key")
    if not values or any(v == "" for v in values):
        raise ScenarioError(f"--what-if {what_if}: empty value in V1,V2[,...]")
    return key, values


def _checked(ref: str, overrides: Sequence[str]) -> Scenario:
    # Load and check the prices now, so a bad instance is reported before anything runs.
    scenario = load_scenario(ref, list(overrides))
    resolve_pricing(scenario, origin=ref)
    return scenario


def what_if_variants(ref: str, what_if: str, overrides: Sequence[str] = ()) -> list[Variant]:
    """One variant of scenario ``ref`` per value of ``--what-if KEY=V1,V2,...``."""
    key, values = parse_what_if(what_if)
    variants = []
    for raw in values:
        assignment = f"{key}={raw}"   # parsed as --set parses it: a YAML scalar
        variants.append(Variant(assignment, _checked(ref, [*overrides, assignment]), ref))
    return variants


def file_variants(refs: Sequence[str], overrides: Sequence[str] = ()) -> list[Variant]:
    """One variant per scenario file (or shipped name); repeated names get ``#2``, ``#3``."""
    variants = []
    seen: dict[str, int] = {}
    for ref in refs:
        seen[ref] = seen.get(ref, 0) + 1
        label = ref if seen[ref] == 1 else f"{ref}#{seen[ref]}"
        variants.append(Variant(label, _checked(ref, overrides), ref))
    return variants


def simulate_variants(variants: Sequence[Variant],
                      progress: Callable[[int, int, str], None] | None = None) -> None:
    """Simulate every variant in place, recording a failure instead of raising it.

    ``progress(done, total, label)`` is called before each variant (done = variants finished).
    Each runs here, one after another, through the shared executor
    (:func:`sim.apps.executor.simulate_task`); its error is worded by :func:`variant_error`.
    """
    for i, v in enumerate(variants):
        if progress is not None:
            progress(i, len(variants), v.label)
        out = simulate_task(Task(i, v.scenario, {}), 1, v.origin, variant_error)
        if out.error is None:
            v.summary = out.summary
        else:
            v.error = out.error
    if progress is not None:
        progress(len(variants), len(variants), "")


def variant_error(exc: BaseException) -> str:
    """A failed variant's error: a ScenarioError's own line (the framework refusing the
    layout), anything else ``internal error: Type: message`` (the CLI exits 1 on it).

    Examples
    --------
    >>> variant_error(ScenarioError("x.yaml: parallelism.tp: 3 does not divide 8 heads"))
    'x.yaml: parallelism.tp: 3 does not divide 8 heads'
    >>> variant_error(ZeroDivisionError("float division by zero"))
    'internal error: ZeroDivisionError: float division by zero'
    """
    if isinstance(exc, ScenarioError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- deltas
def metric_value(summary: Mapping[str, Any], path: str) -> float | None:
    """The number at a dotted path of a summary, or None if absent or null.

    Examples
    --------
    >>> metric_value({"cost": {"usd_per_day": 3.0, "run_usd": None}}, "cost.usd_per_day")
    3.0
    >>> metric_value({"cost": {"run_usd": None}}, "cost.run_usd") is None
    True
    """
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    return float(node)


def delta(value: float, base: float) -> dict[str, float | None]:
    """``{"abs": value - base, "rel": (value - base) / base}``; rel is 0 when both are 0 and
    None when only the base is 0. A difference within 1e-12 of the values is float rounding
    of sums taken in another order (bytes added flow by flow), and reads 0.

    Examples
    --------
    >>> delta(3.0, 2.0)
    {'abs': 1.0, 'rel': 0.5}
    >>> delta(0.0, 0.0), delta(1.0, 0.0)
    ({'abs': 0.0, 'rel': 0.0}, {'abs': 1.0, 'rel': None})
    >>> delta(70.85e12 + 2, 70.85e12)
    {'abs': 0.0, 'rel': 0.0}
    """
    diff = value - base
    if abs(diff) <= 1e-12 * max(abs(value), abs(base)):
        diff = 0.0
    if base != 0:
        rel: float | None = diff / base
    else:
        rel = 0.0 if diff == 0 else None
    return {"abs": diff, "rel": rel}


def compare_result(variants: Sequence[Variant]) -> dict[str, Any]:
    """The comparison as the JSON object documented in this module."""
    ran = [v for v in variants if v.summary is not None]
    baseline = ran[0] if ran else None
    deltas = []
    for v in ran[1:]:
        assert baseline is not None and baseline.summary is not None and v.summary is not None
        entry: dict[str, Any] = {"label": v.label}
        for m in METRICS:
            a, b = metric_value(v.summary, m.path), metric_value(baseline.summary, m.path)
            if a is not None and b is not None:
                entry[m.path] = delta(a, b)
        deltas.append(entry)
    return {
        "baseline": baseline.label if baseline else None,
        "variants": [{"label": v.label, "summary": v.summary, "error": v.error}
                     for v in variants],
        "deltas": deltas,
    }


# --------------------------------------------------------------------------- table
def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} B"


def format_value(value: float, unit: str, signed: bool = False) -> str:
    """A metric's value for the table, in its unit; ``signed`` for deltas.

    Examples
    --------
    >>> format_value(0.4123, "frac"), format_value(-2e9, "bytes", signed=True)
    ('41.2%', '-2.00 GB')
    """
    sign = "+" if signed else ""
    if unit == "s":
        return f"{value:{sign}.4f} s"
    if unit == "tok/s":
        return f"{value:{sign},.0f}"
    if unit == "frac":
        return f"{value:{sign}.1%}"
    if unit == "GiB":
        return f"{value:{sign}.1f} GiB"
    if unit == "bytes":
        value = 0.0 if abs(value) < 0.5 else value   # float noise of summed flows, not bytes
        text = _fmt_bytes(value)
        return ("+" + text) if signed and value >= 0 else text
    if unit == "usd":
        digits = 4 if abs(value) < 1 else 2 if abs(value) < 1e5 else 0
        text = f"${abs(value):,.{digits}f}"
        return ("-" if value < 0 else sign) + text
    if unit == "GB":
        return f"{value:{sign},.1f} GB"
    if unit == "h":
        return f"{value:{sign},.1f} h"
    if unit == "d":
        return f"{value:{sign},.2f} d"
    return f"{value:{sign},g}"


def comparison_table(result: dict[str, Any]) -> Table:
    """The rich table: a row per metric, a column per variant, deltas against the baseline."""
    variants = result["variants"]
    deltas = {d["label"]: d for d in result["deltas"]}
    labels = [v["label"] for v in variants]
    # What-if labels share their key: print it once, in the title, and the values as headers.
    keys = {label.split("=", 1)[0] for label in labels}
    what_if = len(keys) == 1 and all("=" in label for label in labels)
    headers = [label.split("=", 1)[1] for label in labels] if what_if else labels
    title = (f"{len(variants)} variant(s){' of ' + keys.pop() if what_if else ''}; "
             f"deltas against {result['baseline']}")
    table = Table(title=title, title_justify="left")
    table.add_column("metric", style="bold", no_wrap=True)
    for header in headers:
        table.add_column(header, justify="right")
    for m in METRICS:
        if not m.in_table:
            continue
        if m.optional and not any(v["summary"] is not None
                                  and metric_value(v["summary"], m.path) is not None
                                  for v in variants):
            continue
        row = [m.name]
        for v in variants:
            if v["summary"] is None:
                row.append("[red]failed[/red]")
                continue
            value = metric_value(v["summary"], m.path)
            if value is None:
                row.append("—")
                continue
            cell = format_value(value, m.unit)
            d = deltas.get(v["label"], {}).get(m.path)
            if d is not None:
                rel = "n/a" if d["rel"] is None else f"{d['rel']:+.1%}"
                cell += f"\n[dim]{format_value(d['abs'], m.unit, signed=True)}  {rel}[/dim]"
            row.append(cell)
        table.add_row(*row)
    return table


def failures(result: dict[str, Any]) -> list[str]:
    """``label: error`` for each failed variant."""
    return [f"{v['label']}: {v['error']}" for v in result["variants"] if v["error"]]


# --------------------------------------------------------------------------- figure
SEGMENT_COLORS = {"compute": "#4C78A8", "exposed comm": "#E45756", "bubble": "#BAB0AC",
                  "other": "#EECA3B"}


def step_breakdown(summary: Summary) -> dict[str, float]:
    """The step split for the figure: compute, exposed communication, pipeline bubble (the
    bubble fraction of the step) and other = step - compute - exposed - bubble, clipped at 0
    (host overheads and launch gaps; 0 when overlapping parts already fill the step).

    Examples
    --------
    >>> step_breakdown({"step_time_s": 10.0, "compute_time_s": 6.0, "exposed_comm_s": 2.0,
    ...                 "bubble_fraction": 0.1})
    {'compute': 6.0, 'exposed comm': 2.0, 'bubble': 1.0, 'other': 1.0}
    """
    step = summary["step_time_s"]
    compute = summary["compute_time_s"]
    exposed = summary["exposed_comm_s"]
    bubble = summary["bubble_fraction"] * step
    return {"compute": compute, "exposed comm": exposed, "bubble": bubble,
            "other": max(0.0, step - compute - exposed - bubble)}


def compare_figure(result: dict[str, Any]) -> Figure:
    """Two panels, one horizontal bar per variant in each: the step split into compute,
    exposed communication, bubble and other (stacked), and the dollars per million tokens.
    A failed variant keeps its row, empty, marked "failed"."""
    variants = result["variants"]
    labels = [v["label"] for v in variants]
    n = len(variants)
    fig, (ax_time, ax_cost) = plt.subplots(
        1, 2, figsize=(12, 1.6 + 0.55 * n), sharey=True,
        gridspec_kw={"width_ratios": [3, 1.4]})
    y = list(range(n))
    left = [0.0] * n
    for name, color in SEGMENT_COLORS.items():
        widths = [step_breakdown(v["summary"])[name] if v["summary"] else 0.0
                  for v in variants]
        ax_time.barh(y, widths, left=left, color=color, label=name, height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, v in enumerate(variants):
        if v["summary"] is None:
            ax_time.text(0, i, "  failed", va="center", color="#B00020")
        else:
            ax_time.text(left[i], i, f" {v['summary']['step_time_s']:.3g} s", va="center",
                         fontsize=8)
    ax_time.set_yticks(y, labels)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("time per step (s)")
    ax_time.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(SEGMENT_COLORS),
                   fontsize=8, frameon=False)
    ax_time.set_xlim(0, max(left + [1e-9]) * 1.18)

    usd = [metric_value(v["summary"], "cost.usd_per_million_tokens") or 0.0
           if v["summary"] else 0.0 for v in variants]
    ax_cost.barh(y, usd, color="#54A24B", height=0.6)
    for i, value in enumerate(usd):
        if variants[i]["summary"] is not None:
            ax_cost.text(value, i, f" ${value:,.3g}", va="center", fontsize=8)
    ax_cost.set_xlabel("$ per million tokens")
    ax_cost.set_xlim(0, max(usd + [1e-9]) * 1.35)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- outputs
def write_outputs(out: Path, result: dict[str, Any], overwrite: bool = False) -> None:
    """Write ``compare.json`` and ``compare.png`` as the folder ``out``, whole or not at all
    (:func:`sim.outputs.folder.staged_folder`; a folder holding a previous result is
    replaced only with ``overwrite``)."""
    with staged_folder(out, overwrite, prefix=".fabricsim-compare-") as tmp:
        (tmp / "compare.json").write_text(json.dumps(result, indent=2))
        fig = compare_figure(result)
        fig.savefig(tmp / "compare.png", dpi=110)
        plt.close(fig)
