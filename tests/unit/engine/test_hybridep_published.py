"""Hybrid-EP's transfers on the fabric (:mod:`sim.frameworks.megatron.moe_hybridep`,
:mod:`sim.fabric.collectives.hybridep_kernel`) against published measurements.

* deepseek-ai/DeepEP branch ``hybrid-ep``, ``docs/README_Hybrid-EP.md`` "Performance
  Results", GB200: 4096 tokens a rank, hidden 7168, top-8, 8 local experts, uniform routing,
  BF16 dispatch, kernel time; GB/s = the bytes a rank receives (its own share included,
  ``tests/test_hybrid_ep.py`` ``nvl_recv_bytes``) over the kernel's time. The 8-rank row is
  what :mod:`~sim.fabric.collectives.hybridep_kernel` is fitted on; 16 to 36 ranks in one
  NVL72 domain are checked, not fitted.
* The same table on H100 (EP 16 to 64 over 400 Gb/s NICs;
  ``sim/catalog/reference/hybridep_benchmark.yaml``): the rows
  :data:`~sim.fabric.collectives.hybridep_kernel.INTERNODE_CALL_S` is fitted on (a fixed
  0.37 ms a call across nodes; without it the simulation was 5-37% fast there).
* The Megatron Core MoE report (arXiv 2603.07685, Table 7): on H100 at EP 32 (four nodes,
  hidden 7168) HybridEP's dispatch took 3,064 us against the alltoall dispatcher's 8,059.
  The table's token count and routing are not restated here; assumed: Hybrid-EP's own
  benchmark setting (4096 tokens a rank, top-8 of 256 experts, uniform, BF16). Under that
  assumption the 3,064 us is less than the NICs alone need (the simulation's flows without
  any fixed time: 3,433 us), and 21% less than the README's own EP 32 row (3,894 us): the
  report's setting moved fewer bytes than assumed, so its rows are kept as strict xfails.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from sim.fabric.collectives import hybridep_kernel
from sim.frameworks.megatron.moe_hybridep import HybridEPPlan
from sim.program.ir import Op

# The harness the fit tool runs the benchmark with (tools/fit_hybridep_internode.py): one home
# for how a row is simulated, shared by the tool and these checks.
_TOOL = Path(__file__).resolve().parents[3] / "tools" / "fit_hybridep_internode.py"
_spec = importlib.util.spec_from_file_location("fit_hybridep_internode", _TOOL)
assert _spec is not None and _spec.loader is not None
hb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = hb
_spec.loader.exec_module(hb)

REF = hb.reference()
TOKENS, HIDDEN, TOPK = REF["tokens"], REF["hidden"], REF["topk"]

# GB200, 32 SMs, kernel only, BF16 dispatch / combine (GB/s), ranks in one NVLink domain.
GB200_32SM = {8: (764.03, 737.13), 16: (706.95, 666.26), 24: (665.97, 639.80),
              32: (642.23, 605.15), 36: (632.31, 596.99)}


def _run(ops: list[Op], n: int, nodes: int, per_node: int, nvlink: float, arch: str,
         nics: int = 0) -> float:
    return hb.run_alone(ops, n, nodes, per_node, nvlink, arch, nics)


def hybridep_time(ranks: int, domain: int, which: str, sms: int, nvlink: float, arch: str,
                  experts: int | None = None) -> tuple[float, HybridEPPlan]:
    plan = hb.plan_of(ranks, domain, sms, experts)
    return hb.call_time(plan, which, nvlink, arch), plan


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


@pytest.mark.xfail(strict=True, reason="under the assumed setting the report's 3,064 us is "
                   "below the NICs' own time (3,433 us without any fixed cost) and 21% below "
                   "Hybrid-EP's README row at EP 32; with the README-fitted fixed 0.37 ms a "
                   "call the simulation gives about 3,800 us (module docstring)")
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
# multi-domain default), kernel time: the rows INTERNODE_CALL_S is fitted on.
H100_ROWS = [(r, w) for r in sorted(REF["h100"]) for w in hb.WHICH]


@pytest.mark.parametrize(("ranks", "which"), H100_ROWS)
def test_h100_rows_within_9_percent(ranks, which) -> None:
    # The fit's own rows (a check of the fit, not of the model): -5.8% to +8.1% with it.
    t, measured = hb.benchmark_times(ranks, which)
    assert t == pytest.approx(measured, rel=0.09)


def test_the_fixed_time_is_the_rows_mean_offset() -> None:
    # Pins the constant to its data: the mean of measured minus simulated-without-it over the
    # six rows, rounded to 10 us (tools/fit_hybridep_internode.py).
    saved = hybridep_kernel.INTERNODE_CALL_S
    hybridep_kernel.INTERNODE_CALL_S = 0.0
    try:
        gaps = [m - t for t, m in (hb.benchmark_times(r, w) for r, w in H100_ROWS)]
    finally:
        hybridep_kernel.INTERNODE_CALL_S = saved
    assert saved == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    # A constant, not a factor: the gaps spread less (relative to their mean) than the ratios
    # measured / simulated would need to (1.05 to 1.37).
    assert max(gaps) - min(gaps) < 0.7 * (sum(gaps) / len(gaps))


def _without_fixed_time(ranks: int, domain: int, sms: int, nvlink: float, arch: str
                        ) -> tuple[float, float]:
    """(time as priced, time with INTERNODE_CALL_S set to 0) of one dispatch."""
    with_it, _ = hybridep_time(ranks, domain, "dispatch_fwd", sms, nvlink, arch)
    saved = hybridep_kernel.INTERNODE_CALL_S
    hybridep_kernel.INTERNODE_CALL_S = 0.0
    try:
        without, _ = hybridep_time(ranks, domain, "dispatch_fwd", sms, nvlink, arch)
    finally:
        hybridep_kernel.INTERNODE_CALL_S = saved
    return with_it, without


def test_one_nvlink_domain_pays_no_fixed_time() -> None:
    # GB200 NVL72: 16 ranks in one domain, no RDMA leg, no fixed time; two H100 nodes pay it
    # once a call, on top of the same flows.
    with_it, without = _without_fixed_time(16, 16, 32, 900, "blackwell")
    assert with_it == without
    with_it, without = _without_fixed_time(16, 8, 8, 450, "hopper")
    assert with_it - without == pytest.approx(hybridep_kernel.INTERNODE_CALL_S, rel=1e-6)
