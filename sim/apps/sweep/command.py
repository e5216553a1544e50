"""``fabricsim sweep``: check the options, run the sweep with a progress bar, write the rows
and the plot, and print a table.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here); the sweep itself is
:func:`sim.apps.sweep.run_sweep`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sim.apps.sweep.cache import DEFAULT_CACHE_DIRNAME
from sim.apps.sweep.grid import parse_grid
from sim.apps.sweep.plot import axis_value, value_label, write_plot
from sim.apps.sweep.rows import ProgressFn, SweepResult, run_columns, write_rows
from sim.scenario import ScenarioError

INTERRUPTED = 130
"""Exit status of an interrupted sweep (128 + SIGINT, as a shell reports Ctrl-C)."""

OUT_SUFFIXES = (".csv", ".parquet")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def sweep_command(scenario: str, grid: Sequence[str], backend: str = "local",
                  address: str | None = None, workers: int | None = None,
                  out: Path | None = None, plot: Path | None = None, as_json: bool = False,
                  cache: Path | None = None, use_cache: bool = True, steps: int = 1,
                  before_variant: Callable[[dict[str, Any]], None] | None = None,
                  force: bool = False) -> int:
    """Everything ``fabricsim sweep`` does; returns the exit status (0) or raises
    ScenarioError (one line; the CLI exits 2) on bad input, before anything runs.

    Prints a table of the rows (or ``{"rows": [...]}`` with ``as_json``) on stdout and a
    progress bar on stderr when it is a terminal (none with ``as_json``)."""
    if out is not None and out.suffix not in OUT_SUFFIXES:
        raise ScenarioError(f"--out {out}: expected a .csv or .parquet file")
    if out is not None and out.suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ScenarioError(f"--out {out}: Parquet needs the pyarrow package "
                                "(pip install 'fabricsim[parquet]')") from None
    if plot is not None:
        if plot.suffix not in PLOT_SUFFIXES:
            raise ScenarioError(f"--plot {plot}: expected a .png, .svg or .pdf file")
        axes = parse_grid(grid)
        numeric = [a.key for a in axes if all(axis_value(v) is not None for v in a.values)]
        if not numeric:
            raise ScenarioError("--plot: no grid key with only numeric values for the x axis")
    if cache is None:
        cache = (out.expanduser().parent if out is not None else Path.cwd()) \
            / DEFAULT_CACHE_DIRNAME

    from rich.console import Console

    err = Console(stderr=True)
    # stdout carries only the table or the JSON: what backends print while they run goes to
    # stderr (Ray's driver prints its raylet's messages, e.g. a dead worker, on stdout).
    # Looked up through sim.apps.sweep, where run_sweep lives (and where tests may replace it).
    from sim.apps import sweep

    try:
        with contextlib.redirect_stdout(sys.stderr), _sigterm_interrupts(), \
                _ProgressBar(err, quiet=as_json or not err.is_terminal) as progress:
            result = sweep.run_sweep(scenario, grid, backend, address, workers, steps, cache,
                                     use_cache, progress, before_variant, out=out,
                                     **({"force": True} if force else {}))
    except sweep.SweepInterrupted as stop:
        print(f"fabricsim: {stop.line()}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("fabricsim: interrupted", file=sys.stderr)
        return INTERRUPTED
    if out is not None:
        try:
            write_rows(out, result.rows, result.columns)
        except OSError as exc:   # a full disk: one line; the rows wait in the cache
            kept = f"; the rows are in the cache {cache}, run the same command again " \
                "to write them" if use_cache else ""
            raise ScenarioError(f"--out {out}: cannot write it ({exc.strerror or exc})"
                                + kept) from None
    if plot is not None:
        write_plot(plot, result.rows, result.keys, result.title)
    if as_json:
        print(json.dumps({"rows": result.rows}, indent=2, default=str))
    else:
        _print_rows(result, out, plot)
    return 0


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a batch scheduler's stop, ``kill PID``) stops the sweep as Ctrl-C does:
    the finished rows are written before it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _ProgressBar:
    """A rich progress bar on stderr: variants done of all, failed, rate, time left."""

    def __init__(self, console: Any, quiet: bool) -> None:
        self.console = console
        self.quiet = quiet
        self.bar: Any = None
        self.task: Any = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> ProgressFn | None:
        if self.quiet:
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[failed]} failed"),
                            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=self.console, transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("sweep", total=None, failed=0, rate="")
        return self.update

    def update(self, done: int, failed: int, simulated: int, total: int) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = f"{simulated / elapsed:,.1f} variants/s" if simulated and elapsed > 0 else ""
        self.bar.update(self.task, completed=done, total=total, failed=failed, rate=rate)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _short_heads(keys: Sequence[str]) -> list[str]:
    # The last part of each dotted key, unless two keys share it.
    tails = [k.rsplit(".", 1)[-1] for k in keys]
    return [t if tails.count(t) == 1 else k for k, t in zip(keys, tails, strict=True)]


def _run_cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "run.ettr":
        return f"{value:.1%}"
    return f"{value:,.4g}" if column == "run.expected_days" else f"{value:,.0f}"


def _print_rows(result: SweepResult, out: Path | None, plot: Path | None) -> None:
    """A table of the rows on stdout (the file has every column), and what was done on
    stderr."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{result.title}: {len(result.rows)} variants", title_justify="left")
    for head in _short_heads(result.keys):
        t.add_column(head, justify="right", no_wrap=True, min_width=len(head))
    run_cols = run_columns(result.rows)   # only with a `run:` block
    for head in ("step (s)", "tokens/s/GPU", "MFU", "peak GiB", "$/M tokens",
                 *(h for _, h in run_cols)):
        t.add_column(head, justify="right", no_wrap=True, min_width=len(head))
    # Errors are long (file, key path, reason): the start here, in full below the table.
    t.add_column("error", no_wrap=True, overflow="ellipsis")
    for r in result.rows:
        cells = [value_label(r[k]) for k in result.keys]
        if r.get("error"):
            short = r["error"] if len(r["error"]) <= 40 else r["error"][:39] + "…"
            cells += [""] * (5 + len(run_cols)) + [short]
        else:
            cells += [f"{r['step_time_s']:.4g}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"{r['mfu']:.1%}",
                      f"{r['peak_memory_gib']:.1f}" + (" OOM" if r["oom"] else ""),
                      f"{r['cost.usd_per_million_tokens']:.4g}",
                      *(_run_cell(c, r.get(c)) for c, _ in run_cols), ""]
        t.add_row(*cells)
    con = Console()
    if not con.is_terminal:
        con = Console(width=160)   # a file or a pipe: no terminal width to fit
    con.print(t)
    errors: dict[str, int] = {}
    for r in result.rows:
        if r.get("error"):
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    for message, count in errors.items():
        con.print(f"[red]{count} variant{'s' if count > 1 else ''}[/red]: {message}",
                  markup=True, highlight=False, soft_wrap=True)
    wrote = [str(p) for p in (out, plot) if p is not None]
    sys.stdout.flush()
    damaged = (f" ({result.corrupt} damaged cache entries recomputed)" if result.corrupt
               else "")
    print(f"{len(result.rows)} variants: {result.simulated} simulated on {result.backend} "
          f"({result.workers} workers, {result.batch} per task){damaged}, {result.cached} "
          f"reused from the cache, {result.failed} failed, in {result.wall_s:.1f} s"
          + (f"; wrote {', '.join(wrote)}" if wrote else ""), file=sys.stderr)
    if result.cache_write_error:
        print(f"fabricsim: warning: {result.cache_write_error}", file=sys.stderr)
