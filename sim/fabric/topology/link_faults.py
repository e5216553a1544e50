"""NIC link faults on a built :class:`~sim.fabric.topology.fabric.Fabric`: slow and failed links.

Applied once, after :func:`~sim.fabric.topology.fabric.build_fabric` and before anything reads
the fabric's capacities or routes (the flow network and NCCL's plans copy them):

* A **slow link** (``faults.slow_links``: a cable, transceiver or port running at a fraction of
  its rate, or a flapping link averaged over the step) keeps its place in the fabric with its
  capacity divided by ``factor`` in both directions: the NIC -> leaf cable and the leaf -> NIC
  cable (``network`` links). Every route through it, and NCCL's bandwidth estimate of every
  plan that uses it, see the lower rate.
* A **failed link** (``faults.failed_links``) carries nothing: the fabric's router
  (:meth:`Fabric.route`) sends what would have used NIC ``k`` of that node through a remaining
  NIC ``j`` of the same node instead, reached over PCIe (through the host's root complex when
  ``j`` hangs off another PCIe switch, as :func:`~sim.fabric.topology.paths.gpu_nic_nodes`
  lays out). This is NCCL started with the NIC down: it enumerates only live IB devices
  (``ncclIbInit``), and each GPU's traffic goes to the nearest NIC it finds
  (``ncclTopoGetLocalNet``, src/graph/search.cc: best bandwidth, then the shortest PCIe path).
  The nearest NIC is one on the GPU's own PCIe switch when there is one, else any other;
  among equally near ones ``seed`` picks (crc32, deterministic). Modelled simplification: the
  collectives keep their channels and rails, so the remaining NIC carries the failed NIC's
  channels on top of its own (NCCL re-searching its rings over 7 NICs could spread them more
  evenly). A NIC failing in the middle of a step is not modelled: NCCL then aborts the job
  (that is a run-level interruption, ``run:``).

Examples
--------
>>> from sim.fabric.topology import FabricSpec, build_fabric
>>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
...                               pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400))
>>> apply_link_faults(fab, slow=[(1, 3, 2.0)], failed=[(0, 0)])
>>> [round(float(fab.capacity[i]) / 1e9) for i in nic_links(fab, 1, 3)]
[25, 25]
>>> fab.endpoints[fab.route(0, 8)[2]][0] != ("nic", 0, 0)
True
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from sim.fabric.topology.fabric import Fabric
from sim.fabric.topology.links import NETWORK

__all__ = ["apply_link_faults", "nic_links", "substitute_nic"]


def nic_links(fabric: Fabric, node: int, nic: int) -> list[int]:
    """Link indices of NIC ``nic`` of ``node``'s network cable, both directions (NIC -> leaf,
    leaf -> NIC)."""
    dev = ("nic", node, nic)
    return [i for i, (u, v) in enumerate(fabric.endpoints)
            if (u == dev or v == dev) and fabric.kind[i] == NETWORK]


def substitute_nic(fabric: Fabric, node: int, nic: int, down: set[int], seed: int = 0) -> int:
    """The live NIC of ``node`` that takes NIC ``nic``'s traffic when the NICs ``down`` failed:
    one on the same PCIe switch if any, else any live one; ``seed`` picks among equals.

    Examples
    --------
    >>> from sim.fabric.topology import FabricSpec, build_fabric
    >>> fab = build_fabric(FabricSpec(nodes=2, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                               pcie_gbytes_per_s=64, nics_per_node=8, nic_gbps=400,
    ...                               pcie_switches_per_node=4))
    >>> substitute_nic(fab, 0, 2, {2})   # NIC 3 shares NIC 2's PCIe switch
    3
    """
    spec = fabric.spec
    live = [j for j in range(spec.nics_per_node) if j not in down]
    if not live:
        raise ValueError(f"node {node}: every NIC failed")
    switch = spec.pcie_switch_of_nic(nic)
    near = [j for j in live if spec.pcie_switch_of_nic(j) == switch] or live
    return near[zlib.crc32(struct.pack("<qqq", node, nic, seed)) % len(near)]


def apply_link_faults(fabric: Fabric, slow: Iterable[tuple[int, int, float]] = (),
                      failed: Iterable[tuple[int, int]] = (), seed: int = 0) -> None:
    """Divide each slow NIC link's capacity by its factor and route around the failed ones.

    Parameters
    ----------
    fabric : Fabric
        A freshly built fabric (no route asked yet; routes are cached).
    slow : iterable of (node, nic, factor)
        NIC links at ``1 / factor`` of their rate (``factor >= 1``).
    failed : iterable of (node, nic)
        NIC links that are down.
    seed : int
        Salt of the choice among equally near remaining NICs.
    """
    for node, nic, factor in slow:
        if factor < 1:
            raise ValueError(f"slow link node {node} nic {nic}: factor {factor} < 1")
        for i in nic_links(fabric, node, nic):
            fabric.capacity[i] /= factor
            u, v = fabric.endpoints[i]
            fabric.graph.edges[u, v]["capacity"] = float(fabric.capacity[i])
    down: dict[int, set[int]] = {}
    for node, nic in failed:
        down.setdefault(node, set()).add(nic)
    # A server with every NIC down has nothing to route around to: alone it needs none (a
    # multi-server fabric refuses it first, sim.config.faults.check_faults).
    subs = {(node, nic): substitute_nic(fabric, node, nic, nics, seed)
            for node, nics in sorted(down.items()) if len(nics) < fabric.spec.nics_per_node
            for nic in sorted(nics)}
    fabric.set_nic_substitutes(subs)
