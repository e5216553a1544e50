"""Every report of a run kept in order, for the exact advance of steady phases
(:mod:`sim.engine.splice`): ops with their issue times and their class's running sums,
memory, collectives, rates, transfers, and each change of the byte totals."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sim.engine.core import EngineObserver
from sim.fabric.collectives.runner import Choice
from sim.program.ir import Op, RankClass

if TYPE_CHECKING:
    from sim.engine.core import Engine

# Report kinds (the first field of an entry).
OP, MEM, COLL, RATES, XFER, BYTES = range(6)

Entry = tuple[int, float, int, Op | None, tuple[Any, ...], int]
"""(kind, time, rank class or -1, op or None, what else the report says, rate solves so far)."""


class LogTap(EngineObserver):
    """Keeps every report of a run, in order, for :func:`find_cut` and :func:`splice`.

    ``keep_link_rates``: keep each rate change's per-link rates (the recorder's
    ``keep_link_series``); otherwise only the per-class ones.
    """

    def __init__(self, keep_link_rates: bool = False) -> None:
        self.entries: list[Entry] = []
        self.background = False
        """A background stream's op was reported: such a run is not spliced."""
        self._keep_links = keep_link_rates
        self._engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """The engine whose issue times, sums, clock and solve count the reports carry."""
        self._engine = engine

    def _solves(self) -> int:
        assert self._engine is not None
        return self._engine.net.solves

    def on_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
              step: int) -> None:
        engine = self._engine
        assert engine is not None
        self.entries.append((OP, end, cls.id, op, (ready, start, engine.issued_at(op), step,
                                                     engine.accumulators(cls.id)),
                             engine.net.solves))

    def on_background_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
                         step: int) -> None:
        self.background = True

    def on_memory(self, cls: RankClass, t: float, category: str, delta: float,
                  op: Op | None = None) -> None:
        self.entries.append((MEM, t, cls.id, op, (category, delta), self._solves()))

    def on_collective(self, op: Op, choice: Choice | None) -> None:
        assert self._engine is not None
        self.entries.append((COLL, self._engine.env.now, -1, op, (choice,), self._solves()))

    def on_rates(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray) -> None:
        links = link_rates.copy() if self._keep_links else None
        self.entries.append((RATES, t, -1, None, (class_rates.copy(), links), self._solves()))

    def on_transfer_end(self, t: float, tag: object, nbytes: float) -> None:
        op = tag if isinstance(tag, Op) else None
        self.entries.append((XFER, t, -1, op, (nbytes,), self._solves()))

    def on_class_bytes(self, t: float, added: np.ndarray) -> None:
        self.entries.append((BYTES, t, -1, None, (added,), self._solves()))
