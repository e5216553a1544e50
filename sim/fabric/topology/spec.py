"""The fabric builder's input: :class:`FabricSpec`, one cluster's servers, NICs and switches.

Built by the caller from the scenario's ``cluster`` (:func:`sim.api.fabric_spec`); the graph
builders (:mod:`sim.fabric.topology.graph`) and the router
(:class:`sim.fabric.topology.fabric.Fabric`) read it.
It validates itself on construction and answers the placement rules both sides share: which NIC
(rail) and which PCIe switch a GPU uses, which region a zone is in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.config.zones import AzPlacement, zone_of_node, zone_position
from sim.fabric.topology.links import (
    NIC_LATENCY_US,
    NVLINK_LATENCY_US,
    PCIE_LATENCY_US,
    SWITCH_LATENCY_US,
)
from sim.fabric.topology.routing import ROUTINGS

__all__ = ["FabricSpec"]


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
        Availability zones; node ``n`` sits in zone ``n % azs`` (``az_placement``
        ``round_robin``) or the zones' nodes come one zone after another (``blocks``;
        :mod:`sim.config.zones`).
    az_placement : str
        ``round_robin`` or ``blocks``.
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
        :data:`~sim.fabric.topology.links.TRANSPORT_LATENCY_US` has NIC and switch values per
        transport.
    ecmp_seed : int
        Salt of the ECMP hash that spreads flows over spines.
    routing : {"ecmp", "adaptive"}
        Static per-flow ECMP over the spines, or adaptive routing (per-packet spreading, modelled
        as one pooled spine per zone; :mod:`sim.fabric.topology.routing`). The scenario layer picks
        a
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
    az_placement: AzPlacement = "round_robin"
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
    c2c_gbytes_per_s: float = 0.0
    """NVLink-C2C bandwidth per direction of one host CPU (Grace) to its GPUs; 0 = the host is
    reached over the PCIe tree. When set, GPU <-> host traffic (offload, checkpoint copies)
    takes GPU -> ``("cpu", node, c)`` -> host over C2C links; NIC traffic keeps the PCIe tree."""
    gpus_per_host: int = 0
    """GPUs per host CPU on C2C hosts (GB200: 2 per Grace); 0 = all the node's GPUs."""
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
        need(self.az_placement in ("round_robin", "blocks"),
             f"az_placement must be round_robin or blocks, got {self.az_placement!r}")
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
        need(self.gpus_per_host >= 0, "gpus_per_host must be >= 0")
        need(math.isfinite(self.c2c_gbytes_per_s) and self.c2c_gbytes_per_s >= 0,
             f"c2c_gbytes_per_s must be >= 0, got {self.c2c_gbytes_per_s}")
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

    def zone_of_node(self, node: int) -> int:
        """Availability zone of server ``node`` (:func:`sim.config.zones.zone_of_node`)."""
        return zone_of_node(node, self.nodes, self.azs, self.az_placement)

    def zone_position(self, node: int) -> int:
        """Index of server ``node`` among its zone's (its leaf group: this over
        ``nodes_per_leaf``)."""
        return zone_position(node, self.nodes, self.azs, self.az_placement)

    def region_of_zone(self, zone: int) -> int:
        """Region of zone ``zone`` (``zone % regions``)."""
        return zone % self.regions

    def pcie_switch_of_gpu(self, local: int) -> int:
        """PCIe switch of local GPU ``local``."""
        return local * self.pcie_switches // self.gpus_per_node

    @property
    def host_cpus(self) -> int:
        """Host CPUs per node with their own C2C link (0 when the host is behind PCIe)."""
        if not self.c2c_gbytes_per_s:
            return 0
        per = self.gpus_per_host or self.gpus_per_node
        return -(-self.gpus_per_node // per)

    def host_cpu_of_gpu(self, local: int) -> int:
        """The host CPU (Grace) that local GPU ``local`` hangs off over C2C."""
        return local // (self.gpus_per_host or self.gpus_per_node)

    def pcie_switch_of_nic(self, k: int) -> int:
        """PCIe switch of NIC ``k``."""
        return k * self.pcie_switches // self.nics_per_node
