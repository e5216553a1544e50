"""The rows finished so far, kept in the output file while a sweep runs, so that an
interrupted sweep (Ctrl-C, a killed process, a lost machine) leaves every finished variant
on disk: in the cache (:class:`~sim.apps.sweep.cache.SweepCache`, written as each result
arrives) and in ``--out``, which a re-run of the same command then completes.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.apps.sweep.rows import columns_of, write_rows

WRITE_SHARE = 0.05
"""At most this share of a sweep's wall time goes to rewriting the partial output: after a
write that took ``w`` seconds the next waits ``w / WRITE_SHARE``. A row file is rewritten
whole (CSV and Parquet have no safe append once a new column appears), so writing after
every result of a sweep of thousands would cost quadratic time; small sweeps (a write in
about a millisecond) are still written after every result."""


class RowCheckpoint:
    """Rewrites ``path`` atomically with the rows finished so far (in grid order, the
    unfinished ones left out), at most :data:`WRITE_SHARE` of the time."""

    def __init__(self, path: Path, keys: Sequence[str]) -> None:
        self.path = path
        self.keys = list(keys)
        self.next_at = 0.0
        self.written = 0
        """Rows in the file as last written."""
        self.error: str | None = None
        """The last write's error, if it failed."""

    def update(self, rows: Sequence[dict[str, Any] | None], force: bool = False) -> None:
        """Write the finished rows now if the time share allows (or ``force``)."""
        now = time.perf_counter()
        if not force and now < self.next_at:
            return
        done = [r for r in rows if r is not None]
        columns = columns_of(done, self.keys)
        try:
            write_rows(self.path, [{c: r.get(c) for c in columns} for r in done], columns)
        except OSError as exc:   # a full disk: the cache still has every row; go on
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            self.written = len(done)
        took = time.perf_counter() - now
        self.next_at = time.perf_counter() + took / WRITE_SHARE
