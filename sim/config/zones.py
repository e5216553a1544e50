"""Which availability zone each server sits in (``cluster.azs``, ``cluster.az_placement``).

One rule, used by the fabric builder (``sim.fabric.topology``), the shared-cluster placement
of several jobs (:mod:`sim.config.multijob`) and everything that asks a rank's zone:

* ``round_robin`` (the default): node ``n`` in zone ``n % azs``, as a host list that
  alternates zones places it; every group of consecutive nodes (a tensor-, expert- or
  data-parallel group spanning servers) then crosses the zone boundary.
* ``blocks``: the zones' nodes one after another, as a host list that lists each zone's
  servers together places them: zone ``z`` holds as many nodes as under round robin
  (``len(range(z, nodes, azs))``: the first zones one more when ``azs`` does not divide
  ``nodes``), numbered consecutively; with Megatron's rank order (pipeline outermost) whole
  pipeline stages then sit in one zone and only the stage boundaries cross.
"""

from __future__ import annotations

from typing import Literal

AzPlacement = Literal["round_robin", "blocks"]

__all__ = ["AzPlacement", "zone_nodes", "zone_of_node", "zone_position"]


def zone_nodes(nodes: int, azs: int, placement: AzPlacement = "round_robin"
               ) -> tuple[tuple[int, ...], ...]:
    """The nodes of each zone, ascending.

    Examples
    --------
    >>> zone_nodes(5, 2)
    ((0, 2, 4), (1, 3))
    >>> zone_nodes(5, 2, "blocks")
    ((0, 1, 2), (3, 4))
    """
    if placement == "round_robin":
        return tuple(tuple(range(z, nodes, azs)) for z in range(azs))
    return tuple(tuple(range(_block_start(z, nodes, azs), _block_start(z + 1, nodes, azs)))
                 for z in range(azs))


def _block_start(zone: int, nodes: int, azs: int) -> int:
    """First node of ``zone``'s block: the zones before it hold ``nodes // azs`` each, the
    first ``nodes % azs`` of them one more."""
    return zone * (nodes // azs) + min(zone, nodes % azs)


def zone_of_node(node: int, nodes: int, azs: int, placement: AzPlacement = "round_robin"
                 ) -> int:
    """Zone of ``node``.

    Examples
    --------
    >>> [zone_of_node(n, 5, 2, "blocks") for n in range(5)]
    [0, 0, 0, 1, 1]
    """
    if placement == "round_robin" or azs == 1:
        return node % azs
    big, size = nodes % azs, nodes // azs   # the first `big` zones hold size + 1 nodes
    edge = big * (size + 1)
    return node // (size + 1) if node < edge else big + (node - edge) // size


def zone_position(node: int, nodes: int, azs: int, placement: AzPlacement = "round_robin"
                  ) -> int:
    """Index of ``node`` among its zone's nodes (what leaf group it joins).

    Examples
    --------
    >>> [zone_position(n, 5, 2) for n in range(5)], [zone_position(n, 5, 2, "blocks")
    ...                                             for n in range(5)]
    ([0, 0, 1, 1, 2], [0, 1, 2, 0, 1])
    """
    if placement == "round_robin" or azs == 1:
        return node // azs
    return node - _block_start(zone_of_node(node, nodes, azs, placement), nodes, azs)
