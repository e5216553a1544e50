"""Shortcuts for :class:`sim.fabric.network.FlowNetwork`'s per-event work: the same bits
for fewer numpy calls (issue 13).

A numpy call on an array of a few elements costs 1-3 us of dispatch, more than its work,
and the 3,072-GPU Megatron-LM 1T step makes about a million rate solves with a handful of
live flows each. Two kinds of shortcut keep every bit:

* Elementwise IEEE 754 arithmetic is the same in Python as in numpy: ``/``, ``*``, ``<=`` and
  ``min`` on the same doubles give the same doubles (correctly rounded, no fused
  multiply-add on either side), so a Python loop over a few rows decides which flows end and
  when the next one ends exactly as the numpy expressions do. Sums over several terms stay
  numpy's (their order is numpy's).
* What depends only on a list of links (their renumbering, whether one repeats) or only on a
  group's links and lengths (each flow's slowest link, hop counts per link class) is
  remembered by content: the same collective of a rank class starts thousands of times on the
  same links, and capacities and link classes are fixed for a network's life.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sim.fabric.maxmin import _EPS, END_TOLERANCE_S, _renumber

if TYPE_CHECKING:
    from sim.fabric.network import FlowNetwork

__all__ = ["BUSY_SLACK", "SMALL_ROWS", "SMALL_ROWS_NEXT", "GroupShapes", "LinkSets",
           "ReadOnlyMemo", "add_link_rates", "ended_rows", "next_end"]

SMALL_ROWS = 32
"""Tables of at most this many rows (dead ones included) find the flows that end now with
:func:`ended_rows`: a loop costs ~0.1 us per row against ~1 us per numpy call, and the numpy
form makes 8 calls (measured crossover ~40 rows, numpy 2, one core)."""

SMALL_ROWS_NEXT = 48
"""... and the next end with :func:`next_end` (cheaper per row: crossover ~64 rows)."""

BUSY_SLACK = 256
"""The busy-link set may hold this many links (or twice the busy ones) before its idle links
leave it (:func:`add_link_rates`)."""

_CACHE_MAX_INCIDENCES = 4096
"""Link lists longer than this are not remembered: hashing their bytes costs about as much
as the work it saves, and they are few."""

_CACHE_ENTRIES = 4096
"""Entries a cache holds before it starts afresh (a bound on memory; the entries are a pure
function of their key, so forgetting them moves no bit)."""


def ended_rows(remaining: list[float], rate: list[float], size: list[float]) -> list[int]:
    """The rows whose flows end now, as ``FlowNetwork._finished_rows`` decides it: bytes left
    within rounding of none, or time left (moving flows only) within rounding of now."""
    tol = END_TOLERANCE_S
    return [i for i, (r, v, s) in enumerate(zip(remaining, rate, size, strict=True))
            if r <= _EPS * s or (v > 0 and r / v <= tol)]


def next_end(remaining: list[float], rate: list[float]) -> tuple[float, bool]:
    """(least time left among moving flows, inf when none; whether any flow moves): the
    minimum of the same divisions ``FlowNetwork._schedule`` makes (a minimum is exact)."""
    dt = float("inf")
    moving = False
    for r, v in zip(remaining, rate, strict=True):
        if v > 0:
            moving = True
            left = r / v
            if left < dt:
                dt = left
    return dt, moving


class LinkSets:
    """The distinct links of a link list and each entry's number among them (``_renumber``
    in order of first use), and whether no link repeats, remembered by the list's content."""

    def __init__(self, scratch: tuple[np.ndarray, np.ndarray]) -> None:
        self._scratch = scratch
        self._known: dict[bytes, tuple[np.ndarray, np.ndarray, bool]] = {}

    def get(self, links: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(ids, inverse, distinct) with ``links == ids[inverse]``; the arrays are shared
        between calls: read them, never write them."""
        if len(links) > _CACHE_MAX_INCIDENCES:
            ids, inv = _renumber(links, self._scratch, ascending=False)
            return ids, inv, len(ids) == len(links)
        key = links.tobytes()
        hit = self._known.get(key)
        if hit is None:
            if len(self._known) >= _CACHE_ENTRIES:
                self._known.clear()
            ids, inv = _renumber(links, self._scratch, ascending=False)
            hit = self._known[key] = (ids, inv, len(ids) == len(links))
        return hit


class ReadOnlyMemo:
    """Values computed from read-only arrays, remembered by the arrays' identity: the
    collective runner passes the same read-only arrays each time an op repeats, so a pure
    function of their content is found again without hashing or comparing their bytes. The
    arrays are held with the value, so their ids are not reused while remembered; arrays
    that can be written are never remembered."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: dict[tuple[int, ...], tuple[tuple[np.ndarray, ...], object]] = {}

    def lookup(self, arrays: tuple[np.ndarray, ...]) -> tuple[bool, object]:
        """(found, value) for these very arrays."""
        known = self._known.get(tuple(map(id, arrays)))
        if known is not None and all(a is b and not a.flags.writeable
                                     for a, b in zip(known[0], arrays, strict=True)):
            return True, known[1]
        return False, None

    def remember(self, arrays: tuple[np.ndarray, ...], value: object) -> None:
        """Keep ``value`` for ``arrays`` when none of them can be written."""
        if any(a.flags.writeable for a in arrays):
            return
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known[tuple(map(id, arrays))] = (arrays, value)


class GroupShapes:
    """Per group of flows (its links and lengths): each flow's slowest link's capacity,
    each incidence's flow, each flow's hop count per link class, and whether no link repeats
    among the group's incidences; remembered by content for groups up to
    ``_CACHE_MAX_INCIDENCES`` incidences."""

    def __init__(self, capacity: np.ndarray, kind: np.ndarray, n_kinds: int) -> None:
        self.capacity, self.kind, self.n_kinds = capacity, kind, n_kinds
        self._known: dict[tuple[bytes, bytes],
                          tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = {}
        # Groups too large to hash, by the identity of their read-only arrays.
        self._by_id = ReadOnlyMemo(_CACHE_ENTRIES // 16)

    def get(self, flat_links: np.ndarray, lengths: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(slowest capacity per flow, owner per incidence, hops per flow and class,
        distinct); shared arrays: read them, never write them. A group too large to hash
        is remembered by its read-only arrays (:class:`ReadOnlyMemo`): two zones in round
        robin start thousands of unfolded all-to-alls of 20,000 incidences, each a sort for
        ``distinct``."""
        if len(flat_links) > _CACHE_MAX_INCIDENCES:
            found, seen = self._by_id.lookup((flat_links, lengths))
            if found:
                return seen   # type: ignore[return-value]
            shape = self._shape(flat_links, lengths)
            self._by_id.remember((flat_links, lengths), shape)
            return shape
        key = (flat_links.tobytes(), lengths.tobytes())
        hit = self._known.get(key)
        if hit is None:
            if len(self._known) >= _CACHE_ENTRIES:
                self._known.clear()
            hit = self._known[key] = self._shape(flat_links, lengths)
        return hit

    def _shape(self, flat_links: np.ndarray, lengths: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        n = len(lengths)
        starts = lengths.cumsum() - lengths
        slowest = np.minimum.reduceat(self.capacity[flat_links], starts)
        owner = np.repeat(np.arange(n), lengths)
        hops = np.bincount(owner * self.n_kinds + self.kind[flat_links],
                           minlength=n * self.n_kinds).reshape(n, self.n_kinds)
        distinct = len(np.unique(flat_links)) == len(flat_links)
        return slowest, owner, hops, distinct


def add_link_rates(net: FlowNetwork, links: np.ndarray, weights: np.ndarray,
                   link_set: tuple[np.ndarray, np.ndarray, bool] | None = None) -> None:
    """``FlowNetwork._add_link_rates``: add ``weights`` (one per incidence) to the rates of
    their links and keep the busy set. The sums per link run in incidence order as
    ``np.bincount`` over all links would, so every bit is the same; a link not named gains
    nothing (x + 0.0 is x)."""
    n_links = len(net.capacity)
    if net._dense:
        net._link_rates += np.bincount(links, weights=weights, minlength=n_links)
        return
    # A pass over every link costs less below ~20,000 links (a 2,048-GPU fabric: 18 us
    # against 26 us for 31 incidences on 10,560 links), and above ~1/16 as many incidences
    # as links (measured crossover on 168,960 links: 10,000 incidences, ~300 us either way).
    if 16 * len(links) < n_links:
        ids, inv, _ = link_set or net._link_sets.get(links)
        net._link_rates[ids] += np.bincount(inv, weights=weights, minlength=len(ids))
        # The busy set takes every link touched and keeps it until it doubles, then drops
        # the idle ones: a link idle in it adds 0.0 * dt = 0.0 to its bytes (no bit moves),
        # and a group ending and starting again on the same links, the common case, changes
        # nothing in it.
        mask = net._busy_mask
        new = ids[~mask[ids]]
        if len(new):
            mask[new] = True
            busy = net._busy = np.concatenate([net._busy, new])
            if len(busy) > net._busy_limit:
                idle = net._link_rates[busy] == 0.0
                mask[busy[idle]] = False
                net._busy = busy[~idle]
                net._busy_limit = max(BUSY_SLACK, 2 * len(net._busy))
    else:
        net._link_rates += np.bincount(links, weights=weights, minlength=n_links)
        net._busy_mask = net._link_rates != 0.0
        net._busy = np.flatnonzero(net._busy_mask)
