"""Link classes, device ids and device traversal latencies of the fabric graph.

A device (graph node) is a tuple naming its type and position: ``("gpu", node, local)``,
``("nvswitch", node)``, ``("pcie", node, k)``, ``("host", node)``, ``("nvme", node)``,
``("cpu", node, c)`` (a host CPU on NVLink-C2C, GB200's Grace),
``("nic", node, k)``, ``("leaf", zone, i)``, ``("spine", zone, i)``, ``("gw", zone)``,
``("rgw", region)``. A link's class is one of :data:`LINK_KINDS`.

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    "Node",
    "device_latency",
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
"""A device of the graph: a tuple ``(type, ...)`` as listed in the module docstring."""


def device_latency(spec: FabricSpec, node: Node) -> float:
    """Traversal latency of device ``node``, in seconds (see the module docstring).

    Examples
    --------
    >>> from sim.fabric.topology.spec import FabricSpec
    >>> spec = FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
    ...                   pcie_gbytes_per_s=64, nics_per_node=0, nic_gbps=400)
    >>> device_latency(spec, ("gpu", 0, 0)), round(device_latency(spec, ("pcie", 0, 0)) * 1e9, 6)
    (0.0, 115.0)
    """
    t = node[0]
    if t == "gpu":
        return 0.0
    if t == "nvswitch":
        return spec.nvlink_latency_us * 1e-6
    if t in ("pcie", "host", "cpu"):
        # The host's root complex is treated like one more PCIe switch hop; so is a Grace's
        # NVLink-C2C port (assumed: NVIDIA publishes no C2C hop latency).
        return spec.pcie_latency_us * 1e-6
    if t == "nvme":
        return NVME_LATENCY_US * 1e-6
    if t == "nic":
        return spec.nic_latency_us * 1e-6
    return spec.switch_latency_us * 1e-6  # leaf, spine, gw, rgw
