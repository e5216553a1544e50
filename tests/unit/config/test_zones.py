"""Which zone each server sits in (``cluster.az_placement``, :mod:`sim.config.zones`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sim.config.cluster import Cluster
from sim.config.multijob import leaf_group
from sim.config.zones import zone_nodes, zone_of_node, zone_position


@given(st.integers(1, 300), st.integers(1, 9), st.sampled_from(["round_robin", "blocks"]))
def test_each_node_in_one_zone_at_one_position(nodes, azs, placement) -> None:
    zones = zone_nodes(nodes, azs, placement)
    assert sorted(n for z in zones for n in z) == list(range(nodes))
    for z, members in enumerate(zones):
        for i, n in enumerate(members):
            assert zone_of_node(n, nodes, azs, placement) == z
            assert zone_position(n, nodes, azs, placement) == i


@given(st.integers(1, 300), st.integers(1, 9))
def test_blocks_hold_as_many_nodes_as_round_robin_one_run_each(nodes, azs) -> None:
    # The same zone sizes either way (zone 0 the largest, which a zone outage takes), and a
    # block is a run of consecutive nodes in zone order.
    blocks, robin = zone_nodes(nodes, azs, "blocks"), zone_nodes(nodes, azs, "round_robin")
    assert [len(z) for z in blocks] == [len(z) for z in robin]
    flat = [n for z in blocks for n in z]
    assert flat == list(range(nodes))


def test_a_shared_clusters_leaf_groups_follow_the_placement() -> None:
    # 8 nodes, 2 zones, 2 nodes a leaf group: blocks put nodes 4..7 in zone 1.
    c = Cluster(nodes=8, azs=2, nodes_per_leaf=2, az_placement="blocks")
    assert [leaf_group(n, c) for n in range(8)] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                    (1, 0), (1, 0), (1, 1), (1, 1)]
    c = Cluster(nodes=8, azs=2, nodes_per_leaf=2)
    assert [leaf_group(n, c) for n in range(8)] == [(0, 0), (1, 0), (0, 0), (1, 0),
                                                    (0, 1), (1, 1), (0, 1), (1, 1)]
