"""The flex dispatcher's transfers on the fabric against DeepEP's published normal-kernel
bandwidths (deepseek-ai/DeepEP ``docs/legacy.md``, "Normal kernels with NVLink and RDMA
forwarding": H800, ~160 GB/s NVLink, one CX7 400 Gb/s NIC a GPU; 4096 tokens a rank, hidden
7168, 256 experts, top-8, top-4 groups (one group a node, ``min(nodes, 4)`` of them,
``tests/legacy/test_internode.py``), FP8 dispatch, BF16 combine).

DeepEP reports *logical* bandwidth: ``tokens x distinct nodes (own node included) x hidden x
bytes`` over the kernel's time internode (``num_rdma_token_sent``), the received tokens' bytes
intranode (``recv_x``). Measured (dispatch / combine, GB/s): EP8 153 / 158 (NVLink), EP16
43 / 43, EP32 58 / 57, EP64 51 / 50 (RDMA).

Nothing here is fitted to them. Where the network bounds the transfer (EP32, EP64) the model
is within the issue's 15%. Where NVLink forwarding bounds it (EP8, EP16) the model is faster:
its NVLink runs at NCCL's ring efficiency (``nccl.NVLINK_EFFICIENCY``), which DeepEP's 20-24
forwarding SMs do not reach (153 GB/s logical of ~183 in one node); the test pins that gap
so that a change to it is seen.
"""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.fabric.topology import FabricSpec, build_fabric
from sim.frameworks.megatron.moe_flex import FlexLayout, FlexPlan, dispatch_elem_bytes
from sim.program.ir import Op, Program, RankClass

TOKENS, HIDDEN = 4096, 7168
MEASURED = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}


def logical_gbps(ep: int, which: str, tokens_per_rank: int = TOKENS, nvlink: float = 200,
                 arch: str = "hopper") -> float:
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
                  peer_bytes=plan.peer_bytes(which), key="a2a"))
    t = Engine(fab, arch).run_step(p)
    elem = HIDDEN * dispatch_elem_bytes(fp8)
    tokens = (lay.expected_nodes() if nodes > 1
              else sum(lay.hit((r,)) for r in range(ep))) * tokens_per_rank
    return tokens * elem / t / 1e9


@pytest.mark.parametrize("ep", [32, 64])
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_network_bound_transfers_are_within_15_percent(ep, i, which) -> None:
    assert logical_gbps(ep, which) == pytest.approx(MEASURED[ep][i], rel=0.15)


@pytest.mark.parametrize("ep", [8, 16])
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_nvlink_bound_transfers_are_faster_than_deepep_by_under_35_percent(ep, i, which
                                                                          ) -> None:
    ratio = logical_gbps(ep, which) / MEASURED[ep][i]
    assert 1.0 < ratio < 1.35


# DeepEP V2 on SM100 in one node (README.md "Performance", sim/catalog/reference/
# moe_components.yaml deepep_v2): 8K tokens a rank, hidden 7168, top-8, FP8 dispatch, BF16
# combine over NVLink 5 (B200: 900 GB/s a direction); logical GB/s dispatch / combine:
# 726 / 740 with 64 SMs ("max perf"), 643 / 675 with 24 ("min #SM").
V2_SM100 = {64: (726.0, 740.0), 24: (643.0, 675.0)}


@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_deepep_v2_b200_nvlink_within_15_percent_of_its_best(i, which) -> None:
    # The model has no SM budget for DeepEP: it should reach about DeepEP's best.
    sim = logical_gbps(8, which, 8192, 900, "blackwell")
    assert sim == pytest.approx(V2_SM100[64][i], rel=0.15)


@pytest.mark.xfail(strict=True, reason="simulated 792 / 812 GB/s against 643 / 675 measured "
                   "with 24 SMs (+23% / +20%): no SM budget for DeepEP, and Megatron-Core's "
                   "moe_deepep_num_sms default of 20 runs it with fewer than 24")
@pytest.mark.parametrize("i, which", [(0, "dispatch_fwd"), (1, "combine_fwd")])
def test_deepep_v2_b200_nvlink_at_a_training_sm_budget(i, which) -> None:
    sim = logical_gbps(8, which, 8192, 900, "blackwell")
    assert sim == pytest.approx(V2_SM100[24][i], rel=0.15)
