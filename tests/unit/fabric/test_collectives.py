"""Ring collectives on the fabric against the closed forms, and contention between them."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from helpers import dgx, timed

from sim.fabric.collectives import nccl
from sim.fabric.collectives.algorithms import ring_orders
from sim.fabric.collectives.runner import CollectiveRunner, NcclSettings, transport_capacity
from sim.fabric.network import FlowNetwork
from sim.fabric.topology import LINK_KINDS, FabricSpec, build_fabric

GB = 1e9


def runner(spec: FabricSpec, arch: str = "hopper", proto: str = "simple", algo: str = "ring",
           **settings):
    fab = build_fabric(spec)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, arch), fab.kind, len(LINK_KINDS))
    run = CollectiveRunner(env, net, fab, arch, NcclSettings(algo=algo, proto=proto, **settings))
    return env, net, run, fab


@pytest.mark.parametrize("op,factor", [("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8),
                                       ("reduce_scatter", 7 / 8)])
def test_in_node_ring_matches_closed_form(op: str, factor: float) -> None:
    # One node, 8 GPUs on NVSwitch: time = NCCL latency + factor * S / B, where B is the
    # NVLink bandwidth a ring achieves (NCCL's 20.6 GB/s per NVLink4 link x 18 links).
    env, _, run, _ = runner(dgx(1, nics_per_node=0))
    size = 1 << 30
    t = timed(env, run.run_collective(op, tuple(range(8)), size))
    bw = 450 * GB * nccl.NVLINK_EFFICIENCY["hopper"]
    expected = nccl.ring_latency_s(op, "simple", 8, 1) + factor * size / bw
    assert t == pytest.approx(expected, rel=1e-9)
    # busbw as nccl-tests prints it: about 370 GB/s on H100 (nccl-tests issue 212).
    busbw = factor * size / (t - nccl.ring_latency_s(op, "simple", 8, 1))
    assert busbw / GB == pytest.approx(370.8, rel=0.01)


def test_multi_node_ring_is_bound_by_the_nics() -> None:
    # 4 nodes x 8 GPUs, 8 x 400 Gb/s NICs: 8 channels, one per NIC; each channel carries
    # 1/8 of the 2(n-1)/n volume through one NIC at its achieved rate. With PXN every
    # channel also leaves each GPU over its NVLink port (7 in-node hops + 1 hop to the rail
    # GPU), so a GPU's NVLink share caps the channel too: the slower of the two binds.
    env, _, run, _ = runner(dgx(4))
    size = 1 << 30
    n = 32
    t = timed(env, run.run_collective("all_reduce", tuple(range(n)), size))
    nic = 400 / 8 * GB * nccl.NETWORK_EFFICIENCY
    nvlink = 450 * GB * nccl.NVLINK_EFFICIENCY["hopper"]
    lat = nccl.ring_latency_s("all_reduce", "simple", n, 4)
    expected = lat + 2 * (n - 1) / n * size / min(8 * nic, nvlink)
    assert t == pytest.approx(expected, rel=1e-6)
    # About 376 GB/s bus bandwidth per node for 4-node NDR all-reduce (reference.yaml).
    busbw = 2 * (n - 1) / n * size / (t - lat) / GB
    assert 360 < busbw < 390


def test_small_messages_show_the_latency_floor() -> None:
    env, _, run, _ = runner(dgx(1, nics_per_node=0), proto="auto")
    t = timed(env, run.run_collective("all_reduce", tuple(range(8)), 1024))
    ll = nccl.ring_latency_s("all_reduce", "ll", 8, 1)
    assert t == pytest.approx(ll, rel=0.05)   # 1 KiB: latency dominates, LL is chosen
    assert run.chosen[-1].protocol == "ll"


def test_protocol_choice_moves_to_simple_for_large_messages() -> None:
    env, _, run, _ = runner(dgx(1, nics_per_node=0), proto="auto")
    timed(env, run.run_collective("all_reduce", tuple(range(8)), 1 << 30))
    assert run.chosen[-1].protocol == "simple"


def test_ring_orders_stay_on_rail_between_nodes() -> None:
    node_of = {r: r // 4 for r in range(16)}
    rings = ring_orders(list(range(12)), node_of, 4)
    assert len(rings) == 4
    for c, (ring, rail) in enumerate(rings):
        assert rail == c
        assert sorted(ring) == list(range(12))
        hops = [(ring[i], ring[(i + 1) % 12]) for i in range(12)]
        cross = [(a, b) for a, b in hops if node_of[a] != node_of[b]]
        assert len(cross) == 3
        # Channel c enters every node at local GPU c: its network hops all use rail c.
        assert all(b % 4 == c for _, b in cross)


def test_cross_node_edges_leave_through_the_receivers_rail() -> None:
    env, _, run, fab = runner(dgx(2))
    links = run.builder.edge(7, 8)[0]     # node 0 GPU 7 -> node 1 GPU 0 (rail 0)
    kinds = [LINK_KINDS[k] for k in fab.kind[list(links)]]
    assert kinds[:2] == ["nvlink", "nvlink"]     # PXN: over NVLink to node 0's GPU 0
    nic_links = [i for i in links if fab.kind[i] == 2]
    assert fab.route(0, 8)[-len(fab.route(0, 8)):] == links[2:]
    assert nic_links


def test_collectives_sharing_an_oversubscribed_spine_slow_each_other() -> None:
    # Two leaf groups of 2 nodes, 4:1 oversubscribed. Job A spans nodes 0 and 2, job B nodes
    # 1 and 3: both rings cross the spine. Together each gets half the spine, so each takes
    # twice as long (less the latency term) as alone.
    spec = dgx(4, nodes_per_leaf=2, oversubscription=4.0)
    a = tuple(range(0, 8)) + tuple(range(16, 24))
    b = tuple(range(8, 16)) + tuple(range(24, 32))
    size = 1 << 28
    env, _, run, _ = runner(spec)
    alone = timed(env, run.run_collective("all_gather", a, size))
    env, _, run, _ = runner(spec)
    pa = env.process(run.run_collective("all_gather", a, size))
    pb = env.process(run.run_collective("all_gather", b, size))
    env.run(simpy.AllOf(env, [pa, pb]))
    together = env.now
    lat = nccl.ring_latency_s("all_gather", "simple", 16, 2)
    assert (together - lat) == pytest.approx(2 * (alone - lat), rel=1e-6)


def test_in_node_traffic_does_not_slow_inter_node_traffic_on_other_links() -> None:
    # An all-reduce among GPUs 0-3 of node 0 (NVLink) next to an all-gather among GPU 4 of
    # every node (its NIC): the second uses GPU 4's NVLink port only, which the first never
    # touches, so it runs exactly as fast as alone.
    spec = dgx(4)
    tp = (0, 1, 2, 3)
    dp = (4, 12, 20, 28)
    size = 1 << 28
    env, _, run, _ = runner(spec)
    alone = timed(env, run.run_collective("all_gather", dp, size))
    env, _, run, _ = runner(spec)
    p1 = env.process(run.run_collective("all_reduce", tp, 4 * size))
    p2 = env.process(run.run_collective("all_gather", dp, size))
    env.run(p2)
    assert env.now == pytest.approx(alone, rel=1e-9)
    env.run(p1)


def test_bytes_by_class_for_a_two_node_all_gather() -> None:
    # Conservation: the ring moves (n-1)/n*S per rank; a cross-node edge's bytes travel
    # GPU-NVSwitch-GPU (PXN to the rail GPU), then GPU-PCIe-NIC-leaf-NIC-PCIe-GPU (2 network
    # hops on the rail's leaf, 4 PCIe); an in-node edge GPU-NVSwitch-GPU (2 NVLink hops).
    env, net, run, fab = runner(dgx(2))
    size = 1 << 26
    n = 16
    timed(env, run.run_collective("all_gather", tuple(range(n)), size))
    per_flow = (n - 1) / n * size / 8
    cross_edges = 8 * 2          # 8 channels, 2 node boundaries per ring
    in_edges = 8 * (n - 2)
    by_kind = dict(zip(LINK_KINDS, net.class_bytes, strict=True))
    assert by_kind["nvlink"] == pytest.approx((in_edges + cross_edges) * 2 * per_flow)
    assert by_kind["network"] == pytest.approx(cross_edges * 2 * per_flow)
    assert by_kind["pcie"] == pytest.approx(cross_edges * 4 * per_flow)
    assert by_kind["cross_az"] == 0.0


def test_cross_zone_bytes_counted_once_per_crossing() -> None:
    # Two nodes in two zones: each ring crosses the zone boundary twice (there and back).
    env, net, run, _ = runner(dgx(2, azs=2, az_link_gbps=100))
    size = 1 << 24
    n = 16
    timed(env, run.run_collective("all_gather", tuple(range(n)), size))
    per_flow = (n - 1) / n * size / 8
    assert net.class_bytes[3] == pytest.approx(8 * 2 * per_flow)


# ----------------------------------------------------------------------------- algorithms
def test_nvls_all_reduce_closed_form() -> None:
    # NVLink SHARP: each GPU sends S to the switch and gets S/n reduced back, then multicasts
    # its S/n and receives S: S(n+1)/n each way on its NVLink, at NCCL's NVLS share of the
    # ring bandwidth (nvlsEfficiency 0.85 x (16-1)/16 channels, tuning.cc).
    env, _, run, _ = runner(dgx(1, nics_per_node=0), algo="nvls", proto="auto")
    n, size = 8, 1 << 30
    t = timed(env, run.run_collective("all_reduce", tuple(range(n)), size))
    b = 450 * GB * nccl.NVLINK_EFFICIENCY["hopper"] * 0.85 * 15 / 16
    fill = 3 * 128 * 1024 / (b / 16)
    expected = nccl.latency_s("nvls", "all_reduce", "simple", n, 1) + fill + size * (n + 1) / n / b
    assert t == pytest.approx(expected, rel=1e-9)
    assert run.chosen[-1].algorithm == "nvls"


def test_tree_all_reduce_is_bound_by_its_busiest_nic() -> None:
    # Two nodes, NVLink made fast enough not to matter: in each of 8 channels the two trees
    # each carry S/16 up and S/16 down between the nodes' head GPUs, so every rail carries
    # S/8 each way: time = S / (8 x NIC).
    spec = dgx(2, nvlink_gbytes_per_s=45000)
    env, _, run, _ = runner(spec, algo="tree")
    size = 1 << 30
    t = timed(env, run.run_collective("all_reduce", tuple(range(16)), size))
    nic = 50 * GB * nccl.NETWORK_EFFICIENCY * nccl.TREE_BW_FACTOR["simple"]
    plan, est, _ = run.select("all_reduce", tuple(range(16)), size)
    assert plan.algorithm == "tree" and est.protocol == "simple"
    body = t - est.latency_s - run._fill_s(plan, est)
    assert body == pytest.approx(size / (8 * nic), rel=1e-6)


def test_double_binary_trees_are_complementary() -> None:
    from sim.fabric.collectives.algorithms import double_binary_trees

    for n in range(2, 33):
        t0, t1 = double_binary_trees(n)
        assert t0.count(-1) == 1 and t1.count(-1) == 1
        kids0 = [t0.count(i) for i in range(n)]
        kids1 = [t1.count(i) for i in range(n)]
        # Each tree is binary, and no node is interior in both (Sanders et al., 2009) except
        # where n forces it (at most one node).
        assert max(kids0) <= 2 and max(kids1) <= 2
        assert sum(1 for a, b in zip(kids0, kids1, strict=True) if a and b) <= 1


@pytest.mark.parametrize("op,volume", [("all_to_all", 7 / 8), ("broadcast", 1.0),
                                       ("sendrecv", 1.0)])
def test_other_collectives_in_one_node(op: str, volume: float) -> None:
    # All-to-all: each GPU sends (n-1)/n of its buffer; broadcast: every chain edge carries
    # the message; sendrecv: each GPU sends its buffer to the next. All over NVLink at the
    # ring's achieved bandwidth, after the latency term.
    env, _, run, _ = runner(dgx(1, nics_per_node=0), algo="auto")
    size = 1 << 28
    t = timed(env, run.run_collective(op, tuple(range(8)), size))
    bw = 450 * GB * nccl.NVLINK_EFFICIENCY["hopper"]
    choice = run.chosen[-1]
    plan, est, _ = run.select(op, tuple(range(8)), size)
    assert t - est.latency_s == pytest.approx(volume * size / (bw * est.bw_factor), rel=1e-6)
    assert choice.protocol == est.protocol


def test_buffer_window_limits_long_links() -> None:
    # Across zones 1 ms apart, a ring channel has at most NCCL_BUFFSIZE in flight per peer:
    # rate <= buffsize / RTT per NCCL channel; each of the 8 flows (one per NIC) stands for
    # two NCCL channels (16 on 8 NICs). Four times the buffer, four times the rate.
    spec = dgx(2, azs=2, az_link_gbps=3200, az_latency_ms=1.0)
    size = 1 << 30
    times = {}
    for buff in (4 << 20, 16 << 20):
        env, _, run, fab = runner(spec, buffsize=buff)
        t = timed(env, run.run_collective("all_gather", tuple(range(16)), size))
        plan, est, _ = run.select("all_gather", tuple(range(16)), size)
        assert plan.flow_channels == 2
        # The chain: 15 dependent hops of a 16-rank ring cross the zone link both ways.
        assert plan.chain_latency_s == pytest.approx(2e-3, rel=0.01)
        times[buff] = t - est.latency_s - plan.chain_latency_s
        rtt = 2 * plan.path_latency.max()
        per_flow = size * (15 / 16) / 8
        assert times[buff] == pytest.approx(per_flow / (2 * buff / rtt), rel=0.01)
    assert times[4 << 20] / times[16 << 20] == pytest.approx(4.0, rel=0.01)


def test_cutting_a_zone_link_slows_exactly_the_collectives_across_it() -> None:
    # Four nodes over two zones (0, 2 in zone 0; 1, 3 in zone 1). Rings within a zone never
    # touch the zone link; a ring across zones does.
    size = 1 << 28
    inside = tuple(range(0, 8)) + tuple(range(16, 24))      # nodes 0 and 2
    across = tuple(range(0, 16))                            # nodes 0 and 1

    def times(az_gbps: float) -> tuple[float, float]:
        spec = dgx(4, azs=2, az_link_gbps=az_gbps, az_latency_ms=0.01)
        out = []
        for group in (inside, across):
            env, _, run, _ = runner(spec, buffsize=64 << 20)
            out.append(timed(env, run.run_collective("all_gather", group, size)))
        return out[0], out[1]

    wide_in, wide_across = times(3200)
    cut_in, cut_across = times(100)
    assert cut_in == pytest.approx(wide_in, rel=1e-12)
    assert cut_across > 2 * wide_across


def test_cross_nic_lets_rings_change_rails_through_the_spine() -> None:
    spec = dgx(2, nodes_per_leaf=1)
    size = 1 << 26
    spine_bytes = {}
    for cross in (2, 1):
        env, net, run, fab = runner(spec, cross_nic=cross)
        timed(env, run.run_collective("all_reduce", tuple(range(16)), size))
        spine = [i for i, (u, v) in enumerate(fab.endpoints) if "spine" in (u[0], v[0])]
        spine_bytes[cross] = float(net.link_bytes[spine].sum())
    # With PXN (cross_nic 2) every channel stays on its rail's leaf... but nodes on
    # different leaves always cross the spine; with cross_nic 1 they also change rails.
    assert spine_bytes[1] >= spine_bytes[2] * (1 - 1e-9)  # equal up to rounding


def test_gpudirect_rdma_off_bounces_through_host_memory() -> None:
    # Without GDR every cross-node byte crosses PCIe to host memory and back at both ends:
    # twice the PCIe bytes of the direct GPU-NIC path.
    size = 1 << 26
    pcie = {}
    for gdr in (True, False):
        env, net, run, fab = runner(dgx(2, gdr=gdr))
        timed(env, run.run_collective("all_gather", tuple(range(16)), size))
        pcie[gdr] = float(net.class_bytes[1])
    assert pcie[False] == pytest.approx(2 * pcie[True])


@pytest.mark.parametrize("mib,algo,expected", [
    (1, "auto", ("ring", "ll")),
    (9, "auto", ("nvls", "simple")),
    (512, "auto", ("nvls", "simple")),
    (9, "ring", ("ring", "ll128")),
    (27, "ring", ("ring", "ll128")),
    (128, "ring", ("ring", "simple")),
])
def test_algorithm_choice_matches_nccls_on_8_h100(mib: int, algo: str, expected) -> None:
    # Stock NCCL 2.28.9 on 8 x H100 (NVSwitch), NCCL_DEBUG_SUBSYS=TUNING, as reported in a
    # public benchmark write-up: 1 MiB -> RING/LL; 9-512 MiB -> NVLS/SIMPLE; with NVLS off,
    # 9-27 MiB -> RING/LL128 and >= 128 MiB -> RING/SIMPLE.
    _, _, run, _ = runner(dgx(1, nics_per_node=0), algo=algo, proto="auto")
    plan, est, _ = run.select("all_reduce", tuple(range(8)), mib << 20)
    assert (plan.algorithm, est.protocol) == expected


def test_disjoint_in_node_groups_fold_into_one_with_counted_bytes() -> None:
    # The TP all-reduces of two nodes use disjoint NVLink ports: one group's flows stand for
    # both (count 2): same time as one group alone, twice the bytes.
    size = 1 << 26
    env, net, run, _ = runner(dgx(2))
    t_one = timed(env, run.run_collective("all_reduce", tuple(range(8)), size))
    one = float(net.class_bytes.sum())
    env, net, run, _ = runner(dgx(2))
    t_two = timed(env, run.run_collective_groups("all_reduce", [tuple(range(8)),
                                                                tuple(range(8, 16))], size))
    assert t_two == pytest.approx(t_one, rel=1e-12)
    assert float(net.class_bytes.sum()) == pytest.approx(2 * one)
    # Groups across nodes are not folded: both run, sharing what they share.
    env, net, run, _ = runner(dgx(2))
    groups = [(0, 8), (1, 9)]
    timed(env, run.run_collective_groups("all_reduce", groups, size))
    env2, net2, run2, _ = runner(dgx(2))
    timed(env2, run2.run_collective("all_reduce", (0, 8), size))
    assert float(net.class_bytes.sum()) == pytest.approx(2 * float(net2.class_bytes.sum()))


# ------------------------------------------------------------------ plan-building shortcuts
# Issue 13 (docs/performance.md items 2-5): each shortcut must give what the long way gives.

def test_a_link_crossed_twice_halves_a_flows_rate_alone_both_ways_of_counting() -> None:
    # Independent truth: a lock-step flow crossing a NIC link twice and an NVLink once runs
    # alone at min(C_nic / 2, C_nvlink) = C_nic / 2. Counted by a sort (short paths) and by
    # bincount (long paths).
    _, _, run, fab = runner(dgx(2))
    b = run.builder
    nvl = int(np.flatnonzero(fab.kind == LINK_KINDS.index("nvlink"))[0])
    net = int(np.flatnonzero(fab.kind == LINK_KINDS.index("network"))[0])
    cap = b.capacity
    truth = cap[net] / 2
    assert truth < cap[nvl]
    assert b._counted_min((net, nvl, net)) == truth
    b._long_path = 1                              # force the bincount branch
    assert b._counted_min((net, nvl, net)) == truth
    assert b._counted_min((net,)) == cap[net]


def test_pat_is_chosen_on_its_bus_bandwidth_and_built_only_when_it_wins() -> None:
    # One GPU per node on 4 nodes: PAT is a candidate for all-gather. Its stand-in for NCCL's
    # cost model has no flows but the full plan's bus bandwidth, so the choice is the same.
    from sim.fabric.collectives import nccl_plans
    group = (0, 8, 16, 24)
    _, _, run, _ = runner(dgx(4), algo="auto", proto="auto")
    full = nccl_plans.pat(run.builder, "all_gather", group)
    stub = nccl_plans.pat_bus_only(run.builder, "all_gather", group)
    assert stub.n_flows == 0 and full.n_flows == 4 * 2      # log2(4) distances x 4 ranks
    assert stub.bus_bw == full.bus_bw == float(full.bottleneck.min())
    assert (stub.n_ranks, stub.n_nodes, stub.volume, stub.nccl_channels) == (
        full.n_ranks, full.n_nodes, full.volume, full.nccl_channels)
    # Public plans() are built; a large message goes to the ring and PAT's flows stay unbuilt.
    assert [p.algorithm for p in run.plans("all_gather", group)] == ["ring", "pat"]
    assert all(p.n_flows for p in run.plans("all_gather", group))
    _, _, run, _ = runner(dgx(4), algo="auto", proto="auto")
    assert run.select("all_gather", group, 1 << 30)[0].algorithm == "ring"
    assert not run._pat
    # Forced, PAT runs with its flows, the same ones as the direct build.
    _, _, run, _ = runner(dgx(4), algo="pat", proto="auto")
    plan = run.select("all_gather", group, 1 << 30)[0]
    assert plan.algorithm == "pat" and np.array_equal(plan.flat, full.flat)


def test_long_haul_is_the_edges_zone_latency_and_zero_in_one_zone() -> None:
    _, _, run, fab = runner(dgx(2, azs=2, az_latency_ms=1.0))
    b = run.builder
    links = b.edge(0, 8)[0]
    zone = fab.kind == LINK_KINDS.index("cross_az")
    expected = sum(float(fab.latency[i]) for i in links if zone[i])
    assert b.long_links and expected > 1e-3            # 1 ms zone link, crossed once
    assert b.long_haul(0, 8) == expected == b.long_haul(0, 8)   # cached: the same float
    _, _, run, _ = runner(dgx(2))
    assert not run.builder.long_links and run.builder.long_haul(0, 8) == 0.0


def test_send_plans_and_group_sets_follow_their_content_not_the_object() -> None:
    # The runner caches a send's plan by the pairs tuple's identity (it keeps the tuple alive,
    # so the id is not reused); a list may change between calls, so it is not cached that way.
    _, _, run, _ = runner(dgx(2))
    pairs = [(0, 8)]
    first = run._p2p_plan(pairs)
    pairs[0] = (0, 9)
    second = run._p2p_plan(pairs)
    assert first is not None and second is not None
    assert not np.array_equal(first.flat, second.flat)
    assert run._p2p_plan(((0, 8),)) is first and run._p2p_plan(((0, 8), (3, 3))) is first
    assert run._p2p_plan(((3, 3),)) is None
    # The same for several groups of one collective: in-node groups fold, cross-node do not.
    groups = [[0, 1], [8, 9]]
    assert run._group_set(groups)[2]
    groups[1] = [2, 10]
    assert not run._group_set(groups)[2]
    frozen = ((0, 1), (8, 9))
    assert run._group_set(frozen) is run._group_set(frozen) and run._group_set(frozen)[2]
