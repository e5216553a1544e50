"""Skewed routing with Megatron-Core's ``flex`` dispatcher (DeepEP), issue 14 item 4.

Independent truths: the routing matrix itself (:func:`routing_matrix`, recounted here token
by token: a token crosses the network once per *other* node holding one of its experts and is
forwarded once per rank holding one, DeepEP's ``get_dispatch_layout``), so the RDMA bytes are
the tokens routed off-node times DeepEP's record (``get_num_bytes_per_token``); the copies
add up to tokens x top-k whatever the skew; group-limited routing (DeepSeek-V3's node limit)
bounds the nodes a token reaches; the slowest expert rank sets the pace, so skew never makes
the step faster than balanced routing; the seed fixes everything.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_megatron_moe_flex import MOE, SEQ, E, H, K, _a2a, _scn

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.moe_flex import token_bytes
from sim.frameworks.megatron.moe_flex_skew import flex_skew
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError
from sim.workload.routing import rank_loads, routing_matrix, routing_shares

FLEX = {"moe_token_dispatcher_type": "flex"}


def _step(s) -> float:
    return simulate(s).summary["step_time_s"]


@functools.cache
def _base() -> float:
    """The balanced flex step (2 nodes, EP 16)."""
    return _step(_scn(2, 16, **FLEX))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=st.floats(0.0, 3.0), seed=st.integers(0, 10_000))
def test_skew_never_speeds_the_flex_step(s, seed) -> None:
    r = {"distribution": "zipf", "s": s, "seed": seed}
    assert _step(_scn(2, 16, routing=r, **FLEX)) >= _base()


def test_a_hot_histogram_slows_the_flex_step() -> None:
    # Experts wide enough for the GPU, not the host's Python, to pace the step (at width
    # 1,024 the host issues slower than the GPU runs: skew then shows in no step time).
    wide = dict(MOE, moe_ffn_hidden=8192)
    hot = [8.0] + [1.0] * (E - 1)
    assert _step(_scn(2, 16, model=wide, routing={"distribution": "histogram",
                                                  "histogram": hot}, **FLEX)) \
        > _step(_scn(2, 16, model=wide, **FLEX))


def test_same_seed_same_flex_step_other_seed_other_matrix() -> None:
    r = {"distribution": "zipf", "s": 1.0, "seed": 3}
    a, b = (simulate(_scn(2, 16, routing=r, **FLEX)).summary for _ in range(2))
    assert {k: v for k, v in a.items() if k != "sim"} == {k: v for k, v in b.items()
                                                         if k != "sim"}
    m3 = _a2a(_scn(2, 16, routing=r, **FLEX), "dispatch_fwd")[0].peer_bytes
    m4 = _a2a(_scn(2, 16, routing=dict(r, seed=4), **FLEX), "dispatch_fwd")[0].peer_bytes
    assert m3 != m4


def _recount(seed: int, s: float, ep: int, groups: int = 1, m: int = 1):
    """Token by token from the matrix: per source, the tokens each remote node and each
    rank receive (group rank r on node r // 8, holding experts r x E/ep ..)."""
    shares = routing_shares(E, "zipf", s=s, seed=seed)
    idx = routing_matrix(shares, K, ep * SEQ, seed, groups, m)
    local = E // ep
    off_node = np.zeros(ep)
    per_rank = np.zeros((ep, ep))
    nodes_per_token = []
    for t, row in enumerate(idx.tolist()):
        src = t // SEQ
        ranks = {e // local for e in row}
        nodes = {r // 8 for r in ranks}
        nodes_per_token.append(len(nodes))
        off_node[src] += len(nodes - {src // 8})
        for r in ranks:
            per_rank[src, r] += 1
    return off_node, per_rank, nodes_per_token, idx


@pytest.mark.parametrize("nodes", [2, 4])
def test_rdma_bytes_are_the_tokens_routed_off_node(nodes) -> None:
    ep, seed, s = 8 * nodes, 7, 1.2
    r = {"distribution": "zipf", "s": s, "seed": seed}
    off_node, per_rank, _, _ = _recount(seed, s, ep)
    rec = token_bytes(H, K, 2.0)
    op = _a2a(_scn(nodes, ep, routing=r, **FLEX), "dispatch_fwd")[0]
    m = op.peer_bytes
    rdma = [sum(m[i][j] for j in range(ep) if j // 8 != i // 8) for i in range(ep)]
    assert rdma == pytest.approx(list(off_node * rec), rel=1e-12)
    # Only the same-rail GPU of another node gets RDMA bytes (no PXN hop).
    assert all(m[i][j] == 0 for i in range(ep) for j in range(ep)
               if j // 8 != i // 8 and j % 8 != i % 8)
    # NVLink leg: forwarder i relays to j the tokens of every same-rail source bound for j.
    for i in range(ep):
        for j in range(ep):
            if i != j and i // 8 == j // 8:
                want = sum(per_rank[src, j] for src in range(i % 8, ep, 8))
                assert m[i][j] == pytest.approx(want * rec, rel=1e-12)
    assert op.nbytes == pytest.approx(max(sum(row) for row in m), rel=1e-12)
    # The combine runs the same flows backwards.
    comb = _a2a(_scn(nodes, ep, routing=r, **FLEX), "combine_fwd")[0].peer_bytes
    back = token_bytes(H, K, 2.0, weights=False, meta=False)
    assert comb[8][0] == pytest.approx(m[0][8] / rec * back, rel=1e-12)


def test_per_rank_loads_sum_to_tokens_times_top_k() -> None:
    shares = routing_shares(E, "zipf", s=1.5, seed=1)
    sk = flex_skew(shares, K, SEQ, 1, 16, 1, 8)
    assert sum(sk.expert_copies) == 16 * SEQ * K
    per_rank = rank_loads(sk.expert_copies, 16)
    assert sum(per_rank) == 16 * SEQ * K and len(set(per_rank)) > 1
    # Each rank receives every token once however many of its experts it picked: between
    # its copies / local experts and its copies.
    recv = [sum(row[j] for row in sk.rank_tokens) for j in range(16)]
    assert all(c / (E // 16) <= t <= c for c, t in zip(per_rank, recv, strict=True))
    assert sk.received() == max(recv)


def test_the_busiest_expert_rank_sets_the_pace() -> None:
    s = _scn(2, 16, routing={"distribution": "zipf", "s": 1.5, "seed": 1}, **FLEX)
    ctx = JobContext.from_scenario(s, "s.yaml")
    pl = megatron_shape(ctx).moe
    assert pl is not None and pl.pace is not None and pl.flex is not None
    per_rank = rank_loads(pl.flex.skew.expert_copies, 16)
    assert per_rank[pl.pace.rank] == max(per_rank)
    assert pl.experts_cost.fwd_gpu_s > pl.cost["experts"].fwd_gpu_s
    # Each EP rank its own class and GEMM time (moe_ranks); the busiest's is the pace's.
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    assert len(p.classes) == len(set(per_rank))
    times, flops = set(), 0.0
    for c in p.classes:
        ep = {pl.mesh.coords(r)["ep"] for r in c.members}
        assert len({per_rank[e] for e in ep}) == 1
        ops = [o for o in c.streams["compute"] if o.name.endswith(" experts")
               and o.phase == "fwd"]
        assert ops and {o.duration for o in ops} == {pl.ranks[min(ep)].cost.fwd_gpu_s}
        times.add(ops[0].duration)
        flops += ops[0].flops * len(c.members)
    assert max(times) == pl.pace.experts.fwd_gpu_s
    # GEMM FLOPs are linear in rows: the ranks' own FLOPs add up to the balanced total.
    assert flops == pytest.approx(16 * pl.cost["experts"].flops_fwd, rel=1e-9)


def test_group_limited_routing_bounds_nodes_per_token_under_skew() -> None:
    # 4 nodes, 4 expert groups (one a node), 2 groups a token: at most 2 nodes a token, so
    # at most 2 x tokens routed off-node per source (one of them may be its own node).
    seed, s = 5, 1.5
    off_node, _, nodes_per_token, _ = _recount(seed, s, 32, 4, 2)
    assert max(nodes_per_token) <= 2
    r = {"distribution": "zipf", "s": s, "seed": seed}
    lim = _a2a(_scn(4, 32, routing=r, moe_router_num_groups=4, moe_router_group_topk=2,
                    **FLEX), "dispatch_fwd")[0].peer_bytes
    free = _a2a(_scn(4, 32, routing=r, **FLEX), "dispatch_fwd")[0].peer_bytes
    rec = token_bytes(H, K, 2.0)
    for i in range(32):
        off = sum(lim[i][j] for j in range(32) if j // 8 != i // 8) / rec
        assert off == pytest.approx(off_node[i], rel=1e-12) and off <= 2 * SEQ
    assert sum(map(sum, lim)) < sum(map(sum, free))


def test_flex_skew_with_token_dropping_is_refused() -> None:
    with pytest.raises(ScenarioError, match="model.capacity_factor") as err:
        build_program(JobContext.from_scenario(
            _scn(2, 16, model=dict(MOE, capacity_factor=1.5),
                 routing={"distribution": "zipf", "s": 1.0}, **FLEX), "s.yaml"))
    assert "\n" not in str(err.value)
