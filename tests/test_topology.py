"""Tests of the fabric builder and router (sim/topology/fabric.py)."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.topology import (
    CROSS_AZ,
    LINK_KINDS,
    NETWORK,
    NVLINK,
    PCIE,
    Fabric,
    FabricSpec,
    build_fabric,
    build_graph,
)


def make_spec(**kw) -> FabricSpec:
    base = dict(nodes=4, gpus_per_node=8, nvlink_gbytes_per_s=450.0, pcie_gbytes_per_s=64.0,
                nics_per_node=8, nic_gbps=400.0)
    base.update(kw)
    return FabricSpec(**base)


def check_walk(fab: Fabric, links: tuple[int, ...], src, dst) -> None:
    """The links form a connected walk src -> dst in the graph, visiting no node twice."""
    assert links, "empty route between distinct GPUs"
    nodes = [fab.endpoints[links[0]][0]]
    for i in links:
        u, v = fab.endpoints[i]
        assert u == nodes[-1], f"link {i} {u}->{v} does not continue from {nodes[-1]}"
        assert fab.graph.has_edge(u, v)
        assert fab.graph.edges[u, v]["index"] == i
        nodes.append(v)
    assert nodes[0] == src and nodes[-1] == dst
    assert len(set(nodes)) == len(nodes), f"repeated node in {nodes}"


def check_all_pairs(fab: Fabric, hop_counts: bool) -> None:
    g = fab.graph
    for s in range(fab.n_gpus):
        src = fab.gpu(s)
        dist = nx.single_source_shortest_path_length(g, src) if hop_counts else None
        for d in range(fab.n_gpus):
            r = fab.route(s, d)
            if s == d:
                assert r == ()
                continue
            check_walk(fab, r, src, fab.gpu(d))
            if dist is not None:
                assert len(r) == dist[fab.gpu(d)], (s, d, [fab.endpoints[i] for i in r])


FABRICS = [
    pytest.param(dict(nodes=4, nodes_per_leaf=2), id="rail-2leafgroups"),
    pytest.param(dict(nodes=4, nodes_per_leaf=2, rail_optimized=False), id="norail-2groups"),
    pytest.param(dict(nodes=3), id="rail-1group"),
    pytest.param(dict(nodes=3, rail_optimized=False), id="norail-1leaf"),
    pytest.param(dict(nodes=6, azs=2, nodes_per_leaf=2), id="rail-2az"),
    pytest.param(dict(nodes=7, azs=3, nodes_per_leaf=2, rail_optimized=False), id="norail-3az"),
    pytest.param(dict(nodes=3, azs=3, rail_optimized=False), id="norail-3az-1leaf-each"),
    pytest.param(dict(nodes=5, azs=2, gpus_per_node=4, nics_per_node=2, nodes_per_leaf=1),
                 id="rail-2az-4gpu-2nic"),
    pytest.param(dict(nodes=4, gpus_per_node=2, nics_per_node=4, nodes_per_leaf=2),
                 id="more-nics-than-gpus"),
    pytest.param(dict(nodes=3, gpus_per_node=1, nics_per_node=1, azs=2), id="1gpu-2az"),
]


@pytest.mark.parametrize("kw", FABRICS)
def test_routes_are_walks_with_shortest_hop_count(kw):
    check_all_pairs(build_fabric(make_spec(**kw)), hop_counts=True)


@pytest.mark.parametrize("kw", FABRICS)
def test_link_kinds_along_routes(kw):
    fab = build_fabric(make_spec(**kw))
    for s, d in itertools.permutations(range(fab.n_gpus), 2):
        kinds = Counter(int(fab.kind[i]) for i in fab.route(s, d))
        if fab.node_of(s) == fab.node_of(d):
            assert set(kinds) == {NVLINK}
        else:
            assert kinds[NETWORK] >= 2 and kinds[NVLINK] == 0
            assert kinds[CROSS_AZ] == (1 if fab.zone_of(s) != fab.zone_of(d) else 0)


@pytest.mark.parametrize("gpus,nics", [(8, 8), (8, 4), (8, 2), (8, 1), (4, 8), (2, 4), (1, 2)])
@pytest.mark.parametrize("rail", [True, False])
def test_rail_alignment(gpus, nics, rail):
    fab = build_fabric(make_spec(nodes=3, gpus_per_node=gpus, nics_per_node=nics,
                                 rail_optimized=rail, nodes_per_leaf=2))
    for s, d in itertools.permutations(range(fab.n_gpus), 2):
        a, ga = divmod(s, gpus)
        b, gb = divmod(d, gpus)
        if a == b:
            continue
        net = [fab.endpoints[i] for i in fab.route(s, d) if fab.kind[i] == NETWORK]
        assert net[0][0] == ("nic", a, ga * nics // gpus)
        assert net[-1][1] == ("nic", b, gb * nics // gpus)


def test_derived_pcie_switch_shares_gpu_and_rail_nic():
    for gpus, nics in itertools.product([1, 2, 4, 8], [1, 2, 4, 8]):
        fab = build_fabric(make_spec(nodes=2, gpus_per_node=gpus, nics_per_node=nics))
        for g in range(gpus):
            first = [fab.endpoints[i] for i in fab.route(g, gpus + g)][:2]
            assert [v[0] for _, v in first] == ["pcie", "nic"], (gpus, nics, first)


def test_nic_on_another_pcie_switch_goes_through_host():
    # 2 switches; NIC 0 sits on switch 0, so GPUs 4..7 (switch 1) on rail 0 cross the host.
    spec = make_spec(nodes=2, nics_per_node=1, pcie_switches_per_node=2)
    fab = build_fabric(spec)
    hops = [v for _, v in (fab.endpoints[i] for i in fab.route(5, 13))]
    assert hops[:4] == [("pcie", 0, 1), ("host", 0), ("pcie", 0, 0), ("nic", 0, 0)]
    check_walk(fab, fab.route(5, 13), fab.gpu(5), fab.gpu(13))


@pytest.mark.parametrize("oversub", [1.0, 2.0, 4.0, 3.0])
@pytest.mark.parametrize("rail", [True, False])
def test_leaf_uplink_capacity_matches_oversubscription(oversub, rail):
    spec = make_spec(nodes=11, azs=2, nodes_per_leaf=2, oversubscription=oversub,
                     rail_optimized=rail)
    g = build_graph(spec)
    leaves = [n for n in g if n[0] == "leaf"]
    assert leaves
    for leaf in leaves:
        down = sum(d["capacity"] for u, _, d in g.in_edges(leaf, data=True) if u[0] == "nic")
        up = sum(d["capacity"] for _, v, d in g.out_edges(leaf, data=True) if v[0] == "spine")
        back = sum(d["capacity"] for u, _, d in g.in_edges(leaf, data=True) if u[0] == "spine")
        assert up == pytest.approx(down / oversub, rel=1e-12)
        assert back == pytest.approx(up, rel=1e-12)
        assert down == pytest.approx(
            sum(1 for u in g.predecessors(leaf) if u[0] == "nic") * spec.nic_gbps * 1e9 / 8
        )


def test_link_capacities_and_cross_az():
    spec = make_spec(nodes=6, azs=3, az_link_gbps=200.0, az_latency_ms=2.0)
    g = build_graph(spec)
    cross = [(u, v, d) for u, v, d in g.edges(data=True) if d["kind"] == "cross_az"]
    assert len(cross) == 6  # 3 zone pairs, both directions
    for u, v, d in cross:
        assert u[0] == v[0] == "gw"
        assert d["capacity"] == 200.0 * 1e9 / 8
        assert d["zone"] == u[1] == g.nodes[u]["zone"]
        assert d["latency"] >= 2e-3
    for u, v, d in g.edges(data=True):
        kinds = {u[0], v[0]}
        if d["kind"] == "nvlink":
            assert kinds == {"gpu", "nvswitch"} and d["capacity"] == 450e9
        elif d["kind"] == "pcie":
            assert d["capacity"] == 64e9
        elif kinds == {"nic", "leaf"}:
            assert d["capacity"] == 400e9 / 8
        assert g.edges[v, u]["capacity"] == d["capacity"]  # every link is two edges
        assert g.edges[v, u]["latency"] == d["latency"]


def test_graph_annotations_and_arrays():
    spec = make_spec(nodes=5, azs=2, nodes_per_leaf=2)
    fab = build_fabric(spec)
    g = fab.graph
    assert all("zone" in attrs for _, attrs in g.nodes(data=True))
    for n, attrs in g.nodes(data=True):
        if n[0] in ("gpu", "nvswitch", "pcie", "host", "nic"):
            assert attrs["zone"] == n[1] % spec.azs
        else:
            assert attrs["zone"] == n[1]
    m = g.number_of_edges()
    assert fab.n_links == m
    assert sorted(d["index"] for *_, d in g.edges(data=True)) == list(range(m))
    assert fab.capacity.dtype == np.float64 and fab.latency.dtype == np.float64
    assert fab.kind.dtype == np.int8 and fab.zone.dtype == np.int16
    for u, v, d in g.edges(data=True):
        i = d["index"]
        assert fab.endpoints[i] == (u, v)
        assert fab.capacity[i] == d["capacity"] and fab.latency[i] == d["latency"]
        assert LINK_KINDS[fab.kind[i]] == d["kind"] and fab.zone[i] == d["zone"]
        assert d["zone"] == g.nodes[u]["zone"]
    assert np.all(fab.capacity > 0) and np.all(fab.latency >= 0)


def test_single_node_without_nics():
    spec = make_spec(nodes=1, nics_per_node=0, azs=3)
    fab = build_fabric(spec)
    assert {n[0] for n in fab.graph} == {"gpu", "nvswitch", "pcie", "host"}
    assert set(np.unique(fab.kind)) == {NVLINK, PCIE}
    check_all_pairs(fab, hop_counts=True)
    for r in range(8):
        to, back = fab.route_to_host(r), fab.route_from_host(r)
        assert [fab.endpoints[i] for i in to][-1][1] == ("host", 0)
        check_walk(fab, to, fab.gpu(r), ("host", 0))
        check_walk(fab, back, ("host", 0), fab.gpu(r))
        assert all(fab.kind[i] == PCIE for i in to + back)


def test_single_gpu_node_has_no_nvswitch():
    fab = build_fabric(make_spec(nodes=1, gpus_per_node=1, nics_per_node=0))
    assert not any(n[0] == "nvswitch" for n in fab.graph)
    assert fab.route(0, 0) == ()
    assert len(fab.route_to_host(0)) == 2


def test_path_latency_counts_each_device_once():
    spec = make_spec(nodes=2, nvlink_latency_us=0.5, pcie_latency_us=0.1, nic_latency_us=1.0,
                     switch_latency_us=0.2, az_latency_ms=1.0)
    fab = build_fabric(spec)
    assert fab.path_latency(fab.route(0, 1)) == pytest.approx(0.5e-6)
    # GPU - PCIe - NIC - leaf - NIC - PCIe - GPU
    assert fab.path_latency(fab.route(0, 8)) == pytest.approx((2 * 0.1 + 2 * 1.0 + 0.2) * 1e-6)
    # ... - leaf - spine - leaf - ... (different rails)
    assert fab.path_latency(fab.route(0, 9)) == pytest.approx((2 * 0.1 + 2 * 1.0 + 0.6) * 1e-6)
    fab2 = build_fabric(make_spec(nodes=2, azs=2, pcie_latency_us=0.1, nic_latency_us=1.0,
                                  switch_latency_us=0.2, az_latency_ms=1.0))
    # leaf, spine, gw, gw, spine, leaf + the zone link
    expect = (2 * 0.1 + 2 * 1.0 + 6 * 0.2) * 1e-6 + 1e-3
    assert fab2.path_latency(fab2.route(0, 8)) == pytest.approx(expect)
    assert fab2.path_latency(()) == 0.0


def test_ecmp_is_deterministic_and_spreads():
    spec = make_spec(nodes=16, nodes_per_leaf=4, azs=2)
    a, b = build_fabric(spec), build_fabric(spec)
    pairs = list(itertools.permutations(range(0, a.n_gpus, 3), 2))
    assert [a.route(s, d) for s, d in pairs] == [b.route(s, d) for s, d in pairs]
    assert a.route(3, 77) is a.route(3, 77)  # cached

    spines = Counter()
    for s, d in pairs:
        if a.zone_of(s) == a.zone_of(d):
            for i in a.route(s, d):
                u, v = a.endpoints[i]
                if v[0] == "spine":
                    spines[v] += 1
    assert len(spines) > 1
    assert max(spines.values()) < 0.5 * sum(spines.values())

    c = build_fabric(make_spec(nodes=16, nodes_per_leaf=4, azs=2, ecmp_seed=7))
    assert [a.route(s, d) for s, d in pairs] != [c.route(s, d) for s, d in pairs]
    assert sorted(map(len, (a.route(s, d) for s, d in pairs))) == sorted(
        map(len, (c.route(s, d) for s, d in pairs)))


def test_spine_count():
    # Derived: ceil(leaf NIC ports / oversubscription), one uplink from each leaf to each spine.
    g = build_graph(make_spec(nodes=8, nodes_per_leaf=4, oversubscription=2.0))
    assert sum(1 for n in g if n[0] == "spine") == 2
    g = build_graph(make_spec(nodes=8, nodes_per_leaf=4, rail_optimized=False))
    assert sum(1 for n in g if n[0] == "spine") == 32
    g = build_graph(make_spec(nodes=8, nodes_per_leaf=4, spines_per_zone=3, azs=2))
    assert sorted(n for n in g if n[0] == "spine") == [("spine", z, i) for z in (0, 1)
                                                       for i in range(3)]
    # A zone with a single leaf has no spines; its gateway hangs off the leaf.
    g = build_graph(make_spec(nodes=4, azs=2, rail_optimized=False))
    assert not any(n[0] == "spine" for n in g)
    assert set(g.predecessors(("gw", 0))) == {("leaf", 0, 0), ("gw", 1)}


def test_rank_helpers_and_errors():
    fab = build_fabric(make_spec(nodes=3, azs=2))
    assert fab.gpu(13) == ("gpu", 1, 5)
    assert (fab.node_of(13), fab.zone_of(13), fab.zone_of(17)) == (1, 1, 0)
    with pytest.raises(IndexError):
        fab.route(0, 24)
    with pytest.raises(IndexError):
        fab.gpu(-1)
    with pytest.raises(ValueError):
        make_spec(nodes=2, nics_per_node=0)
    with pytest.raises(ValueError):
        make_spec(oversubscription=0)
    with pytest.raises(ValueError):
        make_spec(gpus_per_node=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(1, 12),
    gpus=st.sampled_from([1, 2, 4, 8]),
    nics=st.sampled_from([1, 2, 4, 8]),
    azs=st.integers(1, 3),
    oversub=st.sampled_from([1.0, 2.0, 4.0]),
    per_leaf=st.sampled_from([1, 2, 3, 16]),
    rail=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_specs_build_and_route(nodes, gpus, nics, azs, oversub, per_leaf, rail, seed):
    spec = make_spec(nodes=nodes, gpus_per_node=gpus, nics_per_node=nics, azs=azs,
                     oversubscription=oversub, nodes_per_leaf=per_leaf, rail_optimized=rail,
                     ecmp_seed=seed)
    fab = build_fabric(spec)
    assert fab.n_gpus == nodes * gpus
    # Hop counts against networkx on the smaller ones; walks everywhere.
    check_all_pairs(fab, hop_counts=fab.n_gpus <= 48)
    for r in range(fab.n_gpus):
        check_walk(fab, fab.route_to_host(r), fab.gpu(r), ("host", fab.node_of(r)))
    assert np.all(np.isfinite(fab.capacity)) and np.all(fab.capacity > 0)


def test_speed_ring_over_1024_gpus():
    spec = make_spec(nodes=128)
    t0 = time.perf_counter()
    fab = build_fabric(spec)
    n = fab.n_gpus
    routes = [fab.route(i, (i + 1) % n) for i in range(n)]
    elapsed = time.perf_counter() - t0
    assert n == 1024 and len(routes) == n
    assert elapsed < 2.0, f"build + ring routing took {elapsed:.2f} s"
    assert math.isfinite(sum(fab.path_latency(r) for r in routes))
