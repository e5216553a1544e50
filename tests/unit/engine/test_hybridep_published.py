"""Hybrid-EP's transfers on the fabric (:mod:`sim.frameworks.megatron.moe_hybridep`,
:mod:`sim.fabric.collectives.hybridep_kernel`) against published measurements.

* deepseek-ai/DeepEP branch ``hybrid-ep``, ``docs/README_Hybrid-EP.md`` "Performance
  Results", GB200: 4096 tokens a rank, hidden 7168, top-8, 8 local experts, uniform routing,
  BF16 dispatch, kernel time; GB/s = the bytes a rank receives (its own share included,
  ``tests/test_hybrid_ep.py`` ``nvl_recv_bytes``) over the kernel's time. The 8-rank row is
  what :mod:`~sim.fabric.collectives.hybridep_kernel` is fitted on; 16 to 36 ranks in one
  NVL72 domain are checked, not fitted.
* The same table on H100 (EP 16 to 64 over 400 Gb/s NICs): EP 32 and 64 checked, EP 16
  marked (the simulation is 20-37% faster there).
* The Megatron Core MoE report (arXiv 2603.07685, Table 7): on H100 at EP 32 (four nodes,
  hidden 7168) HybridEP's dispatch took 3,064 us against the alltoall dispatcher's 8,059.
  The table's token count and routing are not restated here; assumed: Hybrid-EP's own
  benchmark setting (4096 tokens a rank, top-8 of 256 experts, uniform, BF16).
"""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.fabric.topology import FabricSpec, build_fabric
from sim.frameworks.megatron.moe_hybridep import HybridEPLayout, HybridEPPlan
from sim.program.ir import Op, Program, RankClass

TOKENS, HIDDEN, TOPK, LOCAL = 4096, 7168, 8, 8

# GB200, 32 SMs, kernel only, BF16 dispatch / combine (GB/s), ranks in one NVLink domain.
GB200_32SM = {8: (764.03, 737.13), 16: (706.95, 666.26), 24: (665.97, 639.80),
              32: (642.23, 605.15), 36: (632.31, 596.99)}


def _run(ops: list[Op], n: int, nodes: int, per_node: int, nvlink: float, arch: str,
         nics: int = 0) -> float:
    fab = build_fabric(FabricSpec(nodes=nodes, gpus_per_node=per_node,
                                  nvlink_gbytes_per_s=nvlink, pcie_gbytes_per_s=63,
                                  nics_per_node=nics, nic_gbps=400))
    cls = RankClass(0, tuple(range(n)))
    p = Program([cls], n, 0, 0, 0)
    for op in ops:
        p.add(cls, op)
    return Engine(fab, arch).run_step(p)


def hybridep_time(ranks: int, domain: int, which: str, sms: int, nvlink: float, arch: str,
                  experts: int | None = None) -> tuple[float, HybridEPPlan]:
    experts = experts or LOCAL * ranks
    lay = HybridEPLayout(tuple(range(ranks)), domain, experts, TOPK, ranks, 1, domain=domain)
    plan = HybridEPPlan(lay, float(TOKENS), HIDDEN, False, sms)
    op = Op(name=which, kind="collective", stream="comm", phase="comm",
            collective="all_to_all", group=tuple(range(ranks)), nbytes=plan.nbytes(which),
            peer_bytes=plan.peer_bytes(which), key="a2a", sm_ctas=sms, fused_kernel="hybridep")
    nodes = ranks // domain
    t = _run([op], ranks, nodes, domain, nvlink, arch, nics=domain if nodes > 1 else 0)
    return t, plan


def recv_gbps(ranks: int, which: str, sms: int = 32) -> float:
    t, plan = hybridep_time(ranks, ranks, which, sms, 900, "blackwell")
    received = sum(plan.layout.hit((r,)) for r in range(ranks)) * TOKENS * HIDDEN * 2.0
    return received / t / 1e9


@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_gb200_fitted_row_eight_ranks(i, which) -> None:
    # The row hybridep_kernel.NVLINK_STORE_EFFICIENCY is fitted on: pins the fit only.
    assert recv_gbps(8, which) == pytest.approx(GB200_32SM[8][i], rel=0.05)


@pytest.mark.parametrize("ranks", [16, 24, 32, 36])
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_gb200_nvl72_domain_rows_within_15_percent(ranks, i, which) -> None:
    # Not fitted: 16 to 36 ranks in one NVL72 domain, every token over NVLink once per
    # destination rank.
    assert recv_gbps(ranks, which) == pytest.approx(GB200_32SM[ranks][i], rel=0.15)


def test_sms_do_not_bind_hybridep_where_they_bind_deepep() -> None:
    # Hybrid-EP's README: on GB200, 8 ranks, 16 SMs moved 750 GB/s (BF16 dispatch), 98% of
    # its 32-SM figure; DeepEP's normal kernels with 16 SMs moved 362 (Torch API, the same
    # table). Every Hybrid-EP block sends, so halving the SMs costs little.
    assert recv_gbps(8, "dispatch_fwd", 16) == pytest.approx(750.15, rel=0.05)
    assert recv_gbps(8, "dispatch_fwd", 16) > 0.95 * recv_gbps(8, "dispatch_fwd", 32)


def alltoall_dispatch_time(ranks: int) -> float:
    # Megatron's alltoall dispatcher: every (token, expert) copy, an even NCCL all-to-all.
    nbytes = TOKENS * TOPK * HIDDEN * 2.0
    op = Op(name="a2a", kind="collective", stream="comm", phase="comm",
            collective="all_to_all", group=tuple(range(ranks)), nbytes=nbytes, key="a2a")
    return _run([op], ranks, ranks // 8, 8, 450, "hopper", nics=8)


def test_report_table7_ep32_h100_dispatch() -> None:
    # arXiv 2603.07685 Table 7: HybridEP 3,064 us, alltoall 8,059 us (EP 32, H100, hidden
    # 7168); 256 experts (8 a rank), 8 SMs (Hybrid-EP's multi-node default).
    t_hyb, plan = hybridep_time(32, 8, "dispatch_fwd", 8, 450, "hopper", experts=256)
    t_a2a = alltoall_dispatch_time(32)
    assert plan.rdma_bytes() > 0
    assert t_hyb == pytest.approx(3064e-6, rel=0.15)
    assert t_a2a == pytest.approx(8059e-6, rel=0.15)
    # Simulated 3,433 and 7,440 us: the ratio 2.17 against 2.63 measured (-18%), the
    # deduplication (a token once per destination node, 2.7 node copies against the
    # alltoall's 6 cross-node copies) carrying it.
    assert 2.0 < t_a2a / t_hyb < 8059 / 3064


# H100, one 400 Gb/s NIC and NVLink 4 (450 GB/s raw) a GPU, 8 local experts, 8 SMs (the
# multi-domain default), kernel time; GB/s = tokens x distinct destination nodes (own node
# included, tests/utils.py count_rdma_send_from_routing_map) x hidden x 2 over the time.
H100_8SM = {16: (76.80, 68.00), 32: (54.50, 56.40), 64: (50.55, 51.03)}


def h100_gbps(ranks: int, which: str, sms: int = 8) -> float:
    t, plan = hybridep_time(ranks, 8, which, sms, 450, "hopper")
    return plan.layout.expected_nodes() * TOKENS * HIDDEN * 2.0 / t / 1e9


@pytest.mark.parametrize("ranks", [32, 64])
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_h100_network_bound_rows_within_15_percent(ranks, i, which) -> None:
    # Not fitted: the network bounds them (simulated 61.8 / 62.9 and 53.1 / 54.1).
    assert h100_gbps(ranks, which) == pytest.approx(H100_8SM[ranks][i], rel=0.15)


@pytest.mark.xfail(strict=True, reason="simulated 92 / 93 GB/s against 77 / 68 measured: "
                   "at EP 16 (two nodes) the forwarding leg moved less than the NIC and "
                   "Hybrid-EP's NVLink share allow; not explained")
def test_h100_ep16_within_15_percent() -> None:
    for i, which in enumerate(("dispatch_fwd", "combine_fwd")):
        assert h100_gbps(16, which) == pytest.approx(H100_8SM[16][i], rel=0.15)
