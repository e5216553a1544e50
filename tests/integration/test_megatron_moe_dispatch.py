"""Megatron-Core's token-dispatch options (issue 14 item 2): the ``allgather`` dispatcher,
``moe_pad_expert_input_to_capacity`` and ``moe_shared_expert_overlap``.

Independent truths: Megatron-Core's ``token_dispatcher.py`` (``MoEAllGatherTokenDispatcher``:
all-gathers of the routing map, probs and hidden states over expert-TP x EP, the
reduce-scatter of the output in the probs' dtype, fp32 here), ``moe_utils.get_capacity``
(``ceil(tokens x top_k / experts x factor)``) and the issue's closed forms: all-gather of
``n x tokens x hidden x bytes`` puts ``(n - 1) / n`` of it on each rank's wire; padded
all-to-alls carry ``2 x experts x capacity x hidden x bytes x (ep - 1) / ep`` per layer and
pass, whatever the routing; an overlap can hide at most what it overlaps.
"""

from __future__ import annotations

import math

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.config.training import Routing
from sim.frameworks import JobContext, build_program
from sim.scenario import ScenarioError, load_scenario

# The small MoE model of test_megatron_moe.py: 4 layers, 8 experts of width 1024, top-2.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048
H = 1024


def _scn(par: dict, model: dict | None = None, routing: dict | None = None, **fw: object):
    s = megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), 8,
                          model=model or TINY, seq=SEQ, framework={"name": "megatron", **fw})
    if routing is not None:
        tr = s.training.model_copy(update={"routing": Routing(**routing)})
        s = s.model_copy(update={"training": tr})
    return s


def _ops(s):
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    return [(c, op) for c in p.classes for ops in c.streams.values() for op in ops]


def _step(s) -> float:
    return simulate(s).summary["step_time_s"]


# ---------------------------------------------------------------------- allgather dispatcher
@pytest.mark.parametrize("par", [{"tp": 1, "ep": 8}, {"tp": 1, "ep": 4}, {"tp": 2, "ep": 2},
                                 {"tp": 2, "ep": 4, "etp": 1}, {"tp": 1, "pp": 2, "ep": 4}])
def test_allgather_dispatcher_bytes_follow_the_closed_form(par) -> None:
    s = _scn(par, moe_token_dispatcher_type="allgather")
    ops = _ops(s)
    tp, ep = par["tp"], par["ep"]
    etp = par.get("etp", tp)
    n = ep * etp                           # the tp_ep group
    tokens = SEQ // tp                     # the sequence-parallel shard entering the router
    mbs = 8 // (8 // (tp * par.get("pp", 1)))
    layers = 4 // par.get("pp", 1)
    assert not [op for _, op in ops if op.collective == "all_to_all"]
    by_name: dict[str, list] = {}
    for c, op in ops:
        if " ag " in op.name and op.collective:
            assert len(op.all_groups[0]) == n
            by_name.setdefault(op.name.split(" ag ", 1)[1], []).append((c, op))
    # Per rank class, per MoE layer and micro-batch: hidden states gathered in bf16, the
    # output reduce-scattered in fp32 (Megatron casts to local_probs.dtype), and in backward
    # the fp32 output gradient gathered and the bf16 token gradient reduce-scattered.
    want = {"tokens all_gather": n * tokens * H * 2, "output reduce_scatter": n * tokens * H * 4,
            "output grad all_gather": n * tokens * H * 4,
            "tokens grad reduce_scatter": n * tokens * H * 2,
            "routing_map all_gather": n * tokens * 8 * 1, "probs all_gather": n * tokens * 8 * 4,
            "probs grad reduce_scatter": n * tokens * 8 * 4}
    assert set(by_name) == set(want)
    classes = {c.id for c, _ in ops}
    for name, items in by_name.items():
        assert {op.nbytes for _, op in items} == {want[name]}, name
        assert len(items) == len(classes) * layers * mbs, name
    # Wire bytes of the tokens' gather per rank: tokens x hidden x 2 B x (n - 1).
    gather = by_name["tokens all_gather"][0][1]
    assert gather.nbytes * (n - 1) / n == tokens * H * 2 * (n - 1)
    # The host waits for the local counts (tokens_per_expert ... .cpu()) after the gathers.
    assert gather.host_sync


def test_allgather_moves_ep_over_top_k_times_the_tokens_and_is_slower_at_large_ep() -> None:
    # Wire bytes of the dispatch, per rank and pass: all-gather (ep - 1) x tokens x h x 2;
    # all-to-all tokens x k x h x 2 x (ep - 1) / ep: a ratio of ep / k (4 at ep=8, top-2).
    a2a = _scn({"tp": 1, "ep": 8})
    ag = _scn({"tp": 1, "ep": 8}, moe_token_dispatcher_type="allgather")
    d_a2a = next(op for _, op in _ops(a2a) if op.name.endswith("dispatch fwd"))
    d_ag = next(op for _, op in _ops(ag) if op.name.endswith("ag tokens all_gather"))
    assert (d_ag.nbytes * 7 / 8) / (d_a2a.nbytes * 7 / 8) == pytest.approx(8 / 2)
    # The bytes slow the step where the GPU paces it: at TINY's hidden 1024 the host's calls
    # do (sim/workload/moe_host_ops.py; the allgather dispatcher makes fewer of them), so
    # compare at hidden 4096.
    wide = dict(TINY, hidden=4096, heads=32, kv_heads=32, ffn_hidden=8192, moe_ffn_hidden=2048)
    assert _step(_scn({"tp": 1, "ep": 8}, model=wide, moe_token_dispatcher_type="allgather")) \
        > _step(_scn({"tp": 1, "ep": 8}, model=wide))
    # Megatron-Core's README calls allgather best for "TP-only setups, small EP, large Top-K":
    # at ep=2 with top-4 the gathered tokens are fewer than the all-to-all's copies (1 x vs
    # 2 x tokens x h), though the fp32 reduce-scatter gives the bytes back.
    k4 = dict(TINY, experts_per_token=4)
    g2 = _scn({"tp": 1, "ep": 2}, model=k4, moe_token_dispatcher_type="allgather")
    a2 = _scn({"tp": 1, "ep": 2}, model=k4)
    g_bytes = next(op for _, op in _ops(g2) if op.name.endswith("ag tokens all_gather")).nbytes
    a_bytes = next(op for _, op in _ops(a2) if op.name.endswith("dispatch fwd")).nbytes
    assert g_bytes / 2 == pytest.approx(a_bytes / 2 / 2)


def test_allgather_conserves_the_model_flops() -> None:
    flops = {}
    for d in ("alltoall", "allgather"):
        s = _scn({"tp": 1, "ep": 4}, moe_token_dispatcher_type=d)
        flops[d] = sum(op.flops * len(c.members) for c, op in _ops(s))
    assert flops["allgather"] == pytest.approx(flops["alltoall"], rel=1e-12)


# ---------------------------------------------------------------------- padding to capacity
CAP = dict(TINY, capacity_factor=1.25)


@pytest.mark.parametrize("routing", [None, {"distribution": "zipf", "s": 1.2}])
def test_padded_all_to_alls_are_fixed_by_capacity(routing) -> None:
    ep = 8
    s = _scn({"tp": 1, "ep": ep}, model=CAP, routing=routing,
             moe_pad_expert_input_to_capacity=True)
    cap = math.ceil(SEQ * 2 / 8 * 1.25)            # get_capacity: 640 tokens per expert
    ops = _ops(s)
    tok = [op for _, op in ops if op.collective == "all_to_all" and "probs" not in op.name]
    for op in tok:
        assert op.nbytes == 8 * cap * H * 2 and op.peer_bytes == ()
    # Per MoE layer per pass: 2 x experts x capacity x h x 2 B x (ep - 1) / ep on the wire.
    per_pass = 2 * 8 * cap * H * 2 * (ep - 1) / ep
    fwd = sum(op.nbytes * (ep - 1) / ep for op in tok if op.phase == "comm"
              and op.name.startswith("fwd"))
    assert fwd == pytest.approx(per_pass * 4)   # 4 layers, one micro-batch (dp = 8), one class
    # No count all-gather and no host synchronisation: preprocess returns fixed counts.
    assert not [op for _, op in ops if "token count" in op.name]
    assert not [op for _, op in ops if op.host_sync and " moe " in op.name]


def test_padding_makes_the_step_independent_of_skew() -> None:
    pad = {"moe_pad_expert_input_to_capacity": True}
    zipf = {"distribution": "zipf", "s": 1.2}
    balanced_pad = _step(_scn({"tp": 1, "ep": 8}, model=CAP, **pad))
    assert _step(_scn({"tp": 1, "ep": 8}, model=CAP, routing=zipf, **pad)) == balanced_pad
    # Dropless, the same skew slows the step (the busiest EP rank sets the pace), where the
    # experts are wide enough for the GPU, not the host's Python, to pace it.
    wide = dict(CAP, moe_ffn_hidden=8192)
    dropless = _step(_scn({"tp": 1, "ep": 8}, model=wide))
    assert _step(_scn({"tp": 1, "ep": 8}, model=wide, routing=zipf)) > dropless
    # Padded, every local expert's grouped GEMM has capacity x ep rows: 1.25 x the balanced
    # dropless rows, so its FLOPs on the hardware are 1.25 x (model FLOPs stay the routed ones
    # in the summary; here the expert op's duration grows).
    def experts(s) -> float:
        return next(op.duration for _, op in _ops(s) if op.name == "fwd moe L0 mb0 experts")
    ratio = experts(_scn({"tp": 1, "ep": 8}, model=CAP, **pad)) / experts(
        _scn({"tp": 1, "ep": 8}, model=CAP))
    assert 1.0 < ratio <= 1.25 + 1e-9
    # Model FLOPs stay those of the routed tokens; the padding rows are hardware FLOPs only.
    padded = [op for _, op in _ops(_scn({"tp": 1, "ep": 8}, model=CAP, **pad))
              if op.name.endswith(" experts")]
    dropless = [op for _, op in _ops(_scn({"tp": 1, "ep": 8}, model=CAP))
                if op.name.endswith(" experts")]
    assert sum(op.flops for op in padded) == pytest.approx(sum(op.flops for op in dropless))
    assert sum(op.hw_flops for op in padded) == pytest.approx(
        1.25 * sum(op.flops for op in dropless))


def test_padding_needs_a_capacity_factor() -> None:
    with pytest.raises(ScenarioError, match="framework.moe_pad_expert_input_to_capacity"):
        _ops(_scn({"tp": 1, "ep": 8}, moe_pad_expert_input_to_capacity=True))


# ---------------------------------------------------------------------- shared-expert overlap
SHARED = dict(TINY, shared_experts=1)


def _v2_lite(par: dict, overlap: bool):
    """The shipped DeepSeek-V2-Lite scenario (2 shared experts beside 64 routed, top-6) with 8
    micro-batches per rank: large enough that the GPU, not the host, sets the pace."""
    s = load_scenario("deepseek-v2-lite-megatron-ep8-8xh100")
    dp = 8 // par["tp"]
    return s.model_copy(update={
        "framework": s.framework.model_copy(update={"moe_shared_expert_overlap": overlap}),
        "parallelism": s.parallelism.model_copy(update=dict(
            par, sequence_parallel=par["tp"] > 1)),
        "training": s.training.model_copy(update={"global_batch_size": 8 * dp})})


@pytest.mark.parametrize("par", [{"tp": 1, "ep": 8}, {"tp": 2, "ep": 4}])
def test_shared_expert_overlap_saves_at_most_the_shared_experts_time(par) -> None:
    base, over = _v2_lite(par, False), _v2_lite(par, True)
    ops = _ops(over)
    side = [op for _, op in ops if op.stream == "moe_shared"]
    assert side and all("shared" in op.name for op in side)
    # What the overlap can hide: the shared experts' kernels on one rank class over the step
    # (every layer, micro-batch and pass), and their TP exchanges, bounded by their bytes at
    # NVLink 4's 450 GB/s per direction (a lower bound on their time, so an upper bound on
    # what hiding them saves).
    first = min(c.id for c, _ in ops)
    shared = [op for c, op in ops if c.id == first and "shared" in op.name]
    hide = (sum(op.duration for op in shared if op.kind == "compute")
            + sum(op.nbytes for op in shared if op.collective) / 450e9)
    t_base, t_over = _step(base), _step(over)
    assert 0 < t_base - t_over <= hide
    # Same work: FLOPs unchanged.
    f = [sum(op.flops * len(c.members) for c, op in _ops(x)) for x in (base, over)]
    assert f[0] == pytest.approx(f[1], rel=1e-12)


def test_shared_expert_overlap_is_a_no_op_without_shared_experts_or_ep() -> None:
    assert _step(_scn({"tp": 1, "ep": 8}, moe_shared_expert_overlap=True)) == \
        _step(_scn({"tp": 1, "ep": 8}))


def test_shared_expert_overlap_needs_the_alltoall_dispatcher() -> None:
    with pytest.raises(ScenarioError, match="framework.moe_shared_expert_overlap"):
        _ops(_scn({"tp": 1, "ep": 8}, model=SHARED, moe_shared_expert_overlap=True,
                  moe_token_dispatcher_type="allgather"))


# ---------------------------------------------------------------------- dispatch buffers
def _dispatch_peak(s) -> tuple[float, float, float]:
    """(highest moe_dispatch bytes, what is left at the step's end, the step's peak bytes) on
    the first rank class."""
    r = simulate(s)
    tr = r.recorder.memory[0]
    return (max(cur.get("moe_dispatch", 0.0) for _, cur in tr.series),
            tr.series[-1][1].get("moe_dispatch", 0.0), tr.peak)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_dispatch_buffers_peak_follows_the_closed_form_in_top_k(k) -> None:
    # ep=8, one local expert: the dispatch's received tokens are the grouped fc1's saved
    # input (already activations). The highest point is the experts' backward: the output
    # gradient that arrived by the combine's reverse all-to-all (tokens x k x h x 2 B) beside
    # the input gradient and probs' gradient going back and the buffers they arrive in
    # (2 x tokens x k x (h x 2 B + 4 B)): tokens x k x (6h + 8) bytes.
    top, left, _ = _dispatch_peak(_scn({"tp": 1, "ep": 8}, model=dict(TINY, experts_per_token=k)))
    assert top == SEQ * k * (6 * H + 8)
    assert left == 0.0          # every buffer is released within its layer


def test_dispatch_buffers_peak_follows_capacity_when_padded() -> None:
    # Padded: experts x capacity rows in every buffer whatever top-k x tokens is.
    cap = math.ceil(SEQ * 2 / 8 * 1.25)
    top, left, _ = _dispatch_peak(_scn({"tp": 1, "ep": 8}, model=CAP,
                                       moe_pad_expert_input_to_capacity=True))
    assert top == 8 * cap * (6 * H + 8) and left == 0.0
    # And the step's peak grows with the padding (more rows saved and in flight).
    assert _dispatch_peak(_scn({"tp": 1, "ep": 8}, model=CAP,
                               moe_pad_expert_input_to_capacity=True))[2] > \
        _dispatch_peak(_scn({"tp": 1, "ep": 8}, model=CAP))[2]


def test_allgather_holds_the_gathered_tokens() -> None:
    # The unpermuted output of every gathered token (ep x tokens x h, 16-bit and fp32).
    top, left, _ = _dispatch_peak(_scn({"tp": 1, "ep": 8},
                                       moe_token_dispatcher_type="allgather"))
    assert top == 8 * SEQ * H * 6 and left == 0.0


def test_no_dispatch_buffers_without_expert_parallelism() -> None:
    assert _dispatch_peak(_scn({"tp": 1, "ep": 1}))[0] == 0.0


def test_trace_and_summary_show_the_dispatch_buffers() -> None:
    from sim.outputs.export.perfetto import chrome_trace

    r = simulate(_scn({"tp": 1, "ep": 8}))
    trace = chrome_trace(r.recorder)
    mem = [e["args"] for e in trace["traceEvents"] if e.get("name") == "memory (GiB)"]
    assert max(a.get("moe_dispatch", 0.0) for a in mem) * 2**30 == \
        pytest.approx(SEQ * 2 * (6 * H + 8))
    assert "moe_dispatch" in r.summary["memory_by_rank_class"][0]["breakdown_gib"]


def test_capacity_below_one_drops_tokens_when_padded() -> None:
    # capacity_factor 0.5: capacity = ceil(2048 x 2 / 8 x 0.5) = 256 rows per expert and rank,
    # half the routed copies: the all-to-alls and the expert op's FLOPs halve (the dropped
    # copies are not computed; no padding rows to count as hardware-only FLOPs).
    half = _ops(_scn({"tp": 1, "ep": 8}, model=dict(TINY, capacity_factor=0.5),
                     moe_pad_expert_input_to_capacity=True))
    full = _ops(_scn({"tp": 1, "ep": 8}))
    def pick(ops, suffix):
        return next(op for _, op in ops if op.name == f"fwd moe L0 mb0 {suffix}")
    assert pick(half, "dispatch fwd").nbytes == 8 * 256 * H * 2
    assert pick(half, "dispatch fwd").nbytes * 2 == pick(full, "dispatch fwd").nbytes
    assert pick(half, "experts").flops * 2 == pytest.approx(pick(full, "experts").flops)
    assert pick(half, "experts").hw_flops == 0.0


# ---------------------------------------------------------------------- dropping (no padding)
def test_capacity_without_padding_drops_only_what_exceeds_it() -> None:
    # Balanced routing at factor >= 1 drops nothing: the dropless program's all-to-alls.
    def a2a(s):
        return [op.nbytes for _, op in _ops(s) if op.collective == "all_to_all"]
    assert a2a(_scn({"tp": 1, "ep": 8}, model=CAP)) == a2a(_scn({"tp": 1, "ep": 8}))
    # Factor 0.5: half the copies (capacity 256 of 512 per expert and rank) travel.
    half = a2a(_scn({"tp": 1, "ep": 8}, model=dict(TINY, capacity_factor=0.5)))
    assert [x * 2 for x in half] == a2a(_scn({"tp": 1, "ep": 8}))
    # The count all-gather's host wait stays (cuda_sync_point before_permutation_1).
    count = [op for _, op in _ops(_scn({"tp": 1, "ep": 8}, model=CAP)) if "token count" in op.name]
    assert count and all(op.host_sync for op in count)


def test_capacity_bounds_the_skew() -> None:
    # Zipf-skewed routing: the hot experts keep at most capacity x sources copies, so a
    # capacity factor lightens the busiest rank's experts, and a tighter one more; balanced
    # routing at factor 1.25 is the dropless balanced step. The step also pays the router's
    # dropping kernels (apply_router_token_dropping), which on this tiny model cost more than
    # a loose factor saves: the tighter factor's step is the faster, not every factor's.
    from sim.frameworks.megatron.shape import megatron_shape
    zipf = {"distribution": "zipf", "s": 1.2}
    scns = [_scn({"tp": 1, "ep": 8}, routing=zipf),
            _scn({"tp": 1, "ep": 8}, model=dict(TINY, capacity_factor=2.0), routing=zipf),
            _scn({"tp": 1, "ep": 8}, model=CAP, routing=zipf)]
    busiest = []
    for s in scns:
        moe = megatron_shape(JobContext.from_scenario(s, "s.yaml")).moe
        assert moe is not None and moe.pace is not None
        busiest.append(max(moe.pace.loads))
    assert busiest[2] < busiest[1] < busiest[0]
    assert _step(scns[2]) < _step(scns[1])
    sh = megatron_shape(JobContext.from_scenario(
        _scn({"tp": 1, "ep": 8}, model=CAP, routing=zipf), "s.yaml"))
    assert sh.moe is not None and sh.moe.pace is not None
    cap = math.ceil(SEQ * 2 / 8 * 1.25)
    assert max(sh.moe.pace.loads) <= cap * 8
