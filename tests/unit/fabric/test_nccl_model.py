"""NCCL's choice and cost across the whole size curve, against NCCL's own cost model computed
here independently from the numbers of NCCL 2.30's ``src/graph/tuning.cc``.

The constants below are copied by hand from tuning.cc (ncclTunerConstantsDefaults: baseLat,
hwLat, llMaxBws, treeCorrectionFactor; getNetOverhead; ncclTopoTuneModel's latency formulas)
so that a slip in :mod:`sim.fabric.collectives.nccl` shows up as a disagreement.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from sim.apps.nccltests import Bench
from sim.fabric.collectives import nccl
from sim.fabric.collectives.nccl_plans import collnet_direct, nvls_gather, pat
from sim.fabric.collectives.runner import CollectiveRunner, NcclSettings, transport_capacity
from sim.fabric.network import FlowNetwork
from sim.fabric.topology import LINK_KINDS, FabricSpec, build_fabric

# tuning.cc (NCCL 2.30), microseconds.
TREE_LL_BASE, RING_LL_BASE = 6.8, 6.6          # baseLatencies[Tree|Ring][LL]
NVLINK_TREE_LL, NVLINK_RING_LL = 0.6, 0.6      # hwLatencies[NVLINK][Tree|Ring][LL]
NET_TREE_LL, NET_RING_LL = 5.0, 2.7            # hwLatencies[NET][Tree|Ring][LL]
PAT_BASE, NET_TREE_SIMPLE = 8.0, 14.0          # baseLatencies[PAT], hwLatencies[NET][Tree][Simple]
# llMaxBws row 0 (Intel hosts across nodes): 2 nodes 39.0, more 20.4 GB/s.
LL_MAX_INTEL = {2: 39.0, 16: 20.4}
# treeCorrectionFactor[LL][log2i(nBytes >> 6)] for log sizes 0..10.
TREE_CORR_LL = (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6)


def ilog2(n: int) -> int:
    return n.bit_length() - 1


def nccl_tree_ll_us(nbytes: int, nodes: int, ppn: int) -> float:
    """NCCL's predicted tree/LL all-reduce time on H100 with Intel hosts and enough NIC
    bandwidth that llMaxBw binds (busBw x 0.92 / 3.8 > llMaxBw: true for 8 x 400 Gb/s)."""
    lat = TREE_LL_BASE + 2 * ((ppn - 1) * NVLINK_TREE_LL + ilog2(nodes) * NET_TREE_LL)
    alg_bw = LL_MAX_INTEL[2 if nodes == 2 else 16] * 0.5        # tree algBw = busBw x 0.5
    log_size = ilog2(nbytes >> 6)
    if 0 <= log_size < len(TREE_CORR_LL):
        alg_bw *= TREE_CORR_LL[log_size]
    return lat + nbytes / (1000 * alg_bw)


def ring_ll_us(nodes: int, ppn: int, net_overhead: float = 1.0) -> float:
    """NCCL's ring/LL all-reduce latency (tuning.cc): intra steps pay max(hw, net overhead)."""
    n = nodes * ppn
    steps, inter = 2 * (n - 1), 2 * (nodes - 1)
    return RING_LL_BASE + (steps - inter) * max(NVLINK_RING_LL, net_overhead) + inter * NET_RING_LL


SMALL = [8, 64, 512, 4096, 32768, 65536]


@pytest.mark.parametrize("gpus", [16, 128, 1024])
def test_small_all_reduce_follows_nccls_model(gpus: int) -> None:
    bench = Bench.build("dgx-h100", gpus)
    nodes = gpus // 8
    for size in SMALL:
        row = bench.run("all_reduce", size)
        model = nccl_tree_ll_us(size, nodes, 8)
        assert model < ring_ll_us(nodes, 8)          # NCCL picks the tree...
        assert (row["algorithm"], row["protocol"]) == ("tree", "ll")
        # ... predicts exactly its own formula (no pipeline fill in the choice) ...
        assert row["nccl_model_s"] * 1e6 == pytest.approx(model, rel=1e-3)
        # ... and the simulated run lands within 20% of it (the bar).
        assert row["time_s"] * 1e6 == pytest.approx(model, rel=0.20)


def test_eight_bytes_on_128_gpus_is_about_55_us() -> None:
    # 6.8 + 2 x (7 x 0.6 + log2(16) x 5.0) = 55.2 us; the ring would take 6.6 + 224 x 1.0 +
    # 30 x 2.7 = 311.6 us.
    row = Bench.build("dgx-h100", 128).run("all_reduce", 8)
    assert row["time_s"] * 1e6 == pytest.approx(55.2, rel=0.02)
    assert ring_ll_us(16, 8) == pytest.approx(311.6)


def test_forced_tree_small_message_pays_no_full_chunk_fill() -> None:
    # 32 B forced tree on 2 nodes: NCCL's model 6.8 + 2 x (7 x 0.6 + 1 x 5.0) = 25.2 us (it
    # was 237 us when every stage waited for a full 512 KiB chunk).
    row = Bench.build("dgx-h100", 16, algo="tree").run("all_reduce", 32)
    assert row["time_s"] * 1e6 == pytest.approx(25.2, rel=0.05)


def test_ring_for_large_messages_without_nvls() -> None:
    # DGX A100 (no NVLink SHARP): the ring wins from large sizes on, as NCCL picks it.
    bench = Bench.build("dgx-a100", 32)
    assert bench.run("all_reduce", 8)["algorithm"] == "tree"
    big = bench.run("all_reduce", 1 << 30)
    assert (big["algorithm"], big["protocol"]) == ("ring", "simple")


def test_whole_curve_tracks_nccls_prediction() -> None:
    # 8 B to 8 GiB on 16 H100: every size within 35% of NCCL's own prediction for the
    # algorithm it picks (medium sizes differ most: NCCL corrects trees down by up to half
    # there, treeCorrectionFactor, which only steers its choice).
    bench = Bench.build("dgx-h100", 16)
    algos = []
    for k in range(3, 34, 3):
        row = bench.run("all_reduce", 1 << k)
        algos.append(row["algorithm"])
        assert row["time_s"] == pytest.approx(row["nccl_model_s"], rel=0.35)
    assert algos[0] == "tree" and algos[-1] != "tree"


def test_latency_tables_follow_the_cpu_vendor() -> None:
    # getNetOverhead: 1 us on Intel, 2 us on AMD (x3 for Simple); llMaxBws row 1 for AMD.
    intel = nccl.latency_s("ring", "all_reduce", "ll", 16, 2, cpu_vendor="intel")
    amd = nccl.latency_s("ring", "all_reduce", "ll", 16, 2, cpu_vendor="amd")
    assert intel * 1e6 == pytest.approx(ring_ll_us(2, 8, 1.0))
    assert amd * 1e6 == pytest.approx(ring_ll_us(2, 8, 2.0))
    assert nccl.ll_max_bw_gbps("hopper", 2, "intel") == 39.0
    assert nccl.ll_max_bw_gbps("hopper", 2, "amd") == 22.5
    assert nccl.ll_max_bw_gbps("hopper", 4, "arm") == 20.4       # Grace reads the Intel row
    assert nccl.ll_max_bw_gbps("hopper", 1, "amd") == 141.0      # one node: by GPU
    # The topology files carry the vendor: AWS p5 (AMD EPYC 7R13), DGX H100 (Xeon 8480C).
    assert Bench.build("aws-p5", 16).fabric.spec.cpu_vendor == "amd"
    assert Bench.build("dgx-h100", 16).fabric.spec.cpu_vendor == "intel"


def test_integer_log2_in_tree_latency() -> None:
    # 12 nodes: log2i(12) = 3, not 3.58.
    lat = nccl.latency_s("tree", "all_reduce", "ll", 96, 12)
    assert lat * 1e6 == pytest.approx(TREE_LL_BASE + 2 * (7 * NVLINK_TREE_LL + 3 * NET_TREE_LL))


def _one_per_node(nodes: int, op: str, size: int, algo: str = "auto"):
    bench = Bench.build("dgx-h100", nodes * 8, algo)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(bench.fabric, bench.arch), bench.fabric.kind,
                      len(LINK_KINDS))
    run = CollectiveRunner(env, net, bench.fabric, bench.arch, bench.settings)
    group = tuple(range(3, nodes * 8, 8))       # local GPU 3 of every node (DP at TP=8)
    env.run(env.process(run.run_collective(op, group, size)))
    return env.now, run.chosen[-1], run


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_pat_for_one_gpu_per_node(op: str) -> None:
    # PAT latency: 8 + log2i(16) x 14 / 3.5 + 16 x 2.8 = 68.8 us (ppn = 1 uses the tree's
    # network latency); the ring would pay 6.6 + 15 x 5.0 = 81.6 us with LL.
    t, choice, _ = _one_per_node(16, op, 4096)
    model = PAT_BASE + ilog2(16) * NET_TREE_SIMPLE / 3.5 + 16 * 2.8
    assert choice.algorithm == "pat"
    assert choice.predicted_s * 1e6 == pytest.approx(model, rel=0.02)
    assert t * 1e6 == pytest.approx(model, rel=0.20)


def test_no_pat_with_several_gpus_per_node() -> None:
    bench = Bench.build("dgx-h100", 16)
    assert bench.run("all_gather", 4096)["algorithm"] != "pat"


def _builder(nodes: int = 4, sharp: bool = True):
    spec = FabricSpec(nodes=nodes, gpus_per_node=8, nvlink_gbytes_per_s=450,
                      pcie_gbytes_per_s=63, nics_per_node=8, nic_gbps=400, sharp=sharp)
    fab = build_fabric(spec)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS))
    return CollectiveRunner(env, net, fab, "hopper", NcclSettings()), fab


def test_new_plans_conserve_bytes() -> None:
    run, fab = _builder()
    b = run.builder
    # PAT over 4 ranks: every rank sends (n-1)/n of the buffer (Bruck distances 1, 2).
    plan = pat(b, "all_gather", [0, 8, 16, 24])
    assert plan.share.sum() == pytest.approx(4 * 3 / 4)
    # NVLS all-gather in one node: per GPU 1/n up to the NVSwitch and the whole buffer down.
    g = nvls_gather(b, "all_gather", list(range(8)), 0.8, 16)
    assert sorted(set(np.round(g.share, 6))) == [pytest.approx(1 / 8), 1.0]
    assert g.share.sum() == pytest.approx(8 * (1 / 8 + 1.0))
    # CollNet Direct: each NIC carries S/ppn up and S/ppn down, whatever the node count.
    d = collnet_direct(b, list(range(32)), 4 * 2**20)
    nic_up = {i for i, (a, z) in enumerate(fab.endpoints) if a[0] == "nic" and z[0] == "leaf"}
    carried = np.zeros(len(fab.capacity))
    start = 0
    for length, share in zip(d.lengths, d.share, strict=True):
        carried[d.flat[start:start + length]] += share
        start += length
    assert {round(carried[i], 9) for i in nic_up} == {round(1 / 8, 9)}


def test_collnet_only_where_the_fabric_has_sharp() -> None:
    # Forced CollNet Direct on a SHARP fabric: NCCL's latency 2 x (1 x 3.7 + 7 x 0.4) + 31 =
    # 44 us for 8 B on 4 nodes.
    row = Bench.build("dgx-h100", 32, algo="collnet_direct").run("all_reduce", 8)
    assert row["algorithm"] == "collnet_direct"
    assert row["time_s"] * 1e6 == pytest.approx(2 * (3.7 + 7 * 0.4) + 31, rel=0.05)
    # Not offered without SHARP (AWS p5, EFA), nor chosen by default (NCCL_COLLNET_ENABLE=0).
    assert Bench.build("aws-p5", 32, algo="collnet_direct").run(
        "all_reduce", 8)["algorithm"] != "collnet_direct"
    auto = Bench.build("dgx-h100", 32)
    assert all(auto.run("all_reduce", s)["algorithm"] not in ("collnet_direct", "collnet_chain")
               for s in (8, 1 << 20, 1 << 30))
    run, _ = _builder(sharp=False)
    assert all(p.algorithm != "collnet_direct" for p in run.plans("all_reduce",
                                                                  tuple(range(32))))


def test_no_ll128_across_nodes_without_gpudirect() -> None:
    # tuning.cc enables LL128 by default only on inter-node paths up to PXN (Hopper); without
    # GPUDirect RDMA NCCL's path goes through the host bridge, and LL128 is off.
    sizes = [1 << k for k in range(10, 25, 2)]
    on = Bench.build("dgx-h100", 16, overrides={"nccl.gdr": True})
    off = Bench.build("dgx-h100", 16, overrides={"nccl.gdr": False})
    assert any(on.run("all_reduce", s)["protocol"] == "ll128" for s in sizes)
    assert all(off.run("all_reduce", s)["protocol"] != "ll128" for s in sizes)
