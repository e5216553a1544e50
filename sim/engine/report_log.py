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
    ``keep_link_series``), as the links whose rate changed and their new rates
    (:class:`LinkRatesReplay` gives back every link's); otherwise only the per-class ones.
    """

    def __init__(self, keep_link_rates: bool = False) -> None:
        self.entries: list[Entry] = []
        self.background = False
        """A background stream's op was reported: such a run is not spliced."""
        self._keep_links = keep_link_rates
        self._links_now = np.zeros(0)
        self._engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """The engine whose issue times, sums, clock and solve count the reports carry."""
        self._engine = engine

    def _solves(self) -> int:
        assert self._engine is not None
        return self._engine.net.solves

    def on_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
              step: int, held: float = 0.0) -> None:
        engine = self._engine
        assert engine is not None
        self.entries.append((OP, end, cls.id, op, (ready, start, engine.issued_at(op), step,
                                                     engine.accumulators(cls.id), held),
                             engine.net.solves))

    def on_background_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
                         step: int, held: float = 0.0) -> None:
        self.background = True

    def on_memory(self, cls: RankClass, t: float, category: str, delta: float,
                  op: Op | None = None) -> None:
        self.entries.append((MEM, t, cls.id, op, (category, delta), self._solves()))

    def on_collective(self, op: Op, choice: Choice | None) -> None:
        assert self._engine is not None
        self.entries.append((COLL, self._engine.env.now, -1, op, (choice,), self._solves()))

    def on_rates(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray) -> None:
        links = None
        if self._keep_links:
            if len(self._links_now) != len(link_rates):
                self._links_now = np.zeros(len(link_rates))
            changed = np.flatnonzero(link_rates != self._links_now)
            links = (changed, link_rates[changed], len(link_rates))
            self._links_now[changed] = links[1]
        self.entries.append((RATES, t, -1, None, (class_rates.copy(), links), self._solves()))

    def on_transfer_end(self, t: float, tag: object, nbytes: float) -> None:
        op = tag if isinstance(tag, Op) else None
        self.entries.append((XFER, t, -1, op, (nbytes,), self._solves()))

    def on_class_bytes(self, t: float, added: np.ndarray) -> None:
        self.entries.append((BYTES, t, -1, None, (added,), self._solves()))


class LinkRatesReplay:
    """Every link's rate as a run's :class:`LogTap` reports give it back, report by report
    (each keeps only the links whose rate changed), for replaying them in another order
    (:func:`sim.engine.splice.splice`)."""

    def __init__(self) -> None:
        self.now = np.zeros(0)
        """Every link's rate after the last report applied."""

    def apply(self, links: tuple[np.ndarray, np.ndarray, int] | None) -> np.ndarray:
        """The rates after a report's change (``links``: its changed links, their new rates
        and the number of links; None where the run kept no link rates: an empty array)."""
        if links is None:
            return np.zeros(0)
        changed, rates, n_links = links
        if len(self.now) != n_links:
            self.now = np.zeros(n_links)
        self.now[changed] = rates
        return self.now

    def copy(self) -> LinkRatesReplay:
        """The same rates, replayed on independently."""
        other = LinkRatesReplay()
        other.now = self.now.copy()
        return other


def link_rates_repeat(entries: list[Entry], at: int, span: int) -> bool:
    """Whether every link's rate after report ``at`` is its rate after report ``at + span``
    (always, where the reports keep no link rates). Matching reports a period apart carry
    the same changes; this says the rates they change from are the same too."""
    rates = LinkRatesReplay()
    before = rates
    for i in range(at + span + 1):
        kind, _, _, _, what, _ = entries[i]
        if kind == RATES:
            if what[1] is None:
                return True
            rates.apply(what[1])
        if i == at:
            before = rates.copy()
    return np.array_equal(before.now, rates.now)
