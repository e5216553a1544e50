"""Fabric topologies: graph builders and the indexed, routed :class:`Fabric`."""

from sim.topology.fabric import (
    CROSS_AZ,
    CROSS_REGION,
    ETHERNET_SWITCH_LATENCY_US,
    LINK_KINDS,
    NETWORK,
    NIC_LATENCY_US,
    NVLINK,
    NVLINK_LATENCY_US,
    PCIE,
    PCIE_LATENCY_US,
    SWITCH_LATENCY_US,
    TRANSPORT_LATENCY_US,
    Fabric,
    FabricSpec,
    build_fabric,
    build_graph,
)

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
