"""Ring collectives and point-to-point transfers as flows on the fabric.

A ring collective of n ranks moves ``2(n-1)/n`` (all-reduce) or ``(n-1)/n`` (all-gather,
reduce-scatter) of the message through every edge of the ring; NCCL pipelines it in chunks
so that all edges carry data at once. We therefore run one flow per ring edge, all started
together, each carrying that volume, after NCCL's latency term (:mod:`sim.collectives.nccl`).
The flows share links with everything else on the fabric, so contention comes out of the
max-min solve rather than out of a formula.

Across nodes NCCL builds several rings (channels) and spreads them over the NICs. Channel c
enters every node at local GPU c and leaves it from the GPU before it; the hop to the next
node goes over NVLink to local GPU c and out through its NIC (NCCL's PXN, "PCI x NVLink",
the default on rail-optimised fabrics since NCCL 2.12), so every channel stays on one rail.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import simpy

from sim.collectives import nccl
from sim.network import FlowNetwork, ring_bytes_per_rank
from sim.topology import CROSS_AZ, NETWORK, NVLINK, PCIE, Fabric


def transport_capacity(fabric: Fabric, arch: str) -> np.ndarray:
    """Link capacity as NCCL's transports achieve it (see :mod:`sim.collectives.nccl`): the
    flow network runs on these, so sharing divides what a transfer can really get."""
    eff = np.ones(len(fabric.capacity))
    eff[fabric.kind == NVLINK] = nccl.NVLINK_EFFICIENCY[arch]
    eff[(fabric.kind == NETWORK) | (fabric.kind == CROSS_AZ)] = nccl.NETWORK_EFFICIENCY
    eff[fabric.kind == PCIE] = nccl.PCIE_EFFICIENCY
    return fabric.capacity * eff


@dataclass(frozen=True)
class RingPlan:
    """The rings (channels) of one group and the links of each ring edge."""

    channels: tuple[tuple[int, ...], ...]
    edge_links: tuple[tuple[tuple[int, ...], ...], ...]
    n_nodes: int
    edge_bw: tuple[tuple[float, ...], ...]
    """Effective bandwidth of each edge's slowest link (bytes/s)."""

    @property
    def bus_bw(self) -> float:
        """Bus bandwidth of the whole collective: each channel moves at its slowest edge."""
        return sum(min(bws) for bws in self.edge_bw)

    @cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(every edge's links in turn, links per edge, each edge's bottleneck) as arrays."""
        edges = [e for ring in self.edge_links for e in ring]
        lengths = np.array([len(e) for e in edges], dtype=np.int64)
        flat = np.fromiter((x for e in edges for x in e), dtype=np.int64,
                           count=int(lengths.sum()))
        bws = np.array([b for ring in self.edge_bw for b in ring])
        return flat, lengths, bws


def ring_orders(group: Sequence[int], node_of: dict[int, int], nics_per_node: int
                ) -> list[list[int]]:
    """The ring of each channel over ``group``.

    Examples
    --------
    Two nodes of two GPUs, two NICs: two channels, entering each node at a different GPU.

    >>> ring_orders([0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 2)
    [[0, 1, 2, 3], [1, 0, 3, 2]]
    """
    by_node: dict[int, list[int]] = {}
    for r in sorted(group):
        by_node.setdefault(node_of[r], []).append(r)
    nodes = sorted(by_node)
    if len(nodes) == 1:
        return [sorted(group)]
    m = min(len(v) for v in by_node.values())
    channels = max(1, min(nics_per_node, m))
    rings = []
    for c in range(channels):
        ring: list[int] = []
        for node in nodes:
            members = by_node[node]
            s = c % len(members)
            ring += members[s:] + members[:s]
        rings.append(ring)
    return rings


class CollectiveRunner:
    """Runs collectives and transfers of the program as flows on one fabric."""

    def __init__(self, env: simpy.Environment, net: FlowNetwork, fabric: Fabric, arch: str,
                 algo: str = "auto", proto: str = "auto") -> None:
        self.env = env
        self.net = net
        self.fabric = fabric
        self.arch = arch
        self.algo = algo
        self.proto = proto
        self._plans: dict[tuple[int, ...], RingPlan] = {}
        self.chosen: list[tuple[str, str, float]] = []

    @property
    def effective_capacity(self) -> np.ndarray:
        """Link capacity as the flows see it (the network was built with it)."""
        return self.net.capacity

    @cached_property
    def _node_of(self) -> dict[int, int]:
        return {r: self.fabric.node_of(r) for r in range(self.fabric.n_gpus)}

    def plan(self, group: tuple[int, ...]) -> RingPlan:
        plan = self._plans.get(group)
        if plan is None:
            rings = ring_orders(group, self._node_of, self.fabric.spec.nics_per_node)
            cap = self.effective_capacity
            links = []
            bws = []
            for ring in rings:
                edges = tuple(self.edge_route(ring[i], ring[(i + 1) % len(ring)])
                              for i in range(len(ring)))
                links.append(edges)
                bws.append(tuple(float(cap[list(e)].min()) for e in edges))
            n_nodes = len({self._node_of[r] for r in group})
            plan = RingPlan(tuple(tuple(r) for r in rings), tuple(links), n_nodes, tuple(bws))
            self._plans[group] = plan
        return plan

    def edge_route(self, src: int, dst: int) -> tuple[int, ...]:
        """Links of one ring edge; between nodes via the proxy GPU on the receiver's rail."""
        fab = self.fabric
        g = fab.spec.gpus_per_node
        if self._node_of[src] == self._node_of[dst] or src % g == dst % g:
            return fab.route(src, dst)
        proxy = self._node_of[src] * g + dst % g
        return fab.route(src, proxy) + fab.route(proxy, dst)

    def run_collective(self, op: str, group: tuple[int, ...], nbytes: float, tag: object = None
                       ) -> Generator[simpy.Event, object, None]:
        """Process: one ring collective of ``nbytes`` (nccl-tests' message size) over ``group``."""
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return
        plan = self.plan(group)
        per_rank = ring_bytes_per_rank(op, nbytes, n)
        est = nccl.choose_protocol(op, per_rank, n, plan.n_nodes, self.arch, plan.bus_bw,
                                   len(plan.channels), self.proto)
        self.chosen.append((op, est.protocol, nbytes))
        yield self.env.timeout(est.latency_s)
        per_flow = per_rank / len(plan.channels)
        factor = min(1.0, est.bus_bw_bytes_per_s / plan.bus_bw)
        flat, lengths, bws = plan.flat
        n = len(lengths)
        yield self.net.start_group(flat, lengths, np.full(n, per_flow), np.ones(n),
                                   bws * factor, tag=tag)

    def run_p2p(self, pairs: Sequence[tuple[int, int]], nbytes: float, tag: object = None
                ) -> Generator[simpy.Event, object, None]:
        """Process: point-to-point transfers (NCCL send/recv, Simple protocol), one flow per
        (source, destination) pair, all at once."""
        pairs = [(s, d) for s, d in pairs if s != d]
        if nbytes <= 0 or not pairs:
            return
        same_node = all(self._node_of[s] == self._node_of[d] for s, d in pairs)
        hop = nccl.RING_HW_LAT_US["nvlink" if same_node else "network"]["simple"]
        yield self.env.timeout((nccl.RING_BASE_LAT_US["simple"] + hop) * 1e-6)
        cap = self.effective_capacity
        specs = []
        for s, d in pairs:
            links = self.fabric.route(s, d)
            specs.append((links, nbytes, 1, float(cap[list(links)].min())))
        yield self.net.start_flows(specs, tag=tag)
