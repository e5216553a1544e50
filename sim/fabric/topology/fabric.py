"""GPU cluster fabric: the indexed, routed :class:`Fabric`, and the package's import surface.

:func:`build_fabric` builds the graph of a :class:`FabricSpec` (:func:`build_graph`, in
:mod:`sim.fabric.topology.graph`) and wraps it in a :class:`Fabric`, which indexes its edges as
numpy
arrays for the flow solver and routes GPU-to-GPU and GPU-to-host traffic with up/down routing over
the hierarchy the builder laid out (device paths from :mod:`sim.fabric.topology.paths`), so a route
costs a few dictionary look-ups rather than a graph search.

The package is split by concern: :mod:`sim.fabric.topology.links` (link classes, device latencies
and
their sources), :mod:`sim.fabric.topology.spec` (:class:`FabricSpec`),
:mod:`sim.fabric.topology.layout`
(switch-level layout), :mod:`sim.fabric.topology.graph` (graph builders per tier),
:mod:`sim.fabric.topology.paths` (device paths), :mod:`sim.fabric.topology.routing` (ECMP or
adaptive
routing). Every name this module had before the split is still importable from it.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
import numpy as np

from sim.fabric.topology.graph import build_graph
from sim.fabric.topology.layout import Layout
from sim.fabric.topology.links import (
    CROSS_AZ,
    CROSS_REGION,
    ETHERNET_SWITCH_LATENCY_US,
    LINK_KINDS,
    NETWORK,
    NIC_LATENCY_US,
    NVLINK,
    NVLINK_LATENCY_US,
    NVME_LATENCY_US,
    PCIE,
    PCIE_LATENCY_US,
    SWITCH_LATENCY_US,
    TRANSPORT_LATENCY_US,
    Node,
)
from sim.fabric.topology.paths import gpu_host_nodes, gpu_nic_nodes, network_nodes
from sim.fabric.topology.spec import FabricSpec

__all__ = [
    "CROSS_AZ",
    "CROSS_REGION",
    "ETHERNET_SWITCH_LATENCY_US",
    "LINK_KINDS",
    "NETWORK",
    "NIC_LATENCY_US",
    "NVLINK",
    "NVLINK_LATENCY_US",
    "NVME_LATENCY_US",
    "PCIE",
    "PCIE_LATENCY_US",
    "SWITCH_LATENCY_US",
    "TRANSPORT_LATENCY_US",
    "Fabric",
    "FabricSpec",
    "Node",
    "build_fabric",
    "build_graph",
]


class Fabric:
    """A fabric graph indexed for the flow solver, with cached up/down routing.

    Parameters
    ----------
    graph : networkx.DiGraph
        A graph from :func:`build_graph` (capacities and latencies may have been edited; the
        structure must match ``spec``).
    spec : FabricSpec
        The spec the graph was built from.

    Attributes
    ----------
    capacity : numpy.ndarray
        float64 bytes/s per link index.
    latency : numpy.ndarray
        float64 seconds per link index.
    kind : numpy.ndarray
        int8 code into :data:`LINK_KINDS` per link index.
    zone : numpy.ndarray
        int16 zone per link index (source zone for ``cross_az`` and ``cross_region`` links).
    region : numpy.ndarray
        int16 region per link index (source region for ``cross_region`` links).
    endpoints : list of tuple
        ``(u, v)`` graph nodes of each link index.
    n_gpus : int
        Number of GPUs (global ranks).

    Examples
    --------
    >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                               pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400))
    >>> [LINK_KINDS[fab.kind[i]] for i in fab.route(0, 1)]
    ['nvlink', 'nvlink']
    >>> len(fab.route(0, 8)), fab.endpoints[fab.route(0, 8)[2]]
    (6, (('nic', 0, 0), ('leaf', 0, 0)))
    """

    def __init__(self, graph: nx.DiGraph, spec: FabricSpec) -> None:
        self.graph = graph
        self.spec = spec
        self.n_gpus = spec.n_gpus
        m = graph.number_of_edges()
        capacity = np.full(m, np.nan)
        latency = np.full(m, np.nan)
        kind = np.full(m, -1, dtype=np.int8)
        zone = np.zeros(m, dtype=np.int16)
        region = np.zeros(m, dtype=np.int16)
        endpoints: list[tuple[Node, Node] | None] = [None] * m
        eid: dict[tuple[Node, Node], int] = {}
        code = {name: c for c, name in enumerate(LINK_KINDS)}
        for u, v, d in graph.edges(data=True):
            i = d["index"]
            if not 0 <= i < m or endpoints[i] is not None:
                raise ValueError(f"edge {u}->{v}: index {i} is out of range or duplicated")
            capacity[i] = d["capacity"]
            latency[i] = d["latency"]
            kind[i] = code[d["kind"]]
            zone[i] = d["zone"]
            region[i] = d.get("region", 0)
            endpoints[i] = (u, v)
            eid[(u, v)] = i
        self.capacity = capacity
        self.latency = latency
        self.kind = kind
        self.zone = zone
        self.region = region
        self.endpoints: list[tuple[Node, Node]] = endpoints  # type: ignore[assignment]
        self._eid = eid
        self._latency_list = latency.tolist()  # python floats: summing short paths is faster
        self._layout = Layout.of(spec)
        self._routes: dict[tuple[int, int, int | None], tuple[int, ...]] = {}
        self._up: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._down: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._to_host: dict[int, tuple[int, ...]] = {}
        self._from_host: dict[int, tuple[int, ...]] = {}
        self._nic_sub: dict[tuple[int, int], int] = {}

    def set_nic_substitutes(self, subs: dict[tuple[int, int], int]) -> None:
        """Failed NICs: cross-node routes that would use NIC ``k`` of ``node`` use NIC
        ``subs[(node, k)]`` instead (:mod:`sim.fabric.topology.link_faults`). Call before any
        route is asked (routes are cached)."""
        if self._routes:
            raise RuntimeError("set_nic_substitutes: routes were already cached")
        self._nic_sub = dict(subs)

    # --- ranks -----------------------------------------------------------------------------
    @property
    def n_links(self) -> int:
        """Number of directed links (length of the arrays)."""
        return len(self.capacity)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.n_gpus:
            raise IndexError(f"rank {rank} out of range [0, {self.n_gpus})")

    def gpu(self, rank: int) -> Node:
        """Graph node of global rank ``rank`` (``rank = node * gpus_per_node + local``).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=4, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=4, nic_gbps=400))
        >>> fab.gpu(5)
        ('gpu', 1, 1)
        """
        self._check(rank)
        return ("gpu", *divmod(rank, self.spec.gpus_per_node))

    def node_of(self, rank: int) -> int:
        """Server index of ``rank``.

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=4, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=4, nic_gbps=400))
        >>> fab.node_of(5)
        1
        """
        self._check(rank)
        return rank // self.spec.gpus_per_node

    def zone_of(self, rank: int) -> int:
        """Availability zone of ``rank`` (its node's: :meth:`FabricSpec.zone_of_node`).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=3, gpus_per_node=1, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=1, nic_gbps=400,
        ...                               azs=2))
        >>> [fab.zone_of(r) for r in range(3)]
        [0, 1, 0]
        """
        return self.spec.zone_of_node(self.node_of(rank))

    def region_of(self, rank: int) -> int:
        """Region of ``rank`` (its zone modulo ``regions``).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=4, gpus_per_node=1, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=1, nic_gbps=400,
        ...                               azs=3, regions=2))
        >>> [fab.region_of(r) for r in range(4)]
        [0, 1, 0, 0]
        """
        return self.zone_of(rank) % self.spec.regions

    def rail_of(self, rank: int) -> int:
        """NIC index that GPU ``rank`` uses by default: ``floor(local * nics / gpus_per_node)``.

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=4, nic_gbps=400))
        >>> [fab.rail_of(r) for r in range(8, 16)]
        [0, 0, 1, 1, 2, 2, 3, 3]
        """
        self._check(rank)
        return self.spec.rail_of(rank % self.spec.gpus_per_node)

    # --- routing ---------------------------------------------------------------------------
    def _ids(self, nodes: Iterable[Node]) -> tuple[int, ...]:
        eid = self._eid
        it = iter(nodes)
        prev = next(it)
        out = []
        for cur in it:
            out.append(eid[(prev, cur)])
            prev = cur
        return tuple(out)

    def _up_down(self, node: int, local: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Links GPU -> NIC ``k`` and NIC ``k`` -> GPU, cached per (node, local GPU, NIC)."""
        key = (node, local, k)
        up = self._up.get(key)
        if up is None:
            nodes = gpu_nic_nodes(self.spec, node, local, k)
            up = self._up[key] = self._ids(nodes)
            self._down[key] = self._ids(reversed(nodes))
        return up, self._down[key]

    def route(self, src_rank: int, dst_rank: int, rail: int | None = None) -> tuple[int, ...]:
        """Link indices from GPU ``src_rank`` to GPU ``dst_rank`` (cached per (src, dst, rail)).

        Same node: GPU -> NVSwitch -> GPU (``rail`` is ignored). Different nodes: up through a NIC
        of the source node, across the network, down through a NIC of the destination node, via
        the shared leaf, or a spine chosen by ECMP hash (the zone's one pooled spine under
        adaptive routing), or spines and the zone gateways (and the
        region gateways between regions). The NICs are the source GPU's rail NIC
        (:meth:`rail_of`) and the destination GPU's rail NIC when ``rail`` is None, and NIC
        ``rail`` at both ends otherwise, reached over PCIe through the host when that NIC hangs
        off another PCIe switch than the GPU. Without GPUDirect RDMA (``spec.gdr=False``) both
        ends always bounce through host memory.

        Parameters
        ----------
        src_rank, dst_rank : int
            Global ranks.
        rail : int or None
            NIC index ``0 <= rail < nics_per_node`` used at both ends of a cross-node route, or
            None for each GPU's own rail NIC.

        Returns
        -------
        tuple of int
            Link indices in path order; empty when ``src_rank == dst_rank``.

        Raises
        ------
        IndexError
            If a rank is out of range, or ``rail`` is out of range on a cross-node route.

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400))
        >>> len(fab.route(0, 8)), len(fab.route(0, 9))  # same rail: leaf; other rail: spine
        (6, 8)
        >>> len(fab.route(0, 9, rail=1))  # NIC 1 at both ends: host bounce at the source, one leaf
        8
        """
        key = (src_rank, dst_rank, rail)
        r = self._routes.get(key)
        if r is not None:
            return r
        self._check(src_rank)
        self._check(dst_rank)
        spec = self.spec
        G = spec.gpus_per_node
        a, ga = divmod(src_rank, G)
        b, gb = divmod(dst_rank, G)
        if src_rank == dst_rank:
            r = ()
        elif a == b:
            sw = ("nvswitch", a)
            r = (self._eid[(("gpu", a, ga), sw)], self._eid[(sw, ("gpu", b, gb))])
        else:
            if rail is None:
                ka, kb = spec.rail_of(ga), spec.rail_of(gb)
            elif 0 <= rail < spec.nics_per_node:
                ka = kb = rail
            else:
                raise IndexError(f"rail {rail} out of range [0, {spec.nics_per_node})")
            if self._nic_sub:   # failed NICs (sim.fabric.topology.link_faults)
                ka = self._nic_sub.get((a, ka), ka)
                kb = self._nic_sub.get((b, kb), kb)
            up = self._up_down(a, ga, ka)[0]
            down = self._up_down(b, gb, kb)[1]
            net = network_nodes(spec, self._layout, src_rank, dst_rank, a, b, ka, kb)
            r = up + self._ids([("nic", a, ka), *net, ("nic", b, kb)]) + down
        self._routes[key] = r
        return r

    def route_to_host(self, rank: int) -> tuple[int, ...]:
        """Link indices from GPU ``rank`` to its node's host memory (GPU -> PCIe switch -> host).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=8, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400))
        >>> [LINK_KINDS[fab.kind[i]] for i in fab.route_to_host(3)]
        ['pcie', 'pcie']
        """
        r = self._to_host.get(rank)
        if r is None:
            node, local = divmod(rank, self.spec.gpus_per_node)
            self._check(rank)
            nodes = gpu_host_nodes(self.spec, node, local)
            r = self._to_host[rank] = self._ids(nodes)
            self._from_host[rank] = self._ids(reversed(nodes))
        return r

    def route_from_host(self, rank: int) -> tuple[int, ...]:
        """Link indices from the host memory of ``rank``'s node to GPU ``rank``.

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=8, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400))
        >>> fab.endpoints[fab.route_from_host(3)[-1]][1]
        ('gpu', 0, 3)
        """
        self.route_to_host(rank)
        return self._from_host[rank]

    def route_nvme(self, node: int, direction: str) -> tuple[int, ...]:
        """Link indices between node ``node``'s host memory and its NVMe drives:
        ``direction`` "read" (drive to host) or "write" (host to drive).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=8, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400,
        ...                               nvme_read_gbytes_per_s=55, nvme_write_gbytes_per_s=32))
        >>> [float(fab.capacity[i]) / 1e9 for i in fab.route_nvme(0, "write")]
        [32.0]
        """
        host, nvme = ("host", node), ("nvme", node)
        if nvme not in self.graph:
            raise KeyError(f"node {node} has no NVMe device (nvme bandwidth is 0)")
        return self._ids([nvme, host] if direction == "read" else [host, nvme])

    def path_latency(self, links: Iterable[int]) -> float:
        """Sum of the latencies of ``links`` in seconds (every device on the path counted once).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400,
        ...                               nvlink_latency_us=0.5))
        >>> round(fab.path_latency(fab.route(0, 1)) * 1e6, 9)
        0.5
        """
        lat = self._latency_list
        return float(sum(lat[i] for i in links))


def build_fabric(spec: FabricSpec) -> Fabric:
    """Build the graph for ``spec`` and index it as a :class:`Fabric`.

    Parameters
    ----------
    spec : FabricSpec
        The cluster description.

    Returns
    -------
    Fabric
        Graph, link arrays and router.

    Examples
    --------
    >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                               pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400))
    >>> fab.n_gpus, len(fab.route(0, 8))
    (16, 6)
    """
    return Fabric(build_graph(spec), spec)
