"""Graph builders: the annotated ``networkx.DiGraph`` of every device and link of a cluster.

:func:`build_graph` turns a :class:`~sim.fabric.topology.spec.FabricSpec` into a graph whose nodes
are
devices (GPUs, NVSwitches, PCIe switches, host memory, NVMe, NICs, leaf and spine switches, zone
gateways, region gateways) and whose edges are one direction of one physical link. It lays the
graph out tier by tier, one builder function each: the inside of every server
(:func:`_add_servers`: NVLink, PCIe, NVMe), the rails (:func:`_add_leaf_spine`: NICs to leaves,
leaves to spines), the zones (:func:`_add_zone_gateways`) and the regions
(:func:`_add_region_gateways`). The order of the calls fixes every node's and edge's position,
and with it the link indices of :class:`~sim.fabric.topology.fabric.Fabric`.

Zones and regions
-----------------
Node ``n`` sits in zone ``n % azs`` (``az_placement: blocks``: the zones' nodes one zone
after another, :mod:`sim.config.zones`) and zone ``z`` in region ``z % regions``. Each
populated zone has a gateway ``("gw", z)``; the gateways of zones of one region are joined
pairwise by ``cross_az`` links. With ``regions > 1`` each populated region also has a region gateway
``("rgw", r)`` linked to its zones' gateways, and region gateways are joined pairwise by
``cross_region`` links, so traffic between regions crosses exactly one ``cross_region`` link and
no ``cross_az`` link: a cloud bills an inter-region transfer once, at the inter-region rate, not
additionally as inter-AZ traffic.
"""

from __future__ import annotations

import networkx as nx

from sim.fabric.topology.layout import Layout
from sim.fabric.topology.links import (
    CROSS_AZ,
    CROSS_REGION,
    LINK_KINDS,
    NETWORK,
    NVLINK,
    PCIE,
    Node,
    device_latency,
)
from sim.fabric.topology.spec import FabricSpec

__all__ = ["build_graph"]


class _Links:
    """The graph being built and its directed edges, in index order.

    Nodes go into the graph as they are laid out; edges are collected here and added in one
    call at the end, each with ``index`` = its position (the :class:`Fabric` link index).
    """

    def __init__(self, spec: FabricSpec, graph: nx.DiGraph) -> None:
        self.spec = spec
        self.graph = graph
        self.edges: list[tuple[Node, Node, dict]] = []

    def link(self, u: Node, v: Node, kind: int, capacity: float,
             extra_latency: float = 0.0) -> None:
        """Both directions of one physical link ``u`` <-> ``v`` of class ``LINK_KINDS[kind]``."""
        # Both directions share capacity and latency; only cross_az / cross_region edges differ
        # in zone (and region) between their two directions.
        spec, nodes, edges = self.spec, self.graph.nodes, self.edges
        lat = 0.5 * (device_latency(spec, u) + device_latency(spec, v)) + extra_latency
        for a, b in ((u, v), (v, u)):
            edges.append((a, b, {
                "kind": LINK_KINDS[kind],
                "capacity": float(capacity),
                "latency": lat,
                "zone": nodes[a]["zone"],
                "region": nodes[a]["region"],
                "index": len(edges),
            }))


def _add_servers(b: _Links) -> None:
    """Inside each server: NVSwitch, PCIe tree, host memory, NICs, and NVMe when it has any.

    Every GPU has an NVLink to its node's NVSwitch (none with one GPU per node) and a PCIe link
    to its switch; every NIC a PCIe link to its switch; every PCIe switch a link to the host's
    root complex.
    """
    spec, g = b.spec, b.graph
    G = spec.gpus_per_node
    nics = spec.nics_per_node
    nvlink_cap = spec.nvlink_gbytes_per_s * 1e9
    pcie_cap = spec.pcie_gbytes_per_s * 1e9
    S = spec.pcie_switches
    for n in range(spec.nodes):
        zone = spec.zone_of_node(n)
        at = {"zone": zone, "region": spec.region_of_zone(zone)}
        host = ("host", n)
        g.add_node(host, **at)
        for s in range(S):
            g.add_node(("pcie", n, s), **at)
        if G > 1:
            g.add_node(("nvswitch", n), **at)
        for k in range(G):
            g.add_node(("gpu", n, k), **at)
        for k in range(nics):
            g.add_node(("nic", n, k), **at)
        for k in range(G):
            gpu = ("gpu", n, k)
            if G > 1:
                b.link(gpu, ("nvswitch", n), NVLINK, nvlink_cap)
            b.link(gpu, ("pcie", n, spec.pcie_switch_of_gpu(k)), PCIE, pcie_cap)
        for k in range(nics):
            b.link(("nic", n, k), ("pcie", n, spec.pcie_switch_of_nic(k)), PCIE, pcie_cap)
        for s in range(S):
            b.link(("pcie", n, s), host, PCIE, pcie_cap)
        _add_c2c(b, n, at)
        if spec.nvme_read_gbytes_per_s > 0 and spec.nvme_write_gbytes_per_s > 0:
            _add_nvme(b, n, at)


def _add_c2c(b: _Links, n: int, at: dict[str, int]) -> None:
    """Node ``n``'s host CPUs on NVLink-C2C (GB200: a Grace per two GPUs), when it has them:
    each GPU's C2C link to its CPU and the CPU's port to the node's host memory, both at the
    CPU's C2C bandwidth, so the CPU's GPUs share it (GB200 NVL72 datasheet: 900 GB/s
    bidirectional per superchip). Links of the host class (``pcie``), added after the PCIe
    tree so that other topologies keep their link indices."""
    spec = b.spec
    if not spec.host_cpus:
        return
    cap = spec.c2c_gbytes_per_s * 1e9
    for c in range(spec.host_cpus):
        b.graph.add_node(("cpu", n, c), **at)
        b.link(("cpu", n, c), ("host", n), PCIE, cap)
    for k in range(spec.gpus_per_node):
        b.link(("gpu", n, k), ("cpu", n, spec.host_cpu_of_gpu(k)), PCIE, cap)


def _add_nvme(b: _Links, n: int, at: dict[str, int]) -> None:
    """Node ``n``'s striped NVMe drives as one device behind the host: reads flow
    nvme -> host, writes host -> nvme, each at its own rate (so not one :meth:`_Links.link`)."""
    spec, edges = b.spec, b.edges
    host, nvme = ("host", n), ("nvme", n)
    b.graph.add_node(nvme, **at)
    lat = 0.5 * (device_latency(spec, host) + device_latency(spec, nvme))
    for src, dst, cap in ((nvme, host, spec.nvme_read_gbytes_per_s),
                          (host, nvme, spec.nvme_write_gbytes_per_s)):
        edges.append((src, dst, {"kind": "pcie", "capacity": cap * 1e9, "latency": lat,
                                 "zone": at["zone"], "region": at["region"],
                                 "index": len(edges)}))


def _add_leaf_spine(b: _Links, layout: Layout) -> None:
    """Leaves and spines of every zone, NIC -> leaf cables (in node order, so indices are
    stable), then leaf -> spine links: each leaf's uplinks carry its NIC capacity divided by the
    oversubscription, split evenly over the zone's spines (pooled under adaptive routing,
    :mod:`sim.fabric.topology.routing`)."""
    spec, g = b.spec, b.graph
    region = spec.region_of_zone
    nics = spec.nics_per_node
    nic_cap = spec.nic_gbps * 1e9 / 8
    for z in range(spec.azs):
        for i in range(layout.leaves[z]):
            g.add_node(("leaf", z, i), zone=z, region=region(z))
        for i in range(layout.spines[z]):
            g.add_node(("spine", z, i), zone=z, region=region(z))
    for n in range(spec.nodes if nics else 0):
        for k in range(nics):
            b.link(("nic", n, k), layout.leaf_of_nic(spec, n, k), NETWORK, nic_cap)
    for z in range(spec.azs):
        n_spines = layout.spines[z]
        for i, ports in enumerate(layout.leaf_downlinks[z] if n_spines else ()):
            up = ports * nic_cap / spec.oversubscription / n_spines
            for s in range(n_spines):
                b.link(("leaf", z, i), ("spine", z, s), NETWORK, up)


def _populated(layout: Layout) -> list[int]:
    """Zones with at least one leaf (zones without nodes get no devices)."""
    return [z for z in range(len(layout.leaves)) if layout.leaves[z]]


def _ample(spec: FabricSpec, layout: Layout) -> dict[int, float]:
    """Capacity of a gateway's links inside its zone or region: all the zone's NICs at line
    rate, so the gateways never bind and only the metered links between zones do."""
    nic_cap = spec.nic_gbps * 1e9 / 8
    return {z: len(layout.zone_nodes[z]) * spec.nics_per_node * nic_cap
            for z in _populated(layout)}


def _add_zone_gateways(b: _Links, layout: Layout) -> None:
    """Zone gateways: ample capacity to the zone's top tier (its spines, or its leaves when it
    has none), metered ``cross_az`` links between the zones of one region (with one region,
    between all zones, as before regions existed). None with one zone."""
    spec = b.spec
    region = spec.region_of_zone
    populated = _populated(layout)
    if spec.azs <= 1 or not populated:
        return
    ample = _ample(spec, layout)
    for z in populated:
        gw = ("gw", z)
        b.graph.add_node(gw, zone=z, region=region(z))
        top = "spine" if layout.spines[z] else "leaf"
        for i in range(layout.spines[z] or layout.leaves[z]):
            b.link((top, z, i), gw, NETWORK, ample[z])
    az_cap = spec.az_link_gbps * 1e9 / 8
    for a_i, a in enumerate(populated):
        for z_b in populated[a_i + 1:]:
            if region(a) == region(z_b):
                b.link(("gw", a), ("gw", z_b), CROSS_AZ, az_cap, spec.az_latency_ms * 1e-3)


def _add_region_gateways(b: _Links, layout: Layout) -> None:
    """Region gateways: ample links to the gateways of the region's zones, metered
    ``cross_region`` links between regions. A route between regions crosses one cross_region
    link and no cross_az link, so per-kind byte counters bill each boundary once, at the
    inter-region price. None with one region."""
    spec = b.spec
    region = spec.region_of_zone
    populated = _populated(layout)
    if spec.regions <= 1 or not populated:
        return
    ample = _ample(spec, layout)
    regions = sorted({region(z) for z in populated})
    for r in regions:
        rgw = ("rgw", r)
        b.graph.add_node(rgw, zone=r, region=r)  # zone r is region r's first zone (r < regions)
        for z in populated:
            if region(z) == r:
                b.link(("gw", z), rgw, NETWORK, ample[z])
    region_cap = spec.region_link_gbps * 1e9 / 8
    for a_i, a in enumerate(regions):
        for r_b in regions[a_i + 1:]:
            b.link(("rgw", a), ("rgw", r_b), CROSS_REGION, region_cap,
                   spec.region_latency_ms * 1e-3)


def build_graph(spec: FabricSpec) -> nx.DiGraph:
    """Build the annotated fabric graph for ``spec``.

    Node ids are tuples: ``("gpu", node, local)``, ``("nvswitch", node)``, ``("pcie", node, k)``,
    ``("host", node)``, ``("nic", node, k)``, ``("leaf", zone, i)``, ``("spine", zone, i)``,
    ``("gw", zone)``, ``("rgw", region)``; every node has ``zone`` and ``region`` attributes (a
    region gateway's zone is its region's first zone, whose index equals the region's). Every
    physical link is two directed edges with ``kind`` (one of :data:`LINK_KINDS`), ``capacity``
    (bytes/s), ``latency`` (s), ``zone`` and ``region`` (the source's) and ``index`` (0..E-1, the
    position in :class:`Fabric` arrays; the two directions of a link get consecutive indices).
    Zones and regions without nodes get no devices. With ``regions == 1`` the graph is the same
    as before regions existed (no region gateways, same indices).

    Parameters
    ----------
    spec : FabricSpec
        The cluster description.

    Returns
    -------
    networkx.DiGraph
        The graph; ``graph.graph["spec"]`` holds ``spec``.

    Examples
    --------
    >>> g = build_graph(FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
    ...                            pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400))
    >>> sorted(g.nodes)
    [('gpu', 0, 0), ('gpu', 0, 1), ('host', 0), ('nvswitch', 0), ('pcie', 0, 0)]
    >>> g.edges[("gpu", 0, 0), ("nvswitch", 0)]["kind"], g.number_of_edges()
    ('nvlink', 10)
    """
    layout = Layout.of(spec)
    g = nx.DiGraph(spec=spec, link_kinds=LINK_KINDS, spines_real=layout.spines_real)
    b = _Links(spec, g)
    _add_servers(b)
    _add_leaf_spine(b, layout)
    _add_zone_gateways(b, layout)
    _add_region_gateways(b, layout)
    g.add_edges_from(b.edges)
    return g
