"""A sweep's rows: each variant's summary flattened after its grid values, the columns in
order, the finished sweep, and the rows written as CSV or Parquet.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.apps.sweep.cache import temporary_beside
from sim.apps.sweep.grid import Variant

ROW_TAIL = ("error", "cached", "wall_s")
"""The columns after the summary's in every row."""

WALL_CLOCK_COLUMNS = frozenset({"wall_s", "sim.wall_s", "cached"})
"""Columns that may differ between two runs of the same sweep (wall clock, cache state)."""

RUN_COLUMNS = (("run.ettr", "ETTR"), ("run.expected_days", "run days"),
               ("run.expected_usd", "run $"))
"""The whole run's headline columns (a scenario with a ``run:`` block: the summary's ``run``
object flattened, :func:`sim.apps.runlength.run_length`), with their short table heads."""


def run_columns(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """:data:`RUN_COLUMNS` some row has a value for: none for a sweep without ``run:``, so
    its table is as before.

    Examples
    --------
    >>> run_columns([{"step_time_s": 1.0}])
    []
    >>> [c for c, _ in run_columns([{"run.ettr": 0.9, "run.expected_days": 3.0,
    ...                              "run.expected_usd": 1e6}])]
    ['run.ettr', 'run.expected_days', 'run.expected_usd']
    """
    rows = list(rows)
    return [(c, head) for c, head in RUN_COLUMNS if any(r.get(c) is not None for r in rows)]


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
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


def make_row(variant: Variant, summary: Mapping[str, Any] | None, error: str | None,
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
    corrupt: int = 0
    """Cache entries found damaged (recomputed)."""
    cache_write_error: str | None = None
    """How many entries could not be written to the cache, and why (a full disk)."""


ProgressFn = Callable[[int, int, int, int], None]
"""``progress(done, failed, simulated, total)`` after each result."""


def without_wall_clock(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without :data:`WALL_CLOCK_COLUMNS`: what two runs of one sweep share."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_COLUMNS} for r in rows]


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
    tmp = temporary_beside(path)
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
