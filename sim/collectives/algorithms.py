"""NCCL's algorithms as sets of flows on the fabric.

Every algorithm is pipelined by NCCL (chunks flow through all its edges at once), so each is
one phase of concurrent flows: one flow per edge and direction the algorithm uses, carrying
that edge's share of the message. Their rates come from the max-min solve, so an algorithm's
speed is what the fabric (and everything else on it) leaves it.

* **ring** (all-reduce, all-gather, reduce-scatter; a chain for broadcast): one ring per
  channel; within a node the ring visits every GPU; across nodes NCCL builds one ring per NIC,
  each entering every node at a different GPU; the hop to the next node goes over NVLink to
  the GPU on the receiver's rail and out through its NIC (PXN, the default on rail-optimised
  fabrics since NCCL 2.12) unless ``cross_nic=1`` lets rings change rails.
* **tree** (all-reduce): NCCL's double binary tree across nodes (Sanders, Speck, Träff,
  "Two-tree algorithms for full bandwidth broadcast, reduction and scan", 2009) with a chain
  through the GPUs of each node; each tree carries half the data up (reduce) and down
  (broadcast).
* **nvls** (all-reduce in one NVLink domain): NVLink SHARP. Each GPU sends its whole buffer
  to the NVSwitch, which reduces (multimem.ld_reduce) and returns 1/n to each GPU, which
  multicasts its reduced shard back (multimem.st): per GPU S(n+1)/n up and down its NVLink.
* **nvls_tree** (all-reduce across nodes): NVLS inside each node, and each GPU's shard
  all-reduced across nodes over its own rail by a double binary tree.
* **p2p** (send/recv, all-to-all): one flow per (source, destination).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.topology import Fabric

NVSWITCH_MIN_GPUS = 2


@dataclass(frozen=True)
class FlowPlan:
    """The flows of one algorithm over one group, per byte of message."""

    algorithm: str
    flat: np.ndarray
    """Every flow's link indices in turn."""
    lengths: np.ndarray
    """Links per flow."""
    share: np.ndarray
    """Bytes each flow carries per byte of message."""
    bottleneck: np.ndarray
    """Each flow's slowest link (bytes/s)."""
    path_latency: np.ndarray
    """Each flow's one-way latency along its links (s)."""
    n_ranks: int
    n_nodes: int
    channels: int
    bus_bw: float
    """Bus bandwidth at full protocol efficiency, as NCCL's nChannels x per-channel bandwidth."""
    volume: float
    """Bytes per rank NCCL's model divides by the bus bandwidth, per byte of message."""
    fill_stages: int = 0
    """Pipeline stages the first chunk crosses before every edge is busy."""
    chunk_bytes: float = 0.0
    nccl_channels: int = 0
    """Channels NCCL runs (for its per-channel caps); 0 = ``channels``."""

    @property
    def n_flows(self) -> int:
        return len(self.lengths)


class PlanBuilder:
    """Builds flow plans on one fabric; routes and edge data are cached."""

    def __init__(self, fabric: Fabric, capacity: np.ndarray, cross_nic: int = 2) -> None:
        self.fabric = fabric
        self.capacity = capacity
        self.cross_nic = cross_nic
        self.g = fabric.spec.gpus_per_node
        self.nics = fabric.spec.nics_per_node
        self.node_of = {r: fabric.node_of(r) for r in range(fabric.n_gpus)}
        self._edges: dict[tuple[int, int, int | None], tuple[tuple[int, ...], float, float]] = {}

    # ------------------------------------------------------------------ edges
    def edge(self, src: int, dst: int, rail: int | None = None
             ) -> tuple[tuple[int, ...], float, float]:
        """(links, bottleneck, latency) of one algorithm edge. Between nodes on ``rail`` the
        data goes over NVLink to the GPU paired with that NIC, then out through the NIC
        (PXN), unless cross_nic=1 lets the edge leave by the source GPU's own NIC."""
        key = (src, dst, rail)
        hit = self._edges.get(key)
        if hit is not None:
            return hit
        fab = self.fabric
        if self.node_of[src] == self.node_of[dst] or self.cross_nic == 1 or self.nics < 1:
            links = fab.route(src, dst)
        else:
            k = fab.rail_of(dst) if rail is None else rail
            proxy = self.node_of[src] * self.g + nic_gpu(k, self.nics, self.g)
            links = (fab.route(src, proxy) if proxy != src else ()) + fab.route(proxy, dst, k)
        idx = list(links)
        out = (links, float(self.capacity[idx].min()), float(fab.path_latency(links)))
        self._edges[key] = out
        return out

    def _plan(self, algorithm: str, edges: list[tuple[int, int, float, int | None]],
              n_ranks: int, n_nodes: int, channels: int, bus_bw: float, volume: float,
              fill_stages: int = 0, chunk_bytes: float = 0.0) -> FlowPlan:
        data = [self.edge(s, d, rail) for s, d, _, rail in edges]
        lengths = np.array([len(x[0]) for x in data], dtype=np.int64)
        flat = np.fromiter((i for x in data for i in x[0]), dtype=np.int64,
                           count=int(lengths.sum()))
        return FlowPlan(algorithm, flat, lengths, np.array([e[2] for e in edges]),
                        np.array([x[1] for x in data]), np.array([x[2] for x in data]),
                        n_ranks, n_nodes, channels, bus_bw, volume, fill_stages, chunk_bytes)

    def _by_node(self, group: Sequence[int]) -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for r in sorted(group):
            by.setdefault(self.node_of[r], []).append(r)
        return by

    # ------------------------------------------------------------------ ring
    def ring_channels(self, group: Sequence[int]) -> list[tuple[list[int], int | None]]:
        return ring_orders(group, self.node_of, self.nics, self.g)

    def ring(self, op: str, group: Sequence[int]) -> FlowPlan:
        """Rings over the group; ``op`` sets the volume (2(n-1)/n or (n-1)/n per edge)."""
        n = len(group)
        rings = self.ring_channels(group)
        factor = 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        edges: list[tuple[int, int, float, int | None]] = []
        for ring, rail in rings:
            for i in range(n):
                edges.append((ring[i], ring[(i + 1) % n], factor / len(rings), rail))
        n_nodes = len(self._by_node(group))
        plan = self._plan("ring", edges, n, n_nodes, len(rings), 0.0, factor)
        bus = sum(float(plan.bottleneck[i * n:(i + 1) * n].min()) for i in range(len(rings)))
        return _with_bus(plan, bus, nccl_channel_count(n_nodes, len(rings), self.g))

    def chain_broadcast(self, group: Sequence[int], root: int) -> FlowPlan:
        """Broadcast down the ring from ``root``: each chain edge carries the whole message."""
        rings = self.ring_channels(group)
        n = len(group)
        edges: list[tuple[int, int, float, int | None]] = []
        for ring, rail in rings:
            start = ring.index(root)
            order = ring[start:] + ring[:start]
            for i in range(n - 1):
                edges.append((order[i], order[i + 1], 1.0 / len(rings), rail))
        n_nodes = len(self._by_node(group))
        plan = self._plan("ring", edges, n, n_nodes, len(rings), 0.0, 1.0)
        bus = sum(float(plan.bottleneck[i * (n - 1):(i + 1) * (n - 1)].min())
                  for i in range(len(rings)))
        return _with_bus(plan, bus, nccl_channel_count(n_nodes, len(rings), self.g))

    # ------------------------------------------------------------------ tree
    def tree(self, group: Sequence[int], buffsize: float) -> FlowPlan:
        """Double binary tree across nodes, chains inside nodes (all-reduce)."""
        by = self._by_node(group)
        nodes = sorted(by)
        n_nodes = len(nodes)
        ppn = min(len(v) for v in by.values())
        chans = self.ring_channels(group) if n_nodes > 1 else [(sorted(group), None)]
        channels = len(chans)
        edges: list[tuple[int, int, float, int | None]] = []
        per = 0.5 / channels          # each tree carries half, spread over the channels
        for ring, rail in chans:
            heads = {}
            for node in nodes:
                chain = [r for r in ring if self.node_of[r] == node]
                heads[node] = chain[0]
                for a, b in zip(chain, chain[1:], strict=False):
                    # Both trees use the chain: reduce towards the head, broadcast back.
                    edges += [(b, a, 2 * per, None), (a, b, 2 * per, None)]
            for parents in double_binary_trees(n_nodes):
                for i, p in enumerate(parents):
                    if p < 0:
                        continue
                    child, parent = heads[nodes[i]], heads[nodes[p]]
                    edges += [(child, parent, per, rail), (parent, child, per, rail)]
        n = len(group)
        plan = self._plan("tree", edges, n, n_nodes, channels, 0.0, 2.0,
                          fill_stages=2 * (int(math.ceil(math.log2(max(n_nodes, 1)))) + ppn - 1),
                          chunk_bytes=buffsize / 8)
        # Each channel's NIC carries about twice the channel's data each way (interior in one
        # tree, leaf in the other), and NCCL counts a tree all-reduce as moving 2S per rank:
        # bus bandwidth = channels x the slowest edge.
        return _with_bus(plan, float(plan.bottleneck.min()) * channels,
                         nccl_channel_count(n_nodes, channels, self.g))

    # ------------------------------------------------------------------ NVLS
    def nvls(self, group: Sequence[int], efficiency: float, channels: int) -> FlowPlan:
        """NVLink SHARP all-reduce in one node: per GPU S(n+1)/n up to the NVSwitch and back."""
        n = len(group)
        switch = ("nvswitch", self.node_of[group[0]])
        edges_idx = []
        for r in group:
            gpu = self.fabric.gpu(r)
            up = self.fabric.graph.edges[gpu, switch]["index"]
            down = self.fabric.graph.edges[switch, gpu]["index"]
            edges_idx += [up, down]
        share = (n + 1) / n
        lengths = np.ones(len(edges_idx), dtype=np.int64)
        flat = np.array(edges_idx, dtype=np.int64)
        bottleneck = self.capacity[flat] * efficiency
        lat = np.array([self.fabric.latency[i] for i in edges_idx])
        bus = 2.0 * (n - 1) / (n + 1) * float(bottleneck.min())
        # Pipeline: copy into the multicast buffer, reduce, multicast, copy out (4 stages).
        return FlowPlan("nvls", flat, lengths, np.full(len(edges_idx), share), bottleneck, lat,
                        n, 1, channels, bus, 2.0 * (n - 1) / n, fill_stages=3,
                        chunk_bytes=128 * 1024)

    def nvls_tree(self, group: Sequence[int], efficiency: float, channels: int,
                  buffsize: float) -> FlowPlan:
        """NVLS inside each node; each GPU's 1/ppn shard all-reduced across nodes on its rail
        by a double binary tree."""
        by = self._by_node(group)
        nodes = sorted(by)
        ppn = min(len(v) for v in by.values())
        inner = [self.nvls(by[node], efficiency, channels) for node in nodes]
        edges: list[tuple[int, int, float, int | None]] = []
        shard = 1.0 / ppn
        for local in range(ppn):
            ranks = [by[node][local] for node in nodes]
            for parents in double_binary_trees(len(nodes)):
                for i, p in enumerate(parents):
                    if p >= 0:
                        edges += [(ranks[i], ranks[p], shard / 2, None),
                                  (ranks[p], ranks[i], shard / 2, None)]
        outer = self._plan("nvls_tree", edges, len(group), len(nodes), channels, 0.0, 2.0)
        flat = np.concatenate([p.flat for p in inner] + [outer.flat])
        lengths = np.concatenate([p.lengths for p in inner] + [outer.lengths])
        share = np.concatenate([p.share for p in inner] + [outer.share])
        bottleneck = np.concatenate([p.bottleneck for p in inner] + [outer.bottleneck])
        lat = np.concatenate([p.path_latency for p in inner] + [outer.path_latency])
        # Across nodes each GPU's rail moves about twice its shard each way (a node is interior
        # in one tree and a leaf in the other): the ppn rails together give ppn x a rail.
        net_bus = float(outer.bottleneck.min()) * ppn if outer.n_flows else math.inf
        bus = min(inner[0].bus_bw, net_bus)
        return FlowPlan("nvls_tree", flat, lengths, share, bottleneck, lat, len(group),
                        len(nodes), channels, bus, 2.0 * (len(group) - 1) / len(group),
                        fill_stages=3 + 2 * int(math.ceil(math.log2(max(len(nodes), 1)))),
                        chunk_bytes=buffsize / 8)

    # ------------------------------------------------------------------ p2p
    def p2p(self, pairs: Sequence[tuple[int, int]], share: float) -> FlowPlan:
        """One flow per (source, destination), each ``share`` bytes per message byte."""
        edges: list[tuple[int, int, float, int | None]] = [
            (s, d, share, None) for s, d in pairs if s != d]
        nodes = len({self.node_of[r] for p in pairs for r in p})
        ranks = len({r for p in pairs for r in p})
        plan = self._plan("p2p", edges, ranks, nodes, 1, 0.0, share * max(1, len(edges)) / ranks)
        return _with_bus(plan, float(plan.bottleneck.min()) if plan.n_flows else math.inf)


def _with_bus(plan: FlowPlan, bus: float, nccl_channels: int = 0) -> FlowPlan:
    return FlowPlan(plan.algorithm, plan.flat, plan.lengths, plan.share, plan.bottleneck,
                    plan.path_latency, plan.n_ranks, plan.n_nodes, plan.channels, bus,
                    plan.volume, plan.fill_stages, plan.chunk_bytes, nccl_channels)


# NCCL's ring/tree channels: through an NVSwitch its search finds 12 and doubles them (24,
# as NCCL_DEBUG=INFO prints on DGX A100/H100); across nodes the search finds one per NIC
# (search.cc), ncclTopoDupChannels does not double them on sm90+ below 50 GB/s per channel
# with more than 4 channels, connect.cc ncclTopoPostset doubles them (and doubles again on
# sm90+ multi-node only while under 16): 2 per NIC, at most MAXCHANNELS/2 = 32.
NVSWITCH_CHANNELS = 24
MAX_SEARCH_CHANNELS = 32


def nccl_channel_count(n_nodes: int, flow_channels: int, gpus_per_node: int) -> int:
    """How many channels NCCL runs a ring or tree on (its per-channel caps use this)."""
    if n_nodes <= 1:
        return NVSWITCH_CHANNELS if gpus_per_node >= NVSWITCH_MIN_GPUS else 2
    return min(MAX_SEARCH_CHANNELS, 2 * flow_channels)


def nic_gpu(k: int, nics: int, gpus_per_node: int) -> int:
    """The local GPU NCCL pairs with NIC ``k``: the one on the same PCIe switch.

    With more NICs than GPUs several NICs share a GPU; with fewer, NIC k serves the GPUs whose
    rail it is and the first of them drives it.

    Examples
    --------
    >>> [nic_gpu(k, 32, 8) for k in (0, 3, 4, 31)], [nic_gpu(k, 4, 8) for k in range(4)]
    ([0, 0, 1, 7], [0, 2, 4, 6])
    """
    if nics >= gpus_per_node:
        return k * gpus_per_node // nics
    return -(-k * gpus_per_node // nics)


def ring_orders(group: Sequence[int], node_of: dict[int, int], nics_per_node: int,
                gpus_per_node: int | None = None) -> list[tuple[list[int], int | None]]:
    """The ring of each channel over ``group``, with the NIC (rail) it crosses nodes on.

    Inside one node there is one ring. Across nodes there is one channel per NIC; channel k
    enters every node at the GPU paired with NIC k (or the next member of the group after it)
    and goes round the node's GPUs from there.

    Examples
    --------
    Two nodes of two GPUs, two NICs: two channels, entering each node at a different GPU.

    >>> ring_orders([0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 2)
    [([0, 1, 2, 3], 0), ([1, 0, 3, 2], 1)]
    """
    by_node: dict[int, list[int]] = {}
    for r in sorted(group):
        by_node.setdefault(node_of[r], []).append(r)
    nodes = sorted(by_node)
    if len(nodes) == 1 or nics_per_node < 1:
        return [(sorted(group), None)]
    g = gpus_per_node or max(len(v) for v in by_node.values())
    rings: list[tuple[list[int], int | None]] = []
    for k in range(nics_per_node):
        entry = nic_gpu(k, nics_per_node, g)
        ring: list[int] = []
        for node in nodes:
            members = by_node[node]
            locals_ = [r % g for r in members]
            # First member at or after the NIC's GPU, wrapping round the node.
            s = next((i for i, loc in enumerate(locals_) if loc >= entry), 0)
            ring += members[s:] + members[:s]
        rings.append((ring, k))
    return rings


def double_binary_trees(n: int) -> list[list[int]]:
    """Parents of each of ``n`` nodes in NCCL's two complementary binary trees (-1: root).

    Tree 0 is a binary tree over 0..n-1 in heap order; tree 1 mirrors it (node i takes the
    place of n-1-i), so a node that is a leaf in one tree is interior in the other (Sanders et
    al., 2009), and each tree carries half the data.

    Examples
    --------
    >>> double_binary_trees(4)
    [[-1, 0, 0, 1], [2, 3, 3, -1]]
    """
    if n <= 1:
        return [[-1] * n, [-1] * n]
    first = [-1] + [(i - 1) // 2 for i in range(1, n)]
    second = [-1] * n
    for i in range(n):
        p = first[n - 1 - i]
        second[i] = -1 if p < 0 else n - 1 - p
    return [first, second]
