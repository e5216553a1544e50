"""The flow tables of :class:`sim.fabric.network.FlowNetwork`: rows and incidences, their
growth and compaction, and the component search over them.

Split from ``network.py`` (which keeps the events: starts, ends, solves, advances) along the
seam between how the active flows are stored and what the network does with them. The
tables are plain arrays, one row per active flow and one entry per flow-link incidence, so
that an event costs a few numpy operations over them (issue 13, ``docs/performance.md``
items 6 and 7).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FlowTables"]

# The flow tables drop their dead rows once rows outnumber live flows this many times: each
# start and end then writes only its own rows, and a compaction costs as much as the old
# copy per start amortised over half as many events.
_KEEP_DEAD = 2
# ... and hold this many more rows besides: with a few live flows (a rank class's collective
# at a time) a compaction every other end cost more than the dead rows it drops (a Python
# loop over a small table costs ~0.1 us per row, sim.fabric.network_fast).
_DEAD_SLACK = 16

# Rows of the per-flow table, before the hop counts per link class.
_ROWS = ("_size", "_remaining", "_rate", "_cap", "_base_cap", "_cap0", "_count")
_N_ROWS = len(_ROWS)


class FlowTables:
    """Per-flow rows and per-incidence entries of the active flows (a base of
    :class:`~sim.fabric.network.FlowNetwork`, which sets the scratch masks and component
    marks these methods read)."""

    n_kinds: int
    _link_mask: np.ndarray
    _seed: int
    _alone: int
    _dirty_seen: list[np.ndarray]
    _seed_alone: bool
    _gone_alone: np.ndarray | None
    _live: int
    _live_folded: int

    def _init_tables(self, n_links: int, n_kinds: int) -> None:
        """Empty tables for a fabric of ``n_links`` links in ``n_kinds`` classes.

        Per flow, one row each of one float table (see ``_ROWS``), its hop counts per link
        class (C-ordered, so the class totals' matrix products sum as they always did), its
        group and which of the group's flows it is (what folds an unfolded group again:
        ``network_fold.refold_due``); per flow-link incidence, row 0 the link and row 1 the
        flow. The tables are preallocated and grow by doubling: a start writes its rows after
        the last, an end marks its flows dead (``FlowNetwork._retire``) and the dead rows go
        when they outnumber the live ones (:meth:`_compact`), so live rows stay in the order
        they started.
        """
        self._flows = np.zeros((_N_ROWS, 8))
        self._hops_t = np.zeros((8, n_kinds))
        self._group_t = np.full(8, -1, dtype=np.int64)
        self._member_t = np.zeros(8, dtype=np.int64)
        self._inc = np.zeros((2, 32), dtype=np.int64)
        self._n = 0      # rows in use, dead or alive
        self._m = 0      # incidences in use
        self._live = 0   # live flows
        # A dead flow's incidences point at this link past the last, which nothing marks.
        self._dead_link = n_links
        self._bind()

    def _bind(self) -> None:
        """Point the per-flow and per-incidence names at the rows in use of the tables
        (views: writing into them writes the table)."""
        f = self._flows[:, :self._n]
        self._size, self._remaining, self._rate, self._cap = f[0], f[1], f[2], f[3]
        self._base_cap, self._cap0, self._count = f[4], f[5], f[6]
        self._hops = self._hops_t[:self._n]
        self._group = self._group_t[:self._n]
        self._member = self._member_t[:self._n]
        self._inc_link = self._inc[0, :self._m]
        self._inc_flow = self._inc[1, :self._m]

    def _grow(self, n: int, m: int) -> None:
        """Room for ``n`` flows and ``m`` incidences, doubling what is short."""
        if n > self._flows.shape[1]:
            size = max(n, 2 * self._flows.shape[1])
            flows = np.zeros((_N_ROWS, size))
            flows[:, :self._n] = self._flows[:, :self._n]
            hops = np.zeros((size, self.n_kinds))
            hops[:self._n] = self._hops_t[:self._n]
            group = np.full(size, -1, dtype=np.int64)
            group[:self._n] = self._group_t[:self._n]
            member = np.zeros(size, dtype=np.int64)
            member[:self._n] = self._member_t[:self._n]
            self._flows, self._hops_t, self._group_t = flows, hops, group
            self._member_t = member
        if m > self._inc.shape[1]:
            inc = np.zeros((2, max(m, 2 * self._inc.shape[1])), dtype=np.int64)
            inc[:, :self._m] = self._inc[:, :self._m]
            self._inc = inc
        self._bind()

    def _compact(self) -> None:
        """Drop the dead rows and incidences, the live ones keeping their order."""
        keep = self._group >= 0
        remap = np.cumsum(keep) - 1
        inc = self._inc[:, :self._m][:, keep[self._inc_flow]]
        inc[1] = remap[inc[1]]
        n, m = int(np.count_nonzero(keep)), inc.shape[1]
        self._inc[:, :m] = inc
        self._flows[:, :n] = self._flows[:, :self._n][:, keep]
        self._hops_t[:n] = self._hops[keep]
        self._group_t[:n] = self._group[keep]
        self._member_t[:n] = self._member[keep]
        self._n, self._m = n, m
        self._bind()

    def _bury_rows(self, rows: np.ndarray, incidences: np.ndarray) -> None:
        """Make ``rows`` (a mask over rows) dead, ``incidences`` their incidences' mask.

        Dead rows: no rate (they add 0 * dt to nothing), infinite bytes left (never finished
        again), no group (no scale reaches them), incidences on no real link (no component
        reaches them); every sum over flows skips them (see _solve)."""
        self._rate[rows] = 0.0
        self._remaining[rows] = np.inf
        self._group[rows] = -1
        self._inc_link[incidences] = self._dead_link

    def _drop_dead_rows(self) -> None:
        """Empty the tables when no live row is left, compact them when dead rows abound."""
        # Live rows: folded groups' flows count in _live but hold no rows.
        rows = self._live - self._live_folded
        if not rows:
            self._n = self._m = 0
            self._bind()
        elif _KEEP_DEAD * rows + _DEAD_SLACK < self._n:
            self._compact()

    def _component(self, links: np.ndarray) -> np.ndarray:
        """Flows connected to ``links`` through shared links (a boolean mask over flows).

        The flows of a group just started (the last ``_seed`` rows) are in it from the start:
        all their links are among ``links``, so the first pass would find them (and the flows
        sharing those links, which the next pass finds all the same). Starting from them
        saves a pass, and the search ends after one when nothing else shares their links (a
        collective alone on its links, the common case).
        """
        n = self._n
        link_mask = self._link_mask
        link_mask[links] = True
        flows = np.zeros(n, dtype=bool)
        seed, self._seed = self._seed, 0
        if seed:
            flows[n - seed:] = True
        # Every flow with a row: once all are found, another pass can find nothing new.
        rows = self._live - self._live_folded
        while True:
            hit = np.zeros(n, dtype=bool)
            hit[self._inc_flow[link_mask[self._inc_link]]] = True
            new = hit & ~flows
            if not new.any():
                # Leave the scratch mask clear: only these links can have been set.
                link_mask[links] = False
                link_mask[self._inc_link] = False
                self._alone = seed
                return flows
            seed = 0
            flows |= new
            if np.count_nonzero(flows) == rows:
                link_mask[links] = False
                link_mask[self._inc_link] = False
                self._alone = 0
                return flows
            link_mask[self._inc_link[new[self._inc_flow]]] = True

    def _known_component(self) -> int:
        """How many flows the component search would find when it is known without it
        (-1 when not): the started group alone when none of its links had users (it is then
        the last rows, what ``_component`` returns from its seed), none when the links of the
        flows just ended have no users left. Consumes the marks either way."""
        seed, dirty = self._seed, self._dirty_seen
        seed_alone, gone = self._seed_alone, self._gone_alone
        self._seed_alone, self._gone_alone = False, None
        self._alone = 0
        if len(dirty) != 1:
            return -1
        if seed and seed_alone and gone is None:
            self._seed = 0
            self._alone = seed
            return seed
        if not seed and gone is not None and dirty[0] is gone:
            return 0
        return -1
