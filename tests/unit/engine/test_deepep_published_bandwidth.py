"""The flex dispatcher's transfers on the fabric against DeepEP's published normal-kernel
bandwidths (deepseek-ai/DeepEP ``docs/legacy.md``, "Normal kernels with NVLink and RDMA
forwarding": H800, ~160 GB/s NVLink, one CX7 400 Gb/s NIC a GPU; 4096 tokens a rank, hidden
7168, 256 experts, top-8, top-4 groups (one group a node, ``min(nodes, 4)`` of them,
``tests/legacy/test_internode.py``), FP8 dispatch, BF16 combine).

DeepEP reports *logical* bandwidth: ``tokens x distinct nodes (own node included) x hidden x
bytes`` over the kernel's time internode (``num_rdma_token_sent``), the received tokens' bytes
intranode (``recv_x``). Measured (dispatch / combine, GB/s): EP8 153 / 158 (NVLink), EP16
43 / 43, EP32 58 / 57, EP64 51 / 50 (RDMA).

DeepEP's kernels copy with their own SMs (``Buffer.set_num_sms``; 24 in DeepEP's tests): a
GPU's NVLink sends are bounded by its sending SMs and by the share of NVLink their stores
reach (:mod:`sim.fabric.collectives.fused_kernel`), fitted on the EP8 row (H800, the links
bind) and on H20's EP8 run (DeepEP issue 16, the SMs bind). Checked, not fitted: EP16 (the
forwarders' NVLink leg) and, where the network bounds the transfer, EP32 and EP64, all
within the issue's 15%.
"""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.fabric.collectives import alltoall, fused_kernel
from sim.fabric.topology import FabricSpec, build_fabric
from sim.frameworks.megatron.moe_flex import FlexLayout, FlexPlan, dispatch_elem_bytes
from sim.program.ir import Op, Program, RankClass

TOKENS, HIDDEN = 4096, 7168
MEASURED = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}


def logical_gbps(ep: int, which: str, tokens_per_rank: int = TOKENS, nvlink: float = 200,
                 arch: str = "hopper", sms: int = 24) -> float:
    nodes = ep // 8
    groups = (nodes, min(nodes, 4)) if nodes > 1 else (1, 1)
    lay = FlexLayout(tuple(range(ep)), 8, 256, 8, ep, 1, *groups)
    fp8 = which == "dispatch_fwd"
    plan = FlexPlan(lay, float(tokens_per_rank), HIDDEN, fp8)
    fab = build_fabric(FabricSpec(nodes=nodes, gpus_per_node=8, nvlink_gbytes_per_s=nvlink,
                                  pcie_gbytes_per_s=63, nics_per_node=8 if nodes > 1 else 0,
                                  nic_gbps=400))
    cls = RankClass(0, tuple(range(ep)))
    p = Program([cls], ep, 0, 0, 0)
    p.add(cls, Op(name=which, kind="collective", stream="comm", phase="comm",
                  collective="all_to_all", group=tuple(range(ep)), nbytes=plan.nbytes(which),
                  peer_bytes=plan.peer_bytes(which), key="a2a", sm_ctas=sms))
    t = Engine(fab, arch).run_step(p)
    elem = HIDDEN * dispatch_elem_bytes(fp8)
    tokens = (lay.expected_nodes() if nodes > 1
              else sum(lay.hit((r,)) for r in range(ep))) * tokens_per_rank
    return tokens * elem / t / 1e9


@pytest.mark.parametrize("ep", [32, 64])
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_network_bound_transfers_are_within_15_percent(ep, i, which) -> None:
    assert logical_gbps(ep, which) == pytest.approx(MEASURED[ep][i], rel=0.15)


def test_fitted_rows_intranode_ep8() -> None:
    # The rows sim.fabric.collectives.fused_kernel is fitted on (8 ranks, 24 SMs): H800
    # (docs/legacy.md, the links bound it) and H20 (DeepEP issue 16, 337.35 GB/s logical,
    # the SMs bound it). This pins the fits, it does not validate them.
    for i, which in enumerate(("dispatch_fwd", "combine_fwd")):
        assert logical_gbps(8, which) == pytest.approx(MEASURED[8][i], rel=0.05)
        assert logical_gbps(8, which, nvlink=450) == pytest.approx(337.35, rel=0.05)


@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_ep16_nvlink_forwarding_within_15_percent(i, which) -> None:
    # Not fitted: two nodes, where the forwarders' NVLink leg at DeepEP's share of NVLink
    # bounds the internode kernel (simulated 46 / 47 GB/s; 56 / 57 at NCCL's share).
    assert logical_gbps(16, which) == pytest.approx(MEASURED[16][i], rel=0.15)


def test_bandwidth_rises_with_the_sm_budget_and_saturates_at_the_link(monkeypatch) -> None:
    # H20's NVLink (450 GB/s raw), EP 8: below the links each channel (two SMs) adds one
    # sending SM's rate (closed form: the logical bytes are 8/7 of those crossing NVLink, a
    # rank's own eighth staying on the GPU); with enough SMs DeepEP's share of the links
    # bounds it: NCCL's flows' rate (no SM bound, sm_ctas 0; without NCCL's own all-to-all
    # call time, alltoall.P2P_NVLINK_CALL_S) times fused_kernel.nvlink_share.
    with monkeypatch.context() as m:
        m.setattr(alltoall, "P2P_NVLINK_CALL_S", 0.0)
        nccl_rate = logical_gbps(8, "dispatch_fwd", nvlink=450, sms=0)
    link = nccl_rate * fused_kernel.nvlink_share(24, "hopper")
    prev = 0.0
    for sms in (4, 8, 12, 16, 20, 24, 32, 48, 64, 96, 128):
        bw = logical_gbps(8, "dispatch_fwd", nvlink=450, sms=sms)
        assert bw >= prev
        prev = bw
        closed = fused_kernel.nvlink_send_rate(sms) * 8 / 7 / 1e9
        assert bw == pytest.approx(min(closed, link), rel=0.04)
    assert logical_gbps(8, "dispatch_fwd", nvlink=450, sms=8) < 0.4 * link
    assert logical_gbps(8, "dispatch_fwd", nvlink=450, sms=128) < nccl_rate


def intranode_gbps(ranks: int, which: str, nvlink: float, arch: str, sms: int) -> float:
    """tests/legacy/test_intranode.py's logical GB/s (received bytes, own share included)
    on ``ranks`` GPUs of one node: 4096 tokens, hidden 7168, 256 experts, top-8, BF16."""
    lay = FlexLayout(tuple(range(ranks)), ranks, 256, 8, ranks, 1)
    plan = FlexPlan(lay, float(TOKENS), HIDDEN, False)
    fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=ranks, nvlink_gbytes_per_s=nvlink,
                                  pcie_gbytes_per_s=63, nics_per_node=0, nic_gbps=400))
    cls = RankClass(0, tuple(range(ranks)))
    p = Program([cls], ranks, 0, 0, 0)
    p.add(cls, Op(name=which, kind="collective", stream="comm", phase="comm",
                  collective="all_to_all", group=tuple(range(ranks)), nbytes=plan.nbytes(which),
                  peer_bytes=plan.peer_bytes(which), key="a2a", sm_ctas=sms))
    t = Engine(fab, arch).run_step(p)
    return sum(lay.hit((r,)) for r in range(ranks)) * TOKENS * HIDDEN * 2.0 / t / 1e9


@pytest.mark.xfail(strict=True, reason="simulated 383 GB/s against 169 measured: the V1 "
                   "intranode kernel on one GB200 host moved 2.3x less than its SMs and "
                   "links allow on Hopper; not explained (MNNVL latency per SM?)")
def test_gb200_single_host_dispatch_within_15_percent() -> None:
    # Not fitted: DeepEP issue 394 ("Unable to saturate NVL BW w/ intranode on GB200",
    # 2025-09-05): the V1 intranode kernel on one GB200 host (4 GPUs, NVLink 5), best
    # config "SMs 24, NVL chunk 16": dispatch 169 GB/s (combine 135).
    assert intranode_gbps(4, "dispatch_fwd", 900, "blackwell", 24) == pytest.approx(
        169.0, rel=0.15)


# DeepEP V2 on SM100 in one node (README.md "Performance", sim/catalog/reference/
# moe_components.yaml deepep_v2): 8K tokens a rank, hidden 7168, top-8, FP8 dispatch, BF16
# combine over NVLink 5 (B200: 900 GB/s a direction); logical GB/s dispatch / combine:
# 726 / 740 with 64 SMs ("max perf"), 643 / 675 with 24 ("min #SM"). V2's ElasticBuffer is
# not the kernel Megatron-Core's flex dispatcher runs (fused_a2a.py builds the legacy
# Buffer, the V1 kernels modelled here): "Comparing with V1, V2 achieves up to 1.3x peak
# performance, while saving up to 4x SM count" (the same README).
V2_SM100 = {64: (726.0, 740.0), 24: (643.0, 675.0)}


@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_v1_kernels_against_deepep_v2(i, which) -> None:
    for sms, measured in V2_SM100.items():
        # At V2's SM counts the V1 kernels move less than V2 did ...
        assert logical_gbps(8, which, 8192, 900, "blackwell", sms) < measured[i]
    # ... and V2's best is at most 1.3x V1's best (128 SMs: past the SMs' bound).
    best = logical_gbps(8, which, 8192, 900, "blackwell", 128)
    assert 1.0 < V2_SM100[64][i] / best <= 1.3
