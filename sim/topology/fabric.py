"""GPU cluster fabric: an annotated graph of every link, and a fast hierarchical router.

The builder turns a :class:`FabricSpec` into a ``networkx.DiGraph`` whose nodes are devices
(GPUs, NVSwitches, PCIe switches, host memory, NICs, leaf and spine switches, zone gateways,
region gateways) and whose edges are one direction of one physical link. :class:`Fabric` indexes
those edges as numpy arrays for the flow solver and routes GPU-to-GPU and GPU-to-host traffic with
up/down routing over the hierarchy the builder laid out, so a route costs a few dictionary look-ups
rather than a graph search.

Latency model
-------------
Every device has a traversal latency: NVSwitch ``nvlink_latency_us``, PCIe switch and host root
complex ``pcie_latency_us``, NIC (with its cable) ``nic_latency_us``, leaf/spine/gateway switch
``switch_latency_us`` (zone and region gateways included), GPU zero (a route's end point). Each
edge carries half the traversal latency of each of its two end devices, ``cross_az`` edges add
``az_latency_ms`` on top and ``cross_region`` edges ``region_latency_ms``, so the latency of a path
counts every device it passes through once per traversal, e.g. GPU -> PCIe -> NIC -> leaf -> NIC ->
PCIe -> GPU costs ``2*pcie + 2*nic + switch``. :data:`TRANSPORT_LATENCY_US` gives sourced NIC and
switch latencies per transport (InfiniBand, RoCE, EFA, TCP).

Zones and regions
-----------------
Node ``n`` sits in zone ``n % azs`` and zone ``z`` in region ``z % regions``. Each populated zone
has a gateway ``("gw", z)``; the gateways of zones of one region are joined pairwise by
``cross_az`` links. With ``regions > 1`` each populated region also has a region gateway
``("rgw", r)`` linked to its zones' gateways, and region gateways are joined pairwise by
``cross_region`` links, so traffic between regions crosses exactly one ``cross_region`` link and
no ``cross_az`` link: a cloud bills an inter-region transfer once, at the inter-region rate, not
additionally as inter-AZ traffic.

GPUDirect RDMA
--------------
With ``gdr=True`` (the default) a NIC reads and writes GPU memory directly over PCIe. With
``gdr=False`` NCCL's network proxy stages every cross-node transfer in host memory, so the route
goes GPU -> PCIe switch -> host -> PCIe switch -> NIC at the sender, and the mirror image at the
receiver. When GPU and NIC share a switch, that switch is passed twice (up to the host and back
down), over the two directions of its host link: the route repeats that device but no link.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np

from sim.topology.routing import ROUTINGS, spine_count

__all__ = [
    "CROSS_AZ",
    "CROSS_REGION",
    "ETHERNET_SWITCH_LATENCY_US",
    "LINK_KINDS",
    "NETWORK",
    "NIC_LATENCY_US",
    "NVLINK",
    "NVLINK_LATENCY_US",
    "PCIE",
    "PCIE_LATENCY_US",
    "SWITCH_LATENCY_US",
    "TRANSPORT_LATENCY_US",
    "Fabric",
    "FabricSpec",
    "build_fabric",
    "build_graph",
]

LINK_KINDS = ("nvlink", "pcie", "network", "cross_az", "cross_region")
"""Link classes; a link's kind code is its index in this tuple (new kinds are appended)."""
NVLINK, PCIE, NETWORK, CROSS_AZ, CROSS_REGION = range(len(LINK_KINDS))

# --- Default device traversal latencies (microseconds) ---------------------------------------
# NVSwitch traversal (GPU -> NVSwitch -> GPU): assumed; NVIDIA publishes no port-to-port figure.
NVLINK_LATENCY_US = 0.5
# PCIe Gen5 switch, x16 to x16 cut-through: Broadcom PEX89000 family, 115 ns (vendor figure as
# summarised at probsee.com/p/PEX89144; Gen4 PEX88000 was 105 ns per Linley Newsletter 2019-09-24).
PCIE_LATENCY_US = 0.115
# NVMe read access of a data-centre TLC drive: ~80 us (Samsung PM1733 / KIOXIA CM6 product
# briefs quote 4 KB random-read latencies of 70-90 us); only large sequential transfers use it.
NVME_LATENCY_US = 80.0
# NIC plus cable, one traversal: assumed (order of magnitude of RDMA NIC processing; the NCCL and
# verbs software overheads are modelled by sim/collectives, not here). A conservative upper bound:
# perftest's ib_send_lat measured 0.83 us one way for 32-byte RC sends host to host, both HCAs
# included (D. Potter, master's thesis, table "mtu_performance", git.dennispotter.eu).
NIC_LATENCY_US = 1.0
# InfiniBand NDR switch (NVIDIA Quantum-2) port to port: "under 150 ns" per a reseller's summary
# (router-switch.com, "Quantum-2 QM9700 vs Spectrum-4 SN5400"); the 130 ns figure could not be
# confirmed from an NVIDIA datasheet and other third-party pages quote up to ~330 ns.
SWITCH_LATENCY_US = 0.15
# Ethernet data-centre switch (for RoCE fabrics; pass as switch_latency_us): 500 ns for a
# low-latency cut-through switch (Arista 7124SX), 850 ns for Trident+ parts (HFT switch list,
# gist.github.com/saillinux/1715451, 2012); a conservative assumption for modern parts. Broadcom's
# Tomahawk Ultra, a part built for low latency, quotes 250 ns port to port (fs.com blog "Broadcom
# Tomahawk Ultra Redefines Ethernet Switching", 2025; All About Circuits via dgttech.com,
# 2025-07-18); cut-through Tomahawk/Trident parts ~450 ns on 100GbE ports (telecomate.com
# forwarding-engine latency FAQ). NVIDIA publishes no port-to-port figure for Spectrum-4 (its
# launch note only says "true, port-to-port, cut-through latency", convergedigest, 2022-03).
ETHERNET_SWITCH_LATENCY_US = 0.5

TRANSPORT_LATENCY_US: dict[str, tuple[float, float]] = {
    # (nic_latency_us, switch_latency_us) per transport; pass them as FabricSpec.nic_latency_us and
    # FabricSpec.switch_latency_us. The NIC figure is one traversal of one NIC with its share of
    # the transport stack (so a cross-node path pays it twice); the switch figure one switch hop.
    #
    # InfiniBand NDR (ConnectX-7 + Quantum-2): the two constants above. Quantum-2 port to port is
    # "under 150 ns" (router-switch.com, "NVIDIA Quantum-2 QM9700 vs Spectrum-4 SN5400"); one
    # third-party page says ~330 ns (yobitel.com knowledge base, "NVIDIA Quantum-2"); NVIDIA's
    # own datasheet figure could not be found. NIC: see NIC_LATENCY_US (assumed, conservative).
    "infiniband": (NIC_LATENCY_US, SWITCH_LATENCY_US),
    # RoCEv2 on Ethernet (ConnectX-7 + Spectrum-4 or Tomahawk): the NIC is the same ConnectX
    # silicon and verbs stack as InfiniBand, so the same NIC figure (assumed); the switch is an
    # Ethernet ASIC, see ETHERNET_SWITCH_LATENCY_US (250-850 ns across the sources cited there).
    "roce": (NIC_LATENCY_US, ETHERNET_SWITCH_LATENCY_US),
    # AWS EFA (SRD on the Nitro card, libfabric). AWS documents only that EFA gives "lower and
    # more consistent latency ... than the TCP transport" (EC2 user guide, efa.html, as quoted at
    # arod-aws.blogspot.com/2020/08) and the SRD paper stresses tail latency over median (Shalev
    # et al., "A Cloud-Optimized Transport Protocol for Elastic and Scalable HPC", IEEE Micro
    # 40(6), 2020, abstract at mendeley.com); independent comparisons put EFA behind InfiniBand
    # and RoCE (ahmedjama.com, "AWS EFA vs InfiniBand & RoCE", 2025-09, quoting SemiAnalysis).
    # No median small-message figure could be confirmed, so both values are assumed: 5 us per
    # NIC traversal (SRD processing on the Nitro card plus the libfabric provider, several times
    # a ConnectX's), and an Ethernet switch hop for AWS's undisclosed Ethernet fabric.
    "efa": (5.0, ETHERNET_SWITCH_LATENCY_US),
    # Kernel TCP sockets (NCCL's socket transport) on 100 GbE: sockperf ping-pong through the
    # Linux kernel stack measured 17.8 us one way (1,500-byte messages, back-to-back 10 GbE; in
    # F-Stack issue #540, github.com/F-Stack/f-stack/issues/540), against 0.6-0.8 us for kernel-
    # bypass stacks (AMD Onload user guide UG1586, "Latency Test Results", 10 GbE). The kernel
    # cost is software, so it hardly shrinks with the line rate: 8 us per end on 100 GbE is
    # assumed (about half of that one-way figure, less the 1.2 us of serialisation at 10 GbE).
    "tcp": (8.0, ETHERNET_SWITCH_LATENCY_US),
}

Node = tuple


@dataclass(frozen=True)
class FabricSpec:
    """Everything the fabric builder needs; built by the caller from the scenario's ``cluster``.

    Parameters
    ----------
    nodes : int
        Number of servers.
    gpus_per_node : int
        GPUs per server; global rank = ``node * gpus_per_node + local``.
    nvlink_gbytes_per_s : float
        NVLink bandwidth per GPU, per direction, GB/s (1 GB = 1e9 bytes).
    pcie_gbytes_per_s : float
        Bandwidth of one x16 PCIe link, per direction, GB/s.
    nics_per_node : int
        Network adapters per server (rails); 0 only when ``nodes == 1``.
    nic_gbps : float
        Line rate of one NIC, gigabits per second.
    azs : int
        Availability zones; node ``n`` sits in zone ``n % azs``.
    az_link_gbps : float
        Capacity between each pair of zones, per direction, Gb/s.
    az_latency_ms : float
        One-way latency of the link between two zones' gateways (the gateways add
        ``switch_latency_us`` each, like any switch).
    regions : int
        Regions; zone ``z`` sits in region ``z % regions``; at most ``azs``. Zones of one region
        are joined pairwise by ``cross_az`` links; regions by their gateways' ``cross_region``
        links (only when ``regions > 1``).
    region_link_gbps : float
        Capacity between each pair of regions, per direction, Gb/s.
    region_latency_ms : float
        One-way latency of the link between two region gateways (each gateway adds
        ``switch_latency_us``).
    nodes_per_leaf : int
        Nodes whose NICs share a leaf switch (per rail when ``rail_optimized``).
    oversubscription : float
        Leaf downlink capacity / leaf uplink capacity (1 = full bisection).
    spines_per_zone : int
        Spine switches per zone; 0 derives it as the number of uplink ports of the zone's largest
        leaf, ``ceil(leaf NIC ports / oversubscription)``, at least 1, i.e. one uplink from every
        leaf to every spine as in a two-tier fat tree. With ``routing="adaptive"`` the graph
        holds one pooled spine per zone instead (its leaf links carry the summed capacity;
        ``graph.graph["spines_real"]`` keeps the real count).
    rail_optimized : bool
        NIC ``k`` of every node in a leaf group goes to that group's rail-``k`` leaf; otherwise one
        leaf per group takes all NICs of its nodes.
    pcie_switches_per_node : int
        PCIe switches per node; 0 derives ``min(max(1, nics_per_node), gpus_per_node)``, which
        puts every GPU on the same switch as its rail NIC.
    gdr : bool
        GPUDirect RDMA: NICs access GPU memory directly. ``False`` stages every cross-node
        transfer in host memory at both ends, as NCCL's proxy does without GDR.
    nvlink_latency_us, pcie_latency_us, nic_latency_us, switch_latency_us : float
        Traversal latency of an NVSwitch, a PCIe switch, a NIC (with cable), a network switch;
        :data:`TRANSPORT_LATENCY_US` has NIC and switch values per transport.
    ecmp_seed : int
        Salt of the ECMP hash that spreads flows over spines.
    routing : {"ecmp", "adaptive"}
        Static per-flow ECMP over the spines, or adaptive routing (per-packet spreading, modelled
        as one pooled spine per zone; :mod:`sim.topology.routing`). The scenario layer picks a
        default by transport; ``ecmp`` here keeps the builder's historical graph.

    Examples
    --------
    >>> spec = FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                   pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400)
    >>> spec.pcie_switches
    8
    """

    nodes: int
    gpus_per_node: int
    nvlink_gbytes_per_s: float
    pcie_gbytes_per_s: float
    nics_per_node: int
    nic_gbps: float
    azs: int = 1
    az_link_gbps: float = 100.0
    az_latency_ms: float = 1.0
    regions: int = 1
    region_link_gbps: float = 100.0
    region_latency_ms: float = 30.0
    nodes_per_leaf: int = 16
    oversubscription: float = 1.0
    spines_per_zone: int = 0
    rail_optimized: bool = True
    pcie_switches_per_node: int = 0
    gdr: bool = True
    nvlink_latency_us: float = NVLINK_LATENCY_US
    pcie_latency_us: float = PCIE_LATENCY_US
    nic_latency_us: float = NIC_LATENCY_US
    switch_latency_us: float = SWITCH_LATENCY_US
    ecmp_seed: int = 0
    nvme_read_gbytes_per_s: float = 0.0
    """Local NVMe read bandwidth per server (drives striped); 0 = no NVMe device."""
    nvme_write_gbytes_per_s: float = 0.0
    """Local NVMe write bandwidth per server."""
    cpu_vendor: str = "intel"
    """Host CPU vendor (intel, amd, arm, power, zhaoxin, mixed): NCCL's tuning indexes its
    multi-node LL bandwidth limit and network overhead by it; Intel where unknown."""
    sharp: bool = False
    """Network switches with in-network reduction (InfiniBand SHARP) for NCCL's CollNet."""
    routing: str = "ecmp"

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"FabricSpec: {what}")

        need(self.nodes >= 1, f"nodes must be >= 1, got {self.nodes}")
        need(self.gpus_per_node >= 1, f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        need(self.nics_per_node >= 0, f"nics_per_node must be >= 0, got {self.nics_per_node}")
        need(
            self.nics_per_node > 0 or self.nodes == 1,
            "nics_per_node must be >= 1 when nodes > 1 (nodes cannot reach each other)",
        )
        need(self.azs >= 1, f"azs must be >= 1, got {self.azs}")
        need(self.regions >= 1, f"regions must be >= 1, got {self.regions}")
        need(
            self.regions <= self.azs,
            f"regions must be <= azs (every region needs a zone), got regions={self.regions} "
            f"> azs={self.azs}",
        )
        need(self.nodes_per_leaf >= 1, f"nodes_per_leaf must be >= 1, got {self.nodes_per_leaf}")
        need(self.spines_per_zone >= 0, "spines_per_zone must be >= 0")
        need(self.routing in ROUTINGS, f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        need(self.pcie_switches_per_node >= 0, "pcie_switches_per_node must be >= 0")
        for name in ("nvlink_gbytes_per_s", "pcie_gbytes_per_s", "nic_gbps", "az_link_gbps",
                     "region_link_gbps", "oversubscription"):
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0, f"{name} must be > 0, got {value}")
        for name in ("az_latency_ms", "region_latency_ms", "nvlink_latency_us", "pcie_latency_us",
                     "nic_latency_us", "switch_latency_us"):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0, f"{name} must be >= 0, got {value}")

    @property
    def n_gpus(self) -> int:
        """Total GPUs in the cluster."""
        return self.nodes * self.gpus_per_node

    @property
    def pcie_switches(self) -> int:
        """PCIe switches per node, after deriving the 0 default."""
        if self.pcie_switches_per_node:
            return self.pcie_switches_per_node
        return min(max(1, self.nics_per_node), self.gpus_per_node)

    def rail_of(self, local: int) -> int:
        """Rail (NIC index) used by local GPU ``local`` for cross-node traffic."""
        return local * self.nics_per_node // self.gpus_per_node

    def region_of_zone(self, zone: int) -> int:
        """Region of zone ``zone`` (``zone % regions``)."""
        return zone % self.regions

    def pcie_switch_of_gpu(self, local: int) -> int:
        """PCIe switch of local GPU ``local``."""
        return local * self.pcie_switches // self.gpus_per_node

    def pcie_switch_of_nic(self, k: int) -> int:
        """PCIe switch of NIC ``k``."""
        return k * self.pcie_switches // self.nics_per_node


@dataclass(frozen=True)
class _Layout:
    """Switch-level structure shared by the builder and the router (derived from the spec)."""

    zone_nodes: tuple[tuple[int, ...], ...]  # nodes of each zone, in order
    leaves: tuple[int, ...]  # leaf count per zone
    leaf_downlinks: tuple[tuple[int, ...], ...]  # NIC ports per leaf, per zone
    spines: tuple[int, ...]  # spines laid out per zone (0 with at most one leaf; 1 if pooled)
    spines_real: tuple[int, ...]  # spine switches per zone before adaptive routing pools them

    @staticmethod
    def of(spec: FabricSpec) -> _Layout:
        zone_nodes = tuple(tuple(range(z, spec.nodes, spec.azs)) for z in range(spec.azs))
        nics = spec.nics_per_node
        leaves: list[int] = []
        downlinks: list[tuple[int, ...]] = []
        spines: list[int] = []
        for members in zone_nodes:
            if nics == 0 or not members:
                leaves.append(0)
                downlinks.append(())
                spines.append(0)
                continue
            groups = [
                len(members[i:i + spec.nodes_per_leaf])
                for i in range(0, len(members), spec.nodes_per_leaf)
            ]
            if spec.rail_optimized:
                ports = tuple(g for g in groups for _ in range(nics))
            else:
                ports = tuple(g * nics for g in groups)
            leaves.append(len(ports))
            downlinks.append(ports)
            if len(ports) <= 1:
                spines.append(0)
            elif spec.spines_per_zone:
                spines.append(spec.spines_per_zone)
            else:
                spines.append(max(1, math.ceil(max(ports) / spec.oversubscription)))
        pooled = tuple(spine_count(spec.routing, n) for n in spines)
        return _Layout(zone_nodes, tuple(leaves), tuple(downlinks), pooled, tuple(spines))

    def leaf_of_nic(self, spec: FabricSpec, node: int, k: int) -> Node:
        zone = node % spec.azs
        group = (node // spec.azs) // spec.nodes_per_leaf
        i = group * spec.nics_per_node + k if spec.rail_optimized else group
        return ("leaf", zone, i)


def _device_latency(spec: FabricSpec, node: Node) -> float:
    """Traversal latency of a device, in seconds (see the module docstring)."""
    t = node[0]
    if t == "gpu":
        return 0.0
    if t == "nvswitch":
        return spec.nvlink_latency_us * 1e-6
    if t in ("pcie", "host"):
        # The host's root complex is treated like one more PCIe switch hop.
        return spec.pcie_latency_us * 1e-6
    if t == "nvme":
        return NVME_LATENCY_US * 1e-6
    if t == "nic":
        return spec.nic_latency_us * 1e-6
    return spec.switch_latency_us * 1e-6  # leaf, spine, gw, rgw


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
    layout = _Layout.of(spec)
    g = nx.DiGraph(spec=spec, link_kinds=LINK_KINDS, spines_real=layout.spines_real)
    azs = spec.azs
    region = spec.region_of_zone
    edges: list[tuple[Node, Node, dict]] = []

    def link(u: Node, v: Node, kind: int, capacity: float, extra_latency: float = 0.0) -> None:
        # Both directions share capacity and latency; only cross_az / cross_region edges differ
        # in zone (and region) between their two directions.
        lat = 0.5 * (_device_latency(spec, u) + _device_latency(spec, v)) + extra_latency
        for a, b in ((u, v), (v, u)):
            edges.append((a, b, {
                "kind": LINK_KINDS[kind],
                "capacity": float(capacity),
                "latency": lat,
                "zone": g.nodes[a]["zone"],
                "region": g.nodes[a]["region"],
                "index": len(edges),
            }))

    G = spec.gpus_per_node
    nics = spec.nics_per_node
    nvlink_cap = spec.nvlink_gbytes_per_s * 1e9
    pcie_cap = spec.pcie_gbytes_per_s * 1e9
    nic_cap = spec.nic_gbps * 1e9 / 8
    S = spec.pcie_switches

    # Inside each server: NVSwitch, PCIe tree, host memory, NICs.
    for n in range(spec.nodes):
        zone = n % azs
        at = {"zone": zone, "region": region(zone)}
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
                link(gpu, ("nvswitch", n), NVLINK, nvlink_cap)
            link(gpu, ("pcie", n, spec.pcie_switch_of_gpu(k)), PCIE, pcie_cap)
        for k in range(nics):
            link(("nic", n, k), ("pcie", n, spec.pcie_switch_of_nic(k)), PCIE, pcie_cap)
        for s in range(S):
            link(("pcie", n, s), host, PCIE, pcie_cap)
        if spec.nvme_read_gbytes_per_s > 0 and spec.nvme_write_gbytes_per_s > 0:
            # The node's striped NVMe drives as one device behind the host: reads flow
            # nvme -> host, writes host -> nvme, each at its own rate.
            nvme = ("nvme", n)
            g.add_node(nvme, **at)
            lat = 0.5 * (_device_latency(spec, host) + _device_latency(spec, nvme))
            for src, dst, cap in ((nvme, host, spec.nvme_read_gbytes_per_s),
                                  (host, nvme, spec.nvme_write_gbytes_per_s)):
                edges.append((src, dst, {"kind": "pcie", "capacity": cap * 1e9, "latency": lat,
                                     "zone": zone, "region": region(zone),
                                     "index": len(edges)}))

    # Leaves, then NIC -> leaf cables (in node order, so indices are stable).
    for z in range(azs):
        for i in range(layout.leaves[z]):
            g.add_node(("leaf", z, i), zone=z, region=region(z))
        for i in range(layout.spines[z]):
            g.add_node(("spine", z, i), zone=z, region=region(z))
    for n in range(spec.nodes if nics else 0):
        for k in range(nics):
            link(("nic", n, k), layout.leaf_of_nic(spec, n, k), NETWORK, nic_cap)

    # Leaf -> spine: each leaf's uplinks carry its NIC capacity / oversubscription, split evenly.
    for z in range(azs):
        n_spines = layout.spines[z]
        for i, ports in enumerate(layout.leaf_downlinks[z] if n_spines else ()):
            up = ports * nic_cap / spec.oversubscription / n_spines
            for s in range(n_spines):
                link(("leaf", z, i), ("spine", z, s), NETWORK, up)

    # Zone gateways: ample capacity to the zone's top tier, metered links between the zones of
    # one region (with one region, between all zones, as before regions existed).
    populated = [z for z in range(azs) if layout.leaves[z]]
    ample = {z: len(layout.zone_nodes[z]) * nics * nic_cap for z in populated}
    if azs > 1 and populated:
        for z in populated:
            gw = ("gw", z)
            g.add_node(gw, zone=z, region=region(z))
            top = "spine" if layout.spines[z] else "leaf"
            for i in range(layout.spines[z] or layout.leaves[z]):
                link((top, z, i), gw, NETWORK, ample[z])
        az_cap = spec.az_link_gbps * 1e9 / 8
        for a_i, a in enumerate(populated):
            for b in populated[a_i + 1:]:
                if region(a) == region(b):
                    link(("gw", a), ("gw", b), CROSS_AZ, az_cap, spec.az_latency_ms * 1e-3)

    # Region gateways: ample links to the gateways of the region's zones, metered links between
    # regions. A route between regions crosses one cross_region link and no cross_az link, so
    # per-kind byte counters bill each boundary once, at the inter-region price.
    if spec.regions > 1 and populated:
        regions = sorted({region(z) for z in populated})
        for r in regions:
            rgw = ("rgw", r)
            g.add_node(rgw, zone=r, region=r)  # zone r is region r's first zone (r < regions)
            for z in populated:
                if region(z) == r:
                    link(("gw", z), rgw, NETWORK, ample[z])
        region_cap = spec.region_link_gbps * 1e9 / 8
        for a_i, a in enumerate(regions):
            for b in regions[a_i + 1:]:
                link(("rgw", a), ("rgw", b), CROSS_REGION, region_cap,
                     spec.region_latency_ms * 1e-3)

    g.add_edges_from(edges)
    return g


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
        self._layout = _Layout.of(spec)
        self._routes: dict[tuple[int, int, int | None], tuple[int, ...]] = {}
        self._up: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._down: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._to_host: dict[int, tuple[int, ...]] = {}
        self._from_host: dict[int, tuple[int, ...]] = {}

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
        """Availability zone of ``rank`` (its node modulo ``azs``).

        Examples
        --------
        >>> fab = build_fabric(FabricSpec(nodes=3, gpus_per_node=1, nvlink_gbytes_per_s=450,
        ...                               pcie_gbytes_per_s=64, nics_per_node=1, nic_gbps=400,
        ...                               azs=2))
        >>> [fab.zone_of(r) for r in range(3)]
        [0, 1, 0]
        """
        return self.node_of(rank) % self.spec.azs

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

    def _up_nodes(self, node: int, local: int, k: int) -> list[Node]:
        """GPU -> its PCIe switch -> [host -> NIC k's switch] -> NIC k.

        The host hop is taken when NIC ``k`` hangs off another switch (peer-to-peer through the
        root complex) and always without GPUDirect RDMA, when NCCL's proxy stages the data in host
        memory (NCCL user guide, "Environment Variables": ``NCCL_NET_GDR_LEVEL`` and
        ``NCCL_NET_GDR_READ`` choose between the two, as discussed in NVIDIA/nccl issue #1295).
        In that case a switch shared by GPU and NIC is passed twice, over the two directions of
        its host link.
        """
        spec = self.spec
        s_gpu = spec.pcie_switch_of_gpu(local)
        s_nic = spec.pcie_switch_of_nic(k)
        path: list[Node] = [("gpu", node, local), ("pcie", node, s_gpu)]
        if s_nic != s_gpu or not spec.gdr:
            path += [("host", node), ("pcie", node, s_nic)]
        path.append(("nic", node, k))
        return path

    def _up_down(self, node: int, local: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Links GPU -> NIC ``k`` and NIC ``k`` -> GPU, cached per (node, local GPU, NIC)."""
        key = (node, local, k)
        up = self._up.get(key)
        if up is None:
            nodes = self._up_nodes(node, local, k)
            up = self._up[key] = self._ids(nodes)
            self._down[key] = self._ids(reversed(nodes))
        return up, self._down[key]

    def _ecmp(self, n: int, src: int, dst: int, salt: int) -> int:
        # crc32 is stable across processes, unlike the salted built-in hash().
        if n == 1:
            return 0
        return zlib.crc32(struct.pack("<qqqq", src, dst, self.spec.ecmp_seed, salt)) % n

    def _network_nodes(self, src: int, dst: int, a: int, b: int, ka: int, kb: int) -> list[Node]:
        """Switch-level path from NIC ``ka`` of node ``a`` to NIC ``kb`` of node ``b`` (leaves).

        Between zones: up to the zone gateway, across one ``cross_az`` link within a region, or
        through the two region gateways and one ``cross_region`` link between regions.
        """
        spec, layout = self.spec, self._layout
        leaf_a = layout.leaf_of_nic(spec, a, ka)
        leaf_b = layout.leaf_of_nic(spec, b, kb)
        if leaf_a == leaf_b:
            return [leaf_a]
        za, zb = leaf_a[1], leaf_b[1]
        if za == zb:
            spine = ("spine", za, self._ecmp(layout.spines[za], src, dst, 0))
            return [leaf_a, spine, leaf_b]
        path = [leaf_a]
        if layout.spines[za]:
            path.append(("spine", za, self._ecmp(layout.spines[za], src, dst, 1)))
        path.append(("gw", za))
        ra, rb = za % spec.regions, zb % spec.regions
        if ra != rb:
            path += [("rgw", ra), ("rgw", rb)]
        path.append(("gw", zb))
        if layout.spines[zb]:
            path.append(("spine", zb, self._ecmp(layout.spines[zb], src, dst, 2)))
        path.append(leaf_b)
        return path

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
            up = self._up_down(a, ga, ka)[0]
            down = self._up_down(b, gb, kb)[1]
            net = self._network_nodes(src_rank, dst_rank, a, b, ka, kb)
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
            nodes = [("gpu", node, local), ("pcie", node, self.spec.pcie_switch_of_gpu(local)),
                     ("host", node)]
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
