"""Flow-level network: max-min fair sharing of link capacity among active flows, on simpy.

Every active flow crosses a fixed list of links. Whenever a flow starts or ends, the rates of
all active flows are recomputed by progressive filling (water-filling): all unfrozen flows
grow at the same rate until a link saturates or a flow reaches its own cap; the flows through
that link freeze; repeat. This is the bandwidth-sharing model of SimGrid's LMM solver without
weights (Casanova et al., "Versatile, Scalable, and Accurate Simulation of Distributed
Applications and Platforms", JPDC 2014; Bertsekas and Gallager, "Data Networks", sec. 6.5.2).

A flow may stand for ``count`` identical flows on disjoint copies of its path (a folded
rank's traffic): it shares its own links as one flow, and its bytes count ``count`` times.

The next completion is scheduled as a simpy timeout; a wake-up made stale by a later change
is ignored (each carries the solver's version number).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

# Relative tolerance for "this link is saturated" and "this flow is done".
_EPS = 1e-9


@dataclass(eq=False)
class Flow:
    """One active transfer."""

    links: tuple[int, ...]
    size: float
    count: int
    cap: float
    done: simpy.Event
    tag: object = None
    remaining: float = 0.0
    rate: float = 0.0
    started: float = 0.0
    kind_hops: np.ndarray = field(default_factory=lambda: np.zeros(0))


class NetworkObserver:
    """Hook surface for the recorder; the network calls these, measurement stays outside.

    Subclass and override what you need.
    """

    def on_rates(self, t: float, class_rates: np.ndarray, flows: Sequence[Flow]) -> None:
        """Called after every rate solve with the bytes/s now flowing per link class."""

    def on_flow_end(self, t: float, flow: Flow) -> None:
        """Called when a flow has delivered all its bytes."""


class FlowNetwork:
    """Max-min fair flows over links with capacities.

    Parameters
    ----------
    env : simpy.Environment
    capacity : array of bytes/s per link
    kind : array of link-class codes per link (any small non-negative ints)
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
        self.kind = np.asarray(kind, dtype=np.int64)
        self.n_kinds = n_kinds
        self.observer = observer or NetworkObserver()
        self.flows: list[Flow] = []
        self.class_bytes = np.zeros(n_kinds)
        self.link_bytes = np.zeros(len(self.capacity))
        self.solves = 0
        self._last = env.now
        self._version = 0
        self._class_rates = np.zeros(n_kinds)
        self._link_rates = np.zeros(len(self.capacity))

    # ------------------------------------------------------------------ API
    def start_flow(self, links: Sequence[int], nbytes: float, count: int = 1,
                   cap: float = math.inf, tag: object = None) -> simpy.Event:
        """Start a flow of ``nbytes`` over ``links``; the returned event fires when it ends."""
        done = self.env.event()
        links = tuple(int(x) for x in links)
        if nbytes <= 0 or not links:
            done.succeed()
            return done
        self._advance()
        hops = np.bincount(self.kind[list(links)], minlength=self.n_kinds).astype(float)
        flow = Flow(links, float(nbytes), int(count), float(cap), done, tag,
                    remaining=float(nbytes), started=self.env.now, kind_hops=hops)
        self.flows.append(flow)
        self._resolve()
        return done

    def start_flows(self, specs: Sequence[tuple[Sequence[int], float, int, float]],
                    tag: object = None) -> list[simpy.Event]:
        """Start several flows at once with a single rate solve: (links, bytes, count, cap)."""
        self._advance()
        events = []
        for links, nbytes, count, cap in specs:
            done = self.env.event()
            links = tuple(int(x) for x in links)
            if nbytes <= 0 or not links:
                done.succeed()
            else:
                hops = np.bincount(self.kind[list(links)], minlength=self.n_kinds).astype(float)
                self.flows.append(Flow(links, float(nbytes), int(count), float(cap), done, tag,
                                       remaining=float(nbytes), started=self.env.now,
                                       kind_hops=hops))
            events.append(done)
        self._resolve()
        return events

    @property
    def link_load(self) -> np.ndarray:
        """Bytes/s now carried by each link (representative flows, not multiplied)."""
        return self._link_rates.copy()

    # ------------------------------------------------------------------ internals
    def _advance(self) -> None:
        """Move every flow forward to now at its current rate and count the bytes."""
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self.flows:
            for f in self.flows:
                f.remaining -= f.rate * dt
            self.class_bytes += self._class_rates * dt
            self.link_bytes += self._link_rates * dt
        self._last = now

    def _resolve(self) -> None:
        # Retire finished flows, solve rates for the rest, schedule the next completion.
        now = self.env.now
        finished = [f for f in self.flows
                    if f.remaining <= _EPS * f.size or (f.rate > 0 and f.remaining / f.rate
                                                        <= 1e-12 * max(1.0, now))]
        if finished:
            keep = set(map(id, finished))
            self.flows = [f for f in self.flows if id(f) not in keep]
            for f in finished:
                f.remaining = 0.0
                f.rate = 0.0
                self.observer.on_flow_end(now, f)
                f.done.succeed()
        self._solve()
        self._version += 1
        if not self.flows:
            return
        times = [f.remaining / f.rate for f in self.flows if f.rate > 0]
        if not times:
            raise RuntimeError("flows are active but none can progress (zero capacity?)")
        dt = max(min(times), 0.0)
        version = self._version
        timeout = self.env.timeout(dt)
        timeout.callbacks.append(lambda _ev: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return  # a later start/finish already re-solved and rescheduled
        self._advance()
        self._resolve()

    def _solve(self) -> None:
        self.solves += 1
        flows = self.flows
        n = len(flows)
        self._link_rates = np.zeros(len(self.capacity))
        if n == 0:
            self._class_rates = np.zeros(self.n_kinds)
            self.observer.on_rates(self.env.now, self._class_rates, flows)
            return
        lengths = np.fromiter((len(f.links) for f in flows), dtype=np.int64, count=n)
        flat = np.fromiter((x for f in flows for x in f.links), dtype=np.int64,
                           count=int(lengths.sum()))
        owner = np.repeat(np.arange(n), lengths)
        caps = np.fromiter((f.cap for f in flows), dtype=float, count=n)
        rates = max_min_rates(flat, owner, n, self.capacity, caps)
        for f, r in zip(flows, rates, strict=True):
            f.rate = float(r)
        self._link_rates = np.bincount(flat, weights=rates[owner], minlength=len(self.capacity))
        counts = np.fromiter((f.count for f in flows), dtype=float, count=n)
        hops = np.stack([f.kind_hops for f in flows])
        self._class_rates = (rates * counts) @ hops
        self.observer.on_rates(self.env.now, self._class_rates, flows)


def max_min_rates(flat_links: np.ndarray, owner: np.ndarray, n_flows: int,
                  capacity: np.ndarray, caps: np.ndarray | None = None) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Parameters
    ----------
    flat_links : link index of every (flow, link) incidence
    owner : flow index of every incidence (same length)
    n_flows : number of flows
    capacity : bytes/s per link
    caps : optional per-flow rate limit (inf = none)

    Returns
    -------
    numpy.ndarray
        The rate of each flow.

    Examples
    --------
    A flow limited to 30 elsewhere leaves 70 of a shared 100 to the other flow:

    >>> max_min_rates(np.array([0, 1, 0]), np.array([0, 0, 1]), 2,
    ...               np.array([100.0, 30.0])).tolist()
    [30.0, 70.0]
    """
    caps = np.full(n_flows, np.inf) if caps is None else np.asarray(caps, dtype=float)
    rates = np.zeros(n_flows)
    remaining = capacity.astype(float).copy()
    n_links = len(capacity)
    tol = _EPS * np.maximum(capacity, float(capacity.max(initial=1.0)) * 1e-6)
    # Work on the incidences of unfrozen flows only; drop them as flows freeze.
    links, own = flat_links, owner
    active = np.ones(n_flows, dtype=bool)
    level = 0.0
    while links.size:
        users = np.bincount(links, minlength=n_links)
        used = users > 0
        share = np.full(n_links, np.inf)
        share[used] = remaining[used] / users[used]
        act_idx = np.flatnonzero(active)
        step = min(share.min(), float((caps[act_idx] - level).min()))
        if not np.isfinite(step):
            raise ValueError("a flow has no finite bottleneck")
        step = max(step, 0.0)
        level += step
        remaining -= step * users
        saturated = used & (remaining <= tol)
        frozen = np.zeros(n_flows, dtype=bool)
        frozen[own[saturated[links]]] = True
        frozen[act_idx[caps[act_idx] <= level * (1 + _EPS)]] = True
        if not frozen.any():
            # Numerical corner: freeze the flows on the tightest link.
            tight = used & (share <= step * (1 + 1e-6))
            frozen[own[tight[links]]] = True
        newly = frozen & active
        rates[newly] = level
        active &= ~frozen
        keep = active[own]
        links, own = links[keep], own[keep]
    # Flows with no links (not expected) keep rate 0.
    return rates


def ring_bytes_per_rank(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective (nccl-tests' bus-bandwidth factors).

    ``nbytes`` is the message size as nccl-tests counts it: the buffer of an all-reduce, the
    gathered output of an all-gather, the input of a reduce-scatter.
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    raise ValueError(f"not a ring collective: {op}")


