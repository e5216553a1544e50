"""Routing imbalance in Megatron-Core's MoE path (issue 14 item 4): ``training.routing``.

Independent truths: balanced routing is the program without the option (the golden numbers
stay); Zipf with s = 0 is balanced; the all-to-alls' bytes conserve (every source sends its
tokens x top-k whatever the routing, so the wire bytes are the issue's closed form
2 x tokens x top-k x hidden x bytes x (ep - 1) / ep per layer per pass, only their spread
over peers changes); the busiest rank sets the pace, so skew never makes a step faster.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import Routing, Scenario, ScenarioError, scenario_from_dict

# The small MoE model of test_megatron_moe.py: 4 layers, 8 experts of width 1024, top-2.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048
# Experts wide enough for the GPU to pace the step: TINY's are host-bound (its Python issues
# slower than its GPU runs, an x86 DGX host's op at sim.hardware.host.X86_TRAINING_HOST_FACTOR
# times its isolated cost), and skew then shows in no step time.
WIDE = dict(TINY, moe_ffn_hidden=8192)


def _scn(routing: dict | None = None, ep: int = 8, seed: int = 0, model: dict | None = None):
    s = megatron_scenario({"tp": 1, "ep": ep}, 8, model=model or TINY, seq=SEQ)
    if routing is None:
        return s
    tr = s.training.model_copy(update={"routing": Routing(**routing)})
    return s.model_copy(update={"training": tr, "seed": seed})


def _summary(s) -> dict:
    """The step's summary without the simulator's own wall time."""
    return {k: v for k, v in simulate(s).summary.items() if k != "sim"}


def _a2a(s):
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    return [op for c in p.classes for ops in c.streams.values() for op in ops
            if op.collective == "all_to_all"]


def test_balanced_and_zipf_zero_are_the_default_program() -> None:
    base = _summary(_scn())
    assert _summary(_scn({"distribution": "balanced"})) == base
    # 2048 tokens x 8 ranks x top-2 over 8 experts: 4096 each, exactly the balanced rows.
    assert _summary(_scn({"distribution": "zipf", "s": 0.0})) == base


def test_skew_never_speeds_the_step() -> None:
    base = _summary(_scn(model=WIDE))
    steps = [_summary(_scn({"distribution": "zipf", "s": s}, model=WIDE))["step_time_s"]
             for s in (0.25, 1.0, 2.0)]
    assert all(t > base["step_time_s"] for t in steps)
    assert steps == sorted(steps)


# GPU-bound: experts 8192 wide on 4096 tokens per rank, so the host never hides GPU time.
WIDE = dict(TINY, hidden=2048, heads=16, moe_ffn_hidden=8192)


@pytest.mark.parametrize("s", [1.0, 2.0])
def test_the_busiest_rank_sets_the_pace(s) -> None:
    def scn(routing: dict | None) -> Scenario:
        sc = megatron_scenario({"tp": 1, "ep": 8}, 8, model=WIDE, seq=4096)
        if routing is None:
            return sc
        return sc.model_copy(update={"training": sc.training.model_copy(
            update={"routing": Routing(**routing)})})

    skewed = scn({"distribution": "zipf", "s": s})
    sh = megatron_shape(JobContext.from_scenario(skewed, "s.yaml"))
    assert sh.moe is not None and sh.moe.pace is not None
    pace, bal = sh.moe.pace, sh.moe.cost["experts"]
    # One expert per EP rank: the hottest's share over the balanced 1/8 is 8 / H(8, s)
    # (generalised harmonic number); at s = 2 its 1/H(8, 2) = 0.66 is capped at 1/top-k =
    # 1/2, four times 1/8. Integer token counts: within 1e-4.
    hot = min(8 / sum(r ** -s for r in range(1, 9)), 8 / 2)
    assert pace.imbalance == pytest.approx(hot, abs=1e-4)
    # Every one of the 4 layers (1 micro-batch) waits for the busiest rank's experts, forward
    # and backward; the uneven all-to-alls add a little more, never less.
    extra = 4 * (pace.experts.fwd_gpu_s + pace.experts.bwd_gpu_s - bal.fwd_gpu_s
                 - bal.bwd_gpu_s)
    grew = _summary(skewed)["step_time_s"] - _summary(scn(None))["step_time_s"]
    assert extra * (1 - 1e-9) <= grew < 1.05 * extra


def test_all_to_all_bytes_conserve_under_skew() -> None:
    s = _scn({"distribution": "zipf", "s": 1.0})
    ep, h, k = 8, 1024, 2
    skewed = _a2a(s)
    assert skewed and all(op.peer_bytes for op in skewed)
    for op in skewed:
        per = 4 if "probs" in op.name else 2 * h
        m = op.peer_bytes
        # the members' buffers average the even op's (``nbytes``); the dispatch's senders
        # each send their tokens x top-k, the combine's receivers each get theirs back
        assert sum(map(sum, m)) / ep == pytest.approx(op.nbytes, rel=1e-12)
        back = any(w in op.name for w in ("combine fwd", "dispatch bwd", "probs bwd"))
        lines = zip(*m, strict=True) if back else m
        for line in lines:
            assert sum(line) == pytest.approx(op.nbytes, rel=1e-12)
        assert op.nbytes == SEQ * k * per
        wire = sum(x for i, row in enumerate(m) for j, x in enumerate(row) if i != j)
        assert wire == pytest.approx(ep * SEQ * k * per * (ep - 1) / ep, rel=1e-12)
        assert len({x for row in m for x in row}) > 1          # but uneven per peer
    # one node: the step's NVLink bytes are the balanced step's (same wire bytes)
    base = _summary(_scn())["bytes"]["nvlink"]
    assert _summary(s)["bytes"]["nvlink"] == pytest.approx(base, rel=1e-9)


def test_flops_stay_balanced_and_the_busiest_rank_holds_more_activations() -> None:
    base = _summary(_scn(model=WIDE))
    skew = _summary(_scn({"distribution": "zipf", "s": 1.0}, model=WIDE))
    assert skew["model_flops_per_step"] == base["model_flops_per_step"]
    assert skew["mfu"] < base["mfu"]
    assert skew["peak_memory_gib"] > base["peak_memory_gib"]


def test_same_seed_same_step_and_the_seed_moves_the_hot_expert() -> None:
    a = _summary(_scn({"distribution": "zipf", "s": 1.0, "seed": 3}))
    assert _summary(_scn({"distribution": "zipf", "s": 1.0, "seed": 3})) == a
    # routing.seed unset: the scenario's seed decides
    paces = set()
    for seed in range(4):
        sh = megatron_shape(JobContext.from_scenario(
            _scn({"distribution": "zipf", "s": 1.0}, ep=4, seed=seed), "s.yaml"))
        assert sh.moe is not None and sh.moe.pace is not None
        paces.add(sh.moe.pace.loads)
    assert len(paces) > 1


def test_histogram_from_a_file_equals_inline(tmp_path) -> None:
    loads = [40, 10, 10, 10, 10, 10, 5, 5]
    f = tmp_path / "loads.txt"
    f.write_text("# tokens per expert, measured\n40, 10 10\n10 10 10\n5 5\n")
    inline = _summary(_scn({"distribution": "histogram", "histogram": loads}))
    assert _summary(_scn({"distribution": "histogram", "histogram": str(f)})) == inline
    wide = _summary(_scn({"distribution": "histogram", "histogram": loads}, model=WIDE))
    assert wide["step_time_s"] > _summary(_scn(model=WIDE))["step_time_s"]
    sh = megatron_shape(JobContext.from_scenario(
        _scn({"distribution": "histogram", "histogram": loads}), "s.yaml"))
    assert sh.moe is not None and sh.moe.pace is not None
    # expert 0 asks 40% of the copies, capped at 1/top-2 = 50%: 16384 tokens x 2 x 0.4
    assert sh.moe.pace.loads[0] == 13107 and sum(sh.moe.pace.loads) == 2 * 8 * SEQ


def test_a_relative_histogram_path_is_read_beside_the_scenario(tmp_path) -> None:
    import yaml

    from sim.scenario import load_scenario

    (tmp_path / "loads.txt").write_text("4 1 1 1 1 1 1 1\n")
    data = {"model": TINY, "framework": "megatron", "cluster": {"gpu": "h100-sxm"},
            "parallelism": {"ep": 8},
            "training": {"routing": {"distribution": "histogram", "histogram": "loads.txt"}}}
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(data))
    s = load_scenario(str(f))
    assert s.training.routing.histogram == [4, 1, 1, 1, 1, 1, 1, 1]


def _load(training: dict) -> None:
    data = {"model": TINY, "framework": "megatron", "cluster": {"gpu": "h100-sxm"},
            "parallelism": {"ep": 8}, "training": training}
    build_program(JobContext.from_scenario(scenario_from_dict(data, "x.yaml"), "x.yaml"))


@pytest.mark.parametrize("routing,match", [
    ({"distribution": "histogram"}, "training.routing.histogram: give it"),
    ({"distribution": "zipf", "histogram": [1, 2]}, "training.routing.histogram: give it"),
    ({"distribution": "histogram", "histogram": "/nonexistent/loads.txt"},
     "training.routing.histogram: cannot read"),
    ({"distribution": "histogram", "histogram": [1, -1, 1, 1, 1, 1, 1, 1]},
     "training.routing.histogram: per-expert loads must be"),
    ({"distribution": "histogram", "histogram": [1, 2, 3]},
     "training.routing.histogram: 3 per-expert loads for the model's 8"),
    ({"distribution": "zipf", "s": -1}, "training.routing.s"),
    ({"distribution": "uniform"}, "training.routing.distribution"),
])
def test_bad_routing_is_one_line_naming_the_key(routing, match) -> None:
    with pytest.raises(ScenarioError, match=match) as e:
        _load({"routing": routing})
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_numbers_names_the_key(tmp_path) -> None:
    f = tmp_path / "bad.txt"
    f.write_text("1 2 three\n")
    with pytest.raises(ScenarioError, match="training.routing.histogram: .*not a list"):
        _load({"routing": {"distribution": "histogram", "histogram": str(f)}})


def test_expert_tp_exchanges_carry_each_ranks_own_tokens() -> None:
    # tp = etp = 2, ep = 4 on 8 GPUs (GPU-bound WIDE experts): each expert-TP group gathers
    # the tokens its own EP rank's two experts receive (a rank class per expert load,
    # moe_ranks.split_expert_ranks); the pace is the busiest rank's.
    s = megatron_scenario({"tp": 2, "ep": 4, "sequence_parallel": True}, 8, model=WIDE,
                          seq=4096)
    tr = s.training.model_copy(update={"routing": Routing(distribution="zipf", s=1.0)})
    skewed = s.model_copy(update={"training": tr})
    sh = megatron_shape(JobContext.from_scenario(skewed, "s.yaml"))
    assert sh.moe is not None and sh.moe.pace is not None
    loads = sh.moe.pace.loads
    per_ep = [sum(loads[2 * j:2 * j + 2]) for j in range(4)]
    # Conservation: 4,096 / 2 tokens on each of the 8 sources, top-2.
    assert sum(per_ep) == 8 * 2048 * 2
    p = build_program(JobContext.from_scenario(skewed, "s.yaml"))
    assert len(p.classes) == len(set(per_ep))
    seen = set()
    for c in p.classes:
        ep = {sh.moe.mesh.coords(r)["ep"] for r in c.members}
        assert len({per_ep[e] for e in ep}) == 1
        gathers = [op for ops in c.streams.values() for op in ops
                   if "etp all_gather" in op.name]
        # the gathered rows of the class's own experts, 16-bit, hidden 2048, over its groups
        assert gathers and {op.nbytes for op in gathers} == {per_ep[min(ep)] * 2048 * 2}
        assert all(set(g) <= set(c.members) for op in gathers for g in op.all_groups)
        seen |= ep
        experts = [op for ops in c.streams.values() for op in ops
                   if op.name.endswith(" experts") and op.phase == "fwd"]
        busiest = max(per_ep[e] for e in ep) == max(per_ep)
        assert (experts[0].duration == sh.moe.pace.experts.fwd_gpu_s) == busiest
    assert seen == set(range(4))
    assert _summary(skewed)["step_time_s"] > _summary(s)["step_time_s"]


def test_a_class_per_expert_load_keeps_the_pace_and_stops_overcounting(monkeypatch) -> None:
    """The slowest EP rank sets the pace either way (every combine waits for it), so the
    per-load classes give the one-class step exactly; only the expert-TP exchanges' NVLink
    bytes drop (each EP rank gathers its own tokens, not the busiest rank's). Past
    MAX_CLASSES the program keeps one class per stage."""
    import sim.frameworks.common.moe_ranks as moe_ranks
    s = megatron_scenario({"tp": 2, "ep": 4, "sequence_parallel": True}, 8, model=WIDE,
                          seq=4096)
    skewed = s.model_copy(update={"training": s.training.model_copy(
        update={"routing": Routing(distribution="zipf", s=1.0)})})
    split = simulate(skewed).summary
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 1)
    p = build_program(JobContext.from_scenario(skewed, "s.yaml"))
    assert len(p.classes) == 1 and p.meta["moe_rank_classes"].startswith("one per stage")
    one = simulate(skewed).summary
    assert split["step_time_s"] == one["step_time_s"]
    assert split["bytes"]["nvlink"] < one["bytes"]["nvlink"]
    assert split["bytes"]["network"] == one["bytes"]["network"]
