"""A group of flows folded onto one representative per class of flows that share alike.

Issue 13, item 10 (``docs/performance.md``). NCCL's all-to-all is ``n (n - 1)`` point-to-point
flows (:mod:`sim.fabric.collectives.alltoall`): 4,032 for DeepSeek-V3's 64-GPU expert groups,
each crossing five or six links, and the fabric re-solves them at every start and end. Their
sharing is regular: every GPU's NVLink port carries the same number of its group's flows,
every rail NIC as many as every other, so max-min fairness gives whole classes of flows one
rate. Progressive filling (:func:`sim.fabric.maxmin.max_min_rates`) keeps them equal step by
step when the classes form an *equitable partition* of the flow-link incidence graph: flows of
one class have the same size, count and cap and meet the same number of links of each link
class; links of one class have the same capacity and carry the same number of incidences of
each flow class. Then every link of a class has the same users and capacity left at every
round, every flow of a class freezes at the same round, and the filling over one
representative per flow class and per link class, each representative incidence weighted by
the incidences it stands for on one link, takes the very same steps: the same rates, to the
last bit (Godsil and Royle, "Algebraic Graph Theory", 2001, sec. 9.3, equitable partitions;
the coarsest one is the stable colouring of one-dimensional Weisfeiler-Leman refinement,
Weisfeiler and Leman 1968, computed here by sorting, without hashing).

:class:`~sim.fabric.network.FlowNetwork` folds a group only while it is alone on its links (no
other flow shares any of them), so the partition of the group alone is the partition of its
component; anything that would make it share a link unfolds it first, into the rows and
incidences the unfolded group would hold at that moment (every member of a class has the
representative's bytes left, rate and cap), and it folds again once alone and still so
(:func:`sim.fabric.network_fold.refold_due`). Link rates and bytes, class totals and the
component searches it stands in for are computed from the members, in the order the
unfolded tables keep them, so every figure is the same to the last bit (the hypothesis test in
``tests/unit/fabric/test_network_fold.py`` compares whole runs with folding on and off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sim.fabric.maxmin import END_TOLERANCE_S

__all__ = ["FOLD_MIN_FLOWS", "FoldPlan", "FoldedGroup", "GroupStatics", "Subset", "fold_plan",
           "reach", "subset"]

FOLD_MIN_FLOWS = 256
"""Groups with fewer flows start unfolded: finding their classes costs more than it saves
(a 16-rank all-to-all has 240 flows; DeepSeek-V3's 64-rank one 4,032)."""
FOLD_MIN_RATIO = 1
"""Fold only when the group has at least this many flows per class."""
VECTOR_CLASSES = 32
"""Above this many classes a folded group's per-event scans run as numpy array operations
(below, a Python loop over the lists is quicker)."""


@dataclass(eq=False)
class FoldPlan:
    """The classes of a group's flows and links, and the folded incidences."""

    orbit: np.ndarray
    """Class of each flow (0 .. n_orbits - 1)."""
    n_orbits: int
    members: np.ndarray
    """Flows per class."""
    links: np.ndarray
    """Folded incidences: one link standing for each link class a flow class meets."""
    owner: np.ndarray
    """Flow class of each folded incidence."""
    weight: np.ndarray
    """Incidences of the class's flows on one link of that link class (a whole number)."""
    reach_cache: dict[tuple[bytes, bytes], np.ndarray | None] = field(default_factory=dict)
    subsets: dict[bytes, Subset] = field(default_factory=dict)
    """:func:`subset` by class mask."""
    statics: GroupStatics | None = None
    """The group the plan was made for (set by the network at its first start)."""
    rates_cache: dict[tuple[bytes, bytes], np.ndarray] = field(default_factory=dict)
    """Folded max-min rates by class mask and caps: a pure function of them (the links and
    capacities are the plan's), as ``FlowNetwork._alone_rates`` for unfolded groups."""


@dataclass(frozen=True, eq=False)
class Subset:
    """The members of some classes of a plan's group and what a solve or an end of them
    needs, in the order the unfolded tables hold them (remembered: the arrays are shared,
    never written)."""

    classes: np.ndarray
    """The classes, ascending."""
    members: np.ndarray
    """Mask over the group's flows."""
    n_members: int
    member_class: np.ndarray
    count: np.ndarray
    hops: np.ndarray
    """Class, copies and hops per link class of each member, in order."""
    links: np.ndarray
    """The members' incidences' links, in order."""
    inc_class: np.ndarray
    """Class of each of those incidences."""
    users: np.ndarray
    """Incidences per link (over every link of the fabric and the dead one)."""
    used: np.ndarray
    """The distinct links, ascending."""
    local: np.ndarray
    """Each incidence's link as its position in ``used``."""
    fold_links: np.ndarray
    fold_owner: np.ndarray
    fold_weight: np.ndarray
    """The folded incidences of the classes, owners numbered 0.. in ``classes``' order."""
    sums: dict[tuple[str, bytes], np.ndarray] = field(default_factory=dict)
    """Per-link and class sums of per-class values over the members, by the values (a pure
    function of them: :func:`sim.fabric.network_fold.link_sums`, ``class_sums``)."""


@dataclass(frozen=True, eq=False)
class GroupStatics:
    """A plan's group as the tables would hold it: the same at every start of it."""

    flat: np.ndarray
    owner: np.ndarray
    lengths: np.ndarray
    """Links of each member (its incidences)."""
    count: np.ndarray
    hops: np.ndarray
    rep: np.ndarray
    """First member of each class."""
    users: np.ndarray
    used: np.ndarray
    n_links: int
    """Links of the fabric plus the dead one."""
    alone: np.ndarray
    """Each flow's rate alone: its cap or its slowest link (what a tag's scale applies to)."""


def subset(plan: FoldPlan, group: GroupStatics, classes: np.ndarray) -> Subset:
    """The members of the classes in mask ``classes`` (remembered per plan)."""
    key = classes.tobytes()
    got = plan.subsets.get(key)
    if got is not None:
        return got
    members = classes[plan.orbit]
    inc = members[group.owner]
    links = group.flat[inc]
    cls = np.flatnonzero(classes)
    local = np.full(plan.n_orbits, -1, dtype=np.int64)
    local[cls] = np.arange(len(cls))
    sel = classes[plan.owner]
    used, local_link = np.unique(links, return_inverse=True)
    got = Subset(
        classes=cls, members=members, n_members=int(np.count_nonzero(members)),
        member_class=plan.orbit[members], count=group.count[members],
        hops=group.hops[members], links=links, inc_class=plan.orbit[group.owner[inc]],
        users=np.bincount(links, minlength=group.n_links), used=used, local=local_link,
        fold_links=plan.links[sel], fold_owner=local[plan.owner[sel]],
        fold_weight=plan.weight[sel])
    plan.subsets[key] = got
    return got


def _sorted_rows(entity: np.ndarray, value: np.ndarray, n: int, own: np.ndarray) -> np.ndarray:
    """Per entity, its own colour then its incidences' distinct values in ascending order, each
    with how often it occurs, padded with -1: two entities get equal rows exactly when colour
    and multiset agree.

    Run-length pairs, not one column per incidence: the row is as wide as the most distinct
    values an entity meets, not as its most incidences (a spine link under a 131,072-rank
    ring carries 262,005 incidences of a handful of flow classes; one column each made a
    32 GiB matrix).

    Examples
    --------
    Entity 0 meets values 5, 5, 7; entity 1 meets 7, 5, 5; entity 2 meets 5, 7, 7.

    >>> _sorted_rows(np.array([0, 0, 0, 1, 1, 1, 2, 2, 2]), np.array([5, 5, 7, 7, 5, 5, 5, 7, 7]),
    ...              3, np.zeros(3, dtype=np.int64)).tolist()
    [[0, 5, 2, 7, 1], [0, 5, 2, 7, 1], [0, 5, 1, 7, 2]]
    """
    order = np.lexsort((value, entity))
    ent, val = entity[order], value[order]
    first = np.ones(len(ent), dtype=bool)
    first[1:] = (ent[1:] != ent[:-1]) | (val[1:] != val[:-1])
    at = np.flatnonzero(first)
    times = np.diff(np.append(at, len(ent)))
    ent, val = ent[at], val[at]
    counts = np.bincount(ent, minlength=n)
    width = int(counts.max(initial=0))
    starts = np.cumsum(counts) - counts
    pos = np.arange(len(ent)) - starts[ent]
    rows = np.full((n, 2 * width + 1), -1, dtype=np.int64)
    rows[:, 0] = own
    rows[ent, 2 * pos + 1] = val
    rows[ent, 2 * pos + 2] = times
    return rows


def _relabel(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Number the distinct rows 0, 1, ... in their lexicographic order (``np.unique(rows,
    axis=0, return_inverse=True)``'s inverse, by a column sort, much faster on wide rows)."""
    n = len(rows)
    if not n:
        return np.zeros(0, dtype=np.int64), 0
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    labels = np.empty(n, dtype=np.int64)
    labels[order] = np.cumsum(new) - 1
    return labels, int(new.sum())


def fold_plan(flat_links: np.ndarray, lengths: np.ndarray, sizes: np.ndarray,
              counts: np.ndarray, caps: np.ndarray, capacity: np.ndarray) -> FoldPlan | None:
    """The coarsest equitable partition of a group's flows and links (module docstring), or
    None when it would not pay (fewer than :data:`FOLD_MIN_RATIO` flows per class).

    Examples
    --------
    Four flows, two on each of two 10 B/s links, all alike: one class, one link class, and
    each link carries two incidences of it.

    >>> p = fold_plan(np.array([0, 0, 1, 1]), np.ones(4, dtype=np.int64), np.ones(4),
    ...               np.ones(4), np.full(4, np.inf), np.array([10.0, 10.0]))
    >>> p.n_orbits, p.weight.tolist()
    (1, [2.0])
    """
    n = len(lengths)
    owner = np.repeat(np.arange(n), lengths)
    ids, inv = np.unique(flat_links, return_inverse=True)
    inv = inv.reshape(-1)
    n_links = len(ids)
    flow_c, n_fc = _relabel(np.column_stack([sizes, counts, caps]))
    link_c, n_lc = _relabel(capacity[ids].reshape(-1, 1))
    while True:
        new_f, new_nf = _relabel(_sorted_rows(owner, link_c[inv], n, flow_c))
        new_l, new_nl = _relabel(_sorted_rows(inv, new_f[owner], n_links, link_c))
        stable = new_nf == n_fc and new_nl == n_lc
        flow_c, n_fc, link_c, n_lc = new_f, new_nf, new_l, new_nl
        if stable:
            break
        if FOLD_MIN_RATIO * n_fc > n:
            return None
    if FOLD_MIN_RATIO * n_fc > n:
        return None
    # Incidences of each flow class on each link class, over the links of that class.
    pair = flow_c[owner] * n_lc + link_c[inv]
    pairs, per_pair = np.unique(pair, return_counts=True)
    links_per_class = np.bincount(link_c, minlength=n_lc)
    f_of, l_of = pairs // n_lc, pairs % n_lc
    weight = per_pair / links_per_class[l_of]
    first_link = np.full(n_lc, -1, dtype=np.int64)
    first_link[link_c[::-1]] = np.arange(n_links)[::-1]
    return FoldPlan(orbit=flow_c, n_orbits=n_fc,
                    members=np.bincount(flow_c, minlength=n_fc),
                    links=ids[first_link[l_of]], owner=f_of, weight=weight.astype(float))


def reach(plan: FoldPlan, flat_links: np.ndarray, owner: np.ndarray, live: np.ndarray,
          dirty: np.ndarray, scratch: np.ndarray) -> np.ndarray | None:
    """The flow classes whose live flows connect to the links of the ``dirty`` classes'
    flows through shared links (what :meth:`FlowNetwork._component` would find in the group
    alone), or None when that set is not a union of whole classes.

    ``live`` and ``dirty`` are boolean masks over classes; ``scratch`` a False mask over all
    links (left so). Remembered per plan.
    """
    key = (live.tobytes(), dirty.tobytes())
    cached = plan.reach_cache.get(key, False)
    if cached is not False:
        return cached   # type: ignore[return-value]
    member_class = plan.orbit[owner]
    live_inc = live[member_class]
    scratch[flat_links[dirty[member_class]]] = True
    n = len(plan.orbit)
    flows = np.zeros(n, dtype=bool)
    while True:
        hit = np.zeros(n, dtype=bool)
        hit[owner[live_inc & scratch[flat_links]]] = True
        new = hit & ~flows
        if not new.any():
            break
        flows |= new
        scratch[flat_links[new[owner]]] = True
    scratch[flat_links] = False
    inside = np.bincount(plan.orbit, weights=flows, minlength=plan.n_orbits)
    result: np.ndarray | None = inside > 0
    if not np.array_equal(inside[result], plan.members[result]):
        result = None
    plan.reach_cache[key] = result
    return result


@dataclass(eq=False)
class FoldedGroup:
    """A group running folded (:class:`~sim.fabric.network.FlowNetwork`): its plan, its
    members as the tables would hold them, and one row of state per class."""

    gid: int
    plan: FoldPlan
    statics: GroupStatics
    size: np.ndarray
    """Bytes of each member (the unfolded rows')."""
    # Per class: the state every member of it shares.
    csize: np.ndarray
    remaining: np.ndarray
    rate: np.ndarray
    cap: np.ndarray
    base_cap: np.ndarray
    cap0: np.ndarray
    live: np.ndarray
    """Classes whose flows have not ended."""

    quiet_from: float = 0.0
    quiet_for: float = -math.inf
    """From the network's clock ``quiet_from`` (its last advance when :meth:`next_end` ran),
    how long no class can end (:meth:`ends_now`'s quick answer; -inf: unknown)."""
    best_note: float = -math.inf
    """What :meth:`next_end` last returned, at ``quiet_from`` (-inf: unknown)."""

    def changed(self) -> None:
        """The group's rates or classes changed: forget what :meth:`next_end` noted."""
        self.quiet_for = self.best_note = -math.inf

    def ends_after(self, last: float, now: float) -> float:
        """A time before which, advanced from ``quiet_from`` to ``last`` and nothing else
        changed since :meth:`next_end` (else :meth:`changed` was called: -inf), no class of
        the group ends: its noted least time left less the time since, less a margin (``1e-9``
        of that time and of the clock, far above the rounding of the advances and of the
        clock's differences) that keeps it a lower bound of what :meth:`next_end` would give."""
        best = self.best_note
        return best - (last - self.quiet_from) - 1e-9 * (best + now + 1.0)

    def next_end(self, last: float, eps: float) -> tuple[float, bool]:
        """(the least time left among moving classes, inf when none moves; whether any
        moves), the same divisions as the tables'. Also notes, from ``last`` (the network's
        last advance), the time before which no class can end as :meth:`ends_now` decides it:
        the least ``(left - eps size) / rate`` over moving live classes (a class that does
        not move keeps its bytes left; one already within ``eps`` of none ends at once)."""
        if len(self.rate) > VECTOR_CLASSES:
            return self._next_end_vector(last, eps)
        best = quiet = math.inf
        moving = False
        for r, left, size, live in zip(self.rate.tolist(), self.remaining.tolist(),
                                       self.csize.tolist(), self.live.tolist(), strict=True):
            if r > 0:
                moving = True
                t = left / r
                if t < best:
                    best = t
                if live:
                    q = (left - eps * size) / r
                    if q < quiet:
                        quiet = q
            elif live and left <= eps * size:
                quiet = -math.inf
        self.quiet_from, self.quiet_for, self.best_note = last, quiet, best
        return best, moving

    def ends_now(self, eps: float, last: float) -> bool:
        """Does a class end now (the tables' test, ``FlowNetwork._finished_rows``)? The
        group's bytes left are advanced to ``last``.

        No, at once, while ``last`` is well inside the quiet time :meth:`next_end` noted
        (only advances have changed the group since: every change of its rates is followed
        by a schedule): a moving class then has more than ``eps`` of its size left by at
        least its rate times the margin, and more than ``END_TOLERANCE_S`` seconds to go.
        The margin (``1e-9`` of the quiet time, plus twice that tolerance) is far above the
        rounding of the advances' subtractions (``2^-53`` of the bytes left each)."""
        quiet = self.quiet_for
        if (quiet > 0 and last - self.quiet_from + 2 * END_TOLERANCE_S + 1e-9 * quiet
                < quiet):
            return False
        limit = END_TOLERANCE_S
        if len(self.rate) > VECTOR_CLASSES:
            rate, left, live = self.rate, self.remaining, self.live
            near = left <= eps * self.csize
            moving = rate > 0
            time_left = np.full(len(rate), np.inf)
            np.divide(left, rate, out=time_left, where=moving)
            return bool((live & (near | (moving & (time_left <= limit)))).any())
        for r, left, size, live in zip(self.rate.tolist(), self.remaining.tolist(),
                                       self.csize.tolist(), self.live.tolist(), strict=True):
            if live and (left <= eps * size or (r > 0 and left / r <= limit)):
                return True
        return False

    def _next_end_vector(self, last: float, eps: float) -> tuple[float, bool]:
        """:meth:`next_end` over many classes at once: the same divisions (numpy's are
        IEEE's, as Python's), the same exact minima, the same note."""
        rate, left, live = self.rate, self.remaining, self.live
        moving = rate > 0
        any_moving = bool(moving.any())
        best = quiet = math.inf
        if any_moving:
            best = float((left[moving] / rate[moving]).min())
            run = moving & live
            if run.any():
                quiet = float(((left[run] - eps * self.csize[run]) / rate[run]).min())
        if (live & ~moving & (left <= eps * self.csize)).any():
            quiet = -math.inf
        self.quiet_from, self.quiet_for, self.best_note = last, quiet, best
        return best, any_moving

    def ending(self, eps: float) -> np.ndarray:
        """Classes whose flows end now (mask)."""
        left = np.full(len(self.rate), np.inf)
        np.divide(self.remaining, self.rate, out=left, where=self.rate > 0)
        return self.live & ((self.remaining <= eps * self.csize)
                            | (left <= END_TOLERANCE_S))
