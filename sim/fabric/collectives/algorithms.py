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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from sim.fabric.collectives.chain import ring_chain, tree_depth
from sim.fabric.topology import CROSS_AZ, CROSS_REGION, Fabric

NVSWITCH_MIN_GPUS = 2
# One edge of an algorithm: (source rank, destination rank, NIC or None).
Hop = tuple[int, int, int | None]


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
    """Each flow's rate alone on the fabric (bytes/s): its slowest link's capacity divided by
    how many times the flow crosses that link."""
    path_latency: np.ndarray
    """Each flow's longest one-way hop latency (s): a flow that strings several hops together
    (a lock-step ring) is windowed by its slowest round trip."""
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
    chain_latency_s: float = 0.0
    """Long-haul propagation along the algorithm's chain of dependent steps (s): the sum of the
    ``cross_az``/``cross_region`` link latencies its data crosses one after the other (a ring
    all-reduce's 2(n-1) consecutive edges, a tree's depth up and down, a send's path). Only
    these count: NCCL's own latency model (``hwLat`` per step in ``tuning.cc``) already covers
    the ~1-3 us of an in-datacenter hop, so only propagation beyond one datacenter is added."""
    flow_channels: float = 1.0
    """NCCL channels each flow stands for; each keeps one ``NCCL_BUFFSIZE`` in flight per peer,
    so a flow's window is ``flow_channels * buffsize / RTT``."""
    window_bytes: float = 0.0
    """Bytes in flight per NCCL channel and peer; 0: ``NCCL_BUFFSIZE`` (collectives)."""
    flow_edges: np.ndarray | None = None
    """Algorithm edges each flow strings together (None: one each); each edge delivers the
    flow's bytes, so the data a plan delivers is ``(share * flow_edges).sum()`` per byte."""

    @property
    def delivered(self) -> float:
        """Bytes the plan's edges deliver per byte of message (every edge counted)."""
        if self.flow_edges is None:
            return float(self.share.sum())
        return float((self.share * self.flow_edges).sum())

    @property
    def n_flows(self) -> int:
        return len(self.lengths)


class PlanBuilder:
    """Builds flow plans on one fabric; routes and edge data are cached."""

    def __init__(self, fabric: Fabric, capacity: np.ndarray, cross_nic: int = 2,
                 pxn: bool = True) -> None:
        self.fabric = fabric
        self.capacity = capacity
        self.cross_nic = cross_nic
        self.pxn = pxn
        """NCCL_PXN_DISABLE=0 (the default): sends (:data:`P2P_ROUTE` edges) go by PXN."""
        self.g = fabric.spec.gpus_per_node
        self.nics = fabric.spec.nics_per_node
        self.node_of = {r: fabric.node_of(r) for r in range(fabric.n_gpus)}
        self._edges: dict[tuple[int, int, int | None], tuple[tuple[int, ...], float, float]] = {}
        self._routes: dict[tuple[int, int, int | None], tuple[tuple[int, ...], float]] = {}
        # Propagation of the links between zones and regions (see sim.fabric.collectives.chain).
        long = (fabric.kind == CROSS_AZ) | (fabric.kind == CROSS_REGION)
        self._long_lat: list[float] = np.where(long, fabric.latency, 0.0).tolist()
        self.long_links = bool(long.any())
        """Whether the fabric has zone or region links: without them every edge's long-haul
        propagation, and so every chain latency, is 0.0."""
        self._long_haul: dict[tuple[int, int, int | None], float] = {}
        self._alone: dict[tuple[int, int, int | None], float] = {}
        # Paths at least this long are counted with bincount over the link ids (its cost is
        # the number of links); shorter ones with np.unique (its cost is the path's).
        self._long_path = max(1, len(capacity) // 32)
        # The capacities as Python floats (fixed for the builder's life, as its edge caches
        # already assume).
        self._cap: list[float] = capacity.tolist()

    # ------------------------------------------------------------------ edges
    def edge(self, src: int, dst: int, rail: int | None = None
             ) -> tuple[tuple[int, ...], float, float]:
        """(links, bottleneck, latency) of one algorithm edge. Between nodes the data leaves by
        NIC ``rail`` (default: the receiver's rail NIC). When that NIC is not the source GPU's
        own (the one on its PCIe switch), the data first goes over NVLink to the GPU paired with
        that NIC (PXN); cross_nic=1 lets the edge leave by the source GPU's own NIC instead."""
        key = (src, dst, rail)
        hit = self._edges.get(key)
        if hit is not None:
            return hit
        links, slowest = self._links(src, dst, rail)
        out = (links, slowest, float(self.fabric.path_latency(links)))
        self._edges[key] = out
        return out

    def _links(self, src: int, dst: int, rail: int | None) -> tuple[tuple[int, ...], float]:
        """(links, bottleneck) of one algorithm edge (:meth:`edge` without its latency)."""
        key = (src, dst, rail)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        fab = self.fabric
        # A send (search.cc ncclTopoGetNetDev without a graph) goes by PXN to the receiver's
        # rail whatever NCCL_CROSS_NIC says, or with PXN disabled by each GPU's own NIC.
        send = rail == P2P_ROUTE
        if send:
            rail = None
        if (self.node_of[src] == self.node_of[dst] or self.nics < 1
                or (not self.pxn if send else self.cross_nic == 1)):
            links = fab.route(src, dst)
        else:
            k = fab.rail_of(dst) if rail is None else rail
            proxy = self.node_of[src] * self.g + nic_gpu(k, self.nics, self.g)
            if proxy == src or fab.rail_of(src) == k:
                # NIC k hangs off the source GPU's own PCIe switch: GPUDirect, no NVLink hop.
                links = fab.route(src, dst, k)
            else:
                links = fab.route(src, proxy) + fab.route(proxy, dst, k)
        # Python's min over the few links' capacities as floats: the same minimum as numpy's,
        # without a numpy call per edge (295k routes for ZeRO-3's 16,384-rank all-reduce).
        cap = self._cap
        out = (links, min(cap[i] for i in links))
        self._routes[key] = out
        return out

    def long_haul(self, src: int, dst: int, rail: int | None = None) -> float:
        """Propagation of the zone and region links on one edge (s), see
        :mod:`sim.fabric.collectives.chain`."""
        if not self.long_links:
            return 0.0     # the sum of the edge's zero long-haul latencies
        key = (src, dst, rail)
        hit = self._long_haul.get(key)
        if hit is None:
            lat = self._long_lat
            hit = self._long_haul[key] = float(sum(lat[i] for i in self.edge(src, dst, rail)[0]))
        return hit

    def _plan(self, algorithm: str, edges: list[tuple[int, int, float, int | None]],
              n_ranks: int, n_nodes: int, channels: int, bus_bw: float, volume: float,
              fill_stages: int = 0, chunk_bytes: float = 0.0) -> FlowPlan:
        """A plan of one independent flow per edge (each edge's own share)."""
        return self._lockstep(algorithm, [([(s, d, rail)], share) for s, d, share, rail in edges],
                              n_ranks, n_nodes, channels, bus_bw, volume, fill_stages,
                              chunk_bytes)

    def _lockstep(self, algorithm: str, flows: list[tuple[list[Hop], float]],
                  n_ranks: int, n_nodes: int, channels: int, bus_bw: float, volume: float,
                  fill_stages: int = 0, chunk_bytes: float = 0.0) -> FlowPlan:
        """A plan of one flow per list of edges that advance together (a ring channel, one tree
        of a channel): the flow's path strings all its edges' links, so the max-min solve
        gives it the rate its most loaded link allows, every edge moves the same bytes, and a
        link crossed twice carries twice (incidences are counted, not links)."""
        paths: list[tuple[int, ...]] = []
        bottleneck, latency = [], []
        for hops, _ in flows:
            if len(hops) == 1:
                # One edge (p2p, PAT): its links, rate alone and latency are cached per edge.
                s, d, rail = hops[0]
                links, _, lat = self.edge(s, d, rail)
                paths.append(links)
                bottleneck.append(self._edge_alone(s, d, rail))
                latency.append(lat)
                continue
            data = [self.edge(s, d, rail) for s, d, rail in hops]
            path = tuple(itertools.chain.from_iterable(x[0] for x in data))
            paths.append(path)
            if not path:
                bottleneck.append(math.inf)
            elif len(path) < self._long_path and len(set(path)) == len(path):
                # No link crossed twice: every count is 1, so the bottleneck is the slowest
                # edge's (the minimum of the edges' minima, the same float).
                bottleneck.append(min(x[1] for x in data))
            else:
                bottleneck.append(self._counted_min(path))
            latency.append(max((x[2] for x in data), default=0.0))
        lengths = np.array([len(p) for p in paths], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64,
                           count=int(lengths.sum()))
        return FlowPlan(algorithm, flat, lengths, np.array([f[1] for f in flows], dtype=float),
                        np.array(bottleneck), np.array(latency), n_ranks, n_nodes, channels,
                        bus_bw, volume, fill_stages, chunk_bytes,
                        flow_edges=np.array([len(f[0]) for f in flows], dtype=np.int64))

    def _edge_alone(self, src: int, dst: int, rail: int | None) -> float:
        """One edge's rate alone on the fabric: its slowest link's capacity over the times
        the edge crosses that link (cached per edge; a route that repeats no link has the
        edge's own bottleneck)."""
        key = (src, dst, rail)
        hit = self._alone.get(key)
        if hit is None:
            links, slowest = self._links(src, dst, rail)
            hit = slowest if len(set(links)) == len(links) else self._counted_min(links)
            self._alone[key] = hit
        return hit

    def _counted_min(self, path: tuple[int, ...]) -> float:
        """min over the links of ``path`` of capacity / times the path crosses the link.

        The links come out in ascending order and each quotient is one float division
        either way, so both branches give the same float; a long path (a tree's flow over
        16,384 ranks) is counted by ``bincount`` over the link ids instead of a sort."""
        arr = np.array(path, dtype=np.int64)
        if len(arr) >= self._long_path:
            counts = np.bincount(arr)
            links = np.flatnonzero(counts)
            times = counts[links]
        else:
            links, times = np.unique(arr, return_counts=True)
        return float((self.capacity[links] / times).min())

    def _by_node(self, group: Sequence[int]) -> dict[int, list[int]]:
        by: dict[int, list[int]] = {}
        for r in sorted(group):
            by.setdefault(self.node_of[r], []).append(r)
        return by

    def _tree_chain(self, ranks: Sequence[int], rail: int | None) -> float:
        """Up-and-down latency of the slower of the two trees over ``ranks`` (one per node)."""
        worst = 0.0
        if not self.long_links:
            return worst   # every hop's long haul is 0.0, and so is every depth
        for parents in double_binary_trees(len(ranks)):
            up = [self.long_haul(ranks[i], ranks[p], rail) if p >= 0 else 0.0
                  for i, p in enumerate(parents)]
            down = [self.long_haul(ranks[p], ranks[i], rail) if p >= 0 else 0.0
                    for i, p in enumerate(parents)]
            worst = max(worst, tree_depth(parents, up, down))
        return worst

    # ------------------------------------------------------------------ ring
    def ring_channels(self, group: Sequence[int]) -> list[tuple[list[int], int | None]]:
        """The ring of each channel (:func:`ring_orders`). A one-GPU-per-node ring whose GPUs
        all sit at the same place in their nodes gets one channel per NIC on that GPU's own
        PCIe switch (NCCL spreads its channels over the NICs nearest the GPU, all at PIX
        distance; on a DGX H100 that is one)."""
        rings = ring_orders(group, self.node_of, self.nics, self.g)
        if len(rings) != 1 or rings[0][1] is not None or len(self._by_node(group)) < 2:
            return rings
        locals_ = {r % self.g for r in group}
        if len(locals_) != 1:
            return rings
        spec = self.fabric.spec
        switch = spec.pcie_switch_of_gpu(locals_.pop())
        own = [k for k in range(self.nics) if spec.pcie_switch_of_nic(k) == switch]
        if len(own) <= 1:
            return rings
        return [(rings[0][0], k) for k in own]

    def ring(self, op: str, group: Sequence[int]) -> FlowPlan:
        """Rings over the group, one lock-step flow per channel; ``op`` sets the volume
        (2(n-1)/n or (n-1)/n per edge) and the chain (2(n-1) or n-1 dependent hops)."""
        n = len(group)
        rings = self.ring_channels(group)
        factor = 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        flows = [([(ring[i], ring[(i + 1) % n], rail) for i in range(n)], factor / len(rings))
                 for ring, rail in rings]
        chain = 0.0    # ring_chain of hops that are all 0.0 without zone or region links
        if self.long_links:
            chain = max(ring_chain([self.long_haul(ring[i], ring[(i + 1) % n], rail)
                                    for i in range(n)], steps) for ring, rail in rings)
        n_nodes = len(self._by_node(group))
        plan = self._lockstep("ring", flows, n, n_nodes, len(rings), 0.0, factor)
        return _with_bus(plan, _ring_bus(plan.bottleneck),
                         nccl_channel_count(n_nodes, len(rings), self.g), chain)

    def chain_broadcast(self, group: Sequence[int], root: int) -> FlowPlan:
        """Broadcast down the ring from ``root``: each chain edge carries the whole message."""
        rings = self.ring_channels(group)
        n = len(group)
        flows = []
        chain = 0.0
        for ring, rail in rings:
            start = ring.index(root)
            order = ring[start:] + ring[:start]
            hops = [(order[i], order[i + 1], rail) for i in range(n - 1)]
            flows.append((hops, 1.0 / len(rings)))
            chain = max(chain, sum(self.long_haul(*h) for h in hops))
        n_nodes = len(self._by_node(group))
        plan = self._lockstep("ring", flows, n, n_nodes, len(rings), 0.0, 1.0)
        return _with_bus(plan, float(plan.bottleneck.sum()),
                         nccl_channel_count(n_nodes, len(rings), self.g), chain)

    # ------------------------------------------------------------------ tree
    def tree(self, group: Sequence[int], buffsize: float) -> FlowPlan:
        """Double binary tree across nodes, chains inside nodes (all-reduce). Each tree of
        each channel is one lock-step flow: its chains (reduce towards the head, broadcast
        back) and its tree edges up and down; both trees use the chains."""
        by = self._by_node(group)
        nodes = sorted(by)
        n_nodes = len(nodes)
        ppn = min(len(v) for v in by.values())
        chans = self.ring_channels(group) if n_nodes > 1 else [(sorted(group), None)]
        channels = len(chans)
        flows: list[tuple[list[Hop], float]] = []
        per = 0.5 / channels          # each tree carries half, spread over the channels
        chain = 0.0
        node_of = self.node_of
        for ring, rail in chans:
            # The ring's members on each node, in ring order: grouped in one pass (a scan of
            # the ring per node is quadratic, 2,048 x 16,384 per channel at 16k GPUs).
            in_ring: dict[int, list[int]] = {}
            for r in ring:
                in_ring.setdefault(node_of[r], []).append(r)
            heads: dict[int, int] = {}
            chains: list[Hop] = []
            for node in nodes:
                members = in_ring[node]
                heads[node] = members[0]
                for a, b in zip(members, members[1:], strict=False):
                    chains += [(b, a, None), (a, b, None)]
            for parents in double_binary_trees(n_nodes):
                hops = list(chains)
                for i, p in enumerate(parents):
                    if p >= 0:
                        child, parent = heads[nodes[i]], heads[nodes[p]]
                        hops += [(child, parent, rail), (parent, child, rail)]
                flows.append((hops, per))
            chain = max(chain, self._tree_chain([heads[node] for node in nodes], rail))
        n = len(group)
        plan = self._lockstep("tree", flows, n, n_nodes, channels, 0.0, 2.0,
                              fill_stages=2 * (int(math.ceil(math.log2(max(n_nodes, 1))))
                                               + ppn - 1),
                              chunk_bytes=buffsize / 8)
        # Each channel's NIC carries about twice the channel's data each way (interior in one
        # tree, leaf in the other), and NCCL counts a tree all-reduce as moving 2S per rank:
        # bus bandwidth = channels x the slowest edge.
        slowest = min(self.edge(s, d, r)[1] for hops, _ in flows for s, d, r in hops)
        return _with_bus(plan, slowest * channels, nccl_channel_count(n_nodes, channels, self.g),
                         chain)

    # ------------------------------------------------------------------ NVLS
    def nvls(self, group: Sequence[int], efficiency: float, channels: int) -> FlowPlan:
        """NVLink SHARP all-reduce in one node: per GPU S(n+1)/n up to the NVSwitch and back,
        one lock-step flow over every GPU's NVLink port (the switch reduces a chunk only when
        every GPU's share of it has arrived)."""
        n = len(group)
        switch = ("nvswitch", self.node_of[group[0]])
        edges_idx = []
        for r in group:
            gpu = self.fabric.gpu(r)
            edges_idx += [self.fabric.graph.edges[gpu, switch]["index"],
                          self.fabric.graph.edges[switch, gpu]["index"]]
        flat = np.array(edges_idx, dtype=np.int64)
        bottleneck = float(self.capacity[flat].min()) * efficiency
        lat = max(float(self.fabric.latency[i]) for i in edges_idx)
        bus = 2.0 * (n - 1) / (n + 1) * bottleneck
        # Pipeline: copy into the multicast buffer, reduce, multicast, copy out (4 stages).
        return FlowPlan("nvls", flat, np.array([len(flat)], dtype=np.int64),
                        np.array([(n + 1) / n]), np.array([bottleneck]), np.array([lat]),
                        n, 1, channels, bus, 2.0 * (n - 1) / n, fill_stages=3,
                        chunk_bytes=128 * 1024, flow_channels=float(channels),
                        flow_edges=np.array([len(flat)], dtype=np.int64))

    def nvls_tree(self, group: Sequence[int], efficiency: float, channels: int,
                  buffsize: float) -> FlowPlan:
        """NVLS inside each node; each GPU's 1/ppn shard all-reduced across nodes on its rail
        by a double binary tree (one lock-step flow per rail and tree)."""
        by = self._by_node(group)
        nodes = sorted(by)
        ppn = min(len(v) for v in by.values())
        inner = [self.nvls(by[node], efficiency, channels) for node in nodes]
        flows: list[tuple[list[Hop], float]] = []
        shard = 1.0 / ppn
        chain = 0.0
        for local in range(ppn):
            ranks = [by[node][local] for node in nodes]
            for parents in double_binary_trees(len(nodes)):
                hops: list[Hop] = []
                for i, p in enumerate(parents):
                    if p >= 0:
                        hops += [(ranks[i], ranks[p], None), (ranks[p], ranks[i], None)]
                if hops:
                    flows.append((hops, shard / 2))
            chain = max(chain, self._tree_chain(ranks, None))
        outer = self._lockstep("nvls_tree", flows, len(group), len(nodes), channels, 0.0, 2.0)
        flat = np.concatenate([p.flat for p in inner] + [outer.flat])
        lengths = np.concatenate([p.lengths for p in inner] + [outer.lengths])
        share = np.concatenate([p.share for p in inner] + [outer.share])
        bottleneck = np.concatenate([p.bottleneck for p in inner] + [outer.bottleneck])
        lat = np.concatenate([p.path_latency for p in inner] + [outer.path_latency])
        n_edges = np.concatenate([p.flow_edges for p in inner if p.flow_edges is not None]
                                 + [outer.flow_edges if outer.flow_edges is not None
                                    else np.ones(outer.n_flows, dtype=np.int64)])
        # Across nodes each GPU's rail moves about twice its shard each way (a node is interior
        # in one tree and a leaf in the other): the ppn rails together give ppn x a rail.
        edge_min = min((self.edge(s, d, r)[1] for hops, _ in flows for s, d, r in hops),
                       default=math.inf)
        net_bus = edge_min * ppn if flows else math.inf
        bus = min(inner[0].bus_bw, net_bus)
        # NVLS channels are split between the two trees of every rail.
        return FlowPlan("nvls_tree", flat, lengths, share, bottleneck, lat, len(group),
                        len(nodes), channels, bus, 2.0 * (len(group) - 1) / len(group),
                        fill_stages=3 + 2 * int(math.ceil(math.log2(max(len(nodes), 1)))),
                        chunk_bytes=buffsize / 8, chain_latency_s=chain,
                        flow_channels=max(1.0, channels / 2), flow_edges=n_edges)

    # ------------------------------------------------------------------ p2p
    def p2p(self, pairs: Sequence[tuple[int, int]], share: float) -> FlowPlan:
        """One flow per (source, destination), each ``share`` bytes per message byte; the
        chain is the slowest pair's path (a send crosses it once)."""
        edges: list[tuple[int, int, float, int | None]] = [
            (s, d, share, P2P_ROUTE) for s, d in pairs if s != d]
        nodes = len({self.node_of[r] for p in pairs for r in p})
        ranks = len({r for p in pairs for r in p})
        plan = self._plan("p2p", edges, ranks, nodes, 1, 0.0, share * max(1, len(edges)) / ranks)
        chain = max((self.long_haul(s, d) for s, d, _, _ in edges), default=0.0)
        return replace(plan, bus_bw=float(plan.bottleneck.min()) if plan.n_flows else math.inf,
                       chain_latency_s=chain, flow_channels=float(P2P_CHANNELS_PER_PEER),
                       window_bytes=float(NCCL_STEPS * P2P_NET_CHUNK_BYTES))


# The ``rail`` of a send's edge: NCCL's p2p route (PXN unless disabled), not a ring's rail.
P2P_ROUTE = -1

# Send/recv to one peer over the network runs on NCCL_NCHANNELS_PER_NET_PEER channels, 2 by
# default (src/graph/paths.cc, ncclTopoGetNchannels), each moving NCCL_P2P_NET_CHUNKSIZE
# (128 KiB, src/init.cc) per step with NCCL_STEPS (8, src/include/device.h) steps in flight.
P2P_CHANNELS_PER_PEER = 2
P2P_NET_CHUNK_BYTES = 128 * 1024
NCCL_STEPS = 8


def _ring_bus(bottleneck: np.ndarray) -> float:
    """A ring's bus bandwidth as NCCL's tuner sees it: its graph search gives every channel
    one speed, the one all of them sustain (search.cc ncclTopoCompute: ``bwIntra``/``bwInter``
    per channel), and busBw = nChannels x that speed (tuning.cc). Equal channels: their sum
    (bit for bit what it always was); unequal ones (a NIC link slowed by ``faults``): the
    slowest times their count, as the lock-step flows then run."""
    if len(bottleneck) == 0:
        return 0.0
    low = float(bottleneck.min())
    return float(bottleneck.sum()) if low == float(bottleneck.max()) else low * len(bottleneck)


def _with_bus(plan: FlowPlan, bus: float, nccl_channels: int = 0,
              chain_latency_s: float = 0.0) -> FlowPlan:
    # Each flow stands for an equal part of NCCL's channels (a ring's flow for
    # nccl_channels / rings of them, a tree's for half a channel pair).
    per_flow = (nccl_channels or plan.channels) / max(1, plan.n_flows)
    return replace(plan, bus_bw=bus, nccl_channels=nccl_channels,
                   chain_latency_s=chain_latency_s, flow_channels=max(1.0, per_flow))


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
    and goes round the node's GPUs from there. A group with one GPU per node (the
    data-parallel groups at TP=8) stays on each GPU's own rail: NCCL's search finds the NIC
    nearest the GPU (on its PCIe switch) and builds its channels there, never through another
    GPU's NVLink and NIC (``ncclTopoCompute`` in ``src/graph/search.cc`` tries paths of the
    closest type first; PXN is only used to reach a peer's rail from a node with several
    GPUs). It is one channel (rail None: the GPUs' own NICs); NCCL runs two on it
    (:func:`nccl_channel_count`).

    Examples
    --------
    Two nodes of two GPUs, two NICs: two channels, entering each node at a different GPU.

    >>> ring_orders([0, 1, 2, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 2)
    [([0, 1, 2, 3], 0), ([1, 0, 3, 2], 1)]

    One GPU per node: one channel on the GPUs' own rails.

    >>> ring_orders([1, 3], {0: 0, 1: 0, 2: 1, 3: 1}, 2)
    [([1, 3], None)]
    """
    by_node: dict[int, list[int]] = {}
    for r in sorted(group):
        by_node.setdefault(node_of[r], []).append(r)
    nodes = sorted(by_node)
    if len(nodes) == 1 or nics_per_node < 1:
        return [(sorted(group), None)]
    if all(len(v) == 1 for v in by_node.values()):
        return [([by_node[node][0] for node in nodes], None)]
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
