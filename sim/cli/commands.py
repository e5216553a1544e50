"""The ``fabricsim`` command line: a small, frozen surface; the knobs live in scenario files.

Exit status: 0 success, 2 bad input (one line on stderr naming the file and key), 1 an
internal error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from sim.cli.render import print_summary, with_progress, write_run_outputs
from sim.scenario import ScenarioError, json_schema, load_scenario

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Discrete-event simulator of distributed LLM training steps.")
err = Console(stderr=True)


def _bad_input(message: str) -> None:
    # One line, no traceback.
    print(f"fabricsim: {message}", file=sys.stderr)
    raise typer.Exit(2)


@app.command()
def run(
    scenario: Annotated[str, typer.Argument(help="Scenario file, or the name of a shipped one.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario key: KEY.PATH=VALUE (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Also write summary, events, trace and plots to this folder.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Training steps to simulate.")] = 1,
    window: Annotated[str | None, typer.Option(
        "--window", help="With --out: zoom the plots to START:END seconds.")] = None,
    hta: Annotated[bool, typer.Option(
        "--hta", help="With --out: also write OUT/hta/rank<N>.json, one trace per rank class "
        "in the layout Holistic Trace Analysis reads.")] = False,
    hta_all_ranks: Annotated[bool, typer.Option(
        "--hta-all-ranks", help="With --out: one HTA trace per rank (implies --hta).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Run even when the estimate says it would take over an hour or "
        "more memory than this machine has.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out folder that holds a previous result.")] = False,
) -> None:
    """Simulate a training step and print its summary (a file with ``jobs:``: several jobs on
    one fabric, each job's summary beside its step time alone)."""
    from sim.api import simulate
    from sim.apps import budget
    from sim.config.multijob import is_multijob_file

    if is_multijob_file(scenario):
        _run_multijob(scenario, set_ or [], as_json, out, steps, overwrite)
        return
    zoom = _parse_window(window) if window is not None else None
    if (hta or hta_all_ranks or window is not None) and out is None:
        _bad_input("--hta, --hta-all-ranks and --window need --out DIR")
    _check_out(out, overwrite)
    try:
        sc = load_scenario(scenario, set_ or [])
        if not force:
            budget.check(sc, steps, scenario)
        note = budget.zone_note(sc)
        result = with_progress(lambda cb: simulate(sc, steps, origin=scenario,
                                                progress=_noting(cb, note),
                                                keep_link_series=out is not None),
                                quiet=as_json, steps=steps)
        if sc.run is not None:
            from sim.apps.runlength import run_length

            result.summary["run"] = run_length(result)
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    paced = budget.host_note(sc, result.summary)
    if paced is not None:
        err.print(f"fabricsim: note: {paced}", markup=False, highlight=False, soft_wrap=True)
    if out is not None:
        write_run_outputs(out, result, zoom, "all" if hta_all_ranks else "classes" if hta
                       else None, overwrite=overwrite)
    if as_json:
        print(json.dumps(result.summary, indent=2))
    else:
        print_summary(result.summary)


def _noting(progress: Callable[[int, int], None] | None, note: str | None
            ) -> Callable[[int, int], None] | None:
    """``progress``, printing ``note`` on stderr once the simulation has started (its program
    built, so a scenario the builder refuses still gets its one line alone)."""
    if note is None:
        return progress
    pending = [note]

    def report(done: int, total: int) -> None:
        if pending:
            err.print(f"fabricsim: note: {pending.pop()}", markup=False, highlight=False,
                      soft_wrap=True)
        if progress is not None:
            progress(done, total)
    return report


@app.command("export-chakra")
def export_chakra(
    scenario: Annotated[str, typer.Argument(help="Scenario file, or the name of a shipped one.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the .et files and "
                                      "comm_groups.json.")],
    all_ranks: Annotated[bool, typer.Option(
        "--all-ranks", help="One .et per rank (what ASTRA-sim runs); by default one per "
        "rank class, for its first member.")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario key: KEY.PATH=VALUE (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out folder that holds a previous result.")] = False,
) -> None:
    """Simulate one step and write it as MLCommons Chakra execution traces (OUT/workload.<rank>.et
    and OUT/comm_groups.json, as ASTRA-sim reads them)."""
    from sim.api import simulate
    from sim.apps import budget
    from sim.outputs.export.chakra import write_chakra
    from sim.outputs.folder import staged_folder

    _check_out(out, overwrite)
    try:
        sc = load_scenario(scenario, set_ or [])
        budget.check(sc, 1, scenario)
        result = simulate(sc, 1, origin=scenario)
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    # Whole or not at all, as every --out (sim.outputs.folder).
    with staged_folder(out, overwrite, prefix=".fabricsim-chakra-") as tmp:
        paths = write_chakra(tmp, result.recorder, result.program, all_ranks=all_ranks,
                             scenario=result.summary["scenario"])
    print(f"wrote {len(paths)} .et file(s) and comm_groups.json to {out}")


@app.command()
def replay(
    trace: Annotated[Path, typer.Argument(help="PyTorch profiler (Kineto) JSON (.json, "
                                          ".json.gz, or a folder of one per rank), or Chakra "
                                          ".et files (a folder: export-chakra --all-ranks).")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a key of the fabric's scenario: KEY.PATH=VALUE (repeatable), "
        "e.g. cluster.nic_gbps=400.")] = None,
    scenario: Annotated[str | None, typer.Option(
        "--scenario", help="Scenario whose cluster runs the trace (default: the one the "
        "trace names; a profiler trace: the shipped server of its GPU).")] = None,
    step: Annotated[str | None, typer.Option(
        "--step", help="Profiler trace: the ProfilerStep#N to replay (default: the last but "
        "one).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Also write summary, events, trace and plots to this folder.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out folder that holds a previous result.")] = False,
) -> None:
    """Replay a profiled step: rebuild its program from a trace (measured compute kept, NCCL
    transfers simulated afresh) and run it on a scenario's fabric; print the summary."""
    from sim.apps.replay import TraceError
    from sim.apps.replay import replay as run_replay

    _check_out(out, overwrite)
    try:
        result = run_replay(trace, set_ or [], scenario, step)
    except (ScenarioError, TraceError) as exc:
        _bad_input(str(exc))
        return
    if out is not None:
        write_run_outputs(out, result, overwrite=overwrite)
    if as_json:
        print(json.dumps(result.summary, indent=2))
    else:
        print_summary(result.summary)


def _run_multijob(ref: str, sets: list[str], as_json: bool, out: Path | None,
                  steps: int, overwrite: bool = False) -> None:
    """``run`` on a multi-job file (:mod:`sim.apps.multijob`); ``--out`` writes its JSON, a
    timeline and a trace (staged like every ``--out``: :mod:`sim.outputs.folder`)."""
    from sim.apps.multijob import render_text, run_multijob, write_outputs
    from sim.config.multijob import load_multijob
    from sim.outputs.folder import staged_folder

    _check_out(out, overwrite)
    try:
        if steps != 1:
            raise ScenarioError(f"{ref}: --steps: a multi-job file sets each job's steps: "
                                "in jobs[i].steps")
        result, shared = run_multijob(load_multijob(ref, sets))
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    if out is not None:
        with staged_folder(out, overwrite, prefix=".fabricsim-jobs-") as tmp:
            write_outputs(tmp, result, shared)
    print(json.dumps(result, indent=2) if as_json else render_text(result))


@app.command()
def schema() -> None:
    """Print the JSON Schema of a scenario file."""
    import sim.frameworks  # noqa: F401  (the registry: its frameworks make the schema's union)

    print(json.dumps(json_schema(), indent=2))


@app.command()
def collective(
    topology: Annotated[str, typer.Argument(help="Topology name (topologies/) or file.")],
    op: Annotated[str, typer.Option("--op", help="all_reduce, all_gather, reduce_scatter, "
                                    "all_to_all, broadcast or sendrecv.")] = "all_reduce",
    gpus: Annotated[int, typer.Option("--gpus", help="Ranks taking part.")] = 8,
    sizes: Annotated[str, typer.Option("--sizes", help="A:B doubles from A to B (8, 64K, "
                                       "1M, 8G), as nccl-tests -b A -e B -f 2.")] = "8:8G",
    algo: Annotated[str, typer.Option("--algo", help="auto, ring, tree, nvls, nvls_tree, pat, "
                                      "collnet_direct, collnet_chain.")] = "auto",
    proto: Annotated[str, typer.Option("--proto", help="auto, ll, ll128, simple.")] = "auto",
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a cluster, nccl or faults key: cluster.azs=2, "
        "cluster.az_latency_ms=10, nccl.buffsize=8388608, "
        "'faults.slow_links=[{node: 0, nic: 0, factor: 2}]' (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What nccl-tests would print on that fabric: time, algbw, busbw per size."""
    from sim.apps.nccltests import collective_table, parse_sizes
    from sim.scenario import parse_set

    algos = ("auto", "ring", "tree", "nvls", "nvls_tree", "pat", "collnet_direct",
             "collnet_chain")
    if algo not in algos:
        _bad_input(f"--algo: {algo!r} is not one of {', '.join(algos)}")
    if proto not in ("auto", "ll", "ll128", "simple"):
        _bad_input(f"--proto: {proto!r} is not auto, ll, ll128 or simple")
    try:
        overrides = dict(parse_set(a) for a in set_ or [])
        bad = [k for k in overrides if k.split(".")[0] not in ("cluster", "nccl", "faults")
               or k.count(".") != 1]
        if bad:
            raise ScenarioError(f"--set {bad[0]}: collective takes cluster.KEY, nccl.KEY or "
                                "faults.KEY")
        table = collective_table(topology, op, gpus, parse_sizes(sizes), algo, proto,
                                 overrides)
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    if as_json:
        print(json.dumps(table, indent=2))
        return
    t = Table(title=f"{op} on {topology}, {gpus} GPUs (nccl-tests definitions)",
              title_justify="left")
    for col in ("size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "algorithm",
                "protocol", "NCCL model (us)"):
        t.add_column(col, justify="right")
    for r in table["rows"]:
        t.add_row(f"{r['bytes']:,}", f"{r['time_s'] * 1e6:,.1f}",
                  f"{r['algbw_gbytes_per_s']:,.2f}", f"{r['busbw_gbytes_per_s']:,.2f}",
                  r["algorithm"], r["protocol"], f"{r['nccl_model_s'] * 1e6:,.1f}")
    Console().print(t)


@app.command()
def validate(
    suite: Annotated[list[str] | None, typer.Option(
        "--suite", help="Suite(s) to run (default: all but the vtrain-*-fit halves; "
        "vtrain-single/-multi report vTrain's validate half, vtrain-*-fit the fit half).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    workers: Annotated[int, typer.Option(
        "--workers", min=1, help="Processes simulating at once in the suites of long "
        "simulations (published, published-moe); the same numbers.")] = 1,
) -> None:
    """Predictions against the measured reference data: error per case and per suite."""
    from sim.apps.validation import SUITES, run_suites

    unknown = [s for s in suite or [] if s not in SUITES]
    if unknown:
        _bad_input(f"--suite: unknown suite {unknown[0]!r} (available: "
                   f"{', '.join(sorted(SUITES))})")
    if as_json or not err.is_terminal:
        result = run_suites(suite or None, workers=workers)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      console=err, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def report(name: str, done: int, total: int) -> None:
                if name not in tasks:
                    tasks[name] = bar.add_task(f"validate {name}", total=total)
                bar.update(tasks[name], completed=done, total=total)

            result = run_suites(suite or None, report, workers)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    con = Console()
    t = Table(title="validation cases", title_justify="left")
    for col in ("suite", "case", "metric", "measured", "simulated", "error"):
        t.add_column(col, justify="right" if col in ("measured", "simulated", "error") else "left")
    for c in result["cases"]:
        t.add_row(c["suite"], c["id"], c["metric"], f"{c['measured']:,.4g}",
                  f"{c['simulated']:,.4g}", f"{c['error']:+.1%}")
    con.print(t)
    if result.get("skipped"):
        # Entries the builders refuse today (published-moe): listed, in no error statistic.
        k = Table(title="skipped (not simulated)", title_justify="left")
        for col in ("suite", "case", "reason"):
            k.add_column(col)
        for c in result["skipped"]:
            k.add_row(c["suite"], c["id"], c["skipped"])
        con.print(k)
    s = Table(title="suites", title_justify="left")
    for col in ("suite", "cases", "MAPE", "max |error|", "mean error"):
        s.add_column(col)
    windows: list[str] = []
    for name, v in result["suites"].items():
        rows = [(name, v)] + [(f"{name} / {w}", r) for w, r in v.get("windows", {}).items()]
        windows += [f"{w}: {r['label']}" for w, r in v.get("windows", {}).items()]
        for label, r in rows:
            s.add_row(label, str(r["cases"]), f"{r['mape']:.1%}", f"{r['max_abs_error']:.1%}",
                      f"{r['mean_error']:+.1%}")
    if windows:
        s.caption = "; ".join(windows)
        s.caption_justify = "left"
    con.print(s)


@app.command()
def compare(
    scenarios: Annotated[list[str], typer.Argument(
        help="One scenario with --what-if, or two or more scenarios (files or shipped names).")],
    what_if: Annotated[str | None, typer.Option(
        "--what-if", help="KEY=V1,V2[,...]: one variant of the scenario per value.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario key in every variant: KEY.PATH=VALUE (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Also write compare.json and compare.png to this folder.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out folder that holds a previous result.")] = False,
) -> None:
    """Variants side by side (--what-if values, or scenario files), with deltas against the
    first."""
    from sim.apps import compare as cmp

    _check_out(out, overwrite)
    try:
        if what_if is not None:
            if len(scenarios) != 1:
                _bad_input("compare --what-if: give exactly one scenario")
            variants = cmp.what_if_variants(scenarios[0], what_if, set_ or [])
        else:
            if len(scenarios) < 2:
                _bad_input("compare: give --what-if KEY=V1,V2[,...] or two or more scenarios")
            variants = cmp.file_variants(scenarios, set_ or [])
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    if as_json or not err.is_terminal:
        # Quiet with --json, and when stderr is not a terminal (a bar there is only noise).
        cmp.simulate_variants(variants)
    else:
        from rich.progress import Progress

        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("comparing", total=len(variants))

            def report(done: int, total: int, label: str) -> None:
                bar.update(task, completed=done, description=label or "done")

            cmp.simulate_variants(variants, report)
    if all(v.summary is None for v in variants):
        # Nothing ran: the first failure is what the user has to fix.
        first = variants[0].error or "every variant failed"
        if first.startswith("internal error"):
            print(f"fabricsim: {first}", file=sys.stderr)
            raise typer.Exit(1)
        _bad_input(first)
    result = cmp.compare_result(variants)
    if out is not None:
        cmp.write_outputs(out, result, overwrite=overwrite)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    con = Console()
    con.print(cmp.comparison_table(result))
    for line in cmp.failures(result):
        con.print(f"[red]failed[/red] {line}")


@app.command()
def sweep(
    scenario: Annotated[str, typer.Argument(help="Scenario file, or the name of a shipped one.")],
    grid: Annotated[list[str] | None, typer.Option(
        "--grid", help="KEY=V1,V2,...: a scenario key and its values (repeatable); every "
        "combination runs.")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="local (processes here), ray or dask.")] = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="Ray or Dask scheduler address (default: start one here).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Worker processes (default: every core).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write one row per variant to FILE: .csv, or .parquet.")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Also plot step time and $/M tokens against the first numeric grid "
        "key (.png, .svg, .pdf).")] = None,
    cache: Annotated[Path | None, typer.Option(
        "--cache", help="Cache folder (default: .fabricsim-cache next to --out, or here).")
                     ] = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Simulate every variant; read and write no cache.")] = False,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Training steps to simulate.")
                     ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print {rows: [...]} as JSON.")
                       ] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Run variants estimated to take over an hour (else failed rows).")
                     ] = False,
) -> None:
    """Every combination of the grid values, in parallel: one row per variant."""
    from sim.apps.sweep import sweep_command

    try:
        rc = sweep_command(scenario, grid or [], backend, address, workers, out, plot, as_json,
                           cache=cache, use_cache=not no_cache, steps=steps, force=force)
    except ScenarioError as exc:
        _bad_input(str(exc))
        return
    if rc:
        raise typer.Exit(rc)


@app.command()
def plan(
    scenario: Annotated[str, typer.Argument(help="Scenario file, or the name of a shipped one.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a scenario key first: KEY.PATH=VALUE (repeatable).")] = None,
    objective: Annotated[str, typer.Option(
        "--objective", help="Rank by time (step time) or cost ($ per million tokens).")] = "time",
    top: Annotated[int, typer.Option("--top", help="Layouts to show.")] = 5,
    backend: Annotated[str, typer.Option(
        "--backend", help="Where simulations run: local, ray or dask.")] = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="With --backend ray or dask: the cluster to connect to.")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="Local processes (default: the CPUs), or simulations at once on "
        "a Ray/Dask cluster.")] = None,
    framework: Annotated[list[str] | None, typer.Option(
        "--framework", help="Search only this framework (repeatable; default all).")] = None,
    max_simulations: Annotated[int, typer.Option(
        "--max-simulations", help="Simulations at most.")] = 16,
    time_limit: Annotated[float | None, typer.Option(
        "--time-limit", help="Start no new work after this many seconds.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write plan.json, plan.csv, pareto.png and top-K.yaml here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    cache: Annotated[Path | None, typer.Option(
        "--cache", help="Simulation cache folder (default: .fabricsim-cache next to --out, "
        "or here); a plan run again simulates only what is missing.")] = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Simulate every layout; read and write no cache.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an --out folder that holds a previous result.")] = False,
) -> None:
    """Search frameworks and parallel layouts that fit in memory; rank by time or cost."""
    from sim.apps.plan import plan_command
    from sim.apps.sweep import DEFAULT_CACHE_DIRNAME

    if cache is None and not no_cache:
        cache = (out.expanduser().parent if out is not None else Path.cwd()) \
            / DEFAULT_CACHE_DIRNAME

    if address and backend == "local":
        _bad_input("--address: only with --backend ray or dask")
    _check_out(out, overwrite)
    be = hook = None
    try:
        if backend in ("ray", "dask"):
            be, hook = _plan_simulations(backend, address, workers)
        rc = plan_command(scenario, set_ or [], objective, top, backend, workers, framework,
                          max_simulations, time_limit, out, as_json, hook,
                          cache=None if no_cache else cache, overwrite=overwrite)
        if rc:
            raise typer.Exit(rc)
    except ScenarioError as exc:
        _bad_input(str(exc))
    finally:
        if be is not None:
            be.close()


def _plan_simulations(backend: str, address: str | None, workers: int | None) -> Any:
    """The planner's ``simulate_many`` on a Ray or Dask cluster, through the executor's
    backend (builds stay on local cores; only the simulations travel)."""
    from sim.apps import sweep
    from sim.apps.plan import backend_simulations

    be = sweep.make_backend(backend, address, workers, 1, "plan")
    return be, backend_simulations(be)


def _parse_window(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        _bad_input(f"--window: {text!r} is not START:END in seconds")
        raise AssertionError from None  # _bad_input exits
    if not 0 <= a < b:
        _bad_input(f"--window: {text!r} needs 0 <= START < END")
    return a, b


def _check_out(out: Path | None, overwrite: bool) -> None:
    """Refuse, before any simulation, an ``--out`` that holds a previous result."""
    if out is None:
        return
    from sim.outputs.folder import OutputError, check_out

    try:
        check_out(out, overwrite)
    except OutputError as exc:
        _bad_input(str(exc))


def main() -> None:
    """Entry point: bad input exits 2 with one line; internal errors exit 1."""
    try:
        # Not standalone: usage errors come back to us instead of printing a usage box.
        rc = app(standalone_mode=False)
    except SystemExit:
        raise
    except ScenarioError as exc:
        print(f"fabricsim: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:
        from sim.outputs.folder import OutputError

        if isinstance(exc, OutputError):   # an --out that cannot be written (disk full)
            print(f"fabricsim: {exc}", file=sys.stderr)
            sys.exit(2)
        code = getattr(exc, "exit_code", None)
        if type(exc).__name__ == "Exit" and isinstance(code, int):
            sys.exit(code)
        if type(exc).__name__ == "Abort":
            sys.exit(1)
        if hasattr(exc, "format_message") and isinstance(code, int):
            # click's usage errors (unknown option, bad value), as one line.
            message = exc.format_message()
            if message:
                print(f"fabricsim: {message}", file=sys.stderr)
            sys.exit(2)
        if os.environ.get("FABRICSIM_DEBUG"):
            raise
        print(f"fabricsim: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
