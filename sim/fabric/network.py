"""Flow-level network: max-min fair sharing of link capacity among active flows, on simpy.

Every active flow crosses a fixed list of links. Whenever flows start or end, the rates of
all active flows are recomputed by progressive filling (water-filling): all unfrozen flows
grow at the same rate until a link saturates or a flow reaches its own cap; the flows through
that link freeze; repeat. This is the bandwidth-sharing model of SimGrid's LMM solver without
weights (Casanova et al., "Versatile, Scalable, and Accurate Simulation of Distributed
Applications and Platforms", JPDC 2014; Bertsekas and Gallager, "Data Networks", sec. 6.5.2).
Ends that leave only slower flows change no rate (max-min fairness; ``_slower_than``), so
those keep the rates held instead of solving.

Flows start in groups (all the flows of one collective, or one transfer); a group's event
fires when its last flow has delivered its bytes. A flow may stand for ``count`` identical
flows on disjoint copies of its path (a folded rank's traffic): it shares its own links as
one flow, and its bytes count ``count`` times.

State is kept as arrays (one row per active flow, one entry per flow-link incidence) so that
a 1,024-GPU ring's thousands of flows cost a few numpy operations per event; on a large
fabric an event costs the links it touches and the links now busy, not every link, and the
solver renumbers the links in use (same sums in the same order: the same bits). The next
completion is scheduled as a simpy timeout; a wake-up made stale by a later change is
ignored (each carries the solver's version number).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import simpy

from sim.fabric import network_fast as fast
from sim.fabric import network_fold as fold_ops
from sim.fabric.fold import FoldedGroup, FoldPlan
from sim.fabric.maxmin import _EPS, END_TOLERANCE_S, max_min_rates, rate_quantum
from sim.fabric.network_tables import FlowTables

__all__ = ["FlowNetwork", "NetworkObserver", "max_min_rates"]

# Fabrics with more links than this update link rates on the touched links only (measured
# crossover of a per-link pass against renumbering the touched links, numpy 2, one core).
_SPARSE_LINKS = 20_000


class NetworkObserver:
    """Hook surface for the recorder; the network calls these, measurement stays outside.

    Subclass and override what you need.
    """

    def on_rates(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray) -> None:
        """After every rate solve: bytes/s now flowing per link class (every hop and every
        folded copy counted) and per link (representative flows)."""

    def on_rates_changed(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray,
                         changed: np.ndarray) -> None:
        """:meth:`on_rates`, naming the links (``changed``, ascending) whose rates may differ
        from the last report's (a replay, :mod:`sim.engine.splice`, knows). Default: that."""
        self.on_rates(t, class_rates, link_rates)

    def on_transfer_end(self, t: float, tag: object, nbytes: float) -> None:
        """A group of flows has delivered all its ``nbytes`` (copies counted)."""

    def on_class_bytes(self, t: float, added: np.ndarray) -> None:
        """``added`` (bytes per link class; read it, never write it) has just been added to
        :attr:`FlowNetwork.class_bytes`: every change of the totals, in order, so that a
        replay (:mod:`sim.engine.splice`) can sum them again to the same bits."""


class FlowNetwork(FlowTables):
    """Max-min fair flows over links with capacities.

    A large group whose flows share links alike runs folded, one flow per class, while it is
    alone on its links (:mod:`sim.fabric.fold`, :mod:`sim.fabric.network_fold`): the same
    figures, to the last bit, for a fraction of the work.

    Parameters
    ----------
    env : simpy.Environment
    capacity : array of bytes/s per link
    kind : array of link-class codes per link (small non-negative ints)
    n_kinds : number of link classes
    observer : optional :class:`NetworkObserver`

    Examples
    --------
    Two flows on one 100 B/s link each get half, so 100 bytes each take 2 s:

    >>> env = simpy.Environment()
    >>> net = FlowNetwork(env, np.array([100.0]), np.array([0]), 1)
    >>> a = net.start_flow((0,), 100.0); b = net.start_flow((0,), 100.0)
    >>> env.run(); env.now
    2.0
    """

    def __init__(self, env: simpy.Environment, capacity: np.ndarray, kind: np.ndarray,
                 n_kinds: int, observer: NetworkObserver | None = None) -> None:
        self.env = env
        self.capacity = np.asarray(capacity, dtype=float)
        # The rate grid's step for these capacities, found once (not a pass over every link
        # at every solve).
        self.rate_quantum = rate_quantum(self.capacity)
        self.kind = np.asarray(kind, dtype=np.int64)
        self.n_kinds = n_kinds
        self.observer = observer or NetworkObserver()
        n_links = len(self.capacity)
        self.class_bytes = np.zeros(n_kinds)
        self.link_bytes = np.zeros(n_links)
        self.solves = 0
        self._last = env.now
        self._version = 0
        self._init_tables(n_links, n_kinds)
        # Per group: [event, flows pending, bytes, tag].
        self._groups: dict[int, list] = {}
        # Rate-cap scales set by tag (:meth:`scale_caps`) and the live groups of each tag.
        self._tag_scale: dict[object, float] = {}
        self._tag_groups: dict[object, set[int]] = {}
        self._next_group = 0
        self._class_rates = np.zeros(n_kinds)
        self._link_rates = np.zeros(n_links)
        # Every link whose rate is not zero (and some idle ones, see _add_link_rates), as
        # indices and as a mask: only they add bytes as time passes, so an event costs the
        # busy links, not every link of a 16k-GPU fabric.
        self._busy = np.zeros(0, dtype=np.int64)
        self._busy_mask = np.zeros(n_links, dtype=bool)
        self._busy_limit = fast.BUSY_SLACK
        # Below _SPARSE_LINKS links a pass over every link costs less than keeping that set
        # (measured on 10,560 links: the busy set's two passes per rate update against one
        # more per advance), and the busy set stays empty.
        self._dense = n_links <= _SPARSE_LINKS
        # Scratch mask over links for the component search and the renumbering, all False
        # between calls, and a scratch position per link (any values between calls).
        self._link_mask = np.zeros(n_links + 1, dtype=bool)
        self._link_pos = np.empty(n_links, dtype=np.intp)
        # Link lists' renumbering and groups' per-flow statics, remembered by content
        # (sim.fabric.network_fast).
        self._link_sets = fast.LinkSets((self._link_mask, self._link_pos))
        self._shapes = fast.GroupShapes(self.capacity, self.kind, n_kinds)
        # Links touched by flows started or ended since the last solve: only the flows
        # connected to them (through shared links) need new rates.
        self._dirty: list[np.ndarray] = []
        # Flows just started (the last rows, with the last incidences) whose links are all
        # dirty: the component search starts from them (see _component), and says in
        # _alone how many they were when it found no other flow on their links.
        self._seed = self._seed_inc = self._alone = 0
        # Live incidences per link (the last entry, the dead link, counts nothing useful):
        # a group started on links nobody uses, or a group ended leaving its links empty,
        # needs no component search (what it would find is known: the group, or nothing).
        self._link_users = np.zeros(n_links + 1, dtype=np.int64)
        self._seed_alone = False
        self._gone_alone: np.ndarray | None = None
        # The rates of a group alone on its links, by its links, owners and caps: the same
        # collective of a rank class repeats thousands of times on the same links, and
        # max_min_rates is a pure function of these and the (fixed) capacities.
        self._alone_rates: dict[tuple[bytes, bytes, bytes], np.ndarray] = {}
        # Folded groups (sim.fabric.fold, sim.fabric.network_fold): by group, the flows they
        # stand for, the one pending a folded solve, the folded group on each link (-1: none;
        # the dead link past the last, none) and the fold plans by group and links.
        self._folded: dict[int, FoldedGroup] = {}
        self._live_folded = 0
        self._fold_pending: int | None = None
        self._fold_owner = np.full(n_links + 1, -1, dtype=np.int64)
        self._fold_plans: dict[tuple, list[tuple[tuple[np.ndarray, ...], FoldPlan | None]]] = {}
        self._fold_plan_ids = fast.ReadOnlyMemo(4 * fold_ops.PLAN_CACHE)
        self.folded_groups = 0
        # Groups unfolded or started as rows that could fold, how many are on each link, and
        # whether one of those links saw an end since the last check: each may fold again
        # (network_fold.refold_due).
        self._unfolded: dict[int, FoldedGroup] = {}
        self._unfolded_on = np.zeros(n_links + 1, dtype=np.int64)
        self._fold_later: FoldPlan | None = None
        self._refold_due = False
        self.refolds = 0

    # ------------------------------------------------------------------ API
    @property
    def active_flows(self) -> int:
        return self._live

    @property
    def link_load(self) -> np.ndarray:
        """Bytes/s now carried by each link (representative flows, not multiplied)."""
        return self._link_rates.copy()

    def scale_caps(self, tag: object, scale: float) -> None:
        """Cap every flow of the groups started with ``tag`` (now and later) at ``scale``
        times its rate alone (its own cap or its slowest link's capacity); 1 lifts it.

        Only the flows sharing links with those groups get new rates (the incremental solve):
        a collective slowed by what runs beside it on its GPUs (:mod:`sim.engine.hbm_share`).
        ``scale`` is clipped to (0, 1]: a scale never raises a flow above its links, and a
        flow always progresses.
        """
        if tag is None:
            return
        scale = min(1.0, max(1e-6, float(scale)))
        if scale >= 1.0:
            if self._tag_scale.pop(tag, None) is None:
                return
        else:
            if self._tag_scale.get(tag) == scale:
                return
            self._tag_scale[tag] = scale
        gids = self._tag_groups.get(tag)
        if not gids:
            return
        self._advance()
        if self._folded and fold_ops.scale_folded(self, gids, scale):
            return
        flows = np.isin(self._group, np.fromiter(gids, dtype=np.int64, count=len(gids)))
        # base <= the flow's own cap, so base * scale is the tighter one; unscaled flows get
        # their own cap back exactly (no rounding moves an unthrottled run).
        self._cap[flows] = (self._cap0[flows] if scale >= 1.0
                            else self._base_cap[flows] * scale)
        self._dirty.append(self._inc_link[flows[self._inc_flow]])
        self._resolve()

    def start_flow(self, links: Sequence[int], nbytes: float, count: int = 1,
                   cap: float = math.inf, tag: object = None) -> simpy.Event:
        """Start one flow of ``nbytes`` over ``links``; the event fires when it ends."""
        return self.start_flows([(links, nbytes, count, cap)], tag)

    def start_flows(self, specs: Sequence[tuple[Sequence[int], float, int, float]],
                    tag: object = None) -> simpy.Event:
        """Start a group of flows, (links, bytes, count, cap) each, with one rate solve; the
        returned event fires when the last of them ends."""
        lengths = np.fromiter((len(s[0]) for s in specs), dtype=np.int64, count=len(specs))
        flat = np.fromiter((x for s in specs for x in s[0]), dtype=np.int64,
                           count=int(lengths.sum()))
        return self.start_group(flat, lengths,
                                np.array([s[1] for s in specs], dtype=float),
                                np.array([s[2] for s in specs], dtype=float),
                                np.array([s[3] for s in specs], dtype=float), tag)

    def start_group(self, flat_links: np.ndarray, lengths: np.ndarray, sizes: np.ndarray,
                    counts: np.ndarray, caps: np.ndarray, tag: object = None,
                    payload: float | None = None) -> simpy.Event:
        """Array form of :meth:`start_flows`: ``flat_links`` holds every flow's links in turn,
        ``lengths`` how many belong to each flow. ``payload``: the data bytes the group
        delivers, reported at its end (default: the bytes it puts on the links)."""
        done = self.env.event()
        if fold_ops.start_folded(self, done, flat_links, lengths, sizes, counts, caps, tag,
                                 payload):
            return done
        keep = (sizes > 0) & (lengths > 0)
        if np.count_nonzero(keep) < len(keep):
            if not keep.any():
                done.succeed()
                return done
            owner = np.repeat(np.arange(len(lengths)), lengths)
            flat_links = flat_links[keep[owner]]
            lengths, sizes, counts, caps = lengths[keep], sizes[keep], counts[keep], caps[keep]
        self._advance()
        n_new = len(lengths)
        gid = self._next_group
        self._next_group += 1
        delivered = float((sizes * counts).sum()) if payload is None else payload
        self._groups[gid] = [done, n_new, delivered, tag]
        # Each flow's rate alone: its own cap or its slowest link, what a scale applies to.
        slowest, owner, hops, distinct = self._shapes.get(flat_links, lengths)
        alone = np.minimum(caps, slowest)
        caps0 = caps
        if tag is not None:
            self._tag_groups.setdefault(tag, set()).add(gid)
            scale = self._tag_scale.get(tag)
            if scale is not None:
                caps = alone * scale
        if self._folded:
            touched = self._fold_owner[flat_links]
            for g in np.unique(touched[touched >= 0]).tolist():
                fold_ops.unfold(self, self._folded[g])
        base, m = self._n, self._m
        end, m_end = base + n_new, m + len(flat_links)
        if end > self._flows.shape[1] or m_end > self._inc.shape[1]:
            self._grow(end, m_end)
        block = self._flows[:, base:end]
        block[0] = sizes          # _size
        block[1] = sizes          # _remaining
        block[2] = 0.0            # _rate
        block[3] = caps           # _cap
        block[4] = alone          # _base_cap
        block[5] = caps0          # _cap0
        block[6] = counts         # _count
        self._group_t[base:end] = gid
        self._hops_t[base:end] = hops
        self._inc[0, m:m_end] = flat_links
        self._inc[1, m:m_end] = owner + base
        self._n, self._m = end, m_end
        self._live += n_new
        self._bind()
        if self._fold_later is not None:
            # Which of its flows each row is: read only to fold it again (refold_due).
            self._member_t[base:end] = np.arange(n_new)
            fold_ops.note_unfolded(self, gid, sizes, caps0, tag)
        users = self._link_users
        self._seed_alone = not np.count_nonzero(users[flat_links])
        if distinct:
            users[flat_links] += 1   # no link repeats: as np.add.at, one call less costly
        else:
            np.add.at(users, flat_links, 1)
        self._dirty.append(flat_links)
        self._seed, self._seed_inc = n_new, len(flat_links)
        self._resolve()
        return done

    # ------------------------------------------------------------------ internals
    def _advance(self) -> None:
        """Move every flow forward to now at its current rate and count the bytes."""
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self._live:
            self._remaining -= self._rate * dt
            added = self._class_rates * dt
            self.class_bytes += added
            self.observer.on_class_bytes(now, added)
            # Idle links add 0 * dt = 0.0, so adding them or leaving them out moves no bit.
            if self._dense:
                self.link_bytes += self._link_rates * dt
            else:
                busy = self._busy
                self.link_bytes[busy] += self._link_rates[busy] * dt
            for group in self._folded.values():
                group.remaining -= group.rate * dt
        self._last = now

    def _resolve(self) -> None:
        # Retire finished flows, solve rates for the rest, schedule the next completion.
        folded = len(self._folded)
        if folded and fold_ops.folded_event(self):
            self._schedule()
            return
        if self._n:
            # Nothing but ends (no start, no cap change, no group unfolded just now).
            only_ends = not self._dirty and len(self._folded) == folded
            finished = self._ended()
            if finished is not None:
                slowest = float(self._rate[finished].min()) if only_ends else 0.0
                self._retire(finished)
                if only_ends and self._slower_than(slowest):
                    self._keep_rates()
                    self._refold_and_schedule()
                    return
        self._solve()
        self._refold_and_schedule()

    def _refold_and_schedule(self) -> None:
        if self._refold_due:
            fold_ops.refold_due(self)
        self._schedule()

    def _slower_than(self, rate: float) -> bool:
        """Is every live flow's rate below ``rate`` (the slowest of the flows that just
        ended)? Then the ends change no rate, and the rates held are the answer.

        Max-min fairness: progressive filling (:func:`max_min_rates`) up to the level
        ``rate`` is the same with or without the ended flows, since each of their links
        saturates at that level or later with them (else they would have frozen below it)
        and later still without them; every flow that froze below ``rate`` freezes again at
        the same level, in the same steps (each round's step is the least share over links
        that keep theirs), and only a flow at ``rate`` or above might rise. So a solve of the
        component gives the rates held, to the bit when they came from a solve of that
        component; when they came from a solve that also took other, independent flows
        (their levels interleaved), the two differ in the last bits of the rate grid, as
        solves of different flow sets always may. Folded classes count as flows, so a run
        decides alike folded or not. Two zones in round robin end thousands of fast in-zone
        flows beside slow zone-crossing ones (``docs/performance.md`` item 16)."""
        if not rate > 0.0 or float(self._rate[:self._n].max(initial=0.0)) >= rate:
            return False
        return all(not g.live.any() or float(g.rate[g.live].max()) < rate
                   for g in self._folded.values())

    def _keep_rates(self) -> None:
        """What :meth:`_solve` leaves when its answer is the rates already held (the ends'
        rates are off the link and class totals, ``_retire``): the marks consumed, the rates
        reported. It counts as a solve (the summary's events count rate changes)."""
        self.solves += 1
        self._dirty = []
        self._seed = self._seed_inc = self._alone = 0
        self._seed_alone, self._gone_alone = False, None
        self.observer.on_rates(self.env.now, self._class_rates, self._link_rates)

    def _ended(self) -> np.ndarray | None:
        """:meth:`_finished_rows`, None when no row ends (a Python loop on small tables,
        :mod:`sim.fabric.network_fast`)."""
        n = self._n
        if n <= fast.SMALL_ROWS:
            rows = fast.ended_rows(self._remaining.tolist(), self._rate.tolist(),
                                   self._size.tolist())
            if not rows:
                return None
            finished = np.zeros(n, dtype=bool)
            finished[rows] = True
            return finished
        finished = self._finished_rows()
        return finished if np.count_nonzero(finished) else None

    def _finished_rows(self) -> np.ndarray:
        """The rows whose flows end now: bytes left within rounding of none, or time left
        within rounding of now. Time left where a flow moves (no errstate context: it costs
        more than the division on the engine's hot path); a dead row has rate 0 and infinite
        bytes left: never finished, never the next to finish."""
        left = np.full(self._n, np.inf)
        np.divide(self._remaining, self._rate, out=left, where=self._rate > 0)
        return (self._remaining <= _EPS * self._size) | (left <= END_TOLERANCE_S)

    def _schedule(self) -> None:
        self._version += 1
        if not self._live:
            return
        # The next completion: the least time left among moving flows (the same divisions
        # and an exact minimum, whether or not the others stand in as inf).
        if self._n <= fast.SMALL_ROWS_NEXT:
            dt, moving = fast.next_end(self._remaining.tolist(), self._rate.tolist())
        else:
            positive = self._rate > 0
            left = np.full(self._n, np.inf)
            np.divide(self._remaining, self._rate, out=left, where=positive)
            dt = float(left.min(initial=math.inf))
            moving = bool(np.count_nonzero(positive))
        if self._folded:
            dt, moving = fold_ops.next_end(self, dt, moving)
        if dt == math.inf and not moving:
            raise RuntimeError("flows are active but none can progress (zero capacity?)")
        version = self._version
        timeout = self.env.timeout(max(dt, 0.0))
        timeout.callbacks.append(lambda _ev: self._wake(version))

    def _retire(self, finished: np.ndarray) -> None:
        ended = self._group[finished]
        if len(ended) > 64:
            gids, n = np.unique(ended, return_counts=True)
            tally = dict(zip(gids.tolist(), n.tolist(), strict=True))
        else:
            # A few flows end at once (usually one group): count them without np.unique's
            # sort machinery; groups end below in ascending order all the same.
            tally = {}
            for g in ended.tolist():
                tally[g] = tally.get(g, 0) + 1
        gone = finished[self._inc_flow]
        gone_links = self._inc_link[gone]
        self._dirty.append(gone_links)
        if self._unfolded and not self._refold_due:
            self._refold_due = bool(self._unfolded_on[gone_links].any())
        users = self._link_users
        links = self._link_sets.get(gone_links)
        if links[2]:
            users[gone_links] -= 1   # no link repeats: as np.subtract.at
        else:
            np.subtract.at(users, gone_links, 1)
        self._gone_alone = None if np.count_nonzero(users[links[0]]) else gone_links
        # Their rates leave the link and class totals (finished flows ran until now).
        self._add_link_rates(gone_links, -self._rate[self._inc_flow[gone]], links)
        self._credit_residue(self._remaining[finished], self._count[finished],
                             self._hops[finished], gone_links, links,
                             self._remaining[self._inc_flow[gone]])
        self._class_rates -= (self._rate[finished] * self._count[finished]) @ \
            self._hops[finished]
        self._bury_rows(finished, gone)
        self._live -= len(ended)
        self._drop_dead_rows()
        for gid in sorted(tally):
            self._end_flows(gid, tally[gid])

    def _credit_residue(self, left: np.ndarray, count: np.ndarray, hops: np.ndarray,
                        links: np.ndarray, link_set: tuple[np.ndarray, np.ndarray, bool],
                        left_per_link: np.ndarray) -> None:
        """Count ending flows as delivering exactly their size: the bytes ``left`` each (one
        per flow; negative where it ran past its last byte) go onto the class totals
        (``count`` times on each of its ``hops``) and ``left_per_link`` (one per incidence)
        onto its link of ``links`` (``link_set``: ``LinkSets.get`` of them), each link's
        sum in incidence order before it is added, as ``network_fold.folded_retire`` sums a
        folded group's (the same bits). A flow ends at an event on the engine's time grid
        (:mod:`sim.engine.time_grid`), up to a quantum after its last byte, or within rounding
        before it."""
        added = (left * count) @ hops
        self.class_bytes += added
        self.observer.on_class_bytes(self.env.now, added)
        ids, inv, distinct = link_set
        if distinct:
            self.link_bytes[links] += left_per_link
        else:
            self.link_bytes[ids] += np.bincount(inv, weights=left_per_link, minlength=len(ids))

    def _end_flows(self, gid: int, k: int) -> None:
        """``k`` flows of group ``gid`` have ended; the last one ends the group."""
        entry = self._groups[gid]
        entry[1] -= k
        if entry[1] == 0:
            del self._groups[gid]
            live = self._tag_groups.get(entry[3])
            if live is not None:
                live.discard(gid)
                if not live:
                    del self._tag_groups[entry[3]]
            self.observer.on_transfer_end(self.env.now, entry[3], entry[2])
            entry[0].succeed()

    def _wake(self, version: int) -> None:
        if version != self._version:
            return  # a later start/finish already re-solved and rescheduled
        self._advance()
        self._resolve()

    def _add_link_rates(self, links: np.ndarray, weights: np.ndarray,
                        link_set: tuple[np.ndarray, np.ndarray, bool] | None = None) -> None:
        """Add ``weights`` (one per incidence) to the rates of their links and keep the busy
        set (:func:`sim.fabric.network_fast.add_link_rates`; ``link_set``:
        ``LinkSets.get(links)`` when the caller has it)."""
        fast.add_link_rates(self, links, weights, link_set)

    def _alone_solve(self, links: np.ndarray, owner: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """:func:`max_min_rates` of a group alone on its links, remembered (see
        ``_alone_rates``; a copy, as the caller keeps what it gets)."""
        caps = self._cap[idx]
        key = (links.tobytes(), owner.tobytes(), caps.tobytes())
        rates = self._alone_rates.get(key)
        if rates is None:
            if len(self._alone_rates) >= 4096:
                self._alone_rates.clear()
            rates = max_min_rates(links, owner, len(idx), self.capacity, caps,
                                  (self._link_mask, self._link_pos),
                                  quantum=self.rate_quantum)
            self._alone_rates[key] = rates
        return rates.copy()

    def _clear_link_rates(self) -> None:
        """Every link's rate back to zero and the busy set emptied (a solve's sums afresh)."""
        self._link_rates = np.zeros(len(self.capacity))
        self._busy_mask[self._busy] = False
        self._busy = np.zeros(0, dtype=np.int64)

    def _solve(self) -> None:
        self.solves += 1
        # Links to mark in the component search (any integer array will do).
        self._dirty_seen = self._dirty
        dirty = (self._dirty[0] if len(self._dirty) == 1 else
                 np.concatenate(self._dirty) if self._dirty else np.zeros(0, dtype=np.int64))
        self._dirty = []
        if not self._live:
            self._seed = 0
            self._seed_alone, self._gone_alone = False, None
            self._clear_link_rates()
            self._class_rates = np.zeros(self.n_kinds)
        else:
            # Flows not connected to a changed link keep their rates: they share no link with
            # any flow whose rate can change, so max-min gives them the same answer.
            n_comp = self._known_component()
            if n_comp < 0:
                comp = self._component(dirty)
                n_comp = self._alone or int(np.count_nonzero(comp))
            if n_comp == self._live == self._n:
                # A full solve on tables without dead rows. No periodic recount: the running
                # totals are exact sums (rates on the grid of sim.fabric.maxmin.RATE_GRID_BITS)
                # and cannot drift, and what the network does stays a function of its state,
                # not of a solve count.
                n = self._n
                if self._alone == self._live:
                    # The started group alone on its links is all there is: its rows and
                    # incidences are the tables', as the incremental shortcut below keys them.
                    self._rate[:] = self._alone_solve(self._inc_link, self._inc_flow,
                                                      np.arange(n))
                else:
                    self._rate[:] = max_min_rates(self._inc_link, self._inc_flow, n,
                                                  self.capacity, self._cap,
                                                  (self._link_mask, self._link_pos),
                                                  quantum=self.rate_quantum)
                self._clear_link_rates()
                self._add_link_rates(self._inc_link, self._rate[self._inc_flow])
                self._class_rates = (self._rate * self._count) @ self._hops
            elif n_comp:
                # The component's rows and incidences, picked out in order. With every live
                # flow in it (dead rows left in the tables: compaction waits in _retire until
                # they outnumber the live ones) these are the arrays compaction would leave,
                # not copied at every end of thousands of flows sharing a link (two zones'
                # all-to-alls on the zone link).
                if self._alone:
                    # Just the group started (the last rows and incidences, in order): the
                    # same arrays as below, without masking every flow and incidence.
                    base, first = self._n - n_comp, self._m - self._seed_inc
                    idx = np.arange(base, self._n)
                    links = self._inc_link[first:]
                    owner = self._inc_flow[first:] - base
                else:
                    sel = comp[self._inc_flow]
                    idx = np.flatnonzero(comp)
                    local = np.full(self._n, -1, dtype=np.int64)
                    local[idx] = np.arange(len(idx))
                    owner = local[self._inc_flow[sel]]
                    links = self._inc_link[sel]
                rates = self._alone_solve(links, owner, idx) if self._alone else \
                    max_min_rates(links, owner, len(idx), self.capacity, self._cap[idx],
                                  (self._link_mask, self._link_pos), quantum=self.rate_quantum)
                if n_comp == self._live:
                    # Every live flow: link and class rates summed afresh, as above.
                    self._rate[idx] = rates
                    self._clear_link_rates()
                    self._add_link_rates(links, rates[owner])
                    self._class_rates = (rates * self._count[idx]) @ self._hops[idx]
                else:
                    delta = rates - self._rate[idx]
                    self._rate[idx] = rates
                    self._add_link_rates(links, delta[owner])
                    self._class_rates += (delta * self._count[idx]) @ self._hops[idx]
        self.observer.on_rates(self.env.now, self._class_rates, self._link_rates)
