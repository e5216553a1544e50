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


def logical_gbps(ep: int, which: str) -> float:
    nodes = ep // 8
    groups = (nodes, min(nodes, 4)) if nodes > 1 else (1, 1)
    lay = FlexLayout(tuple(range(ep)), 8, 256, 8, ep, 1, *groups)
    fp8 = which == "dispatch_fwd"
    plan = FlexPlan(lay, float(TOKENS), HIDDEN, fp8)
    fab = build_fabric(FabricSpec(nodes=nodes, gpus_per_node=8, nvlink_gbytes_per_s=200,
                                  pcie_gbytes_per_s=63, nics_per_node=8 if nodes > 1 else 0,
                                  nic_gbps=400))
    cls = RankClass(0, tuple(range(ep)))
    p = Program([cls], ep, 0, 0, 0)
    p.add(cls, Op(name=which, kind="collective", stream="comm", phase="comm",
                  collective="all_to_all", group=tuple(range(ep)), nbytes=plan.nbytes(which),
                  peer_bytes=plan.peer_bytes(which), key="a2a"))
    t = Engine(fab, "hopper").run_step(p)
    elem = HIDDEN * dispatch_elem_bytes(fp8)
    tokens = (lay.expected_nodes() if nodes > 1
              else sum(lay.hit((r,)) for r in range(ep))) * TOKENS
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
