"""Megatron-Core's ``flex`` token dispatcher with DeepEP (issue 14 item 2): deduplicated
per-node RDMA, NVLink forwarding, group-limited routing, FP8 dispatch, the kernels' SMs.

Independent truths: brute-force enumeration of every routing choice (the closed form of
:func:`miss_probability` must match it exactly); DeepEP's wire format
(``csrc/kernels/legacy/internode.cu`` ``get_num_bytes_per_token``: the row, two ints of
``SourceMeta``, int32 indices and fp32 weights, 16-byte aligned; FP8: 1 byte an element plus
one fp32 scale per 128); the issue's closed form for the ``alltoall`` dispatcher
(``tokens x top_k x hidden x 2`` sent per rank per transfer), which a token deduplicated per
node can only undercut (``P(node hit) <= E[experts on the node] = top_k / nodes``);
Megatron-Core's ``TransformerConfig`` and ``MoEFlexTokenDispatcher`` refusals.
"""

from __future__ import annotations

import itertools
import math

import pytest
from helpers import fabricsim_in_process, megatron_scenario

from sim.api import simulate
from sim.config.training import Routing
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.moe_flex import (
    FlexLayout,
    dispatch_elem_bytes,
    miss_probability,
    persistent_buffer_bytes,
    token_bytes,
)
from sim.scenario import ScenarioError

# 4 layers, 32 experts of width 512, top-4: small enough to simulate on 16 to 32 GPUs.
MOE = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
       "vocab": 32000, "experts": 32, "experts_per_token": 4, "moe_ffn_hidden": 512}
H, K, E, SEQ = 1024, 4, 32, 1024


def _scn(nodes: int, ep: int, precision: str = "bf16", routing: dict | None = None,
         model: dict | None = None, gpn: int = 8, **fw: object):
    par = {"tp": 1, "ep": ep}
    s = megatron_scenario(par, 8 * nodes * gpn // 8, model=model or MOE, seq=SEQ,
                          nodes=nodes, gpn=gpn, precision=precision,
                          framework={"name": "megatron", **fw})
    if routing is not None:
        tr = s.training.model_copy(update={"routing": Routing(**routing)})
        s = s.model_copy(update={"training": tr})
    return s


def _ops(s):
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    return [op for c in p.classes for ops in c.streams.values() for op in ops]


def _a2a(s, which: str):
    return [op for op in _ops(s) if op.collective == "all_to_all"
            and op.name.endswith(which.replace("_", " "))]


# ---------------------------------------------------------------------- closed forms
def _brute_miss(experts: int, k: int, members: set[int], groups: int, m: int) -> float:
    """Enumerate every group choice and every top-k inside it (uniform): the share that
    picks none of ``members``."""
    size = experts // groups
    miss = total = 0
    for gs in itertools.combinations(range(groups), m):
        pool = [e for g in gs for e in range(g * size, (g + 1) * size)]
        for pick in itertools.combinations(pool, k):
            total += 1
            miss += not members.intersection(pick)
    return miss / total


@pytest.mark.parametrize("experts, k, members, groups, m", [
    (8, 2, {0}, 1, 1), (12, 3, {0, 1, 2}, 1, 1), (12, 4, {0, 1, 2, 3}, 4, 2),
    (12, 2, {2, 3, 4}, 4, 2), (16, 4, {5, 6, 7, 8, 9}, 4, 3), (16, 3, {0, 15}, 8, 2)])
def test_miss_probability_matches_enumeration(experts, k, members, groups, m) -> None:
    got = miss_probability(experts, k, tuple(sorted(members)), groups, m)
    assert got == pytest.approx(_brute_miss(experts, k, members, groups, m), abs=1e-12)


def test_token_record_is_deepeps_and_fp8_is_1_plus_4_over_128_of_two_bytes() -> None:
    # get_num_bytes_per_token: row + SourceMeta (8) + k int32 + k fp32, aligned to 16.
    def align(x: int) -> int:
        return -(-x // 16) * 16
    assert token_bytes(7168, 8, 2.0) == align(7168 * 2 + 8 + 32 + 32) == 14416
    assert token_bytes(7168, 8, dispatch_elem_bytes(True)) == align(7168 + 7168 // 128 * 4 + 72)
    # The row alone: FP8 dispatch moves (1 + 4/128) / 2 of the bf16 bytes.
    r = (token_bytes(7168, 8, dispatch_elem_bytes(True), weights=False, meta=False)
         / token_bytes(7168, 8, 2.0, weights=False, meta=False))
    assert r == (1 + 4 / 128) / 2


# ---------------------------------------------------------------------- the program's bytes
@pytest.mark.parametrize("nodes", [2, 4])
def test_dispatch_rdma_bytes_are_tokens_times_distinct_remote_nodes(nodes) -> None:
    ep = 8 * nodes
    s = _scn(nodes, ep, moe_token_dispatcher_type="flex")
    ops = _a2a(s, "dispatch_fwd")
    assert ops and {len(op.all_groups[0]) for op in ops} == {ep}
    rec = token_bytes(H, K, 2.0)
    # Balanced top-4 of 32 experts, E/nodes on each node: P(node hit) = 1 - C(E - E/N, k)/C(E, k).
    p_node = 1 - math.comb(E - E // nodes, K) / math.comb(E, K)
    rdma = SEQ * (nodes - 1) * p_node * rec
    p_rank = 1 - math.comb(E - E // ep, K) / math.comb(E, K)
    nvl = 7 * nodes * SEQ * p_rank * rec      # forwarded to the 7 other GPUs of the node
    for op in ops:
        row = op.peer_bytes[0]
        assert sum(row[8:]) == pytest.approx(rdma, rel=1e-12)
        # Only the same-rail GPU of each other node gets RDMA bytes (no PXN hop).
        assert [j for j in range(8, ep) if row[j]] == list(range(8, ep, 8))
        assert sum(row[1:8]) == pytest.approx(nvl, rel=1e-12)
        assert op.nbytes == pytest.approx(sum(row), rel=1e-12)
        assert op.sm_ctas == 20
    # The combine runs the same flows backwards.
    comb = _a2a(s, "combine_fwd")[0].peer_bytes
    back = token_bytes(H, K, 2.0, weights=False, meta=False)
    assert comb[8][0] == pytest.approx(SEQ * p_node * back, rel=1e-12)
    assert not [op for op in _ops(s) if "probs" in op.name or " etp " in op.name]


def test_flex_crosses_the_network_less_than_alltoall_whose_bytes_stay_the_closed_form() -> None:
    a2a = _scn(2, 16)
    for op in _a2a(a2a, "dispatch_fwd"):     # alltoall: tokens x top-k x hidden x 2
        assert op.nbytes == SEQ * K * H * 2 and not op.sm_ctas
    flex = _scn(2, 16, moe_token_dispatcher_type="flex")
    net = [simulate(s).summary["bytes"]["network"] for s in (a2a, flex)]
    assert 0 < net[1] < net[0]
    # Per dispatch: at most one copy per remote node, versus top-k x (N - 1)/N copies.
    row = _a2a(flex, "dispatch_fwd")[0].peer_bytes[0]
    assert sum(row[8:]) / token_bytes(H, K, 2.0) <= SEQ * K * 8 / 16


def test_node_limited_routing_caps_the_nodes_a_token_reaches() -> None:
    # 4 nodes, 4 expert groups (one a node), 2 groups a token: at most 2 nodes, and exactly
    # 2 x P(at least one of the token's 4 experts on a chosen node) = 2 x (1 - C(8,4)/C(16,4)).
    lay = FlexLayout(tuple(range(32)), 8, E, K, 32, 1, 4, 2)
    assert lay.expected_nodes() == pytest.approx(
        2 * (1 - math.comb(8, 4) / math.comb(16, 4)), rel=1e-12)
    assert lay.expected_nodes() <= 2 < FlexLayout(tuple(range(32)), 8, E, K, 32, 1
                                                  ).expected_nodes()
    free = _a2a(_scn(4, 32, moe_token_dispatcher_type="flex"), "dispatch_fwd")[0]
    lim = _a2a(_scn(4, 32, moe_token_dispatcher_type="flex", moe_router_num_groups=4,
                    moe_router_group_topk=2), "dispatch_fwd")[0]
    assert sum(lim.peer_bytes[0][8:]) < sum(free.peer_bytes[0][8:])


def test_group_limited_routing_leaves_alltoall_bytes_alone() -> None:
    """The alltoall dispatcher sends one copy per chosen expert wherever it is: limiting the
    groups changes nothing there (balanced routing), but Megatron validates the options."""
    base = [op.nbytes for op in _a2a(_scn(4, 32), "dispatch_fwd")]
    lim = [op.nbytes for op in _a2a(_scn(4, 32, moe_router_num_groups=4,
                                         moe_router_group_topk=2), "dispatch_fwd")]
    assert base == lim and base
    with pytest.raises(ScenarioError, match="framework.moe_router_group_topk"):
        _ops(_scn(4, 32, moe_router_num_groups=4, moe_router_group_topk=5))


def test_fp8_dispatch_shrinks_the_dispatch_not_the_combine() -> None:
    bf = _scn(2, 16, precision="fp8", moe_token_dispatcher_type="flex")
    f8 = _scn(2, 16, precision="fp8", moe_token_dispatcher_type="flex",
              moe_deepep_fp8_dispatch=True)
    ratio = token_bytes(H, K, 1 + 4 / 128) / token_bytes(H, K, 2.0)
    # The combine's backward dispatches with the cached handle: row and SourceMeta only.
    cached = token_bytes(H, 0, 1 + 4 / 128) / token_bytes(H, 0, 2.0)
    assert cached == math.ceil((H * (1 + 4 / 128) + 8) / 16) / math.ceil((H * 2 + 8) / 16)
    for which, want in (("dispatch_fwd", ratio), ("combine_bwd", cached),
                        ("combine_fwd", 1.0), ("dispatch_bwd", 1.0)):
        a, b = _a2a(bf, which)[0], _a2a(f8, which)[0]
        assert b.nbytes / a.nbytes == pytest.approx(want, rel=1e-12), which
    assert simulate(f8).summary["bytes"]["network"] < simulate(bf).summary["bytes"]["network"]


def test_expert_tp_ranks_each_receive_the_tokens_of_their_experts() -> None:
    """MoEFlexTokenDispatcher: one group over expert-TP x EP, the routing map replicated over
    expert-TP (router_topk = tp x topk): both expert-TP ranks of an EP rank get its tokens,
    and there is no expert-TP gather."""
    s = megatron_scenario({"tp": 2, "ep": 8, "sequence_parallel": True}, 8, model=MOE,
                          seq=SEQ, nodes=2, framework={"name": "megatron",
                                                       "moe_token_dispatcher_type": "flex"})
    ops = _ops(s)
    op = next(o for o in ops if o.name.endswith("dispatch fwd"))
    assert len(op.all_groups[0]) == 16
    row = op.peer_bytes[0]
    tokens = SEQ // 2                              # the sequence-parallel shard
    p_slot = 1 - math.comb(E - E // 8, K) / math.comb(E, K)
    rec = token_bytes(H, 2 * K, 2.0)               # 2 x top-k indices and weights
    assert row[2] == row[3] == pytest.approx(2 * tokens * p_slot * rec, rel=1e-12)
    assert not [o for o in ops if " etp " in o.name]


def test_intranode_flex_sends_once_per_rank() -> None:
    ops = _a2a(_scn(1, 8, moe_token_dispatcher_type="flex"), "dispatch_fwd")
    p_rank = 1 - math.comb(E - E // 8, K) / math.comb(E, K)
    assert sum(ops[0].peer_bytes[0]) == pytest.approx(7 * SEQ * p_rank * token_bytes(H, K, 2.0))


def test_flex_dispatch_buffers_follow_the_closed_form() -> None:
    """One micro-batch, layers one after another: the moe_dispatch peak is the received
    tokens' records plus the restored expert rows and the combined output, all freed by the
    step's end."""
    s = _scn(2, 16, moe_token_dispatcher_type="flex")
    tr = simulate(s).recorder.memory[0]
    series = [cur.get("moe_dispatch", 0.0) for _, cur in tr.series]
    p_rank = 1 - math.comb(E - E // 16, K) / math.comb(E, K)
    recv = 16 * SEQ * p_rank                      # tokens received, once each
    fwd = recv * token_bytes(H, K, 2.0) + recv * H * 2 + SEQ * H * 2
    bwd = recv * token_bytes(H, 0, 2.0) + recv * H * 2 + SEQ * H * 2 + SEQ * K * 4
    assert max(series) == pytest.approx(max(fwd, bwd), rel=1e-9)
    assert series[-1] == 0.0


def test_deepeps_buffer_is_held_from_the_start() -> None:
    """fused_a2a.get_buffer allocates DeepEP's NVLink and RDMA buffers once per process:
    config.hpp's hints for a 16-rank group, 10 channels (20 SMs), hidden x 2 bytes a token:
    NVLink 10 x 8 x (7 x 4 + 288 x (2048 + 8 + 128 x 12 + 512)), RDMA 10 x 2 x ((8 x 2 + 2)
    x 8 + 128 x 2 x (2048 + 8 + 128 x 12 + 512 + 16)), each rounded up to 128 bytes."""
    def up(x: int) -> int:
        return -(-x // 128) * 128
    want = up(10 * 8 * (7 * 4 + 288 * (2048 + 8 + 1536 + 512))) + up(
        10 * 2 * (18 * 8 + 128 * 2 * (2048 + 8 + 1536 + 512 + 16)))
    assert persistent_buffer_bytes(16, H, 20) == want
    mem = [build_program(JobContext.from_scenario(s, "s.yaml")).classes[0].initial_memory
           for s in (_scn(2, 16), _scn(2, 16, moe_token_dispatcher_type="flex"))]
    assert mem[1].get("buffers", 0.0) - mem[0].get("buffers", 0.0) == want
    assert "no config for a 40-rank" in (FlexLayout(tuple(range(40)), 8, 40, 4, 40, 1).check()
                                         or "")


# ---------------------------------------------------------------------- SMs, determinism
def test_the_kernels_sms_slow_the_shared_experts_beside_them() -> None:
    """The shared experts' GEMMs beside the dispatch lose the SMs DeepEP holds
    (sim.hardware.interference.slowdown: sm / (sm - ctas) for tensor-core math)."""
    shared = dict(MOE, shared_experts=1)
    stretch = []
    for n in (2, 100):
        r = simulate(_scn(2, 16, model=shared, moe_token_dispatcher_type="flex",
                          moe_shared_expert_overlap=True, moe_flex_dispatcher_num_sms=n))
        recs = [x for x in r.recorder.ops if "shared experts fc" in x.op.name
                and x.op.duration > 0]
        assert recs
        stretch.append(max((x.end - x.start) / x.op.duration for x in recs))
    assert 1.0 <= stretch[0] < stretch[1] <= 132 / (132 - 100) + 1e-9


def test_flex_is_deterministic() -> None:
    s = _scn(2, 16, moe_token_dispatcher_type="flex", moe_router_num_groups=2,
             moe_router_group_topk=1)
    a, b = simulate(s).summary, simulate(s).summary
    assert a["step_time_s"] == b["step_time_s"] and a["bytes"] == b["bytes"]


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw, key", [
    ({"moe_pad_expert_input_to_capacity": True}, "framework.moe_pad_expert_input_to_capacity"),
    ({"moe_flex_dispatcher_num_sms": 21}, "framework.moe_flex_dispatcher_num_sms"),
    ({"moe_deepep_fp8_dispatch": True}, "framework.moe_deepep_fp8_dispatch"),
    ({"moe_router_group_topk": 2}, "framework.moe_router_group_topk"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1},
     "framework.moe_router_num_groups"),
])
def test_flex_refuses_what_megatron_refuses(kw, key) -> None:
    model = dict(MOE, capacity_factor=1.0) if "moe_pad_expert_input_to_capacity" in kw else None
    with pytest.raises(ScenarioError, match=key) as err:
        _ops(_scn(2, 16, model=model, moe_token_dispatcher_type="flex", **kw))
    assert "\n" not in str(err.value)


def test_flex_refuses_layouts_deepep_cannot_run() -> None:
    with pytest.raises(ScenarioError, match="expert-TP x EP > 1"):
        _ops(_scn(1, 1, moe_token_dispatcher_type="flex"))
    with pytest.raises(ScenarioError, match="parallelism.ep"):    # 16 GPUs in one node
        _ops(_scn(1, 16, gpn=16, moe_token_dispatcher_type="flex"))
    with pytest.raises(ScenarioError, match="parallelism.ep"):    # 4-GPU nodes
        _ops(_scn(4, 16, gpn=4, moe_token_dispatcher_type="flex"))
    with pytest.raises(ScenarioError, match="framework.moe_deepep_fp8_dispatch"):
        _ops(_scn(2, 16, precision="fp8", moe_deepep_fp8_dispatch=True))


def test_bad_flex_option_is_one_line_exit_2() -> None:
    # In-process through the command's entry point (tests/helpers.py); test_cli.py runs
    # `fabricsim run`'s bad input as a true subprocess.
    proc = fabricsim_in_process(
        "run", "gpt-oss-120b-megatron-tp2pp4ep16-64xh100",
        "--set", "framework.moe_token_dispatcher_type=flex",
        "--set", "framework.moe_flex_dispatcher_num_sms=7")
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "moe_flex_dispatcher_num_sms" in proc.stderr


def test_node_limited_miss_probability_when_more_groups_are_touched_than_chosen() -> None:
    # A rank set whose experts span more groups than a token chooses (HybridEP's NVL72 domain
    # under DeepSeek-V3's 4-of-8 group limit) raised in math.comb; brute force over a small
    # instance (4 groups of 2 experts, 2 groups then 2 experts chosen uniformly) is the truth.
    from sim.frameworks.megatron.moe_flex import miss_probability

    members = (0, 1, 2, 3, 4, 5)        # three groups touched, two chosen
    picks = [es for gs in itertools.combinations(range(4), 2)
             for es in itertools.combinations([e for g in gs for e in (2 * g, 2 * g + 1)], 2)]
    truth = sum(not set(es) & set(members) for es in picks) / len(picks)
    assert miss_probability(8, 2, members, 4, 2) == pytest.approx(truth)
    assert miss_probability(8, 2, tuple(range(8)), 4, 2) == 0.0


# ---------------------------------------------------------------------- round-robin routing
def _brute_round_robin(experts: int, k: int, members: set[int], tokens: int) -> float:
    """AutoModel's FakeBalancedGate token by token: ``arange(tokens * k).view(-1, k) %
    experts``; the share of tokens that pick one of ``members``."""
    return sum(bool(members & {(t * k + j) % experts for j in range(k)})
               for t in range(tokens)) / tokens


@pytest.mark.parametrize("experts, k, members", [
    (128, 8, set(range(16))), (256, 8, set(range(4))), (256, 8, set(range(32))),
    (32, 4, {5, 6, 7, 8}), (12, 8, {0, 1, 2}), (8, 2, {0})])
def test_round_robin_hit_matches_the_gate_token_by_token(experts, k, members) -> None:
    from sim.workload.routing import round_robin_hit
    period = experts // math.gcd(k, experts)
    assert round_robin_hit(experts, k, sorted(members)) == pytest.approx(
        _brute_round_robin(experts, k, members, 7 * period), abs=1e-12)


def test_round_robin_sends_each_token_to_the_one_rank_of_its_experts() -> None:
    """32 experts, top-4, EP 8 (4 experts a rank): a token's 4 consecutive experts from 4t
    are exactly one rank's, so DeepEP sends every token once, to one rank (7/8 of them
    away), where uniform routing reaches 1 - C(28, 4)/C(32, 4) of each rank. The loads are
    balanced either way: same expert GEMMs, fewer bytes, a step no slower."""
    rr = _scn(1, 8, moe_token_dispatcher_type="flex", routing={"distribution": "round_robin"})
    uni = _scn(1, 8, moe_token_dispatcher_type="flex")
    row = _a2a(rr, "dispatch_fwd")[0].peer_bytes[0]
    rec = token_bytes(H, K, 2.0)
    assert sum(row) == pytest.approx(7 * SEQ / 8 * rec, rel=1e-12)
    p_rank = 1 - math.comb(E - E // 8, K) / math.comb(E, K)
    assert sum(_a2a(uni, "dispatch_fwd")[0].peer_bytes[0]) == pytest.approx(
        7 * SEQ * p_rank * rec, rel=1e-12)
    # The alltoall dispatcher sends a copy per chosen expert: round robin changes nothing.
    a2a = [_a2a(_scn(1, 8, routing=r), "dispatch_fwd")[0].nbytes
           for r in ({"distribution": "round_robin"}, None)]
    assert a2a[0] == a2a[1] == SEQ * K * H * 2
    t = [simulate(s).summary["step_time_s"] for s in (rr, uni)]
    assert t[0] <= t[1]


def test_round_robin_crosses_to_one_node_a_token_across_nodes() -> None:
    """4 nodes, EP 32, 32 experts top-4: each token's experts are one rank's, on one node,
    reached over the network for the 3/4 of tokens bound elsewhere, once each; the
    contract's spelling (``training.moe_routing``) says the same."""
    s = _scn(4, 32, moe_token_dispatcher_type="flex", routing={"distribution": "round_robin"})
    row = _a2a(s, "dispatch_fwd")[0].peer_bytes[0]
    assert sum(row[8:]) == pytest.approx(SEQ * 3 / 4 * token_bytes(H, K, 2.0), rel=1e-12)
    from sim.config.moe_keys import MoeRouting
    assert MoeRouting(distribution="round_robin").routing_dict()["distribution"] == \
        "round_robin"
