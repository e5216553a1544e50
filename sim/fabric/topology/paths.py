"""Device-level paths of the router: up/down routing over the hierarchy the builders laid out.

Pure functions of a :class:`~sim.fabric.topology.spec.FabricSpec` (and its
:class:`~sim.fabric.topology.layout.Layout`) that name the devices a transfer passes through, in
order;
:class:`sim.fabric.topology.fabric.Fabric` turns them into link indices and caches them. A route
costs a
few arithmetic steps and dictionary look-ups rather than a graph search.

GPUDirect RDMA
--------------
With ``gdr=True`` (the default) a NIC reads and writes GPU memory directly over PCIe. With
``gdr=False`` NCCL's network proxy stages every cross-node transfer in host memory, so the route
goes GPU -> PCIe switch -> host -> PCIe switch -> NIC at the sender, and the mirror image at the
receiver. When GPU and NIC share a switch, that switch is passed twice (up to the host and back
down), over the two directions of its host link: the route repeats that device but no link.
"""

from __future__ import annotations

import struct
import zlib

from sim.fabric.topology.layout import Layout
from sim.fabric.topology.links import Node
from sim.fabric.topology.spec import FabricSpec

__all__ = ["ecmp_choice", "gpu_host_nodes", "gpu_nic_nodes", "network_nodes"]


def gpu_nic_nodes(spec: FabricSpec, node: int, local: int, k: int) -> list[Node]:
    """GPU -> its PCIe switch -> [host -> NIC k's switch] -> NIC k.

    The host hop is taken when NIC ``k`` hangs off another switch (peer-to-peer through the
    root complex) and always without GPUDirect RDMA, when NCCL's proxy stages the data in host
    memory (NCCL user guide, "Environment Variables": ``NCCL_NET_GDR_LEVEL`` and
    ``NCCL_NET_GDR_READ`` choose between the two, as discussed in NVIDIA/nccl issue #1295).
    In that case a switch shared by GPU and NIC is passed twice, over the two directions of
    its host link.

    Examples
    --------
    >>> spec = FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                   pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400)
    >>> gpu_nic_nodes(spec, 1, 0, 0)
    [('gpu', 1, 0), ('pcie', 1, 0), ('nic', 1, 0)]
    >>> gpu_nic_nodes(spec, 1, 0, 1)
    [('gpu', 1, 0), ('pcie', 1, 0), ('host', 1), ('pcie', 1, 1), ('nic', 1, 1)]
    """
    s_gpu = spec.pcie_switch_of_gpu(local)
    s_nic = spec.pcie_switch_of_nic(k)
    path: list[Node] = [("gpu", node, local), ("pcie", node, s_gpu)]
    if s_nic != s_gpu or not spec.gdr:
        path += [("host", node), ("pcie", node, s_nic)]
    path.append(("nic", node, k))
    return path


def gpu_host_nodes(spec: FabricSpec, node: int, local: int) -> list[Node]:
    """GPU -> its PCIe switch -> its node's host memory; on NVLink-C2C hosts (GB200) GPU ->
    its Grace -> host memory instead.

    Examples
    --------
    >>> spec = FabricSpec(nodes=1, gpus_per_node=4, nvlink_gbytes_per_s=900,
    ...                   pcie_gbytes_per_s=64, nics_per_node=4, nic_gbps=400,
    ...                   c2c_gbytes_per_s=450, gpus_per_host=2)
    >>> gpu_host_nodes(spec, 0, 3)
    [('gpu', 0, 3), ('cpu', 0, 1), ('host', 0)]
    """
    if spec.host_cpus:
        return [("gpu", node, local), ("cpu", node, spec.host_cpu_of_gpu(local)), ("host", node)]
    return [("gpu", node, local), ("pcie", node, spec.pcie_switch_of_gpu(local)), ("host", node)]


def ecmp_choice(n: int, src: int, dst: int, seed: int, salt: int) -> int:
    """Which of ``n`` equal-cost spines the flow ``src -> dst`` hashes onto (static ECMP).

    crc32 is stable across processes, unlike the salted built-in ``hash()``, so the choice is
    deterministic for a given ``seed`` (``FabricSpec.ecmp_seed``, the scenario's seed).

    Examples
    --------
    >>> ecmp_choice(1, 3, 9, 0, 0), ecmp_choice(4, 3, 9, 0, 0) in range(4)
    (0, True)
    """
    if n == 1:
        return 0
    return zlib.crc32(struct.pack("<qqqq", src, dst, seed, salt)) % n


def network_nodes(spec: FabricSpec, layout: Layout, src: int, dst: int, a: int, b: int,
                  ka: int, kb: int) -> list[Node]:
    """Switch-level path from NIC ``ka`` of node ``a`` to NIC ``kb`` of node ``b`` (leaves).

    The shared leaf; or within a zone the two leaves and a spine chosen by ECMP hash of the
    ranks ``src`` and ``dst`` (the zone's one pooled spine under adaptive routing). Between
    zones: up to the zone gateway, across one ``cross_az`` link within a region, or through the
    two region gateways and one ``cross_region`` link between regions.
    """
    leaf_a = layout.leaf_of_nic(spec, a, ka)
    leaf_b = layout.leaf_of_nic(spec, b, kb)
    if leaf_a == leaf_b:
        return [leaf_a]
    seed = spec.ecmp_seed
    za, zb = leaf_a[1], leaf_b[1]
    if za == zb:
        spine = ("spine", za, ecmp_choice(layout.spines[za], src, dst, seed, 0))
        return [leaf_a, spine, leaf_b]
    path = [leaf_a]
    if layout.spines[za]:
        path.append(("spine", za, ecmp_choice(layout.spines[za], src, dst, seed, 1)))
    path.append(("gw", za))
    ra, rb = za % spec.regions, zb % spec.regions
    if ra != rb:
        path += [("rgw", ra), ("rgw", rb)]
    path.append(("gw", zb))
    if layout.spines[zb]:
        path.append(("spine", zb, ecmp_choice(layout.spines[zb], src, dst, seed, 2)))
    path.append(leaf_b)
    return path
