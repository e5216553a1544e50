"""Megatron-Core's flex dispatcher with the HybridEP backend
(``moe_flex_dispatcher_backend: hybridep``, :mod:`sim.frameworks.megatron.moe_hybridep`).

Independent truths: the balanced-routing closed forms (a token crosses the network once per
destination NVLink domain, ``P(domain hit) = 1 - C(E - E/N, k) / C(E, k)``, and goes once to
each rank of a domain that holds one of its experts); Hybrid-EP's record (the 16-bit row and
the fp32 probabilities of the experts it may reach, ``Hybrid-EP_Implementation.md`` 4.2);
Megatron-Core's refusals (``fused_a2a.init_hybrid_ep_buffer``: no FP8 dispatch) and
Megatron-Bridge's NVLink domains (``perf_plugins._set_nvl_domain_size``: 8 on H100, the
whole EP group up to 72 on GB200 NVL72).
"""

from __future__ import annotations

import math

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.moe_hybridep import persistent_buffer_bytes
from sim.scenario import ScenarioError

MOE = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
       "vocab": 32000, "experts": 32, "experts_per_token": 4, "moe_ffn_hidden": 512}
H, K, E, SEQ = 1024, 4, 32, 1024


def _scn(nodes: int, ep: int, gpn: int = 8, precision: str = "bf16", **fw: object):
    fw = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
          **fw}
    return megatron_scenario({"tp": 1, "ep": ep}, nodes * gpn, model=MOE, seq=SEQ,
                             nodes=nodes, gpn=gpn, precision=precision,
                             framework={"name": "megatron", **fw})


def _a2a(s, which: str):
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    return [op for c in p.classes for ops in c.streams.values() for op in ops
            if op.collective == "all_to_all" and op.name.endswith(which.replace("_", " "))]


@pytest.mark.parametrize("nodes", [2, 4])
def test_dispatch_crosses_the_network_once_per_destination_domain(nodes) -> None:
    ep = 8 * nodes
    ops = _a2a(_scn(nodes, ep), "dispatch_fwd")
    assert ops
    local = E // ep
    nvl_rec, rdma_rec = H * 2 + 4 * local, H * 2 + 4 * local * 8
    p_node = 1 - math.comb(E - E // nodes, K) / math.comb(E, K)
    p_rank = 1 - math.comb(E - local, K) / math.comb(E, K)
    for op in ops:
        row = op.peer_bytes[0]
        assert sum(row[8:]) == pytest.approx(SEQ * (nodes - 1) * p_node * rdma_rec, rel=1e-12)
        assert [j for j in range(8, ep) if row[j]] == list(range(8, ep, 8))   # same rail
        assert sum(row[1:8]) == pytest.approx(7 * nodes * SEQ * p_rank * nvl_rec, rel=1e-12)
        assert op.fused_kernel == "hybridep" and op.sm_ctas == 8   # multi-domain default
        assert op.dtype == "bf16"
    # The combine sends rows only, the same flows backwards.
    comb = _a2a(_scn(nodes, ep), "combine_fwd")[0].peer_bytes
    assert comb[8][0] == pytest.approx(SEQ * p_node * H * 2, rel=1e-12)


def test_one_nvl72_domain_sends_everything_over_nvlink_once_per_rank() -> None:
    # A 32-GPU NVLink domain (GB200 NVL72 style: gpus_per_node is the domain): EP 32 is
    # one Hybrid-EP domain, no RDMA, 24 SMs (one-domain default); DeepEP refuses it.
    s = _scn(1, 32, gpn=32)
    op = _a2a(s, "dispatch_fwd")[0]
    p_rank = 1 - math.comb(E - 1, K) / math.comb(E, K)
    assert sum(op.peer_bytes[0][1:]) == pytest.approx(31 * SEQ * p_rank * (H * 2 + 4),
                                                      rel=1e-12)
    assert op.sm_ctas == 24
    r = simulate(s).summary["bytes"]
    assert r["network"] == 0 or r["network"] < 1e6      # the gradients stay in the domain
    with pytest.raises(ScenarioError, match="parallelism.ep"):
        _a2a(_scn(1, 32, gpn=32, moe_flex_dispatcher_backend="deepep"), "dispatch_fwd")


def test_hybridep_moves_deepeps_tokens_far_below_alltoall() -> None:
    # The same tokens cross the network as with DeepEP (once per destination node); the
    # records differ by a few bytes (the domain's fp32 probs against DeepEP's SourceMeta,
    # indices and weights), so the totals agree within 1%.
    hyb = _scn(2, 16)
    a2a = _scn(2, 16, moe_token_dispatcher_type="alltoall")
    deepep = _scn(2, 16, moe_flex_dispatcher_backend="deepep")
    net = [simulate(s).summary["bytes"]["network"] for s in (hyb, deepep, a2a)]
    assert net[0] == pytest.approx(net[1], rel=0.01)
    assert net[0] < net[2]     # with the gradient traffic both share


def test_sms_and_buffer() -> None:
    s = _scn(2, 16, moe_flex_dispatcher_num_sms=32)   # Megatron-Bridge's perf scripts
    assert {op.sm_ctas for op in _a2a(s, "dispatch_fwd")} == {32}
    # The shared worst-case buffer: 16 x max(1024, 512) rows and probs, one RDMA domain.
    want = 16 * SEQ * (H * 2 + 4 * 2 * 8) + SEQ * (H * 2 + 4 * 2 * 8)
    assert persistent_buffer_bytes(16, 8, SEQ, H, 2) == want


@pytest.mark.parametrize("kw, key", [
    ({"moe_deepep_fp8_dispatch": True}, "framework.moe_deepep_fp8_dispatch"),
    ({"moe_flex_dispatcher_num_sms": 999}, "framework.moe_flex_dispatcher_num_sms"),
])
def test_hybridep_refuses_what_megatron_refuses(kw, key) -> None:
    with pytest.raises(ScenarioError, match=key) as err:
        _a2a(_scn(2, 16, precision="fp8", **kw), "dispatch_fwd")
    assert "\n" not in str(err.value)


def test_bad_backend_is_refused() -> None:
    with pytest.raises(Exception, match="moe_flex_dispatcher_backend"):
        _scn(2, 16, moe_flex_dispatcher_backend="nccl")


def test_metadata_preprocess_gathers_the_routing_map() -> None:
    # Hybrid-EP's metadata_preprocess all-gathers each rank's [tokens, experts] bool routing
    # map over the group (Hybrid-EP_Implementation.md: "Allgather + metadata kernel"); the
    # alltoall dispatcher gathers one int64 count per expert.
    def gather(s):
        p = build_program(JobContext.from_scenario(s, "s.yaml"))
        return [op for c in p.classes for ops in c.streams.values() for op in ops
                if op.name.endswith("token count all_gather")]
    hyb, a2a = gather(_scn(2, 16)), gather(_scn(2, 16, moe_token_dispatcher_type="alltoall"))
    assert hyb and a2a
    assert {op.nbytes for op in hyb} == {SEQ * E * 16}
    assert {op.nbytes for op in a2a} == {E * 8 * 16}
    assert all(op.host_sync for op in hyb)
