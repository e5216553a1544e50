"""Lower bounds on a layout's step time from its built program, without the engine.

:func:`collective_lower_bound` (:class:`CommBounds`) is the least time a collective or send
takes on the fabric whatever NCCL's algorithm; :func:`_earliest_schedule` runs every op of a
program at its fastest, with the engine's own host-clock rule (:mod:`sim.engine.host_clock`), and
:func:`per_micro_batch_bound` is the least time one more micro-batch adds. Part of
``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sim.engine.host_clock import host_issues, issue_order, issue_time
from sim.scenario import Scenario


@dataclass(frozen=True)
class LinkRates:
    """The fabric figures the step-time lower bound needs, bytes per second."""

    gpus_per_node: int
    nvlink: float
    """Per GPU, per direction."""
    node_network: float
    """Every NIC of a node together, per direction."""

    @classmethod
    def of(cls, s: Scenario) -> LinkRates:
        from sim import catalog

        c = s.cluster
        gpu = catalog.gpu(c.gpu)
        nvlink = (c.nvlink_gbytes_per_s or gpu.nvlink_gbytes_per_s) * 1e9
        return cls(c.gpus_per_node, nvlink, c.nics_per_node * c.nic_gbps * 1e9 / 8)


def collective_lower_bound(op: Any, rates: LinkRates) -> float:
    """Seconds a collective or point-to-point op takes at least on the fabric, whatever
    NCCL's algorithm: the bytes some GPU or some server must move over its own links.

    * A group inside one server: each of its ``n`` GPUs receives (all-gather, all-reduce) or
      sends (reduce-scatter) at least ``(n-1)/n`` of the message over its NVLink port.
    * A group over several servers: a server holding ``g`` of the ``n`` ranks must bring in
      the ``(n-g)/n`` of an all-gather's output it lacks, and send out the ``(n-g)/n`` of a
      reduce-scatter's reduced shards that other servers own (its own ranks' contributions
      pre-reduced at best); an all-reduce does both (``(k-1)/k`` each way on ``k`` servers,
      the bandwidth-optimal bound that ring and tree algorithms reach at best). All groups
      of a folded op run at once through the server's NICs together.
    * A send: bytes leaving (entering) each server through its NICs, or one GPU's NVLink
      port inside a server.

    * An all-to-all: what each GPU sends to (receives from) the peers of its own server
      over its NVLink port, and what each server sends out (brings in) through its NICs
      (:meth:`CommBounds._all_to_all`; an even split sends ``(n-1)/n`` of ``nbytes``).

    Broadcasts count zero (a lower bound). Latencies count zero.

    Examples
    --------
    >>> from sim.program.ir import Op
    >>> rates = LinkRates(gpus_per_node=8, nvlink=450e9, node_network=400e9)
    >>> ag = Op("ag", "collective", "c", "comm", collective="all_gather", nbytes=8e9,
    ...         group=tuple(range(16)), key="k")
    >>> round(collective_lower_bound(ag, rates), 4)      # half of 8 GB enters each server
    0.01
    """
    bounds = _BOUNDS.get(rates)
    if bounds is None or len(bounds._per_byte) > _BOUNDS_KEYS:
        if len(_BOUNDS) >= 16:
            _BOUNDS.clear()
        bounds = _BOUNDS[rates] = CommBounds(rates)
    return bounds.seconds(op)


_BOUNDS: dict[LinkRates, CommBounds] = {}
"""One :class:`CommBounds` per fabric's rates: ``fabricsim plan``'s layer profiles ask
the same groups' bounds across tens of thousands of profiles (a new one per op timed every
64-rank all-to-all's 4,032 pairs again: a fifth of the planner's time on DeepSeek-V3)."""
_BOUNDS_KEYS = 4096
"""Group shapes one remembers before it starts afresh."""


class CommBounds:
    """:func:`collective_lower_bound` with the per-byte time of each group shape kept (a
    program repeats the same groups thousands of times)."""

    def __init__(self, rates: LinkRates) -> None:
        self.rates = rates
        self._per_byte: dict[tuple[Any, ...], float] = {}

    def seconds(self, op: Any) -> float:
        nbytes = float(op.nbytes)
        if nbytes <= 0:
            return 0.0
        if op.kind in ("send", "recv"):
            key: tuple[Any, ...] = ("p2p", op.pairs)
        elif op.collective in ("all_gather", "reduce_scatter", "all_reduce"):
            key = ("coll", op.groups or (op.group,))
        elif op.collective == "all_to_all":
            key = ("a2a", op.groups or (op.group,), op.peer_bytes, None if op.peer_bytes
                   else nbytes)
            seconds = self._per_byte.get(key)
            if seconds is None:
                seconds = self._per_byte[key] = self._all_to_all(key[1], op.peer_bytes,
                                                                 nbytes)
            return seconds
        else:
            return 0.0
        per_byte = self._per_byte.get(key)
        if per_byte is None:
            per_byte = self._per_byte[key] = (self._p2p(op.pairs) if key[0] == "p2p"
                                              else self._groups(key[1]))
        return nbytes * per_byte

    def _p2p(self, pairs: Sequence[tuple[int, int]]) -> float:
        per_node = self.rates.gpus_per_node
        out_count: Counter[int] = Counter()
        in_count: Counter[int] = Counter()
        worst = 0.0
        for src, dst in pairs:
            a, b = src // per_node, dst // per_node
            if a == b:
                worst = 1.0 / self.rates.nvlink
            else:
                out_count[a] += 1
                in_count[b] += 1
        busiest = max(list(out_count.values()) + list(in_count.values()) + [0])
        # A one-node cluster has no network (rate 0) and nothing crossing it.
        return max(worst, busiest / self.rates.node_network if busiest else 0.0)

    def _all_to_all(self, groups: Sequence[Sequence[int]],
                    peer_bytes: Sequence[Sequence[float]], nbytes: float) -> float:
        """Seconds of an all-to-all at least: what each GPU sends to (receives from) peers
        in its own server over its NVLink port, and what each server sends out (brings in)
        through its NICs, all groups of a folded op together. ``peer_bytes[i][j]``: member
        i to member j; none: ``nbytes / n`` to each (the op's even split, ``Op.peer_bytes``).
        The diagonal stays on the GPU. PXN or not, bytes for another server leave through
        some NIC of their own server."""
        per_node = self.rates.gpus_per_node
        nvl: dict[tuple[int, str], float] = defaultdict(float)
        nic: dict[tuple[int, str], float] = defaultdict(float)
        for group in groups:
            n = len(group)
            for i, src in enumerate(group):
                for j, dst in enumerate(group):
                    if i == j:
                        continue
                    b = float(peer_bytes[i][j]) if peer_bytes else nbytes / n
                    a, c = src // per_node, dst // per_node
                    if a == c:
                        nvl[src, "out"] += b
                        nvl[dst, "in"] += b
                    else:
                        nic[a, "out"] += b
                        nic[c, "in"] += b
        intra = max(nvl.values(), default=0.0) / self.rates.nvlink
        inter = max(nic.values()) / self.rates.node_network if nic else 0.0
        return max(intra, inter)

    def _groups(self, groups: Sequence[Sequence[int]]) -> float:
        per_node = self.rates.gpus_per_node
        intra = 0.0
        load: dict[int, float] = defaultdict(float)
        for group in groups:
            n = len(group)
            if n <= 1:
                continue
            nodes = Counter(r // per_node for r in group)
            if len(nodes) == 1:
                intra = max(intra, (n - 1) / n / self.rates.nvlink)
                continue
            for node, held in nodes.items():
                load[node] += (n - held) / n
        inter = max(load.values()) / self.rates.node_network if load else 0.0
        return max(intra, inter)


@dataclass
class _Schedule:
    """Earliest start and end of every op in the lower-bound schedule, by ``op.index``."""

    start: list[float]
    end: list[float]
    makespan: float


class _HostNodes(NamedTuple):
    """The host-clock nodes of :func:`_earliest_schedule`, node ``n_op_nodes + i`` for entry
    ``i``: one per op of each rank class, in the order its host issues them."""

    cpu: list[float]
    """The op's CPU seconds."""
    waits: list[int]
    """How many of ``preds`` the host waits for before spending them: 0 (the class's first
    op), 1 (the host's previous node) or 2 (that and the ``host_sync`` op just issued)."""
    preds: list[tuple[int, ...]]
    """Those, then the nodes whose ends free the launch-queue room the op needs."""


def _host_nodes(program: Any, node_of: list[int], preds: list[list[int]]) -> _HostNodes:
    """Host nodes for every op of ``program`` by the engine's rule (:mod:`sim.engine.host_clock`),
    each added to ``preds`` of its op's node (an op starts once issued). ``node_of`` maps an
    op's index to its node; host nodes are numbered after the ``len(preds)`` op nodes."""
    first = len(preds)
    nodes = _HostNodes([], [], [])
    cpu, waits, host_preds = nodes
    for cls in program.classes:
        prev_host = -1
        for op, synced, launches in host_issues(issue_order(cls)):
            h_node = first + len(cpu)
            cpu.append(float(op.cpu_s))
            # A sync op is issued before the op that waits for it: prev_host exists then.
            if synced is not None:
                before: tuple[int, ...] = (prev_host, node_of[synced.index])
            else:
                before = (prev_host,) if prev_host >= 0 else ()
            waits.append(len(before))
            host_preds.append(before + tuple([node_of[o.index] for o in launches])
                              if launches else before)
            preds[node_of[op.index]].append(h_node)
            prev_host = h_node
    return nodes


def _earliest_schedule(program: Any, rates: LinkRates) -> _Schedule | None:
    """The program run with every op at its fastest, as :class:`sim.engine.core.Engine` runs it
    but with nothing shared: compute and copy ops take their durations, collectives and
    sends :func:`collective_lower_bound`; an op starts once its stream predecessor, its
    dependencies and (for a collective) every class of its group allow, and once its rank
    class's host has issued it. The host clock is the engine's own rule,
    :mod:`sim.engine.host_clock` (:func:`~sim.engine.host_clock.host_issues` names the ops the host
    waits
    for, :func:`~sim.engine.host_clock.issue_time` adds them up), run on this schedule's ends.

    The engine can only be slower: its compute ops are slowed beside NCCL kernels, its flows
    share links and pay latencies. None if the graph has a cycle (a broken program)."""
    ops = program.ops
    n_ops = len(ops)
    bounds = CommBounds(rates)
    node_of = [0] * n_ops
    dur: list[float] = []
    key_node: dict[str, int] = {}
    for op in ops:
        kind = op.kind
        if kind == "collective":
            node = key_node.get(op.key)
            t = bounds.seconds(op)
            if node is None:
                node = key_node[op.key] = len(dur)
                dur.append(t)
            elif t > dur[node]:
                dur[node] = t
        else:
            node = len(dur)
            if kind in ("send", "recv"):
                dur.append(bounds.seconds(op))
            elif op.host_transfer is not None:
                dur.append(0.0)     # PCIe/NVMe flows: bounded below by nothing here
            else:
                dur.append(float(op.duration))
        node_of[op.index] = node
    n_op_nodes = len(dur)
    preds: list[list[int]] = [[] for _ in range(n_op_nodes)]
    for cls in program.classes:
        for stream in cls.streams.values():
            prev = -1
            for op in stream:
                node = node_of[op.index]
                np_ = preds[node]
                if prev >= 0 and prev != node:
                    np_.append(prev)
                for d in op.deps:
                    dn = node_of[d.index]
                    if dn != node:
                        np_.append(dn)
                prev = node
    host_cpu, host_waits, host_preds = _host_nodes(program, node_of, preds)
    n_nodes = n_op_nodes + len(host_cpu)
    all_preds: list[Sequence[int]] = [*preds, *host_preds]
    succs: list[list[int]] = [[] for _ in range(n_nodes)]
    indegree = [0] * n_nodes
    for node, ps in enumerate(all_preds):
        indegree[node] = len(ps)
        for p in ps:
            succs[p].append(node)
    ready = [node for node in range(n_nodes) if indegree[node] == 0]
    start = [0.0] * n_nodes
    end = [0.0] * n_nodes
    done = 0
    while ready:
        node = ready.pop()
        done += 1
        if node < n_op_nodes:
            t = 0.0
            for p in all_preds[node]:
                if end[p] > t:
                    t = end[p]
            start[node] = t
            end[node] = t + dur[node]
        else:
            i = node - n_op_nodes
            ps = host_preds[i]
            w = host_waits[i]
            launch_end = -math.inf
            for j in range(w, len(ps)):
                if end[ps[j]] > launch_end:
                    launch_end = end[ps[j]]
            start[node] = end[node] = issue_time(end[ps[0]] if w else 0.0,
                                                 end[ps[1]] if w == 2 else -math.inf,
                                                 host_cpu[i], launch_end)
        for s in succs[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if done != n_nodes:
        return None
    return _Schedule([start[node_of[i]] for i in range(n_ops)],
                     [end[node_of[i]] for i in range(n_ops)],
                     max(end[:n_op_nodes], default=0.0))


def per_micro_batch_bound(program: Any, rates: LinkRates, micro_batches: int) -> float:
    """The least time one more micro-batch adds: over the micro-batches that are neither
    the first nor the last, the smallest of (the busiest stream of any rank class: its
    compute ops' durations plus its collectives' and sends' lower bounds). Each extra
    micro-batch puts that much more on that stream, which runs its ops one at a time."""
    per: dict[tuple[int, int, str], float] = defaultdict(float)
    middle = set(range(1, micro_batches - 1))
    bounds = CommBounds(rates)
    for cls in program.classes:
        for name, stream in cls.streams.items():
            for op in stream:
                if op.micro_batch not in middle:
                    continue
                if op.kind in ("collective", "send", "recv"):
                    t = bounds.seconds(op)
                elif op.host_transfer is None:
                    t = float(op.duration)
                else:
                    continue
                per[(op.micro_batch, cls.id, name)] += t
    if not per:
        return 0.0
    busiest: dict[int, float] = defaultdict(float)
    for (mb, _, _), t in per.items():
        busiest[mb] = max(busiest[mb], t)
    return min(busiest[mb] for mb in middle) if len(busiest) == len(middle) else 0.0
