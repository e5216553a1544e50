"""Max-min fair rates of flows over links with capacities, by progressive filling.

All unfrozen flows grow at the same rate until a link saturates or a flow reaches its own
cap; the flows through that link freeze; repeat (Bertsekas and Gallager, "Data Networks",
sec. 6.5.2; SimGrid's LMM solver without weights, Casanova et al., JPDC 2014).
:class:`sim.fabric.network.FlowNetwork` calls :func:`max_min_rates` on every rate solve.
"""

from __future__ import annotations

import math

import numpy as np

# Relative tolerance for "this link is saturated" and "this flow is done".
_EPS = 1e-9

END_TOLERANCE_S = 1e-12
"""A flow with less time than this left ends now. A constant, not a share of the clock: the
same flow ends at the same event wherever in the run it falls (the engine's time grid,
:mod:`sim.engine.time_grid`, keeps intervals exact so that periods repeat to the bit)."""

RATE_GRID_BITS = 40
"""Every rate :func:`max_min_rates` returns is rounded down (no link goes above its capacity)
to a whole multiple of a power of two, ``2^-RATE_GRID_BITS`` of the fabric's largest capacity
(:func:`rate_quantum`: 0.5 B/s beside a 900 GB/s NVLink, 2e-12 of it). Sums of such rates
are exact while below ``2^(53 - RATE_GRID_BITS)`` = 8,192 times that capacity: a link's total
always (it is at most its capacity), a link class's total on fabrics of up to a few thousand
busy links. Exact totals, kept by adding and taking away each change, do not drift: they are
back at their exact value when the same flows run again and at exactly zero when all have
ended, which a period of a steady pipeline needs to repeat to the bit (issue 13 item 3)."""


def rate_quantum(capacity: np.ndarray) -> float:
    """The rate grid's spacing for a fabric with these link capacities (a power of two).

    >>> rate_quantum(np.array([100.0, 30.0])) == 2.0 ** (7 - RATE_GRID_BITS)
    True
    """
    top = float(capacity.max(initial=1.0))
    if not (top > 0 and math.isfinite(top)):
        top = 1.0
    return math.ldexp(1.0, math.frexp(top)[1] - RATE_GRID_BITS)


def on_rate_grid(rates: np.ndarray, quantum: float) -> np.ndarray:
    """``rates`` rounded down to whole multiples of ``quantum`` (a power of two; in place and
    returned). A rate below one quantum keeps its value: rounding it to zero would stall its
    flow.

    >>> on_rate_grid(np.array([100.0, 31.9, 5.5, 0.0]), 16.0).tolist()
    [96.0, 16.0, 5.5, 0.0]
    """
    grid = np.floor(rates * (1.0 / quantum)) * quantum
    np.copyto(rates, grid, where=grid > 0)
    return rates


# max_min_rates renumbers the used links on fabrics with more links than this (below, a
# numpy pass over every link costs less than renumbering).
_DENSE_LINKS = 2048
# _renumber walks the incidences alone (O(incidences)) while they number fewer than the links
# over this factor, else it marks the links in a mask and scans it (O(links)): measured
# crossover on a 168,960-link fabric, numpy 2, one core (20,000 incidences: 89 against 139 us;
# 200,000: 8.6 ms against 0.66 ms).
_RENUMBER_SCAN = 8


def _renumber(links: np.ndarray, scratch: tuple[np.ndarray, np.ndarray],
              ascending: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The distinct links of ``links`` and each incidence's local number among them.

    Parameters
    ----------
    links : link index per incidence
    scratch : a boolean mask over all links, all False (left so), and an integer array over
        all links (any values; overwritten)
    ascending : number the links in ascending order, as ``np.unique(links,
        return_inverse=True)`` does (the same two arrays); else in an order of first use

    Returns
    -------
    ids, inverse : ``links == ids[inverse]``
    """
    mask, pos = scratch
    k = len(links)
    if _RENUMBER_SCAN * k < len(pos):
        # Few incidences: each link's slot in ``pos`` names one incidence of it (whichever a
        # repeated write leaves), which stands for the link; number those in incidence order.
        seq = np.arange(k)
        pos[links] = seq
        rep = pos[links]
        first = rep == seq
        ids = links[first]
        inverse = (np.cumsum(first) - 1)[rep]
        if ascending and len(ids) > 1:
            order = np.argsort(ids)
            rank = np.empty(len(ids), dtype=np.intp)
            rank[order] = np.arange(len(ids))
            ids, inverse = ids[order], rank[inverse]
        return ids, inverse
    # Many incidences: mark the links and scan the mask (ascending by construction).
    mask[links] = True
    ids = np.flatnonzero(mask)
    pos[ids] = np.arange(len(ids))
    mask[ids] = False
    return ids, pos[links]


def max_min_rates(flat_links: np.ndarray, owner: np.ndarray, n_flows: int,
                  capacity: np.ndarray, caps: np.ndarray | None = None,
                  scratch: tuple[np.ndarray, np.ndarray] | None = None,
                  weights: np.ndarray | None = None,
                  quantum: float | None = None) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Parameters
    ----------
    flat_links : link index of every (flow, link) incidence
    owner : flow index of every incidence (same length)
    n_flows : number of flows
    capacity : bytes/s per link
    caps : optional per-flow rate limit (inf = none)
    scratch : optional arrays over all links for :func:`_renumber` (a False mask and an
        integer array), so that a caller solving often allocates them once
    weights : optional whole number per incidence: the flows it stands for on that link (a
        folded group's representative, :mod:`sim.fabric.fold`); each round counts a link's
        users as the sum of its unfrozen incidences' weights, the count the unfolded flows
        would give, so the filling takes the same steps
    quantum : optional step of the rate grid (:func:`rate_quantum` of ``capacity``, which a
        caller solving often finds once); None: found here

    Returns
    -------
    numpy.ndarray
        The rate of each flow.

    Notes
    -----
    On a large fabric the filling runs on the links the flows use, renumbered 0..k-1 in
    ascending order, as ``np.unique`` would (again
    when most have lost their flows), so each round costs the live incidences and k, not
    every link of the fabric. The saturation tolerance is
    taken against the whole fabric's largest capacity, as before the renumbering, so the
    rates are the same to the last bit.

    Examples
    --------
    A flow limited to 30 elsewhere leaves 70 of a shared 100 to the other flow:

    >>> max_min_rates(np.array([0, 1, 0]), np.array([0, 0, 1]), 2,
    ...               np.array([100.0, 30.0])).tolist()
    [30.0, 70.0]
    """
    caps = np.full(n_flows, np.inf) if caps is None else np.asarray(caps, dtype=float)
    rates = np.zeros(n_flows)
    capacity = np.asarray(capacity, dtype=float)
    if not len(flat_links):
        return rates
    if n_flows == 1 and weights is None:
        # One flow (most solves of an incremental run): on distinct links, the first round
        # already freezes it at min(bottleneck, cap), so skip the renumbering.
        path = np.sort(flat_links)
        if not (path[1:] == path[:-1]).any():
            step = min(float(capacity[path].min()), float(caps[0]))
            if not math.isfinite(step):
                raise ValueError("a flow has no finite bottleneck")
            rates[0] = 0.0 + max(step, 0.0)
            return on_rate_grid(rates, quantum or rate_quantum(capacity))
    floor = float(capacity.max(initial=1.0)) * 1e-6
    if len(capacity) > _DENSE_LINKS:
        if scratch is None:
            scratch = (np.zeros(len(capacity), dtype=bool), np.empty(len(capacity), dtype=np.intp))
        used_ids, inverse = _renumber(np.asarray(flat_links), scratch)
        links = inverse.astype(np.intp, copy=False)
        remaining = capacity[used_ids]
    else:
        # A small fabric: a pass over all its links costs less than renumbering them.
        links = np.asarray(flat_links, dtype=np.intp)
        remaining = capacity.copy()
    n_links = len(remaining)
    tol = _EPS * np.maximum(remaining, floor)
    own = np.asarray(owner, dtype=np.intp)
    wts = None if weights is None else np.asarray(weights, dtype=float)
    # Work on the incidences of unfrozen flows only; drop them as flows freeze.
    active = np.ones(n_flows, dtype=bool)
    act_idx = np.arange(n_flows)
    act_caps = caps
    level = 0.0
    while links.size:
        users = (np.bincount(links, minlength=n_links) if wts is None else
                 np.bincount(links, weights=wts, minlength=n_links))
        used = users > 0
        n_used = int(np.count_nonzero(used)) if n_links > _DENSE_LINKS else n_links
        if 2 * n_used < n_links:
            # Most links have lost all their flows: renumber the rest (a link without flows
            # never bounds a step nor saturates, so dropping it moves no rate).
            alive = np.flatnonzero(used)
            renum = np.cumsum(used) - 1
            links = renum[links]
            remaining, tol, users = remaining[alive], tol[alive], users[alive]
            used = np.ones(n_used, dtype=bool)
            n_links = n_used
        share = np.full(n_links, np.inf)
        np.divide(remaining, users, out=share, where=used)
        step = min(share.min(), float((act_caps - level).min()))
        if not np.isfinite(step):
            raise ValueError("a flow has no finite bottleneck")
        step = max(step, 0.0)
        level += step
        remaining -= step * users
        saturated = used & (remaining <= tol)
        frozen = own[saturated[links]]
        capped = act_idx[act_caps <= level * (1 + _EPS)]
        if not frozen.size and not capped.size:
            # Numerical corner: freeze the flows on the tightest link.
            tight = used & (share <= step * (1 + 1e-6))
            frozen = own[tight[links]]
        # Every flow named here is still active (its incidences or its index are live).
        rates[frozen] = level
        rates[capped] = level
        active[frozen] = False
        active[capped] = False
        keep = active[own]
        links, own = links[keep], own[keep]
        if wts is not None:
            wts = wts[keep]
        live = active[act_idx]
        act_idx, act_caps = act_idx[live], act_caps[live]
    return on_rate_grid(rates, quantum or rate_quantum(capacity))
