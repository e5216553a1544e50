"""FlowNetwork's folded groups: starting, solving, ending and unfolding them.

Functions of a :class:`sim.fabric.network.FlowNetwork` (its state passed explicitly), kept in
their own module beside the network's tables (``network.py``); :mod:`sim.fabric.fold` says
what a folded group is and why its figures are those of the unfolded one, bit for bit. The
rules here keep it so:

* a group folds at its start only when none of its links has a user and nothing else ends at
  that instant;
* it stays folded while every solve it takes part in is its own (its start, a cap scale of its
  tag alone, the end of some of its classes with nothing else ending); any other start on one
  of its links, any end at the same instant as another's, or an end whose component
  is not a union of whole classes unfolds it first into the rows and incidences the tables
  would hold, at the place they would hold them (groups keep their start order);
* what it adds to link and class rates is computed from its members in the tables' order;
* a group unfolded, or one that could fold but started beside other flows, folds again at
  an end on its links that leaves it alone there with its rows as a folded group holds them
  (whole classes, alike within each, at the rates a folded solve gives): ``refold_due``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import simpy

from sim.fabric.fold import (
    FOLD_MIN_FLOWS,
    FoldedGroup,
    FoldPlan,
    GroupStatics,
    Subset,
    fold_plan,
    reach,
    subset,
)
from sim.fabric.maxmin import _EPS, max_min_rates

if TYPE_CHECKING:
    from sim.fabric.network import FlowNetwork

__all__ = ["FOLD_MIN_FLOWS", "finishing_now", "folded_event", "note_unfolded", "refold_due",
           "scale_folded", "start_folded", "unfold"]

PLAN_CACHE = 128
"""Fold plans remembered per network (a group repeats on the same links thousands of times)."""


def start_folded(net: FlowNetwork, done: simpy.Event, flat_links: np.ndarray,
                 lengths: np.ndarray, sizes: np.ndarray, counts: np.ndarray, caps: np.ndarray,
                 tag: object, payload: float | None) -> bool:
    """Start a group folded when it may (module docstring): what ``start_group`` does, with
    its per-flow arrays taken from the plan (the same at every start of the group). False:
    nothing done that matters, start it as rows (noted in ``net._fold_later`` when it could
    fold but its links are in use: ``start_group`` notes it with :func:`note_unfolded`)."""
    net._fold_later = None
    n = len(lengths)
    if (n < FOLD_MIN_FLOWS
            or not ((sizes > 0) & (lengths > 0)).all()):
        return False
    plan = _plan_for(net, flat_links, lengths, sizes, counts, caps)
    if plan is None:
        return False
    statics = plan.statics
    if statics is None:
        owner = np.repeat(np.arange(n), lengths)
        _, rep = np.unique(plan.orbit, return_index=True)
        n_links = len(net._link_users)
        starts = lengths.cumsum() - lengths
        statics = plan.statics = GroupStatics(
            flat=flat_links.copy(), owner=owner, lengths=lengths.copy(), count=counts.copy(),
            hops=np.bincount(owner * net.n_kinds + net.kind[flat_links],
                             minlength=n * net.n_kinds).reshape(n, net.n_kinds),
            rep=rep, users=np.bincount(flat_links, minlength=n_links),
            used=np.unique(flat_links), n_links=n_links,
            alone=np.minimum(caps, np.minimum.reduceat(net.capacity[flat_links], starts)))
    net._advance()
    if finishing_now(net):
        net._fold_later = plan
        return False
    if net._folded:
        touched = net._fold_owner[statics.used]
        for g in np.unique(touched[touched >= 0]).tolist():
            unfold(net, net._folded[g])
    if net._link_users[statics.used].any():
        net._fold_later = plan
        return False
    # As start_group: a group number, its entry, its tag's scale on each flow's rate alone.
    gid = net._next_group
    net._next_group += 1
    delivered = float((sizes * counts).sum()) if payload is None else payload
    net._groups[gid] = [done, n, delivered, tag]
    if tag is not None:
        net._tag_groups.setdefault(tag, set()).add(gid)
    net._folded[gid] = _fresh_group(net, gid, plan, sizes, caps, tag)
    net._link_users += statics.users
    net._fold_owner[statics.used] = gid
    net._live += n
    net._live_folded += n
    net._fold_pending = gid
    net.folded_groups += 1
    net._resolve()
    return True


def _fresh_group(net: FlowNetwork, gid: int, plan: FoldPlan, sizes: np.ndarray,
                 caps: np.ndarray, tag: object) -> FoldedGroup:
    """The folded state of a group at its start: every class whole, its bytes all left, its
    cap its flows' (or its tag's scale on their rate alone)."""
    statics = plan.statics
    assert statics is not None
    rep = statics.rep
    alone = statics.alone[rep]
    cap = caps[rep]
    scale = net._tag_scale.get(tag) if tag is not None else None
    if scale is not None:
        cap = alone * scale
    return FoldedGroup(
        gid=gid, plan=plan, statics=statics, size=sizes, csize=sizes[rep],
        remaining=sizes[rep], rate=np.zeros(plan.n_orbits), cap=cap, base_cap=alone,
        cap0=caps[rep], live=np.ones(plan.n_orbits, dtype=bool))


def note_unfolded(net: FlowNetwork, gid: int, sizes: np.ndarray, caps: np.ndarray,
                  tag: object) -> None:
    """A group that could fold started as rows (its links in use, ``start_folded``): it may
    fold once alone (:func:`refold_due`), as an unfolded one may. Its rows are its flows in
    order (``start_folded`` takes only groups whose every flow has bytes and links)."""
    plan, net._fold_later = net._fold_later, None
    assert plan is not None
    _note_candidate(net, _fresh_group(net, gid, plan, sizes, caps, tag))


def _plan_for(net: FlowNetwork, flat_links: np.ndarray, lengths: np.ndarray, sizes: np.ndarray,
              counts: np.ndarray, caps: np.ndarray) -> FoldPlan | None:
    """The group's fold plan, made once per group and links: looked up by a fingerprint,
    then checked element by element (cheaper than hashing every byte at every start)."""
    arrays = (flat_links, lengths, sizes, counts, caps)
    # The very arrays of an earlier start, all read-only: the same content, no need to
    # compare.
    found, known = net._fold_plan_ids.lookup(arrays)
    if found:
        return known   # type: ignore[return-value]
    plan = _plan_by_content(net, arrays)
    net._fold_plan_ids.remember(arrays, plan)
    return plan


def _plan_by_content(net: FlowNetwork, arrays: tuple[np.ndarray, ...]) -> FoldPlan | None:
    flat_links, lengths, sizes, counts, caps = arrays
    key = (len(flat_links), len(lengths), flat_links[::61].tobytes(), float(sizes[0]),
           float(sizes[-1]), float(caps[0]), float(counts[0]))
    for seen, plan in net._fold_plans.get(key, ()):
        if all(np.array_equal(a, b) for a, b in zip(seen, arrays, strict=True)):
            return plan
    plan = fold_plan(flat_links, lengths, sizes, counts, caps, net.capacity)
    if sum(len(v) for v in net._fold_plans.values()) >= PLAN_CACHE:
        net._fold_plans.clear()
    net._fold_plans.setdefault(key, []).append(
        (tuple(a.copy() for a in arrays), plan))
    return plan


def finishing_now(net: FlowNetwork) -> bool:
    """Would ``FlowNetwork._resolve`` end any flow now (rows or folded classes)?"""
    if net._n and net._finished_rows().any():
        return True
    return any(g.ends_now(_EPS, net._last) for g in net._folded.values())


def scale_folded(net: FlowNetwork, gids: set[int], scale: float) -> bool:
    """A cap scale on a tag: done folded when its one live group is folded and nothing
    ends now (True); else the tag's folded groups unfold (False)."""
    folded = sorted(g for g in gids if g in net._folded)
    if not folded:
        return False
    if len(gids) == 1 and not finishing_now(net):
        group = net._folded[folded[0]]
        group.cap = group.cap0.copy() if scale >= 1.0 else group.base_cap * scale
        net._fold_pending = group.gid
        net._resolve()
        return True
    for g in folded:
        unfold(net, net._folded[g])
    return False

# ------------------------------------------------------------------ events
def next_end(net: FlowNetwork, dt: float, moving: bool) -> tuple[float, bool]:
    """``FlowNetwork._schedule``'s least time left and whether anything moves, given the
    rows' (``dt``, ``moving``), over the folded groups too. A group whose lower bound
    (:meth:`FoldedGroup.ends_after`) already exceeds the least time found cannot be the
    minimum (an exact one, whatever the order): it is skipped, its note kept (it moves when
    that bound is finite: a group moving at its note moves until it changes). The groups are
    taken by their bounds, least first, so the one likeliest to set the minimum goes first."""
    last, now = net._last, net.env.now
    groups = list(net._folded.values())
    if len(groups) > 1:
        bounds = [g.ends_after(last, now) for g in groups]
        order = sorted(range(len(groups)), key=bounds.__getitem__)
    else:
        bounds, order = [-math.inf], [0]
    for i in order:
        bound = bounds[i]
        if bound > dt:
            if bound != math.inf:
                moving = True
            continue
        g_dt, g_moving = groups[i].next_end(last, _EPS)
        if g_dt < dt:
            dt = g_dt
        moving = moving or g_moving
    return dt, moving


def folded_event(net: FlowNetwork) -> bool:
    """Handle this resolve folded, when it is one folded group's own (True); else unfold
    the folded groups it involves and leave it to the tables (False)."""
    pending, net._fold_pending = net._fold_pending, None
    if pending is not None:
        # start_folded and scale_folded made sure nothing else ends now.
        group = net._folded[pending]
        folded_solve(net, group, group.live.copy())
        return True
    ending = {gid: g.ending(_EPS) for gid, g in net._folded.items()
              if g.ends_now(_EPS, net._last)}
    if not ending:
        return False
    if (len(ending) == 1 and not net._dirty
            and not (net._n and net._finished_rows().any())):
        gid, fin = ending.popitem()
        group = net._folded[gid]
        comp = reach(group.plan, group.statics.flat, group.statics.owner, group.live & ~fin,
                     fin, net._link_mask)
        folded_retire(net, group, fin)
        if comp is not None:
            folded_solve(net, group, comp)
            return True
        if gid in net._folded:
            unfold(net, group)
        return False
    for gid in sorted(ending):
        unfold(net, net._folded[gid])
    return False

def folded_retire(net: FlowNetwork, group: FoldedGroup, fin: np.ndarray) -> None:
    """The classes ``fin`` end: what ``FlowNetwork._retire`` does for their members."""
    ended = subset(group.plan, group.statics, fin)
    k = ended.n_members
    gone_links = ended.links
    net._dirty.append(gone_links)
    users = net._link_users
    users -= ended.users
    net._gone_alone = gone_links if not users[ended.used].any() else None
    _add_link_rates(net, ended, -group.rate)
    net._class_rates -= class_sums(ended, group.rate)
    # The plain rows' credit (FlowNetwork._credit_residue) summed the same way, remembered by
    # the bytes left: a steady all-to-all ends each time with the same few bytes over.
    added = class_sums(ended, group.remaining)
    net.class_bytes += added
    net.observer.on_class_bytes(net.env.now, added)
    net.link_bytes[ended.used] += link_sums(ended, group.remaining)
    group.rate[fin] = 0.0
    group.remaining[fin] = np.inf
    group.live[fin] = False
    group.changed()
    net._live -= k
    net._live_folded -= k
    if not net._live:
        net._n = net._m = 0
        net._bind()
    if not group.live.any():
        del net._folded[group.gid]
        net._fold_owner[group.statics.used] = -1
    net._end_flows(group.gid, k)


def folded_solve(net: FlowNetwork, group: FoldedGroup, comp: np.ndarray) -> None:
    """What ``FlowNetwork._solve`` does when the component is the classes ``comp`` of
    ``group`` (every flow of them, nothing else)."""
    net.solves += 1
    net._dirty_seen, net._dirty = net._dirty, []
    net._seed = net._seed_inc = net._alone = 0
    net._seed_alone, net._gone_alone = False, None
    if not net._live:
        # As the tables' solve with nothing live: every rate back to zero.
        net._clear_link_rates()
        net._class_rates = np.zeros(net.n_kinds)
    elif comp.any():
        sub, rates = _folded_rates(net, group.plan, group.statics, comp, group.cap)
        new = group.rate.copy()
        new[sub.classes] = rates
        group.changed()
        if sub.n_members == net._live:
            # The tables' full solve: link and class rates summed afresh.
            group.rate = new
            net._clear_link_rates()
            _add_link_rates(net, sub, new)
            net._class_rates = class_sums(sub, new).copy()
        else:
            delta = new - group.rate
            group.rate = new
            _add_link_rates(net, sub, delta)
            net._class_rates += class_sums(sub, delta)
    net.observer.on_rates(net.env.now, net._class_rates, net._link_rates)


def _folded_rates(net: FlowNetwork, plan: FoldPlan, statics: GroupStatics, comp: np.ndarray,
                  cap: np.ndarray) -> tuple[Subset, np.ndarray]:
    """The classes ``comp`` (a mask) and their max-min rates alone on their links at the
    per-class caps ``cap``, one per class of the subset (remembered per plan)."""
    sub = subset(plan, statics, comp)
    caps = cap[sub.classes]
    key = (comp.tobytes(), caps.tobytes())
    rates = plan.rates_cache.get(key)
    if rates is None:
        if len(plan.rates_cache) >= 256:
            plan.rates_cache.clear()
        rates = max_min_rates(sub.fold_links, sub.fold_owner, len(sub.classes),
                              net.capacity, caps, (net._link_mask, net._link_pos),
                              weights=sub.fold_weight, quantum=net.rate_quantum)
        plan.rates_cache[key] = rates
    return sub, rates


def _add_link_rates(net: FlowNetwork, sub: Subset, values: np.ndarray) -> None:
    """``FlowNetwork._add_link_rates`` of the subset's incidences, each weighted by its
    class's entry of ``values`` (one per class of the plan): on a fabric that keeps no busy
    set, summed on the subset's own links (each link's sum in incidence order, as a
    ``bincount`` over every link sums it, then added to its rate: the same bits), the sums
    remembered by the values (:func:`link_sums`)."""
    if net._dense:
        net._link_rates[sub.used] += link_sums(sub, values)
    else:
        net._add_link_rates(sub.links, values[sub.inc_class])


_SUMS_CACHE = 64
"""Sums a subset remembers (:func:`link_sums`, :func:`class_sums`) before it starts afresh."""


def link_sums(sub: Subset, values: np.ndarray) -> np.ndarray:
    """Per link of ``sub.used``, the sum of ``values[class]`` over the subset's incidences on
    it, in incidence order (``np.bincount``'s). A pure function of the subset and the values
    of its classes: an all-to-all repeats every layer and micro-batch with the same rates, so
    its 25,000 incidences are summed once per distinct rates, not at every event."""
    key = ("l", values[sub.classes].tobytes())
    got = sub.sums.get(key)
    if got is None:
        if len(sub.sums) >= _SUMS_CACHE:
            sub.sums.clear()
        got = sub.sums[key] = np.bincount(sub.local, weights=values[sub.inc_class],
                                          minlength=len(sub.used))
    return got


def class_sums(sub: Subset, values: np.ndarray) -> np.ndarray:
    """Bytes/s per link class of the subset's members at ``values[class]`` each (counted
    ``count`` times on each of their hops), the product the tables make over the same rows in
    the same order; remembered by the values as :func:`link_sums`."""
    key = ("c", values[sub.classes].tobytes())
    got = sub.sums.get(key)
    if got is None:
        if len(sub.sums) >= _SUMS_CACHE:
            sub.sums.clear()
        got = sub.sums[key] = (values[sub.member_class] * sub.count) @ sub.hops
    return got


# ------------------------------------------------------------------ unfold
def unfold(net: FlowNetwork, group: FoldedGroup) -> None:
    """Put the group's live flows into the tables, where and as they would be."""
    del net._folded[group.gid]
    statics = group.statics
    net._fold_owner[statics.used] = -1
    live = subset(group.plan, statics, group.live)
    idx = np.flatnonzero(live.members)
    r = len(idx)
    net._live_folded -= r
    if net._n > net._live - net._live_folded - r:
        net._compact()
    n, m = net._n, net._m
    # Rows keep their groups' start order: the group goes before the first later one.
    pos = int(np.searchsorted(net._group, group.gid))
    inc_pos = int(np.searchsorted(net._inc_flow, pos))
    links = live.links
    k = len(links)
    if n + r > net._flows.shape[1] or m + k > net._inc.shape[1]:
        net._grow(n + r, m + k)
    flows, hops_t, group_t, inc_t = net._flows, net._hops_t, net._group_t, net._inc
    member_t = net._member_t
    flows[:, pos + r:n + r] = flows[:, pos:n].copy()
    hops_t[pos + r:n + r] = hops_t[pos:n].copy()
    group_t[pos + r:n + r] = group_t[pos:n].copy()
    member_t[pos + r:n + r] = member_t[pos:n].copy()
    inc_t[:, inc_pos + k:m + k] = inc_t[:, inc_pos:m].copy()
    inc_t[1, inc_pos + k:m + k] += r
    cls = live.member_class
    block = flows[:, pos:pos + r]
    block[0] = group.size[idx]
    block[1] = group.remaining[cls]
    block[2] = group.rate[cls]
    block[3] = group.cap[cls]
    block[4] = group.base_cap[cls]
    block[5] = group.cap0[cls]
    block[6] = live.count
    hops_t[pos:pos + r] = live.hops
    group_t[pos:pos + r] = group.gid
    member_t[pos:pos + r] = idx
    inc_t[0, inc_pos:inc_pos + k] = links
    local = np.cumsum(live.members) - 1
    inc_t[1, inc_pos:inc_pos + k] = local[statics.owner[live.members[statics.owner]]] + pos
    net._n, net._m = n + r, m + k
    net._bind()
    _note_candidate(net, group)


# ------------------------------------------------------------------ refold
def _note_candidate(net: FlowNetwork, group: FoldedGroup) -> None:
    """The group runs as rows and may fold once alone on its links (:func:`refold_due`):
    its links count it."""
    net._unfolded[group.gid] = group
    net._unfolded_on[group.statics.used] += 1


def refold_due(net: FlowNetwork) -> None:
    """After an end on the links of an unfolded group that could fold (one unfolded by the
    flows started beside it, or one started beside them): fold again each that is alone on
    its links with its rows what a folded group would hold. The end of the flows beside it
    leaves it so: a shared expert's TP collective beside Megatron's expert all-to-all, every
    layer and micro-batch."""
    net._refold_due = False
    # Ended groups first (their flows all gone), so that they count on no link below.
    for gid in [g for g in net._unfolded if g not in net._groups]:
        _forget(net, net._unfolded[gid])
    on = net._unfolded_on
    for gid in sorted(net._unfolded):
        group = net._unfolded[gid]
        # A link under another such group's rows: not alone, no pass over the rows needed.
        if not (on[group.statics.used] > 1).any():
            _refold(net, group)


def _forget(net: FlowNetwork, group: FoldedGroup) -> None:
    """No longer a candidate to fold again (ended, or folded again)."""
    del net._unfolded[group.gid]
    net._unfolded_on[group.statics.used] -= 1


def _refold(net: FlowNetwork, group: FoldedGroup) -> None:
    """Fold the group's rows again when that moves no bit: no other flow on its links
    (the same partition then holds its component), its live flows whole classes of its
    plan, every member of a class with the class's bytes left, rate and caps, and those
    rates the ones a folded solve gives (the rows' may come from a solve that took other
    flows too, different in the last bits: then it waits for its next end). The folded group
    adds to the link and class totals exactly what its rows did, so they stay as they are."""
    rows = np.flatnonzero(net._group == group.gid)   # its live flows (refold_due: some)
    plan, statics = group.plan, group.statics
    members = net._member[rows]
    if int(net._link_users[statics.used].sum()) != int(statics.lengths[members].sum()):
        return
    cls = plan.orbit[members]
    per_class = np.bincount(cls, minlength=plan.n_orbits)
    live = per_class > 0
    if not np.array_equal(per_class[live], plan.members[live]):
        return
    state = net._flows[1:6, rows]   # bytes left, rate, cap, base cap, first cap
    per = np.zeros((5, plan.n_orbits))
    per[:, cls] = state
    if not np.array_equal(per[:, cls], state):
        return
    cap = group.cap.copy()
    cap[live] = per[2, live]
    sub, rates = _folded_rates(net, plan, statics, live, cap)
    if not np.array_equal(rates, per[1, sub.classes]):
        return
    remaining = np.full(plan.n_orbits, np.inf)
    rate = np.zeros(plan.n_orbits)
    base_cap, cap0 = group.base_cap.copy(), group.cap0.copy()
    remaining[live], rate[live], base_cap[live], cap0[live] = per[0, live], per[1, live], \
        per[3, live], per[4, live]
    _forget(net, group)
    net._folded[group.gid] = FoldedGroup(
        gid=group.gid, plan=plan, statics=statics, size=group.size, csize=group.csize,
        remaining=remaining, rate=rate, cap=cap, base_cap=base_cap, cap0=cap0, live=live)
    net._fold_owner[statics.used] = group.gid
    net._live_folded += len(rows)
    net.refolds += 1
    # Its rows go as ended rows go (FlowNetwork._retire), with nothing credited or
    # subtracted: the flows run on, folded.
    dead = np.zeros(net._n, dtype=bool)
    dead[rows] = True
    net._bury_rows(dead, dead[net._inc_flow])
    net._drop_dead_rows()
