"""Parameter sweeps: every combination of grid values, run in parallel, one row per variant.

``fabricsim sweep SCENARIO --grid KEY=V1,V2 ...`` (see ``docs/sweeps.md``). The phases:

1. **Expand** the grid: the cross product of the ``--grid`` values, in grid order (the last
   key varies fastest, as ``itertools.product``). Each value is parsed as ``--set`` parses it
   (a YAML scalar, so ``100`` is an int, ``true`` a bool, ``ring`` a string).
2. **Load** every variant's scenario before anything runs. A grid value that no variant can
   use (an unknown key, a wrong type, a value out of range, a layout that fits no variant) is
   bad input: :class:`~sim.scenario.ScenarioError`, exit status 2. A value that is refused in
   some combinations only (``parallelism.tp=2`` with ``framework.name=ddp``, which fsdp2
   takes) makes those variants failed rows: a sweep does not die for one illegal
   combination. The same holds for what only the framework builders check (tp not dividing
   the heads: ``sim/frameworks/fsdp2/checks.py``, ``sim/frameworks/megatron/shape.py``;
   micro-batches not dividing the global batch).
3. **Look up the cache**: a variant whose fully resolved scenario (topology merged, defaults
   filled), simulator version and source, and step count were simulated before is served
   from disk (:class:`SweepCache`).
4. **Run** the rest on a backend of the shared executor layer (:mod:`sim.apps.executor`, which
   ``compare`` and ``plan`` use too): local processes (joblib's loky executor), a Ray
   cluster or a Dask cluster. Short variants travel several to a task (:func:`batch_size`).
   Results are taken as they finish (``concurrent.futures.as_completed`` over the loky
   executor's futures, ``ray.wait``, Dask's ``as_completed``), cached at once, and counted
   on a progress bar.
5. **Write** the rows in grid order, whatever the finishing order: CSV, or Parquet for a
   ``.parquet`` file; optionally a plot.

A variant that raises becomes a row with its ``error`` (exception type and message); a
variant that kills its worker process (a segfault, the kernel's OOM killer, ``os._exit``)
becomes a row with a ``WorkerDied`` error, and every other row is kept (:func:`run_sweep`).

Rows are the run summary (``sim.api.summarise``) flattened with dotted keys
(``bytes.network``, ``cost.usd_per_step``), after the grid keys and followed by ``error``,
``cached`` and ``wall_s``. Same sweep, same rows on every backend, to the last bit, except the
wall-clock columns ``wall_s`` and ``sim.wall_s`` (and ``cached``).

The phases live in one module each, every name re-exported here: :mod:`sim.apps.sweep.grid` (1, 2),
:mod:`sim.apps.sweep.cache` (3), :mod:`sim.apps.sweep.rows` (rows, CSV and Parquet),
:mod:`sim.apps.sweep.plot`
and :mod:`sim.apps.sweep.command` (``fabricsim sweep``); :func:`run_sweep`, which drives them, is
here, and finds the backend layer (``make_backend``, ``run_tasks``) through this module.

Examples
--------
>>> [a.values for a in parse_grid(["cluster.nic_gbps=100,400", "framework.name=ddp,fsdp2"])]
[(100, 400), ('ddp', 'fsdp2')]
>>> [v.values for v in expand(parse_grid(["a=1,2", "b=x,y"]))]  # doctest: +NORMALIZE_WHITESPACE
[{'a': 1, 'b': 'x'}, {'a': 1, 'b': 'y'}, {'a': 2, 'b': 'x'}, {'a': 2, 'b': 'y'}]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sim.apps import budget
from sim.apps.executor import (  # noqa: F401 - the backend layer, importable from here as before
    BACKENDS,
    MAX_BATCH,
    MAX_WORKER_LOSSES,
    TASKS_PER_WORKER,
    Backend,
    DaskBackend,
    LocalBackend,
    Lost,
    Outcome,
    RayBackend,
    Task,
    backend_missing,
    batch_size,
    make_backend,
    one_line,
    run_batch,
    run_tasks,
)
from sim.apps.sweep.cache import DEFAULT_CACHE_DIRNAME, SweepCache, cache_key, code_digest
from sim.apps.sweep.checkpoint import RowCheckpoint
from sim.apps.sweep.command import OUT_SUFFIXES, PLOT_SUFFIXES, sweep_command
from sim.apps.sweep.grid import GridAxis, Variant, expand, load_variants, parse_grid, split_values
from sim.apps.sweep.plot import plot_axis, sweep_figure, write_plot
from sim.apps.sweep.rows import (
    ROW_TAIL,
    WALL_CLOCK_COLUMNS,
    ProgressFn,
    SweepResult,
    columns_of,
    flatten,
    make_row,
    without_wall_clock,
    write_rows,
)
from sim.scenario import ScenarioError


def run_sweep(scenario: str, grid: Sequence[str], backend: str = "local",
              address: str | None = None, workers: int | None = None, steps: int = 1,
              cache_dir: Path | None = None, use_cache: bool = True,
              progress: ProgressFn | None = None,
              before_variant: Callable[[dict[str, Any]], None] | None = None,
              out: Path | None = None, force: bool = False) -> SweepResult:
    """Run every combination of the grid values; bad input raises ScenarioError before
    anything runs.

    Parameters
    ----------
    scenario
        Scenario file or shipped name.
    grid
        ``KEY=V1,V2,...`` strings.
    backend, address, workers
        Where to run (:data:`BACKENDS`); a Ray/Dask address, or None to start one here;
        worker processes (None: every core here, or the cluster's CPUs).
    steps
        Training steps per simulation.
    cache_dir, use_cache
        The cache folder (None: ``.fabricsim-cache`` in the current folder) and whether to
        use it.
    progress
        Called after each variant (cached ones first, at once).
    before_variant
        Called in the worker with each variant's grid values before it runs (tests).
    out
        The row file (.csv or .parquet) to keep the finished rows in while the sweep runs
        (:class:`~sim.apps.sweep.checkpoint.RowCheckpoint`); the caller writes the final
        one from the result.
    force
        Run variants that the estimate (:mod:`sim.apps.budget`) says would take over an
        hour or more memory than this machine has; without it they are failed rows.

    Raises
    ------
    SweepInterrupted
        On Ctrl-C (a KeyboardInterrupt): the finished rows are in the cache and ``out``,
        the backend's workers are stopped.
    """
    wall0 = time.perf_counter()
    if steps < 1:
        raise ScenarioError(f"--steps {steps}: must be at least 1")
    if not grid:
        raise ScenarioError("sweep: give at least one --grid KEY=V1,V2,...")
    if backend not in BACKENDS:
        raise ScenarioError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if backend == "local" and address:
        raise ScenarioError("--address: only with --backend ray or dask")
    if workers is not None and workers < 1:
        raise ScenarioError(f"--workers {workers}: must be at least 1")
    missing = backend_missing(backend)
    if missing:
        raise ScenarioError(missing)
    axes = parse_grid(grid)
    keys = [a.key for a in axes]
    variants = expand(axes)
    loaded = load_variants(scenario, axes, variants)
    cache = SweepCache(cache_dir or Path(DEFAULT_CACHE_DIRNAME)) if use_cache else None

    rows, todo, ckeys, n_failed, n_cached = _served(variants, loaded, steps, cache, force)
    n_sim = 0
    title = next((x.name for x in loaded if not isinstance(x, str)), Path(scenario).stem)
    total = len(variants)
    done = total - len(todo)
    if progress is not None:
        progress(done, n_failed, 0, total)
    checkpoint = RowCheckpoint(out, keys) if out is not None and todo else None
    if checkpoint is not None:
        checkpoint.update(rows, force=True)

    used_workers = workers or 0
    size = 1
    if todo:
        be = make_backend(backend, address, workers, steps, scenario, before_variant)
        used_workers = be.workers
        size = batch_size(len(todo), be.workers)
        try:
            for got in run_tasks(be, todo, size):
                v = variants[got.index]
                if got.error is None and got.summary is not None:
                    if cache is not None:
                        cache.put(ckeys[got.index], got.summary, got.wall_s)
                    rows[got.index] = make_row(v, got.summary, None, False, got.wall_s)
                else:
                    rows[got.index] = make_row(v, None, got.error, False, got.wall_s)
                    n_failed += 1
                n_sim += 1
                done += 1
                if checkpoint is not None:
                    checkpoint.update(rows)
                if progress is not None:
                    progress(done, n_failed, n_sim, total)
        except BaseException as exc:
            # Interrupted (Ctrl-C, SIGTERM) or failed: what finished goes to disk first,
            # then the workers are stopped.
            try:
                if checkpoint is not None:
                    checkpoint.update(rows, force=True)
            finally:
                be.abort()
            if isinstance(exc, KeyboardInterrupt):
                raise SweepInterrupted(done, total, n_cached, out if checkpoint else None,
                                       cache.folder if cache else None) from exc
            raise
        be.close()
    done_rows = [r for r in rows if r is not None]
    assert len(done_rows) == total
    # Every row gets every column (None where a failed variant has no summary).
    columns = columns_of(done_rows, keys)
    final = [{c: r.get(c) for c in columns} for r in done_rows]
    return SweepResult(keys, final, columns, backend, used_workers,
                       time.perf_counter() - wall0, n_sim, n_cached, n_failed, title, size,
                       corrupt=cache.corrupt if cache else 0,
                       cache_write_error=_write_error(cache))


def _served(variants: list[Variant], loaded: list[Any], steps: int,
            cache: SweepCache | None, force: bool
            ) -> tuple[list[dict[str, Any] | None], list[Task], dict[int, str], int, int]:
    """What needs no simulation: the rows of variants refused (by the loader, or by the
    estimate without ``force``) and of those in the cache; the rest as tasks. Returns the
    rows (None where still to run), the tasks, the cache keys, and the refused and cached
    counts."""
    rows: list[dict[str, Any] | None] = [None] * len(variants)
    todo: list[Task] = []
    ckeys: dict[int, str] = {}
    n_failed = n_cached = 0
    memory = budget.physical_memory()
    for v, sc in zip(variants, loaded, strict=True):
        if not isinstance(sc, str) and not force:
            est = budget.estimate(sc, steps)
            why = budget.refusal(est, memory) if est is not None else None
            sc = why if why is not None else sc
        if isinstance(sc, str):
            rows[v.index] = make_row(v, None, f"ScenarioError: {sc}", False, 0.0)
            n_failed += 1
            continue
        if cache is not None:
            ckeys[v.index] = cache_key(sc, steps)
            hit = cache.get(ckeys[v.index])
            if hit is not None:
                rows[v.index] = make_row(v, hit[0], None, True, hit[1])
                n_cached += 1
                continue
        todo.append(Task(v.index, sc, v.values))
    return rows, todo, ckeys, n_failed, n_cached


def _write_error(cache: SweepCache | None) -> str | None:
    if cache is None or not cache.write_errors:
        return None
    return f"{cache.write_errors} cache entries not written ({cache.write_error})"


class SweepInterrupted(KeyboardInterrupt):
    """A sweep stopped by Ctrl-C, after its finished rows went to the cache and ``out``.

    Attributes: ``done`` of ``total`` variants finished (``cached`` of them from the cache),
    ``out`` the row file holding them (None: none given), ``cache`` the cache folder.
    """

    def __init__(self, done: int, total: int, cached: int, out: Path | None,
                 cache: Path | None) -> None:
        super().__init__(f"interrupted after {done} of {total} variants")
        self.done, self.total, self.cached, self.out, self.cache = \
            done, total, cached, out, cache

    def line(self) -> str:
        """What the command prints: how far it got, where the rows are, how to go on."""
        where = [str(p) for p in (self.out, self.cache) if p is not None]
        kept = f" (kept in {' and '.join(where)})" if where else ""
        again = ("; run the same command again to finish the rest" if self.cache
                 else "")
        return f"interrupted: {self.done} of {self.total} variants done{kept}{again}"



__all__ = ["BACKENDS", "DEFAULT_CACHE_DIRNAME", "OUT_SUFFIXES", "PLOT_SUFFIXES", "ROW_TAIL",
           "WALL_CLOCK_COLUMNS", "GridAxis", "ProgressFn", "SweepCache", "SweepInterrupted",
           "SweepResult",
           "Variant", "cache_key", "code_digest", "columns_of", "expand", "flatten",
           "load_variants", "make_row", "parse_grid", "plot_axis", "run_sweep", "split_values",
           "sweep_command", "sweep_figure", "without_wall_clock", "write_plot", "write_rows"]
