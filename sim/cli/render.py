"""What the ``fabricsim`` commands print and write: the progress bar, the summary table, and
``run --out``'s folder (summary, CSVs, trace, plots). The commands themselves are
:mod:`sim.cli.commands`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sim.analysis.summary import Summary, bytes_items

err = Console(stderr=True)


def with_progress(fn: Any, quiet: bool, steps: int) -> Any:
    """Run ``fn(callback)`` under a transient progress bar on stderr (ops simulated of all
    steps, rate, time left); none with ``--json`` or when stderr is not a terminal."""
    if quiet or not err.is_terminal:
        return fn(None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    label = "simulating" + (f" {steps} steps" if steps > 1 else "") + " (ops)"
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        return fn(lambda done, total: bar.update(task, completed=done, total=total))


def write_run_outputs(out: Path, result: Any, window: tuple[float, float] | None = None,
                   hta: str | None = None, overwrite: bool = False) -> None:
    """Write every output into a temporary folder, then put it in place of ``out`` with one
    rename (:mod:`sim.outputs.folder`): a failed run leaves nothing half-written."""
    from sim.engine.gc_pause import paused_gc
    from sim.outputs import export, plot
    from sim.outputs.folder import staged_folder

    # Without the cyclic collector, as the run itself (sim.api.simulate): a large run's
    # records are millions of objects, which every collection the plots' allocations
    # trigger walked again (a third of the output folder's time on a 1,024-GPU step).
    with paused_gc(), staged_folder(out, overwrite) as tmp:
        rec = result.recorder
        labels = {c.id: c.label or f"rank class {c.id}" for c in result.program.classes}
        export.write_summary(tmp / "summary.json", result.summary)
        export.write_events_csv(tmp / "events.csv", rec)
        export.write_timeseries_csv(tmp / "timeseries.csv", rec)
        export.write_trace(tmp / "trace.json", rec, labels, program=result.program,
                           scenario=result.summary["scenario"])
        if hta is not None:
            sc = result.scenario
            # Each collective names its own dtype (Op.dtype, set by its builder); the
            # training precision's is the fallback for ops left without one.
            export.write_hta_traces(
                tmp / "hta", rec, result.program, gpus_per_node=sc.cluster.gpus_per_node,
                gpu=result.context.gpu, dtype=export.NCCL_TYPES[sc.training.precision],
                all_ranks=hta == "all", scenario=result.summary["scenario"])
        export.write_memory_csv(tmp / "memory.csv", rec, labels)
        title = result.summary["scenario"]
        stages = result.program.pipeline_stages
        plot.timeline(tmp / "timeline.png", rec, title, labels, pipeline_stages=stages,
                      window=window)
        plot.bytes_over_time(tmp / "bytes.png", rec, title,
                             # the prices the run was charged (instance, cloud or defaults)
                             egress_usd_per_gb=result.summary["cost"]["egress_usd_per_gb"],
                             region_egress_usd_per_gb=result.summary["cost"][
                                 "region_egress_usd_per_gb"],
                             window=window)
        plot.memory_over_time(tmp / "memory.png", rec, title, labels,
                              result.summary["gpu_memory_gib"], window=window)
        plot.links(tmp / "links.png", rec, result.fabric, title, window=window)
        if result.summary.get("run") is not None:
            write_goodput(tmp / "goodput.png", result, title)


def write_goodput(path: Path, result: Any, title: str) -> None:
    """goodput.png: the run's expected ETTR against the checkpoint interval (``run:`` block)."""
    from sim.apps.runlength.goodput import goodput_curve
    from sim.outputs.plot.goodput import goodput

    c = goodput_curve(result)
    goodput(path, c.interval_steps, c.ettr, optimal_steps=c.optimal_steps,
            young_daly_steps=c.young_daly_steps, chosen_steps=c.chosen_steps, step_s=c.step_s,
            title=title)


def fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f} B"


def print_summary(s: Summary) -> None:
    con = Console()
    t = Table(title=f"{s['scenario']} — {s['gpus']} GPU(s), {s['framework']}",
              show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("step time", f"{s['step_time_s']:.4f} s"),
        ("tokens / s", f"{s['tokens_per_s']:,.0f}  ({s['tokens_per_s_per_gpu']:,.0f} per GPU)"),
        ("MFU / HFU", f"{s['mfu']:.1%} / {s['hfu']:.1%}"),
        ("model TFLOP/s per GPU", f"{s['model_tflops_per_gpu']:.1f}"),
        ("compute time", f"{s['compute_time_s']:.4f} s"),
        ("communication time", f"{s['comm_time_s']:.4f} s"),
        ("exposed communication", f"{s['exposed_comm_s']:.4f} s"
         f"  ({s['overlap_fraction']:.0%} hidden)"),
        ("pipeline bubble", f"{s['bubble_fraction']:.1%}"),
        ("waiting on the host", f"{s.get('host_bound_s', 0.0):.4f} s"
         f"  ({s.get('host_bound_s', 0.0) / s['step_time_s']:.1%} of the step)"),
        ("peak memory", f"{s['peak_memory_gib']:.1f} GiB allocated, "
         f"{s.get('peak_reserved_gib', s['peak_memory_gib']):.1f} reserved, "
         f"{s.get('peak_nvidia_smi_gib', s['peak_memory_gib']):.1f} in nvidia-smi, "
         f"of {s['gpu_memory_gib']:.1f}" + ("  [red]OOM[/red]" if s["oom"] else "")),
    ]
    for kind, nbytes in bytes_items(s["bytes"]):
        rows.append((f"bytes · {kind}", fmt_bytes(nbytes)))
    c = s["cost"]
    priced = f", {c['instance']}" if c.get("instance") else ""
    rows += [
        ("cost / hour", f"${c['usd_per_hour']:,.2f}  ({s['gpus']} GPU(s) x "
                        f"${c['gpu_hour_usd']:,.3f}/GPU-h{priced})"),
        ("cost / step", f"${c['usd_per_step']:,.4f}  (egress ${c['egress_usd_per_step']:,.4f})"),
        ("cost / M tokens", f"${c['usd_per_million_tokens']:,.4f}"),
        ("cost / day", f"${c['usd_per_day']:,.2f}  (egress ${c['egress_usd_per_day']:,.2f})"),
        ("egress / day", f"{c['egress_gb_per_day']:,.1f} GB at "
                         f"${c['egress_usd_per_gb']:,.4f}/GB crossing a zone"),
    ]
    if c["run_usd"] is not None:
        rows.append(("whole run", f"{c['run_hours']:,.0f} h, ${c['run_usd']:,.0f}"))
    if "run" in s:
        r = s["run"]
        rows += [
            ("run: days", f"{r['expected_days']:,.1f} expected ({r['days_p5']:,.1f} to "
                          f"{r['days_p95']:,.1f}, 5th-95th percentile), ${r['expected_usd']:,.0f}"),
            ("run: ETTR", f"{r['ettr']:.1%}, {r['interruptions_expected']:,.0f} interruptions"),
            ("run: checkpoint", f"every {r['checkpoint_interval_steps']:,} steps "
                                f"(best {r['optimal_checkpoint_interval_steps']:,}), "
                                f"{r['checkpoint_gb']:,.0f} GB, "
                                f"{r['checkpoint_blocking_s']:,.1f} s blocking"),
        ]
    if "checkpoint" in s:
        ck = s["checkpoint"]
        rows.append(("checkpoint (simulated)",
                     f"{ck['saves']} save(s) of {ck['gb_per_save']:,.1f} GB to "
                     f"{ck['storage']}: {ck['blocking_s']:,.3f} s blocking, write "
                     f"{ck['write_s']:,.2f} s, {ck['contention_s_per_save']:,.3f} s lost "
                     "to contention" + ("" if ck["write_ends_in_window"] else
                                        " (the write outlasts the window: --steps more)")))
    rows.append(("simulated", f"{s['sim']['ranks_simulated']} rank class(es), "
                              f"{s['sim']['events']:,} events in {s['sim']['wall_s']:.2f} s"))
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    if s.get("claims"):
        ct = Table(title="claims", title_justify="left")
        for col in ("metric", "claimed", "simulated", "verdict", "reason"):
            ct.add_column(col)
        for cl in s["claims"]:
            ct.add_row(cl["metric"], f"{cl['claimed']:,.4g}", f"{cl['simulated']:,.4g}",
                       cl["verdict"], cl["reason"])
        con.print(ct)
