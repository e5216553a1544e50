"""NCCL's all-to-all across the network at its measured share of the ring's per-NIC rate
(``sim.fabric.collectives.alltoall.P2P_NETWORK_SHARE``).

The share is fitted on two measured two-node plateaus (4 GB buffers), so the first test only
shows the fit holds on both points through the whole path (topology, PXN routes, flows); the
others check what the share must leave alone: ring collectives across the same NICs, NCCL's
all-to-all inside one node, and the fused kernels (DeepEP, Hybrid-EP), which keep their own
published rates.
"""

from __future__ import annotations

import pytest

from sim.apps.nccltests import Bench
from sim.fabric.collectives import alltoall, nccl

FOUR_GB = 4 * 2**30


@pytest.mark.parametrize(("topology", "overrides", "measured"), [
    # nccl-tests issue 355 (2025-10-31, NCCL 2.28.7): 16 H100, one 400 Gb/s CX-7 a GPU.
    ("dgx-h100", {}, 80.0),
    # NVIDIA/nccl issue 1138 (2024-01-05, NCCL 2.18.6): 16 A100, four 200 Gb/s NICs a node.
    ("dgx-a100", {"cluster.nics_per_node": 4}, 19.83),
])
def test_two_node_plateaus_it_was_fitted_on(topology, overrides, measured) -> None:
    row = Bench.build(topology, 16, overrides=overrides).run("all_to_all", FOUR_GB)
    assert row["algorithm"] == "p2p"
    # The mean of the two ratios: each point within half their spread (0.9%).
    assert row["busbw_gbytes_per_s"] == pytest.approx(measured, rel=0.01)


def test_the_share_is_recomputed_from_the_two_measured_plateaus() -> None:
    # sim/catalog/reference/nccl.yaml's role-fit entries: on 2 nodes half of each rank's
    # buffer crosses the network, so the ring's rate would give busbw = 15/16 x 2 x the
    # NIC's rate a GPU x NETWORK_EFFICIENCY; the share is measured over that, averaged.
    from pathlib import Path

    from sim import catalog

    ref = catalog.load_yaml((Path(catalog.__file__).parent / "reference" / "nccl.yaml")
                            .read_text())
    fits = [e for e in ref if e["id"].endswith("-alltoall-2node-measured")]
    assert len(fits) == 2 and all(e["role"] == "fit" and e["nodes"] == 2 for e in fits)
    ratios = [e["points"][0]["busbw_GBps"]
              / (15 / 16 * 2 * e["nic_gbytes_per_s_per_gpu"] * nccl.NETWORK_EFFICIENCY)
              for e in fits]
    assert alltoall.P2P_NETWORK_SHARE == pytest.approx(sum(ratios) / 2, rel=1e-12)
    assert max(ratios) - min(ratios) < 0.02     # the two setups agree


def test_the_share_is_below_the_rings_and_the_ring_keeps_its_rate() -> None:
    assert 0.8 < alltoall.P2P_NETWORK_SHARE < 1.0
    # A ring all-reduce on the same two nodes still reaches the maintainers' 46-48 GB/s a
    # NIC (nccl-tests issue 290): the share is the all-to-all's alone.
    row = Bench.build("dgx-h100", 16, "ring").run("all_reduce", 8 * 2**30)
    per_nic = row["busbw_gbytes_per_s"] / 8
    assert 46.0 <= per_nic <= 48.0 < 50.0 * nccl.NETWORK_EFFICIENCY * 1.02


def test_inside_one_node_nothing_moves() -> None:
    # No network link: the 8-GPU plateau is NVLink's (the maintainers' 370 GB/s, nccl.yaml).
    row = Bench.build("dgx-h100", 8).run("all_to_all", 8 * 2**30)
    assert row["busbw_gbytes_per_s"] == pytest.approx(370.0, rel=0.05)


def _two_node_time(fused_sms: int) -> float:
    """Seconds of a 1 GiB-a-rank all-to-all over 16 H100 on 2 nodes, by NCCL (0) or by a
    fused kernel of ``fused_sms`` SMs (DeepEP's normal kernels)."""
    import simpy

    from sim.fabric.collectives.runner import CollectiveRunner, transport_capacity
    from sim.fabric.network import FlowNetwork
    from sim.fabric.topology import LINK_KINDS

    fab = Bench.build("dgx-h100", 16).fabric
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS))
    run = CollectiveRunner(env, net, fab, "hopper")
    group = tuple(range(16))
    matrix = alltoall.even_matrix(16, float(2**30))
    env.run(env.process(run.run_collective_groups("all_to_all", [group], 2**30,
                                                  peer_bytes=matrix, fused_sms=fused_sms)))
    return env.now


def test_fused_kernels_keep_the_rings_network_rate() -> None:
    # DeepEP and Hybrid-EP post their own RDMA writes (no NCCL proxy): across nodes, where
    # the NICs bound both, NCCL's own sends take 1 / P2P_NETWORK_SHARE as long as the fused
    # kernel's (whose NVLink share, 24 SMs, is not what paces a two-node op).
    nccl_s, fused_s = _two_node_time(0), _two_node_time(24)
    assert nccl_s / fused_s == pytest.approx(1 / alltoall.P2P_NETWORK_SHARE, rel=0.02)



def _builder(gpus: int):
    import simpy

    from sim.fabric.collectives.runner import CollectiveRunner, transport_capacity
    from sim.fabric.network import FlowNetwork
    from sim.fabric.topology import LINK_KINDS

    fab = Bench.build("dgx-h100", gpus).fabric
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(fab, "hopper"), fab.kind, len(LINK_KINDS))
    return CollectiveRunner(env, net, fab, "hopper").builder


@pytest.mark.parametrize(("gpus", "capped"), [(8, False), (16, True)])
def test_the_share_caps_the_even_split_only_where_it_crosses_the_network(gpus, capped) -> None:
    # The even split (coflow off) is left to max-min sharing; inside one node the network
    # share has no link to act on, so it must leave that plan exactly as it was.
    b, group = _builder(gpus), tuple(range(gpus))
    matrix = alltoall.even_matrix(gpus, 1.0)
    plain = alltoall.peer_plan(b, [group], matrix, coflow=False)
    shared = alltoall.peer_plan(b, [group], matrix, coflow=False,
                                network_share=alltoall.P2P_NETWORK_SHARE)
    assert plain is not None and shared is not None
    assert (shared.bus_bw < plain.bus_bw) == capped
    assert (not (shared.bottleneck == plain.bottleneck).all()) == capped
