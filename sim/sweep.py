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
   the heads: ``sim/frameworks/fsdp2/checks.py``, ``megatron_shape.py``; micro-batches not
   dividing the global batch).
3. **Look up the cache**: a variant whose fully resolved scenario (topology merged, defaults
   filled), simulator version and source, and step count were simulated before is served
   from disk (:class:`SweepCache`).
4. **Run** the rest on a backend of the shared executor layer (:mod:`sim.executor`, which
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

Examples
--------
>>> [a.values for a in parse_grid(["cluster.nic_gbps=100,400", "framework.name=ddp,fsdp2"])]
[(100, 400), ('ddp', 'fsdp2')]
>>> [v.values for v in expand(parse_grid(["a=1,2", "b=x,y"]))]  # doctest: +NORMALIZE_WHITESPACE
[{'a': 1, 'b': 'x'}, {'a': 1, 'b': 'y'}, {'a': 2, 'b': 'x'}, {'a': 2, 'b': 'y'}]
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.executor import (  # noqa: F401 - the backend layer, importable from here as before
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
from sim.scenario import Scenario, ScenarioError, load_scenario, parse_set

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROW_TAIL = ("error", "cached", "wall_s")
"""The columns after the summary's in every row."""

WALL_CLOCK_COLUMNS = frozenset({"wall_s", "sim.wall_s", "cached"})
"""Columns that may differ between two runs of the same sweep (wall clock, cache state)."""

DEFAULT_CACHE_DIRNAME = ".fabricsim-cache"
"""The cache folder's name, placed next to ``--out`` (or in the current folder)."""


# --------------------------------------------------------------------------- the grid
@dataclass(frozen=True)
class GridAxis:
    """One ``--grid KEY=V1,V2`` option: a dotted scenario key and its values."""

    key: str
    """Dotted path into the scenario (``cluster.nic_gbps``)."""
    raws: tuple[str, ...]
    """Each value as written, handed to the scenario loader as ``KEY=RAW``."""
    values: tuple[Any, ...]
    """Each value parsed as ``--set`` parses it (a YAML scalar or flow collection)."""


@dataclass(frozen=True)
class Variant:
    """One combination of grid values."""

    index: int
    """Position in grid order (the row's position in the output)."""
    values: dict[str, Any]
    """Grid key -> parsed value, in grid order."""
    overrides: tuple[str, ...]
    """``KEY=RAW`` assignments for :func:`sim.scenario.load_scenario`."""


def split_values(text: str) -> list[str]:
    """Split ``V1,V2,...`` at the commas outside brackets, braces and quotes, so a value may
    be a YAML flow collection (``{layers: 2, hidden: 512}``) or a quoted string with a comma.

    Examples
    --------
    >>> split_values("100,200")
    ['100', '200']
    >>> split_values("{a: 1, b: 2},[1, 2],'x,y'")
    ['{a: 1, b: 2}', '[1, 2]', "'x,y'"]
    """
    parts: list[str] = []
    depth = 0
    quote = ""
    start = 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def parse_grid(specs: Sequence[str]) -> list[GridAxis]:
    """Parse ``--grid KEY=V1,V2,...`` options; raise ScenarioError (one line) on bad syntax,
    an empty key path or value, a key given twice or a value given twice for one key."""
    axes: list[GridAxis] = []
    seen: set[str] = set()
    for spec in specs:
        if "=" not in spec:
            raise ScenarioError(f"--grid {spec}: expected KEY=V1,V2,...")
        key, text = (s.strip() for s in spec.split("=", 1))
        if not key or not all(key.split(".")):
            raise ScenarioError(f"--grid {spec}: empty key path")
        if key in seen:
            raise ScenarioError(f"--grid {key}: given twice (put all its values in one --grid)")
        seen.add(key)
        raws = split_values(text)
        if any(not r for r in raws):
            raise ScenarioError(f"--grid {spec}: empty value")
        # The same parse as `--set KEY=VALUE` (sim.scenario.parse_set), value by value.
        values = [parse_set(f"{key}={raw}")[1] for raw in raws]
        canon = [_canonical(v) for v in values]
        for i, c in enumerate(canon):
            if c in canon[:i]:
                raise ScenarioError(f"--grid {key}: value {raws[i]} given twice")
        axes.append(GridAxis(key, tuple(raws), tuple(values)))
    return axes


def expand(axes: Sequence[GridAxis]) -> list[Variant]:
    """Every combination of the axes' values, in grid order: the first key varies slowest."""
    combos = itertools.product(*(range(len(a.values)) for a in axes))
    return [
        Variant(i, {a.key: a.values[j] for a, j in zip(axes, combo, strict=True)},
                tuple(f"{a.key}={a.raws[j]}" for a, j in zip(axes, combo, strict=True)))
        for i, combo in enumerate(combos)
    ]


def load_variants(scenario: str, axes: Sequence[GridAxis], variants: Sequence[Variant]
                  ) -> list[Scenario | str]:
    """Each variant's validated scenario, or the loader's one-line error where the combination
    is refused.

    Raises ScenarioError when the input itself is bad: every variant refused (the scenario or
    the grid as a whole), or one grid value refused in every variant it appears in (an
    unknown key, a wrong type, a value out of range for every combination).
    """
    loaded: list[Scenario | str] = []
    for v in variants:
        try:
            loaded.append(load_scenario(scenario, list(v.overrides)))
        except ScenarioError as exc:
            loaded.append(str(exc))
    errors = [x for x in loaded if isinstance(x, str)]
    if not errors:
        return loaded
    if len(errors) == len(loaded):
        load_scenario(scenario)   # the scenario itself is bad: its own error, unprefixed
    # Values refused in every variant they appear in; blame first the one whose key the
    # error names (an unknown key fails every other key's values too when it is alone).
    culprits: list[str] = []
    for axis in axes:
        for raw, value in zip(axis.raws, axis.values, strict=True):
            mine = [x for v, x in zip(variants, loaded, strict=True)
                    if _canonical(v.values[axis.key]) == _canonical(value)]
            if all(isinstance(x, str) for x in mine):
                line = f"--grid {axis.key}={raw}: {mine[0]}"
                if f"{axis.key}:" in str(mine[0]) or f"{axis.key}." in str(mine[0]):
                    raise ScenarioError(line)
                culprits.append(line)
    if culprits:
        raise ScenarioError(culprits[0])
    return loaded


# --------------------------------------------------------------------------- the cache
@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 over the simulator's source and data files (``sim/``, without the bundled
    scenario copies), so a cache entry made by other code is never served."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (not path.is_file() or "__pycache__" in rel.parts or rel.parts[0] == "_bundled"
                or path.suffix in (".pyc", ".pyo")):
            continue
        h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(scenario: Scenario, steps: int) -> str:
    """Content hash of one simulation's inputs: the fully resolved scenario's JSON (topology
    merged, every default filled), the simulator's version and source digest, the step count.
    """
    from sim import __version__

    material = {"scenario": scenario.model_dump(mode="json"), "version": __version__,
                "code": code_digest(), "steps": steps}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


class SweepCache:
    """Summaries on disk, one JSON file per cache key (``DIR/ab/abcdef....json``).

    Written by the process that gathers the results (workers on other machines need no
    shared disk), atomically (a temporary file renamed into place), so an interrupted sweep
    leaves only whole entries. An unreadable entry counts as missing.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> tuple[dict[str, Any], float] | None:
        """The cached summary and the wall seconds its simulation took, or None."""
        try:
            entry = json.loads(self._path(key).read_text())
            return entry["summary"], float(entry["wall_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, summary: dict[str, Any], wall_s: float) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temporary_beside(path)
        tmp.write_text(json.dumps({"summary": summary, "wall_s": wall_s}))
        os.replace(tmp, path)


def _temporary_beside(path: Path) -> Path:
    # Same folder (so os.replace is atomic), a name no other process writes at once.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


# --------------------------------------------------------------------------- rows
def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings become dotted keys; lists (rank classes, claims) stay whole values.

    Examples
    --------
    >>> flatten({"step_time_s": 1.0, "bytes": {"network": 5.0}, "claims": [1]})
    {'step_time_s': 1.0, 'bytes.network': 5.0, 'claims': [1]}
    """
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def make_row(variant: Variant, summary: dict[str, Any] | None, error: str | None,
             cached: bool, wall_s: float) -> dict[str, Any]:
    """A row: the grid values, the summary flattened, then error, cached, wall_s. Where a
    summary key equals a grid key (``framework``), the grid's value is kept."""
    row: dict[str, Any] = dict(variant.values)
    for k, v in flatten(summary or {}).items():
        row.setdefault(k, v)
    row.update(error=error, cached=cached, wall_s=wall_s)
    return row


def columns_of(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """Grid keys, then every summary column in order of first appearance, then the tail."""
    cols: dict[str, None] = dict.fromkeys(keys)
    for r in rows:
        for k in r:
            if k not in ROW_TAIL:
                cols.setdefault(k)
    cols.update(dict.fromkeys(ROW_TAIL))
    return list(cols)


@dataclass
class SweepResult:
    """A finished sweep: rows in grid order and how it went."""

    keys: list[str]
    rows: list[dict[str, Any]]
    columns: list[str]
    backend: str
    workers: int
    wall_s: float
    simulated: int
    cached: int
    failed: int
    title: str = ""
    batch: int = 1


ProgressFn = Callable[[int, int, int, int], None]
"""``progress(done, failed, simulated, total)`` after each result."""


def run_sweep(scenario: str, grid: Sequence[str], backend: str = "local",
              address: str | None = None, workers: int | None = None, steps: int = 1,
              cache_dir: Path | None = None, use_cache: bool = True,
              progress: ProgressFn | None = None,
              before_variant: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
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

    rows: list[dict[str, Any] | None] = [None] * len(variants)
    todo: list[Task] = []
    ckeys: dict[int, str] = {}
    n_failed = n_cached = n_sim = 0
    for v, sc in zip(variants, loaded, strict=True):
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
    title = next((x.name for x in loaded if not isinstance(x, str)), Path(scenario).stem)
    total = len(variants)
    done = total - len(todo)
    if progress is not None:
        progress(done, n_failed, 0, total)

    used_workers = workers or 0
    size = 1
    if todo:
        be = make_backend(backend, address, workers, steps, scenario, before_variant)
        used_workers = be.workers
        size = batch_size(len(todo), be.workers)
        try:
            for out in run_tasks(be, todo, size):
                v = variants[out.index]
                if out.error is None and out.summary is not None:
                    if cache is not None:
                        cache.put(ckeys[out.index], out.summary, out.wall_s)
                    rows[out.index] = make_row(v, out.summary, None, False, out.wall_s)
                else:
                    rows[out.index] = make_row(v, None, out.error, False, out.wall_s)
                    n_failed += 1
                n_sim += 1
                done += 1
                if progress is not None:
                    progress(done, n_failed, n_sim, total)
        finally:
            be.close()
    done_rows = [r for r in rows if r is not None]
    assert len(done_rows) == total
    # Every row gets every column (None where a failed variant has no summary).
    columns = columns_of(done_rows, keys)
    final = [{c: r.get(c) for c in columns} for r in done_rows]
    return SweepResult(keys, final, columns, backend, used_workers,
                       time.perf_counter() - wall0, n_sim, n_cached, n_failed, title, size)


# --------------------------------------------------------------------------- outputs
def _cell(value: Any) -> Any:
    # Lists and mappings (rank classes, claims, inline model grids) as JSON text.
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return value


def write_rows(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """CSV, or Parquet when ``path`` ends in ``.parquet``; written to a temporary file and
    renamed into place. Lists are JSON text; a column whose values mix types (numbers and
    words) is text in Parquet."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            data: dict[str, list[Any]] = {}
            for c in columns:
                cells = [_cell(r.get(c)) for r in rows]
                kinds = {type(x) for x in cells if x is not None}
                if len(kinds) > 1 and kinds != {int, float}:
                    cells = [None if x is None else str(x) for x in cells]
                data[c] = cells
            pq.write_table(pa.table(data), tmp)
        else:
            with open(tmp, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(columns)
                for r in rows:
                    w.writerow(["" if r.get(c) is None else _cell(r.get(c)) for c in columns])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def plot_axis(keys: Sequence[str], rows: Sequence[dict[str, Any]]) -> str | None:
    """The first grid key whose values are all numbers (the plot's x axis), or None."""
    for k in keys:
        if all(_is_number(r[k]) for r in rows):
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
        groups.setdefault(tuple(_label(r[k]) for k in others), []).append(r)
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


def _label(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def write_plot(path: Path, rows: Sequence[dict[str, Any]], keys: Sequence[str],
               title: str = "") -> None:
    """Save :func:`sweep_figure` to ``path`` (PNG, SVG or PDF by suffix)."""
    fig = sweep_figure(rows, keys, title)
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- the command
OUT_SUFFIXES = (".csv", ".parquet")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def sweep_command(scenario: str, grid: Sequence[str], backend: str = "local",
                  address: str | None = None, workers: int | None = None,
                  out: Path | None = None, plot: Path | None = None, as_json: bool = False,
                  cache: Path | None = None, use_cache: bool = True, steps: int = 1,
                  before_variant: Callable[[dict[str, Any]], None] | None = None) -> int:
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
        numeric = [a.key for a in axes if all(_is_number(v) for v in a.values)]
        if not numeric:
            raise ScenarioError("--plot: no grid key with only numeric values for the x axis")
    if cache is None:
        cache = (out.expanduser().parent if out is not None else Path.cwd()) \
            / DEFAULT_CACHE_DIRNAME

    from rich.console import Console

    err = Console(stderr=True)
    # stdout carries only the table or the JSON: what backends print while they run goes to
    # stderr (Ray's driver prints its raylet's messages, e.g. a dead worker, on stdout).
    with contextlib.redirect_stdout(sys.stderr), \
            _ProgressBar(err, quiet=as_json or not err.is_terminal) as progress:
        result = run_sweep(scenario, grid, backend, address, workers, steps, cache,
                           use_cache, progress, before_variant)
    if out is not None:
        write_rows(out, result.rows, result.columns)
    if plot is not None:
        write_plot(plot, result.rows, result.keys, result.title)
    if as_json:
        print(json.dumps({"rows": result.rows}, indent=2, default=str))
    else:
        _print_rows(result, out, plot)
    return 0


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


def _print_rows(result: SweepResult, out: Path | None, plot: Path | None) -> None:
    """A table of the rows on stdout (the file has every column), and what was done on
    stderr."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{result.title}: {len(result.rows)} variants", title_justify="left")
    for head in _short_heads(result.keys):
        t.add_column(head, justify="right", no_wrap=True, min_width=len(head))
    for head in ("step (s)", "tokens/s/GPU", "MFU", "peak GiB", "$/M tokens"):
        t.add_column(head, justify="right", no_wrap=True, min_width=len(head))
    # Errors are long (file, key path, reason): the start here, in full below the table.
    t.add_column("error", no_wrap=True, overflow="ellipsis")
    for r in result.rows:
        cells = [_label(r[k]) for k in result.keys]
        if r.get("error"):
            short = r["error"] if len(r["error"]) <= 40 else r["error"][:39] + "…"
            cells += ["", "", "", "", "", short]
        else:
            cells += [f"{r['step_time_s']:.4g}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                      f"{r['mfu']:.1%}",
                      f"{r['peak_memory_gib']:.1f}" + (" OOM" if r["oom"] else ""),
                      f"{r['cost.usd_per_million_tokens']:.4g}", ""]
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
    print(f"{len(result.rows)} variants: {result.simulated} simulated on {result.backend} "
          f"({result.workers} workers, {result.batch} per task), {result.cached} from the "
          f"cache, {result.failed} failed, in {result.wall_s:.1f} s"
          + (f"; wrote {', '.join(wrote)}" if wrote else ""), file=sys.stderr)


def without_wall_clock(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without :data:`WALL_CLOCK_COLUMNS`: what two runs of one sweep share."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_COLUMNS} for r in rows]


__all__ = ["BACKENDS", "GridAxis", "SweepCache", "SweepResult", "Variant", "cache_key",
           "expand", "flatten", "load_variants", "parse_grid", "run_sweep", "sweep_command",
           "sweep_figure", "without_wall_clock", "write_plot", "write_rows"]
