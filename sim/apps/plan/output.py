"""What a plan reports: the ranking explained, plan.json, plan.csv, top-K.yaml, pareto.png
and the top-K table.

:func:`why` and :func:`explain` say what makes a layout fast; :func:`plan_json` is the
``--json`` object (CONTRACT.md); :func:`write_outputs` writes ``--out``; :func:`print_table`
the terminal table. Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.analysis.summary import Summary
from sim.apps.plan.layouts import Layout, layout_scenario
from sim.apps.plan.search import Candidate, PlanResult
from sim.scenario import Scenario

GIB = float(2**30)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Which points no other point beats on both coordinates (both are minimised): a point
    is dominated when another is no worse on either and better on one.

    Examples
    --------
    >>> pareto_front([(1, 5), (2, 3), (3, 4), (4, 1), (2, 3)])
    [True, True, False, True, True]
    """
    out = []
    for i, (x, y) in enumerate(points):
        dominated = any((a <= x and b <= y) and (a < x or b < y)
                        for j, (a, b) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def why(summary: Summary) -> dict[str, float]:
    """What a layout's step is made of, as shares of its step time and memory: the
    quantities the top-K table explains a rank with.

    ``exposed_comm``: communication not hidden under computation; ``bubble``: the pipeline
    leaving the critical stage idle; ``recompute``: the share of the hardware's FLOPs spent
    recomputing activations ((hfu - mfu) / hfu); ``headroom_gib``: usable memory left at the
    peak.

    Examples
    --------
    >>> w = why({"step_time_s": 4.0, "exposed_comm_s": 0.2, "bubble_fraction": 0.05,
    ...          "mfu": 0.45, "hfu": 0.6, "peak_memory_gib": 60.0, "gpu_memory_gib": 79.19})
    >>> [round(w[k], 2) for k in ("exposed_comm", "bubble", "recompute", "headroom_gib")]
    [0.05, 0.05, 0.25, 19.19]
    """
    step = float(summary["step_time_s"]) or 1.0
    hfu = float(summary.get("hfu") or 0.0)
    mfu = float(summary.get("mfu") or 0.0)
    return {"exposed_comm": float(summary["exposed_comm_s"]) / step,
            "bubble": float(summary["bubble_fraction"]),
            "recompute": (hfu - mfu) / hfu if hfu > 0 else 0.0,
            "headroom_gib": float(summary["gpu_memory_gib"]) - float(summary["peak_memory_gib"]),
            "mfu": mfu}


def explain(summary: Summary, other: Summary | None = None,
            other_name: str = "next") -> str:
    """One line on what makes a layout fast, and where it beats ``other`` (the scenario as
    given, or the next layout).

    Examples
    --------
    >>> a = {"step_time_s": 4.0, "exposed_comm_s": 0.04, "bubble_fraction": 0.0, "mfu": 0.5,
    ...      "hfu": 0.5, "peak_memory_gib": 60.0, "gpu_memory_gib": 79.19}
    >>> b = dict(a, step_time_s=4.4, exposed_comm_s=0.5, mfu=0.45, hfu=0.6)
    >>> explain(a, b).split("; ")[-1]
    'vs next: exposed comm 1% vs 11%, recompute 0% vs 25%, MFU 50.0% vs 45.0%'
    """
    w = why(summary)
    parts = [f"MFU {w['mfu']:.0%}",
             f"exposed comm {w['exposed_comm']:.0%} of the step",
             f"bubble {w['bubble']:.0%}" if w["bubble"] > 0.005 else "no bubble",
             f"recompute {w['recompute']:.0%} of FLOPs" if w["recompute"] > 0.005
             else "no recompute",
             f"{w['headroom_gib']:.1f} GiB free"]
    if other is not None:
        o = why(other)
        gains = []
        for key, label in (("exposed_comm", "exposed comm"), ("bubble", "bubble"),
                           ("recompute", "recompute")):
            # Name the shares where this layout is at least 1 point lower than the next.
            if o[key] - w[key] >= 0.01:
                gains.append(f"{label} {w[key]:.0%} vs {o[key]:.0%}")
        if w["mfu"] > o["mfu"] + (0.0 if not gains else 0.01):
            gains.append(f"MFU {w['mfu']:.1%} vs {o['mfu']:.1%}")
        if gains:
            parts.append(f"vs {other_name}: " + ", ".join(gains))
    return "; ".join(parts)


def _why_line(result: PlanResult, ranked: list[Candidate], k: int) -> str:
    """Layout ``k`` of the ranking explained against the scenario as given when it
    simulated and fits, else against the next layout."""
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None and not base["oom"]:
        return explain(_ran(ranked[k]), base, "the scenario as given")
    nxt = ranked[k + 1].summary if k + 1 < len(ranked) else None
    return explain(_ran(ranked[k]), nxt)


def _ran(c: Candidate) -> Summary:
    """A ranked layout's summary (:meth:`PlanResult.ranked` keeps only simulated ones)."""
    assert c.summary is not None
    return c.summary


def _gib(x: float | None) -> float | None:
    return None if x is None else x / GIB


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def layout_row(c: Candidate) -> dict[str, Any]:
    """One layout as a flat row (plan.csv) and entry (plan.json's ``layouts``)."""
    x = c.layout
    ev = c.evaluation
    s = c.summary
    row: dict[str, Any] = {
        "index": c.index, "layout": x.label(), "framework": x.framework,
        "tp": x.tp, "pp": x.pp, "dp": x.dp, "cp": x.cp, "vp": x.vp,
        # The expert layout: mixture-of-experts layouts only (dense rows as before).
        **({"ep": x.ep, "etp": x.etp} if x.moe else {}),
        "micro_batch_size": x.micro_batch_size,
        "activation_checkpointing": x.activation_checkpointing,
        # Megatron's recompute_modules the planner set (mixture-of-experts rows only).
        **({"recompute_modules": ";".join(x.recompute)} if x.moe else {}),
        "options": ";".join(f"{k}={v}" for k, v in x.options),
        "micro_batches": c.micro_batches, "status": c.status, "reason": c.reason,
        "profile_bound_s": _finite(c.bound0_s) if c.bound0_s else None,
        "lower_bound_s": _finite(c.lower_bound_s) if ev is not None else None,
        "memory_estimate_gib": _gib(ev.memory_bytes) if ev is not None and ev.refused is None
        else None,
        "model_states_gib": _gib(ev.states_bytes) if ev is not None and ev.refused is None
        else None,
    }
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib",
                "exposed_comm_s", "bubble_fraction"):
        row[key] = s.get(key) if s else None
    row["usd_per_million_tokens"] = s["cost"]["usd_per_million_tokens"] if s else None
    if x.moe:
        row.update(moe_option_columns(x))
    return row


def moe_option_columns(x: Layout) -> dict[str, Any]:
    """The Megatron MoE options a mixture-of-experts row was tried with, as columns (after
    the others: dense rows as before): the token dispatcher (``flex-deepep``,
    ``flex-hybridep``), the CUDA graphs (``impl:scope;scope``), Adam's moments' dtypes
    (``bf16`` under the precision-aware optimizer) and FP8 primary weights, each blank where
    the planner did not set it (the scenario's own value holds: the alltoall dispatcher, no
    graphs, fp32 moments unless the scenario sets them).

    Examples
    --------
    >>> x = Layout("megatron", 1, 1, 8, 1, 1, 1, "none", (("cuda_graph_impl",
    ...     "transformer_engine"), ("cuda_graph_scope", ("attn", "moe_router"))), 8, 1)
    >>> moe_option_columns(x)["cuda_graphs"]
    'transformer_engine:attn;moe_router'
    """
    o = dict(x.options)
    disp = str(o.get("moe_token_dispatcher_type", ""))
    if disp == "flex":
        disp += "-" + str(o.get("moe_flex_dispatcher_backend", "deepep"))
    impl = o.get("cuda_graph_impl")
    graphs = "" if impl is None else \
        f"{impl}:{';'.join(o.get('cuda_graph_scope') or ())}" if impl != "none" else "none"
    aware = o.get("use_precision_aware_optimizer")
    return {"token_dispatcher": disp, "cuda_graphs": graphs,
            "exp_avg_dtype": o.get("exp_avg_dtype", "fp32") if aware else "",
            "exp_avg_sq_dtype": o.get("exp_avg_sq_dtype", "fp32") if aware else "",
            "fp8_param_gather": o.get("fp8_param_gather", ""),
            "offload_modules": ";".join(o.get("offload_modules") or ())
            if o.get("fine_grained_activation_offloading") else ""}


def scenario_mapping(base: Scenario, layout: Layout) -> dict[str, Any]:
    """The layout as a complete scenario file (what ``--out`` writes as top-K.yaml).

    ``Layout.varied`` lists the keys the planner set; applied with ``--set`` to a scenario
    of another framework they can clash with that framework's options (``framework.
    reshard_after_forward`` is no Megatron key), because the planner replaces the
    framework section rather than merging it. This mapping runs as it is.
    """
    return layout_scenario(base, layout).model_dump(mode="json", exclude_unset=True)


def plan_json(result: PlanResult, everything: bool = False,
              rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``--json`` object (CONTRACT.md: ``searched, fitted, wall_s, top``, plus ``pruned``
    counts by reason and how the search went); each top entry also carries its complete
    scenario (``scenario_file``). With ``everything``, every layout too (plan.json), from
    ``rows`` (each candidate's :func:`layout_row`, in order) when the caller has them."""
    ranked = result.ranked()[:result.top_k]
    out: dict[str, Any] = {
        "scenario": result.base.name,
        "objective": result.objective,
        "searched": len(result.candidates),
        "fitted": len(result.fitted),
        "wall_s": result.wall_s,
        "top": [{"scenario": c.layout.varied(), "summary": c.summary,
                 "lower_bound_s": c.lower_bound_s, "why": _why_line(result, ranked, k),
                 "scenario_file": scenario_mapping(result.base, c.layout)}
                for k, c in enumerate(ranked)],
        "baseline": ({"scenario": result.base.name, "summary": result.baseline.summary,
                      "error": result.baseline.error}
                     if result.baseline is not None else None),
        "pruned": result.pruned(),
        "built": len(result.built),
        "simulated": len(result.simulated),
        "layer_profiles": result.profiles,
        "stop": result.stop,
        "workers": result.workers,
        "backend": result.backend,
    }
    if everything:
        # Each layout's row (its keys are the row's columns; ``options`` the framework
        # options it sets), with the summary of those simulated.
        if rows is None:
            rows = [layout_row(c) for c in result.candidates]
        out["layouts"] = [dict(row, summary=c.summary) if c.summary is not None else row
                          for row, c in zip(rows, result.candidates, strict=True)]
    return out


def write_outputs(result: PlanResult, out: Path, overwrite: bool = False) -> list[Path]:
    """plan.json, plan.csv, pareto.png and top-1.yaml ... top-K.yaml (each a scenario file
    ``fabricsim run`` takes) as the folder ``out``, whole or not at all
    (:func:`sim.outputs.folder.staged_folder`; a previous result is replaced only with
    ``overwrite``); returns their paths."""
    from sim.outputs.folder import staged_folder

    out = out.expanduser()
    with staged_folder(out, overwrite, prefix=".fabricsim-plan-") as tmp:
        written = _write_plan_files(result, tmp)
    return [out / p.name for p in written]


def _write_plan_files(result: PlanResult, out: Path) -> list[Path]:
    import yaml

    paths = [out / "plan.json", out / "plan.csv", out / "pareto.png"]
    for k, c in enumerate(result.ranked()[:result.top_k]):
        path = out / f"top-{k + 1}.yaml"
        path.write_text(yaml.safe_dump(scenario_mapping(result.base, c.layout),
                                       sort_keys=False))
        paths.append(path)
    # One row per layout for both files (the search's hundreds of thousands of layouts).
    rows = [layout_row(c) for c in result.candidates]
    paths[0].write_text(json.dumps(plan_json(result, everything=True, rows=rows), default=str))
    with paths[1].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    pareto_figure(result).savefig(paths[2], dpi=120)
    return paths


def pareto_figure(result: PlanResult) -> Any:
    """Step time against dollars per million tokens of every simulated layout that fits,
    the Pareto front (no layout both faster and cheaper) joined and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = result.ranked()
    pts = [(float(c.summary["step_time_s"]), float(c.summary["cost"]["usd_per_million_tokens"]))
           for c in ranked if c.summary]
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    by_fw: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c, p in zip(ranked, pts, strict=True):
        by_fw[c.layout.framework].append(p)
    for fw, ps in sorted(by_fw.items()):
        ax.scatter([p[0] for p in ps], [p[1] for p in ps], s=22, alpha=0.6, label=fw)
    fpts = sorted(p for p, f in zip(pts, front, strict=True) if f)
    if fpts:
        ax.plot([p[0] for p in fpts], [p[1] for p in fpts], "-o", color="black", lw=1.2,
                ms=7, mfc="none", label="Pareto front")
        for c, p, f in zip(ranked, pts, front, strict=True):
            if f:
                ax.annotate(c.layout.label(), p, textcoords="offset points", xytext=(6, 4),
                            fontsize=7)
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None:
        ax.scatter([base["step_time_s"]], [base["cost"]["usd_per_million_tokens"]],
                   marker="*", s=160, color="crimson", zorder=5,
                   label="the scenario as given" + (" (out of memory)" if base["oom"] else ""))
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("$ per million tokens")
    ax.set_title(f"{result.base.name}: {len(pts)} simulated layouts that fit "
                 f"(of {len(result.candidates)} searched)", fontsize=10)
    ax.grid(alpha=0.3)
    if pts or base is not None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def print_table(result: PlanResult, console: Any = None) -> None:
    """The top K as a rich table, what makes each one fast, then how the search went."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    ranked = result.ranked()[:result.top_k]
    by = "step time" if result.objective == "time" else "$ per million tokens"
    t = Table(title=f"{result.base.name}: best {len(ranked)} layouts by {by}",
              title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("layout", no_wrap=True)
    for col in ("step s", "tok/s/GPU", "$/M tok", "MFU", "peak GiB"):
        t.add_column(col, justify="right")
    for k, c in enumerate(ranked):
        s = _ran(c)
        t.add_row(str(k + 1), c.layout.label(), f"{s['step_time_s']:.3f}",
                  f"{s['tokens_per_s_per_gpu']:,.0f}",
                  f"{s['cost']['usd_per_million_tokens']:.3f}", f"{why(s)['mfu']:.0%}",
                  f"{s['peak_memory_gib']:.1f}")
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None:
        t.add_row("", "(the scenario as given)", f"{base['step_time_s']:.3f}",
                  f"{base['tokens_per_s_per_gpu']:,.0f}",
                  f"{base['cost']['usd_per_million_tokens']:.3f}", f"{why(base)['mfu']:.0%}",
                  f"{base['peak_memory_gib']:.1f}" + (" OOM" if base["oom"] else ""),
                  style="dim")
    console.print(t)
    for k, c in enumerate(ranked):
        console.print(f"  #{k + 1} {c.layout.label()}: {_why_line(result, ranked, k)}")
    pruned = ", ".join(f"{n:,} {reason}" for reason, n in result.pruned().items())
    console.print(f"Searched {len(result.candidates):,} layouts ({result.profiles:,} layer "
                  f"profiles, {len(result.built):,} built, {len(result.fitted):,} fit, "
                  f"{len(result.simulated):,} simulated) in {result.wall_s:.1f} s with "
                  f"{result.workers} worker{'s' if result.workers > 1 else ''}; stopped: "
                  f"{result.stop}. Not simulated: {pruned}.")
    if not ranked:
        console.print("No layout fits in memory and simulates: nothing to recommend.")
