"""Switch-level layout of a fabric: zones' nodes, leaves, their NIC ports and the spines.

One :class:`Layout` is derived from a :class:`~sim.fabric.topology.spec.FabricSpec` and shared by
the
graph builders (:mod:`sim.fabric.topology.graph`), which lay out the switches it counts, and the
router
(:class:`sim.fabric.topology.fabric.Fabric`), which finds a NIC's leaf and a zone's spines through
it, so
both read the same structure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.config import zones
from sim.fabric.topology.links import Node
from sim.fabric.topology.routing import spine_count
from sim.fabric.topology.spec import FabricSpec

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Switch-level structure shared by the builder and the router (derived from the spec).

    Examples
    --------
    >>> spec = FabricSpec(nodes=3, gpus_per_node=8, nvlink_gbytes_per_s=450,
    ...                   pcie_gbytes_per_s=64, nics_per_node=2, nic_gbps=400,
    ...                   nodes_per_leaf=2)
    >>> lay = Layout.of(spec)
    >>> lay.leaves, lay.leaf_downlinks, lay.spines
    ((4,), ((2, 2, 1, 1),), (2,))
    >>> lay.leaf_of_nic(spec, 2, 1)
    ('leaf', 0, 3)
    """

    zone_nodes: tuple[tuple[int, ...], ...]  # nodes of each zone, in order
    leaves: tuple[int, ...]  # leaf count per zone
    leaf_downlinks: tuple[tuple[int, ...], ...]  # NIC ports per leaf, per zone
    spines: tuple[int, ...]  # spines laid out per zone (0 with at most one leaf; 1 if pooled)
    spines_real: tuple[int, ...]  # spine switches per zone before adaptive routing pools them

    @staticmethod
    def of(spec: FabricSpec) -> Layout:
        """The layout of ``spec``: leaf groups of ``nodes_per_leaf`` nodes per zone (one leaf per
        rail and group when rail-optimised), and the spine count of each zone with two leaves or
        more (:attr:`FabricSpec.spines_per_zone`, pooled by :func:`~sim.fabric.topology.routing.
        spine_count` under adaptive routing)."""
        zone_nodes = zones.zone_nodes(spec.nodes, spec.azs, spec.az_placement)
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
        return Layout(zone_nodes, tuple(leaves), tuple(downlinks), pooled, tuple(spines))

    def leaf_of_nic(self, spec: FabricSpec, node: int, k: int) -> Node:
        """Leaf switch that NIC ``k`` of node ``node`` is cabled to."""
        zone = spec.zone_of_node(node)
        group = spec.zone_position(node) // spec.nodes_per_leaf
        i = group * spec.nics_per_node + k if spec.rail_optimized else group
        return ("leaf", zone, i)
