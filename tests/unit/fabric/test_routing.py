"""Spine routing: static ECMP against adaptive routing (pooled spines),
sim/fabric/topology/routing.py.

Independent truths used here: a full-bisection two-tier fat tree with per-packet spreading
carries any permutation at the NIC line rate (the rearrangeably non-blocking Clos property);
NCCL's own cost model (``ncclTopoGetAlgoTime``, sim/fabric/collectives/nccl.py) for PAT all-gather;
the NIC floor ``(n-1)/n * S / B`` that no all-gather over ``n`` NICs of rate ``B`` can beat;
conservation of bytes per link class (a route crosses as many links of each class whichever
spine carries it).
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from conftest import make_scenario
from helpers import MINIMAL_1B
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.api import fabric_spec
from sim.apps.nccltests import Bench
from sim.fabric.collectives.runner import CollectiveRunner, transport_capacity
from sim.fabric.network import FlowNetwork, max_min_rates
from sim.fabric.topology import LINK_KINDS, NETWORK, FabricSpec, build_fabric, build_graph
from sim.fabric.topology.routing import ROUTING_BY_TRANSPORT, default_routing, spine_count

MIB = 2**20
NIC_BYTES_PER_S = 400e9 / 8  # dgx-h100: one 400 Gb/s ConnectX-7 per GPU (topologies/dgx-h100)


def _spec(**kw) -> FabricSpec:
    base = dict(nodes=64, gpus_per_node=1, nvlink_gbytes_per_s=450, pcie_gbytes_per_s=64,
                nics_per_node=1, nic_gbps=400, nodes_per_leaf=8)
    base.update(kw)
    return FabricSpec(**base)


def _pat_one_gpu_per_node(nodes: int, routing: str, nbytes: float, algo: str = "pat",
                          **cluster) -> tuple[float, float, str]:
    """All-gather over one GPU per dgx-h100 node (Megatron's DP group at TP=8): (simulated s,
    NCCL model s, algorithm)."""
    overrides = {"cluster.routing": routing}
    overrides.update({f"cluster.{k}": v for k, v in cluster.items()})
    b = Bench.build("dgx-h100", 8 * nodes, algo=algo, overrides=overrides)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(b.fabric, b.arch, b.transport), b.fabric.kind,
                      len(LINK_KINDS))
    runner = CollectiveRunner(env, net, b.fabric, b.arch, b.settings)
    env.run(env.process(runner.run_collective("all_gather", tuple(range(0, 8 * nodes, 8)),
                                              nbytes)))
    choice = runner.chosen[-1]
    return env.now, choice.predicted_s, choice.algorithm


# --- defaults and schema ------------------------------------------------------------------
@pytest.mark.parametrize("transport,expected", [("infiniband", "adaptive"), ("efa", "adaptive"),
                                                ("roce", "ecmp"), ("tcp", "ecmp")])
def test_default_routing_per_transport(transport, expected):
    s = make_scenario(MINIMAL_1B, cluster={"nodes": 2, "nic_transport": transport})
    assert s.cluster.routing is None
    assert fabric_spec(s).routing == expected == default_routing(transport)


@pytest.mark.parametrize("topology,expected", [("dgx-h100", "adaptive"),
                                               ("coreweave-h100-ib", "adaptive"),
                                               ("aws-p5", "adaptive"),
                                               ("meta-grand-teton", "ecmp"),
                                               ("ethernet-100g", "ecmp")])
def test_topology_files_name_their_routing(topology, expected):
    s = make_scenario(MINIMAL_1B, cluster={"topology": topology, "nodes": 2})
    assert s.cluster.routing == expected
    # Each file's value is its transport's default (the sources are the same).
    assert expected == ROUTING_BY_TRANSPORT[s.cluster.nic_transport]


def test_inline_routing_overrides_the_topology():
    s = make_scenario(MINIMAL_1B, cluster={"topology": "dgx-h100", "nodes": 2,
                                           "routing": "ecmp"})
    assert fabric_spec(s).routing == "ecmp"


def test_bad_routing_is_refused():
    with pytest.raises(ValueError, match="routing"):
        _spec(routing="spray")
    with pytest.raises(ValueError, match="routing"):
        spine_count("spray", 4)


def test_ecmp_is_the_fabric_default_and_keeps_every_spine():
    assert FabricSpec.routing == "ecmp"
    g = build_graph(_spec())
    spines = [v for v in g.nodes if v[0] == "spine"]
    # 8 nodes x 1 NIC per leaf, full bisection: 8 spines (one uplink from every leaf to each).
    assert len(spines) == 8 == g.graph["spines_real"][0]


# --- pooled links ------------------------------------------------------------------------
def _uplinks(g, zone_leaf):
    return [d["capacity"] for u, v, d in g.edges(data=True)
            if u == zone_leaf and v[0] == "spine"]


def _downlinks(g, zone_leaf):
    return [d["capacity"] for u, v, d in g.edges(data=True)
            if v == zone_leaf and u[0] == "spine"]


@settings(max_examples=40, deadline=None)
@given(nodes=st.integers(2, 40), per_leaf=st.integers(1, 8), nics=st.sampled_from([1, 2, 4]),
       oversub=st.sampled_from([1.0, 1.5, 2.0, 3.0]), rail=st.booleans(),
       spines=st.integers(0, 5), azs=st.integers(1, 2))
def test_pooled_link_carries_exactly_its_members_capacity(nodes, per_leaf, nics, oversub, rail,
                                                          spines, azs):
    kw = dict(nodes=nodes, gpus_per_node=nics, nics_per_node=nics, nodes_per_leaf=per_leaf,
              oversubscription=oversub, rail_optimized=rail, spines_per_zone=spines, azs=azs)
    ge, ga = build_graph(_spec(**kw, routing="ecmp")), build_graph(_spec(**kw, routing="adaptive"))
    assert ge.graph["spines_real"] == ga.graph["spines_real"]
    leaves = [v for v in ge.nodes if v[0] == "leaf"]
    assert leaves == [v for v in ga.nodes if v[0] == "leaf"]
    for leaf in leaves:
        for members_of, pooled_of in ((_uplinks(ge, leaf), _uplinks(ga, leaf)),
                                      (_downlinks(ge, leaf), _downlinks(ga, leaf))):
            assert len(pooled_of) == (1 if members_of else 0)
            if members_of:
                assert pooled_of[0] <= sum(members_of) * (1 + 1e-12)
                assert pooled_of[0] == pytest.approx(sum(members_of), rel=1e-12)


def _permutation(fab, n: int, shift: int) -> list[tuple[int, ...]]:
    return [fab.route(i, (i + shift) % n) for i in range(n)]


@pytest.mark.parametrize("shift", [8, 13, 31])
def test_permutation_bytes_per_class_identical(shift):
    """Each route crosses as many links of each class under both policies, so bytes per
    link class are exact whatever the routing."""
    counts = {}
    for routing in ("ecmp", "adaptive"):
        fab = build_fabric(_spec(routing=routing))
        routes = _permutation(fab, 64, shift)
        counts[routing] = [np.bincount(fab.kind[list(r)], minlength=len(LINK_KINDS)).tolist()
                           for r in routes]
        assert all(c[NETWORK] == 4 for c in counts[routing])  # NIC-leaf-spine-leaf-NIC
    assert counts["ecmp"] == counts["adaptive"]


def _rates(fab, routes):
    flat = np.concatenate([np.asarray(r) for r in routes])
    owner = np.repeat(np.arange(len(routes)), [len(r) for r in routes])
    return max_min_rates(flat, owner, len(routes), fab.capacity)


def test_adaptive_carries_any_permutation_at_line_rate():
    """Full-bisection fat tree + per-packet spreading: every flow of a permutation gets the NIC
    rate; static ECMP hashes some flows onto the same spine link and slows them."""
    slow_ecmp = 0
    for shift in (8, 13, 24, 31):
        ada = build_fabric(_spec(routing="adaptive"))
        ecmp = build_fabric(_spec(routing="ecmp"))
        r_ada = _rates(ada, _permutation(ada, 64, shift))
        r_ecmp = _rates(ecmp, _permutation(ecmp, 64, shift))
        assert np.allclose(r_ada, NIC_BYTES_PER_S, rtol=1e-9)
        assert r_ecmp.max() <= NIC_BYTES_PER_S * (1 + 1e-9)
        slow_ecmp += int((r_ecmp < 0.99 * NIC_BYTES_PER_S).sum())
    assert slow_ecmp > 0  # hash collisions exist for 64 flows over 8 spines


def test_adaptive_respects_oversubscription():
    """2:1 oversubscribed leaves: 8 flows out of one leaf share half its NIC capacity."""
    fab = build_fabric(_spec(routing="adaptive", oversubscription=2.0))
    routes = [fab.route(i, i + 8) for i in range(8)]  # leaf 0 -> leaf 1, one flow per node
    assert np.allclose(_rates(fab, routes), NIC_BYTES_PER_S / 2, rtol=1e-9)


# --- PAT against NCCL's model ----------------------------------------------------------------
@pytest.mark.parametrize("nodes", [64, 256])
def test_pat_across_leaves_matches_nccl_model_with_adaptive_routing(nodes):
    nbytes = 256 * MIB
    t, model, algo = _pat_one_gpu_per_node(nodes, "adaptive", nbytes)
    assert algo == "pat"
    assert t == pytest.approx(model, rel=0.10)
    assert t >= (nodes - 1) / nodes * nbytes / NIC_BYTES_PER_S


def test_pat_nodes_per_leaf_no_longer_matters_with_adaptive_routing():
    nbytes = 256 * MIB
    times = [_pat_one_gpu_per_node(128, "adaptive", nbytes, nodes_per_leaf=k)[0]
             for k in (16, 32, 128)]
    _, model, _ = _pat_one_gpu_per_node(128, "adaptive", nbytes)
    for t in times:
        assert t == pytest.approx(model, rel=0.10)
        assert t >= 127 / 128 * nbytes / NIC_BYTES_PER_S


def test_ecmp_keeps_previous_numbers():
    """Regression: static ECMP is the code path that existed before routing did. Values
    measured at commit 21c137d (before this module) with the same calls."""
    nbytes = 256 * MIB
    assert _pat_one_gpu_per_node(64, "ecmp", nbytes)[0] == pytest.approx(
        0.01045413187368421, rel=1e-12)
    assert _pat_one_gpu_per_node(256, "ecmp", nbytes)[0] == pytest.approx(
        0.014531777347368423, rel=1e-12)
    assert _pat_one_gpu_per_node(128, "ecmp", nbytes, nodes_per_leaf=16)[0] == pytest.approx(
        0.007870562919298245, rel=1e-12)


def test_collective_table_with_one_gpu_per_node_sizes_the_cluster():
    """``fabricsim collective --gpus 256 --set cluster.gpus_per_node=1``: 256 nodes, not 32
    (the override used to be ignored when sizing the cluster, and the run failed)."""
    from sim.apps.nccltests import collective_table

    out = collective_table("dgx-h100", "all_gather", 256, [256 * MIB],
                           overrides={"cluster.gpus_per_node": 1, "cluster.nics_per_node": 1})
    row = out["rows"][0]
    assert row["algorithm"] == "pat"
    assert row["time_s"] == pytest.approx(row["nccl_model_s"], rel=0.10)
    assert row["time_s"] >= 255 / 256 * 256 * MIB / NIC_BYTES_PER_S
