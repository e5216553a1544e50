"""How a fabric spreads traffic over its equal-cost spine paths: static ECMP or adaptive routing.

Two policies, chosen per fabric (``FabricSpec.routing``, ``cluster.routing``):

``ecmp``
    Static per-flow hashing: every (source, destination) pair is pinned to one spine by a hash
    of its endpoints (:meth:`sim.fabric.topology.fabric.Fabric._ecmp`), so two large flows that hash
    to
    the same spine share its links while other spines idle. This is what RoCE clusters built on
    ordinary Ethernet ECMP do; Meta's RoCE training fabric, for one, runs (enhanced) ECMP and
    raises the number of queue pairs per connection to give the hash more entropy (Gangidi et
    al., "RDMA over Ethernet for Distributed AI Training at Meta Scale", SIGCOMM 2024, sections
    on routing: E-ECMP with QP scaling). Kernel TCP sockets hash flows the same way.

``adaptive``
    Per-packet choice of the least-loaded equal-cost port, as InfiniBand switches with adaptive
    routing do (NVIDIA Quantum-2 in the DGX SuperPOD; NVIDIA, "InfiniBand Adaptive Routing",
    and SHIELD self-healing). NCCL turns adaptive routing on by default on InfiniBand ports:
    ``ncclIbInitDevices`` sets ``ncclIbDevs[d].ar = (link_layer == IBV_LINK_LAYER_INFINIBAND)``
    unless ``NCCL_IB_ADAPTIVE_ROUTING`` overrides it (NCCL ``src/transport/net_ib/init.cc``;
    the parameter's default is -2, "auto"). AWS EFA's SRD sprays each flow's packets over many
    paths and reorders at the receiver (Shalev et al., "A Cloud-Optimized Transport Protocol
    for Elastic and Scalable HPC", IEEE Micro 40(6), 2020), which the fluid model treats alike.

How adaptive routing is modelled
--------------------------------
Under max-min fluid sharing, spreading every flow's packets evenly over all ``S`` spines of a
zone puts ``1/S`` of the leaf's outgoing load on each of its ``S`` uplinks, each of capacity
``U/S`` (the builder splits a leaf's uplink capacity ``U`` evenly). Every uplink then binds
exactly when ``sum of flows out of the leaf <= U`` binds, and likewise for the downlinks into
the destination leaf; the spines themselves are non-blocking. So the zone's spines are
*pooled*: the builder lays out one spine per zone, ``("spine", zone, 0)``, and each leaf gets
one up link and one down link to it carrying the summed capacity of its real uplinks
(:func:`spine_count` and the builder's ``ports * nic / oversubscription / spines``). A route
crosses the pooled hop once, as a packet crosses one real spine, so bytes per link class are
exact (each byte still counts two ``network`` hops leaf -> spine -> leaf). Fewer links and no
hashing also keep solves cheap. Adaptive routing only ever chooses a less-loaded port, so even
spreading is what it converges to for the long transfers that matter here.

In ``links.png`` a pooled link reads as "leaf i <-> spine 0 of the zone" and stands for all the
leaf's uplinks together: its utilisation is the mean over them (equal under even spreading),
its bytes the sum. The real spine count stays in ``graph.graph["spines_real"]``. Zone and
region gateways and the cross-zone links are unchanged.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ROUTINGS", "ROUTING_BY_TRANSPORT", "Routing", "default_routing", "spine_count"]

Routing = Literal["ecmp", "adaptive"]
ROUTINGS: tuple[str, ...] = ("ecmp", "adaptive")

ROUTING_BY_TRANSPORT: dict[str, str] = {
    # NCCL enables adaptive routing on every InfiniBand port by default (init.cc, above), and
    # Quantum-class switches in the fabrics our InfiniBand topologies model run it.
    "infiniband": "adaptive",
    # SRD: packet spraying over many paths (Shalev et al. 2020).
    "efa": "adaptive",
    # Ethernet RoCE: static (E-)ECMP per flow (Gangidi et al., SIGCOMM 2024).
    "roce": "ecmp",
    # Kernel TCP: the switches hash each connection's 5-tuple onto one path (ECMP).
    "tcp": "ecmp",
}
"""Default routing per ``nic_transport`` when a cluster or topology does not name one."""


def default_routing(transport: str) -> str:
    """Routing a fabric of ``transport`` uses when none is given.

    Examples
    --------
    >>> default_routing("infiniband"), default_routing("roce")
    ('adaptive', 'ecmp')
    """
    return ROUTING_BY_TRANSPORT[transport]


def spine_count(routing: str, real: int) -> int:
    """Spines the builder lays out for a zone with ``real`` spine switches.

    ``ecmp`` keeps every spine (flows are hashed onto one); ``adaptive`` pools them into one,
    whose links to each leaf carry the summed capacity of that leaf's real uplinks (see the
    module docstring for why this equals per-packet spreading under max-min sharing).

    Examples
    --------
    >>> spine_count("ecmp", 32), spine_count("adaptive", 32), spine_count("adaptive", 0)
    (32, 1, 0)
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "adaptive" and real > 0:
        return 1
    return real
