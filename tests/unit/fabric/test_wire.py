"""What a collective does on the wire: latency along its chain of dependent steps, the buffer
window, lock-step channels, and rails for one-GPU-per-node groups (issue 11, items 1, 3, 4)."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from helpers import dgx, timed
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric.collectives import nccl
from sim.fabric.collectives.runner import CollectiveRunner, NcclSettings, transport_capacity
from sim.fabric.network import FlowNetwork, NetworkObserver
from sim.fabric.topology import LINK_KINDS, NETWORK, NVLINK, PCIE, FabricSpec, build_fabric
from sim.frameworks import JobContext, build_program

GB = 1e9


class _Watch(NetworkObserver):
    """Records every rate solve's per-link rates."""

    def __init__(self) -> None:
        self.solves: list[np.ndarray] = []

    def on_rates(self, t, class_rates, link_rates) -> None:
        self.solves.append(link_rates.copy())


def runner(spec: FabricSpec, algo: str = "ring", proto: str = "simple", **settings):
    fab = build_fabric(spec)
    env = simpy.Environment()
    watch = _Watch()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS), watch)
    run = CollectiveRunner(env, net, fab, "hopper",
                           NcclSettings(algo=algo, proto=proto, **settings))
    return env, net, run, fab, watch


# ------------------------------------------------------------------ latency is time
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_tiny_all_reduce_across_zones_pays_the_zone_link(algo: str) -> None:
    # Issue 11's bar: an 8-byte all-reduce across two zones takes at least twice the one-way
    # zone latency (its data must go there and come back), and scales with it: 1 ms -> 10 ms
    # makes it about 10x slower (NCCL's own microsecond terms are negligible beside it).
    times, chains = {}, {}
    for ms in (1.0, 10.0):
        env, _, run, _, _ = runner(dgx(2, azs=2, az_latency_ms=ms), algo=algo, proto="auto")
        times[ms] = timed(env, run.run_collective("all_reduce", tuple(range(16)), 8))
        chains[ms] = run.select("all_reduce", tuple(range(16)), 8)[0].chain_latency_s
        assert times[ms] >= 2 * ms * 1e-3
    # Only the propagation differs between the two: the chain crosses the zone link 4 times
    # (ring: 30 consecutive hops of 16) or twice (tree: up and down one level).
    crossings = 4 if algo == "ring" else 2
    assert chains[10.0] / chains[1.0] == pytest.approx(10.0, rel=1e-3)
    assert chains[1.0] == pytest.approx(crossings * 1e-3, rel=1e-3)
    # (and the 8 bytes themselves, a few ns at the smaller window of the longer round trip)
    assert times[10.0] - times[1.0] == pytest.approx(chains[10.0] - chains[1.0], abs=1e-7)
    if algo == "ring":
        # The ring has no pipeline-fill term; NCCL's microseconds vanish beside 4 ms.
        assert times[10.0] / times[1.0] == pytest.approx(10.0, rel=0.05)


def test_ring_chain_counts_every_dependent_crossing() -> None:
    # A 16-rank ring over 2 nodes in 2 zones crosses the zone link on 2 of its 16 hops; an
    # all-reduce's chunk crosses 30 hops in a row, so the slowest chunk crosses it 4 times
    # (each crossing: az_latency plus the two gateways' switch halves, ~1 ms); an all-gather's
    # 15 hops cross it twice.
    spec = dgx(2, azs=2, az_latency_ms=1.0)
    _, _, run, fab, _ = runner(spec)
    zone_link = float(fab.latency[np.flatnonzero(fab.kind == LINK_KINDS.index("cross_az"))[0]])
    ar = run.builder.ring("all_reduce", tuple(range(16)))
    ag = run.builder.ring("all_gather", tuple(range(16)))
    assert ar.chain_latency_s == pytest.approx(4 * zone_link)
    assert ag.chain_latency_s == pytest.approx(2 * zone_link)
    # In one zone nothing is added: NCCL's hwLat already covers in-datacenter hops.
    _, _, run1, _, _ = runner(dgx(2))
    assert run1.builder.ring("all_reduce", tuple(range(16))).chain_latency_s == 0.0


def test_large_message_over_a_long_link_is_window_bound() -> None:
    # One GPU per node, 10 ms between zones: one ring flow on the GPUs' own NICs standing for
    # two NCCL channels, each with NCCL_BUFFSIZE (4 MiB) in flight per peer. Rate = 2 x 4 MiB
    # per round trip (~20 ms): ~0.42 GB/s, far below the 50 GB/s NIC.
    env, _, run, fab, _ = runner(dgx(2, azs=2, az_latency_ms=10.0))
    size = 1 << 30
    group = (0, 8)
    t = timed(env, run.run_collective("all_reduce", group, size))
    plan, est, _ = run.select("all_reduce", group, size)
    assert plan.n_flows == 1 and plan.flow_channels == 2
    rtt = 2 * plan.path_latency.max()
    assert rtt == pytest.approx(20e-3, rel=0.01)
    rate = 2 * (4 << 20) / rtt
    expected = est.latency_s + plan.chain_latency_s + size / rate   # 2(n-1)/n = 1 for n = 2
    assert t == pytest.approx(expected, rel=1e-6)


def test_sends_pay_their_path_latency() -> None:
    # Pipeline-parallel sends (run_p2p, used by the engine's send ops) cross the zone link once.
    for ms in (1.0, 10.0):
        env, _, run, _, _ = runner(dgx(2, azs=2, az_latency_ms=ms))
        t = timed(env, run.run_p2p([(0, 8)], 8))
        assert ms * 1e-3 <= t < ms * 1e-3 + 100e-6
    env, _, run, _, _ = runner(dgx(2))
    assert timed(env, run.run_p2p([(0, 8)], 8)) < 100e-6


# ------------------------------------------------------------------ one thing on the wire
def test_a_flow_crossing_a_link_twice_uses_it_twice() -> None:
    # The lock-step flows string a ring's edges together; a link on two of its edges carries
    # the flow twice: max_min_rates counts incidences (bincount), and so do link_bytes.
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([100.0, 100.0]), np.array([0, 1]), 2)
    net.start_flow((0, 1, 0), 100.0)
    env.run()
    assert env.now == pytest.approx(2.0)
    assert net.link_bytes.tolist() == pytest.approx([200.0, 100.0])
    assert net.class_bytes.tolist() == pytest.approx([200.0, 100.0])


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(2, 4), gpus=st.sampled_from([2, 4]), nics=st.sampled_from([1, 2]),
    leaf=st.sampled_from([1, 16]), algo=st.sampled_from(["ring", "auto"]),
    colls=st.lists(st.tuples(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]),
                             st.integers(0, 2**16), st.integers(2, 16),
                             st.floats(1e5, 1e8), st.floats(0.0, 1e-3)),
                   min_size=2, max_size=2),
)
def test_two_collectives_sharing_links(nodes, gpus, nics, leaf, algo, colls) -> None:
    # Two collectives (rings, or what NCCL picks: trees, NVLS) on random groups of one fabric,
    # started at random times, sharing links: (1) bytes per link class = what their flows
    # carry (every hop counted);
    # (2) no link above capacity at any moment; (3) lock-step: at every moment every link a
    # ring channel uses alone carries the same rate (its edges advance together).
    spec = FabricSpec(nodes=nodes, gpus_per_node=gpus, nvlink_gbytes_per_s=450,
                      pcie_gbytes_per_s=63, nics_per_node=nics, nic_gbps=400,
                      nodes_per_leaf=leaf)
    env, net, run, fab, watch = runner(spec, algo=algo)
    n = spec.n_gpus
    users: dict[int, int] = {}
    expected = np.zeros(len(LINK_KINDS))
    colls_run = []
    for op, seed, size, nbytes, delay in colls:
        rng = np.random.default_rng(seed)
        group = tuple(sorted(rng.choice(n, size=min(size, n), replace=False).tolist()))
        if len(group) < 2:
            continue
        plan, est, _ = run.select(op, group, nbytes)
        colls_run.append((op, group, plan.algorithm))
        for f in range(plan.n_flows):
            links = plan.flat[plan.lengths[:f].sum():plan.lengths[:f + 1].sum()]
            expected += np.bincount(fab.kind[links], minlength=len(LINK_KINDS)) \
                * plan.share[f] * nbytes / (est.wire_factor or 1.0)
        for i in plan.flat.tolist():
            users[i] = users.get(i, 0) + 1

        def go(op=op, group=group, nbytes=nbytes, delay=delay):
            yield env.timeout(delay)
            yield from run.run_collective(op, group, nbytes)
        env.process(go())
    env.run()
    assert net.class_bytes == pytest.approx(expected, rel=1e-6)
    cap = net.capacity
    for rates in watch.solves:
        assert (rates <= cap * (1 + 1e-9)).all()
    # Lock-step: the links of a ring channel (from its ring order, not from the plan's flows)
    # that nothing else crosses all carry the same rate at every moment. Independent edge
    # flows would fail this as soon as one edge of a channel meets the other collective.
    channels = []
    for _, group, algorithm in colls_run:
        if algorithm != "ring":
            continue
        for ring, rail in run.builder.ring_channels(group):
            channels.append([i for k in range(len(ring))
                             for i in run.builder.edge(ring[k], ring[(k + 1) % len(ring)],
                                                       rail)[0]])
    for links in channels:
        alone = [i for i in links if users[i] == 1]
        for rates in watch.solves:
            if alone:
                r = rates[alone]
                assert np.ptp(r) <= 1e-9 * max(1.0, float(r.max()))


# ------------------------------------------------------------------ rails
def _dp_bytes(nodes: int, nics: int, algo: str, size: float) -> np.ndarray:
    # The 8 data-parallel groups of TP=8: group j holds local GPU j of every node. Bytes per
    # link class, in payload bytes (the protocol's wire overhead, e.g. the tree's Simple
    # 0.92 in tuning.cc, taken off).
    spec = dgx(nodes, nics_per_node=nics)
    env, net, run, _, _ = runner(spec, algo=algo)
    groups = [tuple(node * 8 + j for node in range(nodes)) for j in range(8)]
    timed(env, run.run_collective_groups("all_reduce", groups, size))
    plan, est, _ = run.select("all_reduce", groups[0], size)
    assert plan.algorithm == algo
    return net.class_bytes * (est.wire_factor or 1.0)


@pytest.mark.parametrize("nodes", [2, 4, 16])
@pytest.mark.parametrize("nics", [8, 4])
def test_data_parallel_rings_at_tp8_stay_on_their_rail(nodes: int, nics: int) -> None:
    # NCCL keeps a one-GPU-per-node ring on the GPU's own NIC (the one on its PCIe switch).
    # Closed form, per group: n ring edges, each carrying 2(n-1)/n x S, each crossing
    # GPU -> PCIe switch -> NIC (2 PCIe links), NIC -> leaf -> NIC (2 network links, all
    # nodes under one leaf of 16), NIC -> PCIe switch -> GPU (2 PCIe links); no NVLink at all.
    size = 1 << 26
    got = _dp_bytes(nodes, nics, "ring", size)
    per_group_edges = nodes * 2 * (nodes - 1) / nodes * size
    assert got[NVLINK] == 0.0
    assert got[NETWORK] == pytest.approx(8 * per_group_edges * 2, rel=1e-9)
    assert got[PCIE] == pytest.approx(8 * per_group_edges * 4, rel=1e-9)


@pytest.mark.parametrize("nodes", [2, 4, 16])
def test_data_parallel_trees_at_tp8_stay_on_their_rail(nodes: int) -> None:
    # A double binary tree over n nodes has n-1 edges per tree; each tree carries S/2 up and
    # S/2 down every edge: 2(n-1) x S/2 x 2 trees = 2(n-1)S per group on the edges.
    size = 1 << 26
    got = _dp_bytes(nodes, 8, "tree", size)
    per_group_edges = 2 * (nodes - 1) * size
    assert got[NVLINK] == 0.0
    assert got[NETWORK] == pytest.approx(8 * per_group_edges * 2, rel=1e-9)
    assert got[PCIE] == pytest.approx(8 * per_group_edges * 4, rel=1e-9)


def test_rail_groups_get_one_nic_each() -> None:
    # On its own NIC a data-parallel all-reduce runs at the NIC's achieved rate: 2 nodes,
    # 2(n-1)/n = 1, so S / (50 GB/s x efficiency) plus NCCL's latency.
    size = 1 << 30
    env, _, run, _, _ = runner(dgx(2))
    t = timed(env, run.run_collective("all_reduce", (3, 11), size))
    plan, est, _ = run.select("all_reduce", (3, 11), size)
    nic = 400 / 8 * GB * nccl.NETWORK_EFFICIENCY
    assert t == pytest.approx(est.latency_s + size / nic, rel=1e-6)


def test_rail_groups_fold_into_one() -> None:
    # On their own rails the 8 data-parallel groups share no link, so one group's flows stand
    # for all eight (the fold that keeps 1,024-GPU steps fast); the bytes still count 8 groups.
    size = 1 << 26
    env, net, run, _, _ = runner(dgx(4))
    groups = [tuple(node * 8 + j for node in range(4)) for j in range(8)]
    env.process(run.run_collective_groups("all_reduce", groups, size))
    env.run(until=1e-3)
    assert net.active_flows == 1
    assert all(run._disjoint.values())
    env.run()
    assert net.class_bytes[NETWORK] == pytest.approx(8 * 4 * 2 * 3 / 4 * size * 2, rel=1e-9)


def test_a_large_send_over_a_long_link_is_window_bound() -> None:
    # A send to one peer over the network: 2 channels (NCCL_NCHANNELS_PER_NET_PEER), each
    # with NCCL_STEPS x NCCL_P2P_NET_CHUNKSIZE = 8 x 128 KiB in flight: 2 MiB per ~20 ms round
    # trip at 10 ms one way, ~0.1 GB/s, after the one-way propagation of the first bytes.
    env, _, run, _, _ = runner(dgx(2, azs=2, az_latency_ms=10.0))
    size = 1 << 28
    t = timed(env, run.run_p2p([(0, 8)], size))
    plan = run.builder.p2p([(0, 8)], 1.0)
    rtt = 2 * plan.path_latency.max()
    rate = 2 * 8 * 128 * 1024 / rtt
    assert plan.chain_latency_s == pytest.approx(10e-3, rel=0.01)
    # NCCL's own send latency (~20 us) is within the tolerance.
    assert t - plan.chain_latency_s == pytest.approx(size / rate, rel=1e-3)


def test_a_collective_is_capped_as_a_whole_where_nccl_caps_it() -> None:
    # NCCL caps LL's bus bandwidth for the whole collective (tuning.cc llMaxBws: across nodes
    # indexed by the host CPU, 39 GB/s for 2 Intel nodes as on a DGX H100). The cap is spread
    # over the ring's lock-step flows in proportion to their rates alone (bus_bw is their
    # sum), so the collective runs at exactly the cap.
    size = 1 << 26
    env, _, run, _, _ = runner(dgx(2), proto="ll")
    group = tuple(range(16))
    t = timed(env, run.run_collective("all_reduce", group, size))
    plan, est, _ = run.select("all_reduce", group, size)
    assert plan.bus_bw == pytest.approx(float(plan.bottleneck.sum()))
    cap = nccl.ll_max_bw_gbps("hopper", 2, "intel") * GB
    assert est.bus_bw_bytes_per_s == pytest.approx(cap)
    assert t == pytest.approx(est.latency_s + 2 * 15 / 16 * size / cap, rel=1e-6)


def test_megatron_data_parallel_ops_at_tp8_touch_no_nvlink() -> None:
    # Issue 11's bar on a shipped layout: Llama 3 70B, TP8 x PP4 x DP2 on 8 DGX H100. Every
    # collective whose groups span nodes (the data-parallel gradient and parameter traffic:
    # one GPU per node per group) runs on the GPUs' own rails: no NVLink link on any flow,
    # and only the GPU <-> PCIe switch <-> NIC links at both ends (4 PCIe per edge).
    from sim.api import fabric_spec
    from sim.scenario import load_scenario

    s = load_scenario("llama3-70b-megatron-tp8pp4-64xh100")
    ctx = JobContext.from_scenario(s)
    prog = build_program(ctx)
    env, _, run, fab, _ = runner(fabric_spec(s), algo="auto", proto="auto")
    seen = 0
    for op in prog.ops:
        if not op.collective:
            continue
        for group in op.all_groups:
            if len({fab.node_of(r) for r in group}) < 2:
                continue
            plan, _, _ = run.select(op.collective, tuple(group), op.nbytes)
            kinds = fab.kind[plan.flat]
            assert not (kinds == NVLINK).any(), (op.collective, group)
            assert (kinds == PCIE).sum() == 2 * (kinds == NETWORK).sum()
            seen += 1
    assert seen > 0


def test_one_gpu_nodes_use_every_nic_on_the_gpus_switch() -> None:
    # One GPU per node with two NICs on its PCIe switch: NCCL spreads the ring's channels over
    # both (both are at PIX distance); each NIC carries half, no host or NVLink hop.
    spec = FabricSpec(nodes=2, gpus_per_node=1, nvlink_gbytes_per_s=450, pcie_gbytes_per_s=63,
                      nics_per_node=2, nic_gbps=400)
    env, net, run, fab, _ = runner(spec)
    size = 1 << 28
    t = timed(env, run.run_collective("all_reduce", (0, 1), size))
    plan, est, _ = run.select("all_reduce", (0, 1), size)
    assert plan.channels == 2
    nic_up = [fab._eid[(("nic", 0, k), fab._layout.leaf_of_nic(spec, 0, k))] for k in (0, 1)]
    assert net.link_bytes[nic_up].tolist() == pytest.approx([size / 2, size / 2])
    # The GPU's one PCIe link to its switch carries everything: 63 GB/s x efficiency binds
    # before the two NICs' 2 x 50 GB/s do.
    pcie = 63 * GB * nccl.PCIE_EFFICIENCY
    nics = 2 * 50 * GB * nccl.NETWORK_EFFICIENCY
    assert t == pytest.approx(est.latency_s + size / min(pcie, nics), rel=1e-6)


def test_pat_pays_the_zone_link_once_per_crossing_distance() -> None:
    # PAT (one GPU per node) exchanges at distances 1, 2, 4 in dependent steps. Nodes are
    # spread over the two zones round robin, so only the odd distance (1) crosses the zone
    # link: an 8-node PAT all-gather's chain crosses it once, a ring's 7 hops cross it 7 times.
    spec = dgx(8, azs=2, az_latency_ms=1.0)
    _, _, run, fab, _ = runner(spec, algo="pat")
    zone_link = float(fab.latency[np.flatnonzero(fab.kind == LINK_KINDS.index("cross_az"))[0]])
    group = tuple(range(0, 64, 8))
    plan, _, _ = run.select("all_gather", group, 8)
    assert plan.algorithm == "pat"
    assert plan.chain_latency_s == pytest.approx(zone_link, rel=0.01)
    ring = run.builder.ring("all_gather", group)
    assert ring.chain_latency_s == pytest.approx(7 * zone_link, rel=0.01)
