"""Fabric topologies: graph builders and the indexed, routed :class:`Fabric`.

One module per concern, read top-down:

``links``    link classes (:data:`LINK_KINDS`), device ids, traversal latencies and their sources
``spec``     :class:`FabricSpec`, the builder's input, and its placement rules (rail, PCIe switch)
``routing``  ECMP or adaptive routing over a zone's spines, and the default per transport
``layout``   the switch-level layout (leaves, their ports, spines per zone) builder and router share
``graph``    :func:`build_graph`: the annotated graph, one builder function per tier
``paths``    the router's device paths (GPU to NIC, GPU to host, the network between NICs)
``fabric``   :class:`Fabric` (link arrays, cached routes) and :func:`build_fabric`

Import the names below from here (or from :mod:`sim.fabric.topology.fabric`, which re-exports them).
"""

from sim.fabric.topology.fabric import (
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
