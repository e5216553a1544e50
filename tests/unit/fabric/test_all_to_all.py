"""NCCL's all-to-all as per-peer flows: conservation, closed forms, PXN routes, uneven sizes."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from helpers import dgx, timed

from sim.fabric.collectives import nccl
from sim.fabric.collectives.alltoall import (
    P2P_NETWORK_SHARE,
    even_matrix,
    network_capacity,
    nvlink_call_s,
    paced_bytes,
    peer_plan,
)
from sim.fabric.collectives.runner import (
    CollectiveRunner,
    NcclSettings,
    _p2p_latency,
    transport_capacity,
)
from sim.fabric.network import FlowNetwork, NetworkObserver
from sim.fabric.topology import LINK_KINDS, FabricSpec, build_fabric

GB = 1e9
S = float(1 << 30)
NVLINK = 450 * GB * nccl.NVLINK_EFFICIENCY["hopper"]   # an H100's NVLink port as NCCL gets it
NIC = 400 / 8 * GB * nccl.NETWORK_EFFICIENCY           # one NDR NIC as NCCL gets it
A2A_NIC = NIC * P2P_NETWORK_SHARE     # ... and as its all-to-all's grouped sends get it


def runner(spec: FabricSpec, **settings):
    fab = build_fabric(spec)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS))
    run = CollectiveRunner(env, net, fab, "hopper", NcclSettings(**settings))
    return env, net, run, fab


def kind_of(fab, i: int) -> str:
    (a, b) = fab.endpoints[i]
    return f"{a[0]}>{b[0]}"


def latency(run: CollectiveRunner, groups, matrix) -> float:
    # NCCL's p2p latency, plus the all-to-all's measured call time inside one NVLink domain.
    plan = peer_plan(run.builder, groups, matrix)
    assert plan is not None
    return _p2p_latency(plan) + nvlink_call_s(run.builder, plan)


def test_in_node_even_all_to_all_matches_closed_form() -> None:
    # 8 GPUs on NVSwitch: each rank sends (n-1)/n of its buffer over its NVLink port and
    # receives as much: t = latency + (7/8) S / B, busbw = B (nccl-tests: (n-1)/n x algbw).
    env, net, run, fab = runner(dgx(1, nics_per_node=0))
    group = tuple(range(8))
    t = timed(env, run.run_collective("all_to_all", group, S))
    lat = latency(run, [group], even_matrix(8, S))
    assert t == pytest.approx(lat + 7 / 8 * S / NVLINK, rel=1e-9)
    # The same op given as its matrix (Op.peer_bytes) takes the same time.
    env2, _, run2, _ = runner(dgx(1, nics_per_node=0))
    t2 = timed(env2, run2.run_collective_groups("all_to_all", [group], S,
                                                peer_bytes=even_matrix(8, S)))
    assert t2 == pytest.approx(t, rel=1e-12)
    # NVLink bytes: every GPU's port up carries 7/8 S, down 7/8 S; nothing else moves.
    for i in range(len(fab.capacity)):
        k = kind_of(fab, i)
        want = 7 / 8 * S if k in ("gpu>nvswitch", "nvswitch>gpu") else 0.0
        assert net.link_bytes[i] == pytest.approx(want, rel=1e-9), k


def test_bytes_are_conserved_per_peer_and_per_link() -> None:
    # An uneven matrix over 2 nodes: every link carries exactly the bytes of the flows whose
    # routes cross it, and every rank's sent (received) bytes are its row (column) sum.
    env, net, run, fab = runner(dgx(2))
    n = 16
    rng = np.random.default_rng(7)
    matrix = tuple(tuple(0.0 if i == j else float(rng.integers(1, 9)) * 2**20
                         for j in range(n)) for i in range(n))
    group = tuple(range(n))
    t = timed(env, run.run_collective_groups("all_to_all", [group], 1.0, peer_bytes=matrix))
    plan = peer_plan(run.builder, [group], matrix)
    assert plan is not None
    # Alone on the fabric the op takes its most loaded link's bytes over that link's rate
    # (the sends are paced as one coflow and all end then), network links at the share
    # NCCL's grouped sends reach of the ring's rate.
    busiest = float((net.link_bytes / network_capacity(run.builder, P2P_NETWORK_SHARE)).max())
    assert t == pytest.approx(_p2p_latency(plan) + busiest, rel=1e-9)
    expected = np.zeros(len(fab.capacity))
    start = 0
    for length, share in zip(plan.lengths, plan.share, strict=True):
        np.add.at(expected, plan.flat[start:start + length], share)
        start += length
    np.testing.assert_allclose(net.link_bytes, expected, rtol=1e-9, atol=1.0)
    m = np.array(matrix)
    assert plan.share.sum() == pytest.approx(m.sum())
    # Sent: each GPU's first hop (NVLink to a peer or its PXN proxy, or PCIe to its own NIC)
    # carries its row; received: each GPU's last hop its column.
    sent = np.zeros(n)
    got = np.zeros(n)
    start = 0
    for length, share in zip(plan.lengths, plan.share, strict=True):
        first, last = fab.endpoints[plan.flat[start]], fab.endpoints[plan.flat[start + length - 1]]
        sent[first[0][1] * 8 + first[0][2]] += share
        got[last[1][1] * 8 + last[1][2]] += share
        start += length
    np.testing.assert_allclose(sent, m.sum(axis=1))
    np.testing.assert_allclose(got, m.sum(axis=0))


def test_pxn_keeps_cross_node_bytes_on_the_receivers_rail() -> None:
    # 2 nodes x 8 GPUs, rail-optimised: with PXN (NCCL's default, search.cc ncclTopoGetNetDev)
    # a send leaves by the NIC on the receiver's rail after one NVLink hop, so no byte
    # climbs to a spine and every NIC k carries exactly the bytes for the other node's GPU k:
    # 8 senders x S/16 = S/2 each way. No PCIe link carries a byte from one rail to another
    # (GPU k's PCIe switch only ever feeds NIC k). The op ends when the NICs have moved S/2.
    env, net, run, fab = runner(dgx(2))
    group = tuple(range(16))
    t = timed(env, run.run_collective("all_to_all", group, S))
    for i in range(len(fab.capacity)):
        a, b = fab.endpoints[i]
        k = kind_of(fab, i)
        if "spine" in k:
            assert net.link_bytes[i] == 0.0, k
        if k in ("nic>leaf", "leaf>nic"):
            assert net.link_bytes[i] == pytest.approx(S / 2, rel=1e-9)
        if k in ("gpu>pcie", "pcie>nic", "nic>pcie", "pcie>gpu"):
            # the PCIe switch and NIC of one rail (index 2 of the node names) on both ends
            assert a[2] == b[2]
            assert net.link_bytes[i] == pytest.approx(S / 2, rel=1e-9)
    lat = latency(run, [group], even_matrix(16, S))
    assert t == pytest.approx(lat + S / 2 / A2A_NIC, rel=1e-6)
    # busbw = (n-1)/n x algbw = 15/8 x the NIC rate on 2 nodes (nccl-tests issue 130,
    # maintainer: "On 2 nodes ... BusBW = 2x network bandwidth per GPU", n/(n-g) exactly),
    # the NIC at the rate NCCL's grouped sends reach (two measured plateaus, alltoall.py).
    assert 15 / 16 * S / (t - lat) == pytest.approx(15 / 8 * A2A_NIC, rel=1e-6)


def test_without_pxn_sends_cross_rails_through_the_spines() -> None:
    # NCCL_PXN_DISABLE=1 (each GPU's own NIC at both ends): a send from rail i to rail
    # j != i must climb to a spine; 7 of every 8 cross-node sends do, and the op is never
    # faster than with PXN.
    env, net, run, fab = runner(dgx(2), pxn=False)
    group = tuple(range(16))
    t = timed(env, run.run_collective("all_to_all", group, S))
    spine = sum(net.link_bytes[i] for i in range(len(fab.capacity)) if "leaf>spine" in
                kind_of(fab, i))
    assert spine == pytest.approx(2 * 8 * 7 * S / 16, rel=1e-9)
    env2, _, run2, _ = runner(dgx(2))
    assert t >= timed(env2, run2.run_collective("all_to_all", group, S)) * (1 - 1e-9)


def test_sends_use_pxn_whatever_cross_nic_says() -> None:
    # search.cc ncclTopoGetNetDev: with NCCL_P2P_PXN_LEVEL=2 a send takes the PXN route even
    # with NCCL_CROSS_NIC=1 (that knob is for rings and trees): the same time, no spine bytes.
    group = tuple(range(16))
    env, net, run, fab = runner(dgx(2), cross_nic=1)
    t = timed(env, run.run_collective("all_to_all", group, S))
    assert all(net.link_bytes[i] == 0.0 for i in range(len(fab.capacity))
               if "spine" in kind_of(fab, i))
    env2, _, run2, _ = runner(dgx(2))
    assert t == pytest.approx(timed(env2, run2.run_collective("all_to_all", group, S)),
                              rel=1e-12)


@pytest.mark.parametrize("heavy", ["row", "column"])
def test_largest_row_or_column_paces_an_uneven_all_to_all(heavy: str) -> None:
    # In one node every port has the same rate, so the op takes the busiest port's bytes
    # over that rate: rank 0 sends (or receives) 4x as much as the others.
    env, _, run, _ = runner(dgx(1, nics_per_node=0))
    n, part = 8, 64 * 2**20
    def size(i: int, j: int) -> float:
        if i == j:
            return 0.0
        return 4.0 * part if (i if heavy == "row" else j) == 0 else float(part)
    matrix = tuple(tuple(size(i, j) for j in range(n)) for i in range(n))
    group = tuple(range(n))
    t = timed(env, run.run_collective_groups("all_to_all", [group], 1.0, peer_bytes=matrix))
    assert paced_bytes(matrix) == 7 * 4 * part
    lat = latency(run, [group], matrix)
    assert t == pytest.approx(lat + paced_bytes(matrix) / NVLINK, rel=1e-9)
    # Never faster than the balanced op of the same total bytes.
    total = sum(map(sum, matrix))
    even = tuple(tuple(0.0 if i == j else total / (n * (n - 1)) for j in range(n))
                 for i in range(n))
    env2, _, run2, _ = runner(dgx(1, nics_per_node=0))
    assert t > timed(env2, run2.run_collective_groups("all_to_all", [group], 1.0,
                                                       peer_bytes=even))


def test_folded_groups_in_nodes_move_every_groups_bytes() -> None:
    # Four expert-parallel groups of 4 GPUs in 2 nodes: one group's flows stand for all
    # (disjoint NVLink ports), and the bytes delivered count all four groups.
    class Seen(NetworkObserver):
        delivered = 0.0

        def on_transfer_end(self, t: float, tag: object, nbytes: float) -> None:
            Seen.delivered += nbytes

    fab = build_fabric(dgx(2))
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS),
                      observer=Seen())
    run = CollectiveRunner(env, net, fab, "hopper", NcclSettings())
    groups = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    t = timed(env, run.run_collective_groups("all_to_all", groups, S,
                                             peer_bytes=even_matrix(4, S)))
    assert t == pytest.approx(latency(run, groups[:1], even_matrix(4, S))
                              + 3 / 4 * S / NVLINK, rel=1e-9)
    assert Seen.delivered == pytest.approx(16 * 3 / 4 * S, rel=1e-9)


def test_balanced_bytes_per_link_class_match_the_closed_form() -> None:
    # N = 4 nodes x g = 8 GPUs, S bytes per rank, S/n to each peer, PXN. Per GPU:
    # NVLink up = in-node sends (g-1) S/n + PXN hops to the other rails' proxies
    # (N-1)(g-1) S/n = (g-1)/g S, and as much down (received in node + relayed as proxy);
    # its PCIe to its NIC carries every cross-node send for its rail from the node's g GPUs:
    # g (N-1) S/n = (N-1)/N S, the NIC to the leaf the same; no spine bytes.
    nodes, g = 4, 8
    n = nodes * g
    env, net, run, fab = runner(dgx(nodes))
    timed(env, run.run_collective("all_to_all", tuple(range(n)), S))
    want = {"gpu>nvswitch": (g - 1) / g * S, "nvswitch>gpu": (g - 1) / g * S,
            "gpu>pcie": (nodes - 1) / nodes * S, "pcie>nic": (nodes - 1) / nodes * S,
            "nic>leaf": (nodes - 1) / nodes * S, "leaf>nic": (nodes - 1) / nodes * S,
            "nic>pcie": (nodes - 1) / nodes * S, "pcie>gpu": (nodes - 1) / nodes * S,
            "leaf>spine": 0.0, "spine>leaf": 0.0, "pcie>host": 0.0, "host>pcie": 0.0}
    for i in range(len(fab.capacity)):
        assert net.link_bytes[i] == pytest.approx(want[kind_of(fab, i)], rel=1e-9, abs=1.0)


def test_groups_on_distinct_nodes_fold_and_overlapping_groups_do_not() -> None:
    # Two 16-GPU groups on nodes {0, 1} and {2, 3}: disjoint links, one group's flows stand
    # for both and the time is one group's alone. Groups whose PXN proxies are the other
    # group's GPUs (local GPUs 0-3 of node 0 with 4-7 of node 1, and the rest) share NVLink
    # ports and NICs: all their flows run.
    m = even_matrix(16, S)
    env, _, run, _ = runner(dgx(4))
    apart = (tuple(range(16)), tuple(range(16, 32)))
    t = timed(env, run.run_collective_groups("all_to_all", apart, S, peer_bytes=m))
    env1, _, run1, _ = runner(dgx(4))
    alone = timed(env1, run1.run_collective_groups("all_to_all", apart[:1], S, peer_bytes=m))
    assert t == pytest.approx(alone, rel=1e-12)
    assert [v[3] for v in run._a2a.values()] == [2]
    env2, _, run2, _ = runner(dgx(2))
    m8 = even_matrix(8, S)
    crossed = ((0, 1, 2, 3, 12, 13, 14, 15), (4, 5, 6, 7, 8, 9, 10, 11))
    timed(env2, run2.run_collective_groups("all_to_all", crossed, S, peer_bytes=m8))
    (plan, _, _, count), = run2._a2a.values()
    assert count == 1 and plan is not None and plan.n_flows == 2 * 8 * 7


def test_the_scenario_key_nccl_pxn_reaches_the_runner() -> None:
    # nccl.pxn: false is NCCL_PXN_DISABLE=1, the setting the test above runs with.
    from conftest import make_scenario

    from sim.api import nccl_settings

    assert nccl_settings(make_scenario()).pxn is True
    assert nccl_settings(make_scenario(nccl={"pxn": False})).pxn is False
