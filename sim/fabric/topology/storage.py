"""Checkpoint storage on the fabric: the node's NVMe drives, or a storage endpoint on the network.

A checkpoint save (:mod:`sim.program.checkpoint_ops`) writes each rank's share from host
memory (or from GPU memory through host memory) to one of three targets
(``run.checkpoint.storage``):

* ``local_nvme``: the node's own striped drives, the ``host -> nvme`` link the graph already
  has (:func:`sim.fabric.topology.graph._add_nvme`), at the drives' write rate (the run's
  ``gbytes_per_s`` replaces it when given: the same drives, for every writer).
* ``pfs``: a parallel file system shared by the job, as one endpoint ``("storage", z)`` behind
  a front switch ``("storage_sw", z)`` hung off the top tier (spines, or the leaf) of zone
  ``z``; the front switch's link to the endpoint carries the file system's aggregate write
  rate, so every writer shares it max-min.
* ``object_store``: S3-like storage, the same endpoint, whose link carries servers x the
  per-server rate; each rank's flow is capped at its server's rate over the server's GPUs
  (a client's upload rate is per server, not shared with other servers).

Network targets are reached from host memory through the PCIe switch of the GPU's rail NIC,
the NIC and the compute network (so a background write contends with the step's collectives
on the same NICs and uplinks; clusters whose storage has NICs of its own are not modelled).
A zone without GPUs (``zone >= azs``, or any zone of a one-zone cluster but 0) gets a gateway
of its own joined to the job's zones by metered ``cross_az`` links (or, in another region, to
the region's gateway, whose ``cross_region`` links then carry it), so bytes to storage in
another zone or region are counted and billed as every zone crossing is
(:mod:`sim.analysis.cost`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from sim.fabric.topology.layout import Layout
from sim.fabric.topology.links import (
    CROSS_AZ,
    CROSS_REGION,
    LINK_KINDS,
    NETWORK,
    Node,
    device_latency,
)
from sim.fabric.topology.paths import ecmp_choice, gpu_host_nodes
from sim.fabric.topology.spec import FabricSpec

__all__ = ["StorageTarget", "attach_storage", "local_storage"]

STORAGE_KINDS = ("local_nvme", "pfs", "object_store")
_SALT = 7   # ECMP salt of storage flows (distinct from the GPU-to-GPU routes' 0, 1, 2)


@dataclass
class StorageTarget:
    """Where a job's checkpoint bytes go, and how the engine routes them.

    Build with :func:`local_storage` or :func:`attach_storage`, then :meth:`bind` to the
    :class:`~sim.fabric.topology.fabric.Fabric` built from the graph."""

    kind: str
    zone: int | None = None
    """The endpoint's zone (network targets)."""
    flow_cap: float = np.inf
    """Bytes/s a rank's write may take at most (object storage's per-server rate split over
    the server's GPUs; infinite otherwise)."""
    _fabric: object = None
    _layout: Layout | None = None
    _eid: dict[tuple[Node, Node], int] = field(default_factory=dict)

    def bind(self, fabric: object) -> StorageTarget:
        """Route over ``fabric`` (a :class:`~sim.fabric.topology.fabric.Fabric`)."""
        self._fabric = fabric
        self._eid = fabric._eid    # type: ignore[attr-defined]
        self._layout = Layout.of(fabric.spec)   # type: ignore[attr-defined]
        return self

    def nodes_from_host(self, rank: int) -> list[Node]:
        """Devices from the host memory of ``rank``'s node to the storage."""
        fab = self._fabric
        assert fab is not None, "StorageTarget.bind first"
        spec: FabricSpec = fab.spec   # type: ignore[attr-defined]
        node, local = divmod(rank, spec.gpus_per_node)
        if self.kind == "local_nvme":
            return [("host", node), ("nvme", node)]
        k = spec.rail_of(local)
        k = fab._nic_sub.get((node, k), k)   # type: ignore[attr-defined]  # failed NICs
        lay = self._layout
        assert lay is not None and self.zone is not None
        leaf = lay.leaf_of_nic(spec, node, k)
        z = leaf[1]
        path: list[Node] = [("host", node), ("pcie", node, spec.pcie_switch_of_nic(k)),
                            ("nic", node, k), leaf]
        if lay.spines[z]:
            path.append(("spine", z, ecmp_choice(lay.spines[z], rank, -1, spec.ecmp_seed,
                                                 _SALT)))
        zs = self.zone
        if z != zs:
            path.append(("gw", z))
            rz, rs = z % spec.regions, zs % spec.regions
            if rz != rs:
                path += [("rgw", rz), ("rgw", rs)]
            path.append(("gw", zs))
        return [*path, ("storage_sw", zs), ("storage", zs)]

    def route(self, rank: int, from_gpu: bool) -> tuple[int, ...]:
        """Link indices of ``rank``'s write: from host memory, or (``from_gpu``) from GPU
        memory through host memory."""
        fab = self._fabric
        spec: FabricSpec = fab.spec   # type: ignore[attr-defined]
        nodes = self.nodes_from_host(rank)
        if from_gpu:
            node, local = divmod(rank, spec.gpus_per_node)
            nodes = gpu_host_nodes(spec, node, local)[:-1] + nodes
        eid = self._eid
        return tuple(eid[(a, b)] for a, b in zip(nodes, nodes[1:], strict=False))


def local_storage(graph: nx.DiGraph, spec: FabricSpec, gbytes_per_s: float | None
                  ) -> StorageTarget:
    """Each node's NVMe drives as the target; ``gbytes_per_s`` (if given) becomes their write
    rate (the ``host -> nvme`` links' capacity)."""
    if not any(n[0] == "nvme" for n in graph.nodes):
        raise ValueError("run.checkpoint.storage: local_nvme needs NVMe drives "
                         "(cluster.nvme_write_gbytes_per_s is 0)")
    if gbytes_per_s is not None:
        for n in range(spec.nodes):
            graph.edges[("host", n), ("nvme", n)]["capacity"] = gbytes_per_s * 1e9
    return StorageTarget("local_nvme")


def _ample(spec: FabricSpec) -> float:
    """A link that never binds: every NIC of the job at line rate."""
    return spec.nodes * max(spec.nics_per_node, 1) * spec.nic_gbps * 1e9 / 8


def attach_storage(graph: nx.DiGraph, spec: FabricSpec, kind: str, gbytes_per_s: float,
                   zone: int = 0) -> StorageTarget:
    """Add a network storage endpoint (``pfs`` or ``object_store``) in zone ``zone`` to
    ``graph`` (module docstring); build the :class:`Fabric` after, then bind the target.

    ``gbytes_per_s``: the file system's aggregate rate (pfs) or each server's (object_store).
    Edges are appended after the graph's, so every existing link keeps its index.

    Examples
    --------
    >>> from sim.fabric.topology.fabric import Fabric, build_graph
    >>> spec = FabricSpec(nodes=2, gpus_per_node=2, nvlink_gbytes_per_s=450,
    ...                   pcie_gbytes_per_s=64, nics_per_node=2, nic_gbps=400)
    >>> g = build_graph(spec)
    >>> t = attach_storage(g, spec, "pfs", 10.0)
    >>> fab = Fabric(g, spec)
    >>> t = t.bind(fab)
    >>> [LINK_KINDS[fab.kind[i]] for i in t.route(3, from_gpu=False)][-2:]
    ['network', 'network']
    >>> float(fab.capacity[t.route(3, from_gpu=False)[-1]]) / 1e9
    10.0
    """
    if spec.nics_per_node <= 0:
        raise ValueError(f"run.checkpoint.storage: {kind} is reached over the network, "
                         "and the cluster has no NICs (cluster.nics_per_node is 0)")
    if kind not in ("pfs", "object_store"):
        raise ValueError(f"run.checkpoint.storage: {kind} is not a network target")
    layout = Layout.of(spec)
    edges: list[tuple[Node, Node, dict]] = []
    m = graph.number_of_edges()
    region = spec.region_of_zone

    def link(u: Node, v: Node, kind_code: int, cap: float, extra: float = 0.0) -> None:
        lat = 0.5 * (device_latency(spec, u) + device_latency(spec, v)) + extra
        for a, b in ((u, v), (v, u)):
            at = graph.nodes[a]
            edges.append((a, b, {"kind": LINK_KINDS[kind_code], "capacity": float(cap),
                                 "latency": lat, "zone": at["zone"],
                                 "region": at["region"], "index": m + len(edges)}))

    def add(node: Node, z: int) -> None:
        graph.add_node(node, zone=z, region=region(z))

    populated = [z for z in range(len(layout.leaves)) if layout.leaves[z]]
    ample = _ample(spec)
    sw, end = ("storage_sw", zone), ("storage", zone)
    add(sw, zone)
    add(end, zone)
    rate = gbytes_per_s * 1e9 * (spec.nodes if kind == "object_store" else 1)
    link(sw, end, NETWORK, rate)
    if zone in populated:
        top = "spine" if layout.spines[zone] else "leaf"
        for i in range(layout.spines[zone] or layout.leaves[zone]):
            link((top, zone, i), sw, NETWORK, ample)
    needs_gateways = any(z != zone for z in populated)
    if needs_gateways:
        for z in [*populated, zone]:
            gw = ("gw", z)
            if gw in graph:
                continue
            add(gw, z)
            if z in populated:
                top = "spine" if layout.spines[z] else "leaf"
                for i in range(layout.spines[z] or layout.leaves[z]):
                    link((top, z, i), gw, NETWORK, ample)
        link(("gw", zone), sw, NETWORK, ample)
        if zone not in populated:
            _join_zone(graph, spec, zone, populated, link, ample)
    graph.add_edges_from(edges)
    cap = (gbytes_per_s * 1e9 / spec.gpus_per_node if kind == "object_store" else np.inf)
    return StorageTarget(kind, zone=zone, flow_cap=cap)


def _join_zone(graph: nx.DiGraph, spec: FabricSpec, zone: int, populated: list[int],
               link: Callable[..., None], ample: float) -> None:
    """Join the storage's own gateway to the job's zones: ``cross_az`` links to the zones of
    its region; through its region's gateway (``cross_region`` links to the others) when the
    cluster spans regions (:func:`sim.fabric.topology.graph._add_region_gateways`)."""
    region = spec.region_of_zone
    rs = region(zone)
    for z in populated:
        if region(z) == rs:
            link(("gw", z), ("gw", zone), CROSS_AZ, spec.az_link_gbps * 1e9 / 8,
                 spec.az_latency_ms * 1e-3)
    if spec.regions <= 1:
        return
    rgw = ("rgw", rs)
    if rgw not in graph:
        graph.add_node(rgw, zone=rs, region=rs)
        for r in sorted({region(z) for z in populated}):
            link(("rgw", r), rgw, CROSS_REGION, spec.region_link_gbps * 1e9 / 8,
                 spec.region_latency_ms * 1e-3)
    link(("gw", zone), rgw, NETWORK, ample)
