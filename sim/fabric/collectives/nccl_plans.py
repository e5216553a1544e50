"""Flow plans of NCCL's newer algorithms: PAT, NVLS all-gather/reduce-scatter, CollNet.

Like :mod:`sim.fabric.collectives.algorithms`, each plan is one phase of concurrent flows carrying
the real bytes of every link per byte of message (nccl-tests' size: the whole buffer of an
all-gather or reduce-scatter, the buffer of an all-reduce), so the bytes per link class come
out of the flows and their time out of the max-min solve.

* **pat** (all-gather, reduce-scatter; one GPU per node, NCCL >= 2.23): Parallel Aggregated
  Trees, a Bruck-like exchange at distances 1, 2, 4, ... (``src/device/prims_simple.h``
  patSteps, ``src/include/collectives.h`` PatAGAlgorithm): at distance d a rank exchanges
  min(d, n-d) shards with the rank d away, so every rank moves (n-1)/n of the buffer in
  log2(n) dependent steps instead of the ring's n-1.
* **nvls_gather** (all-gather, reduce-scatter in one NVLink domain): NVLink SHARP. An
  all-gather stores each GPU's shard once to the multicast address (``multimem.st``) and the
  NVSwitch writes it to every GPU: per GPU S/n up its NVLink, S down; a reduce-scatter is the
  reverse (``multimem.ld_reduce`` reads every GPU's copy of a shard): S up, S/n down.
* **collnet_direct** (all-reduce across nodes, SHARP switches): inside each node a direct
  reduce-scatter to the node's heads (one per NIC), each head's shard reduced in the network
  switches (one stream per link of the aggregation tree), and a direct all-gather back:
  per GPU 2(ppn-1)/ppn of the buffer over NVLink, S/ppn each way through its NIC.
* **collnet_chain**: the same network part, the node's GPUs in a chain to the head instead
  of direct (reduce up the chain, broadcast down it), one chain per head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from sim.fabric.collectives.algorithms import FlowPlan, PlanBuilder, nccl_channel_count

# Fabric graph vertices that are not switches: an aggregation tree reduces in every vertex
# that is none of these (leaf, spine, zone and region gateways).
_ENDPOINT_KINDS = frozenset({"gpu", "pcie", "nic", "nvswitch", "cpu", "host", "nvme"})


def _raw(b: PlanBuilder, algorithm: str, paths: list[tuple[tuple[int, ...], float]],
         n_ranks: int, n_nodes: int, channels: int, bus_bw: float, volume: float,
         nccl_channels: int, fill_stages: int = 0, chunk_bytes: float = 0.0) -> FlowPlan:
    """A plan from explicit link paths and shares."""
    fab = b.fabric
    lengths = np.array([len(p) for p, _ in paths], dtype=np.int64)
    flat = np.fromiter((i for p, _ in paths for i in p), dtype=np.int64,
                       count=int(lengths.sum()))
    bottleneck = np.array([float(b.capacity[list(p)].min()) for p, _ in paths])
    latency = np.array([float(fab.path_latency(p)) for p, _ in paths])
    return FlowPlan(algorithm, flat, lengths, np.array([s for _, s in paths]), bottleneck,
                    latency, n_ranks, n_nodes, channels, bus_bw, volume, fill_stages,
                    chunk_bytes, nccl_channels)


def _pat_steps(op: str, group: Sequence[int]) -> list[list[tuple[int, int, float]]]:
    """PAT's dependent steps, distances 1, 2, 4, ...: each rank's (source, destination,
    shards / n) at that distance."""
    ranks = sorted(group)
    n = len(ranks)
    steps = []
    d = 1
    while d < n:
        shards = min(d, n - d)
        # All-gather sends towards r + d; reduce-scatter the mirror image: same bytes.
        steps.append([(r, ranks[(i + d) % n] if op == "all_gather" else ranks[(i - d) % n],
                       shards / n) for i, r in enumerate(ranks)])
        d *= 2
    return steps


def pat(b: PlanBuilder, op: str, group: Sequence[int]) -> FlowPlan:
    """PAT all-gather / reduce-scatter over one GPU per node."""
    n = len(group)
    edges: list[tuple[int, int, float, int | None]] = []
    chain = 0.0
    for step_edges in _pat_steps(op, group):
        edges += [(r, dst, share, None) for r, dst, share in step_edges]
        # The log2(n) distances are dependent steps: each pays its slowest long-haul hop
        # (sim.fabric.collectives.chain).
        chain += max(b.long_haul(r, dst) for r, dst, _ in step_edges)
    plan = b._plan("pat", edges, n, n, 1, 0.0, 1.0)
    # NCCL: busBw = nChannels x the tree graph's per-channel bandwidth; all-gather and
    # reduce-scatter keep busBw as algBw for PAT (no nRanks/nsteps ratio): volume 1. The
    # physical counterpart is each rank's own path out, its slowest link.
    bus = float(plan.bottleneck.min()) if plan.n_flows else math.inf
    return FlowPlan("pat", plan.flat, plan.lengths, plan.share, plan.bottleneck,
                    plan.path_latency, n, n, 1, bus, 1.0, 0, 0.0,
                    nccl_channel_count(n, 1, b.g), chain_latency_s=chain)


def pat_bus_only(b: PlanBuilder, op: str, group: Sequence[int]) -> FlowPlan:
    """What NCCL's cost model reads of :func:`pat` (algorithm, ranks, nodes, channels, bus
    bandwidth, volume), without its flows: the bus bandwidth is the same minimum over the
    same edges' rates alone, so the choice is the same. The runner builds the flows
    (:func:`pat`) only when PAT wins."""
    n = len(group)
    bus = min((b._edge_alone(r, dst, None) for step_edges in _pat_steps(op, group)
               for r, dst, _ in step_edges), default=math.inf)
    empty = np.zeros(0)
    return FlowPlan("pat", np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), empty,
                    empty, empty, n, n, 1, bus, 1.0, 0, 0.0, nccl_channel_count(n, 1, b.g))


def nvls_gather(b: PlanBuilder, op: str, group: Sequence[int], efficiency: float,
                channels: int) -> FlowPlan:
    """NVLS all-gather or reduce-scatter inside one node (NVSwitch multicast/reduction)."""
    n = len(group)
    fab = b.fabric
    switch = ("nvswitch", b.node_of[group[0]])
    up_share, down_share = (1.0 / n, 1.0) if op == "all_gather" else (1.0, 1.0 / n)
    idx: list[int] = []
    share: list[float] = []
    for r in group:
        gpu = fab.gpu(r)
        idx += [fab.graph.edges[gpu, switch]["index"], fab.graph.edges[switch, gpu]["index"]]
        share += [up_share, down_share]
    flat = np.array(idx, dtype=np.int64)
    bottleneck = b.capacity[flat] * efficiency
    lat = np.array([fab.latency[i] for i in idx])
    # NCCL (tuning.cc): busBw = nChannels x bwIntra x nvlsEfficiency x (nCh-1)/nCh x
    # (ppn-1)/ppn, kept as algBw for all-gather/reduce-scatter (volume 1).
    bus = float(bottleneck.min()) * (n - 1) / n
    return FlowPlan("nvls", flat, np.ones(len(idx), dtype=np.int64), np.array(share),
                    bottleneck, lat, n, 1, channels, bus, 1.0, fill_stages=1,
                    chunk_bytes=128 * 1024)


def _switch_split(b: PlanBuilder, links: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
    """(access up to the first switch, switch-to-switch links, access down from the last)."""
    ends = b.fabric.endpoints
    first = next(i for i, link in enumerate(links) if ends[link][1][0] not in _ENDPOINT_KINDS)
    last = max(i for i, link in enumerate(links) if ends[link][0][0] not in _ENDPOINT_KINDS)
    return links[:first + 1], list(links[first + 1:last]), links[last:]


def _sharp_tree(b: PlanBuilder, heads: list[int], share: float
                ) -> list[tuple[tuple[int, ...], float]]:
    """The SHARP aggregation tree of one rail: every head's access links up and down, and
    each switch-to-switch link once in each direction (the switches reduce: one stream)."""
    fab = b.fabric
    paths: list[tuple[tuple[int, ...], float]] = []
    root = heads[0]
    middle: set[int] = set()
    for h in heads:
        other = heads[1] if h == root else root
        rail = fab.rail_of(h)
        up, mid_up, _ = _switch_split(b, tuple(fab.route(h, other, rail)))
        _, mid_down, down = _switch_split(b, tuple(fab.route(other, h, rail)))
        paths += [(up, share), (down, share)]
        if h != root:
            middle.update(mid_up)
            middle.update(mid_down)
    paths += [((link,), share) for link in sorted(middle)]
    return paths


def _collnet(b: PlanBuilder, algorithm: str, group: Sequence[int], buffsize: float
             ) -> FlowPlan:
    by = b._by_node(group)
    nodes = sorted(by)
    ppn = min(len(v) for v in by.values())
    n = len(group)
    fab = b.fabric
    paths: list[tuple[tuple[int, ...], float]] = []
    for node in nodes:
        local = by[node]
        if algorithm == "collnet_direct":
            # Direct reduce-scatter to the heads and all-gather back: 2/ppn per ordered pair.
            for s in local:
                for d in local:
                    if s != d:
                        paths.append((tuple(fab.route(s, d)), 2.0 / ppn))
        else:
            # One chain per head, ending at it: reduce up, broadcast down, 1/ppn each way.
            for c in range(ppn):
                chain = local[c + 1:] + local[:c + 1]
                for a, z in zip(chain, chain[1:], strict=False):
                    paths += [(tuple(fab.route(a, z)), 1.0 / ppn),
                              (tuple(fab.route(z, a)), 1.0 / ppn)]
    nvl = min((float(b.capacity[list(p)].min()) for p, _ in paths), default=math.inf)
    nic = math.inf
    propagation = 0.0
    for k in range(ppn):
        heads = [by[node][k] for node in nodes]
        # Reduced up the aggregation tree to its root and multicast back down
        # (sim.fabric.collectives.chain): the slowest head's long-haul propagation both ways.
        propagation = max([propagation] + [b.long_haul(h, heads[0]) + b.long_haul(heads[0], h)
                                           for h in heads[1:]])
        tree = _sharp_tree(b, heads, 1.0 / ppn)
        nic = min(nic, min(float(b.capacity[list(p)].min()) for p, _ in tree))
        paths += tree
    # NCCL counts a CollNet all-reduce as 2S per rank over busBw (ratio 0.5): volume 2, and
    # the physical bus bandwidth is 2 / the busiest GPU port's or NIC's time per byte.
    per_byte = max(2.0 * (ppn - 1) / ppn / nvl, 1.0 / ppn / nic)
    chans = nccl_channel_count(len(nodes), ppn, b.g)
    stages = 2 if algorithm == "collnet_direct" else 2 * ppn
    plan = _raw(b, algorithm, paths, n, len(nodes), ppn, 2.0 / per_byte, 2.0, chans,
                fill_stages=stages, chunk_bytes=buffsize / 8)
    return dataclasses.replace(plan, chain_latency_s=propagation)


def collnet_direct(b: PlanBuilder, group: Sequence[int], buffsize: float) -> FlowPlan:
    """CollNet Direct all-reduce (SHARP): direct in-node scatter/gather, network reduction."""
    return _collnet(b, "collnet_direct", group, buffsize)


def collnet_chain(b: PlanBuilder, group: Sequence[int], buffsize: float) -> FlowPlan:
    """CollNet Chain all-reduce (SHARP): in-node chains to the head, network reduction."""
    return _collnet(b, "collnet_chain", group, buffsize)
