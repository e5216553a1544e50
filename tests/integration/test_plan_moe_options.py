"""``fabricsim plan`` on Megatron mixture-of-experts layouts: the light ``recompute_modules``
sets of NVIDIA's MoE recipes (least recomputation first, the first that fits) and the
combined 1F1B schedule (``moe_a2a_overlap``) where Megatron-Core allows it
(sim/frameworks/megatron/search.py, sim/apps/plan/recompute.py; docs/planner.md).

DeepSeek-V2-Lite (MLA, 64 routed experts, 2 shared) on one DGX H100 server, the shipped
scenario with a smaller global batch: a layout simulates in about 0.2 s. The searches are
pinned to one family (tp 1, pp 1, cp 1, ep 8) so that each runs in a few seconds.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from conftest import make_scenario

from sim.api import simulate
from sim.apps import plan
from sim.scenario import load_scenario

DSV2 = "deepseek-v2-lite-megatron-ep8-8xh100"
FAMILY = {"parallelism.tp": 1, "parallelism.pp": 1, "parallelism.cp": 1,
          "parallelism.ep": 8, "framework.cuda_graph_impl": "none"}


@pytest.fixture
def no_levers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recomputation and overlap tests study those alone: no bf16-moment twins
    (tests/integration/test_plan_moe_levers.py tests those)."""
    from sim.apps.plan import levers

    monkeypatch.setattr(levers.Levers, "spawn", lambda self, c: None)


def _dsv2(*overrides: str) -> Any:
    return load_scenario(DSV2, ["training.global_batch_size=16", *overrides])


# --------------------------------------------------------------------------- recomputation
# Micro-batch 2 on ep 8 (reserved peaks as simulated, of the H100's 79.2 GiB): at 5,120
# tokens no recomputation needs 80.0 GiB, and Megatron-Core's default selective recomputation
# (core_attn) frees nothing of it (flash attention keeps only its output and statistics);
# [moe_act] drops the experts' fc2 input (76.7 GiB). At 6,144 tokens [moe_act] (83.1) and
# [layernorm, moe_act] (79.4 GiB) do not fit; [mla_up_proj, layernorm, moe_act] does (75.1).
@pytest.mark.usefixtures("no_levers")
@pytest.mark.parametrize("seq_len, lightest, lighter", [
    (5120, ("moe_act",), ["none", "selective"]),
    (6144, ("mla_up_proj", "layernorm", "moe_act"),
     ["none", "selective(moe_act)", "selective(layernorm,moe_act)", "selective"]),
])
def test_plan_picks_the_lightest_recompute_set_that_fits(
        seq_len: int, lightest: tuple[str, ...], lighter: list[str]) -> None:
    base = _dsv2(f"training.seq_len={seq_len}")
    pin = dict(FAMILY, **{"training.micro_batch_size": 2, "framework.moe_a2a_overlap": False})
    result = plan.search(base, "time", top=1, workers=1, max_simulations=3,
                         compare_baseline=False, pin=pin)
    sets = [c.layout.recompute for c in result.candidates
            if c.layout.activation_checkpointing == "selective" and c.layout.recompute]
    # Tried least recomputation first (Megatron-Bridge's recipes' sets; MLA: mla_up_proj).
    assert sets == [("moe_act",), ("layernorm", "moe_act"),
                    ("mla_up_proj", "layernorm", "moe_act"), ("mla_up_proj", "layernorm", "moe")]
    best = result.ranked()[0]
    assert best.layout.recompute == lightest
    # The simulator itself: every lighter setting of the layout runs out of memory, and so
    # does the core_attn default; the chosen one does not.
    chosen = plan.recomputed(best.layout)
    others = [c for c in result.candidates if c is not best and (
        plan.covers(chosen, plan.recomputed(c.layout))
        or (c.layout.activation_checkpointing, c.layout.recompute) == ("selective", ()))]
    assert [c.layout.label().split()[-1] for c in others] == lighter
    for c in others:
        assert c.status in ("memory", "oom"), (c.layout.label(), c.status)
        assert simulate(plan.layout_scenario(base, c.layout)).summary["oom"], c.layout.label()
    assert best.summary is not None and not best.summary["oom"]
    # More recomputation of the same layout is not built or simulated once it fits.
    for c in result.candidates:
        if plan.covers(plan.recomputed(c.layout), chosen) and c is not best:
            assert c.simulated is None, c.layout.label()
            assert c.status == "bound", (c.layout.label(), c.status)


def test_memory_pruning_compares_what_is_recomputed() -> None:
    # core_attn's selection not fitting says nothing of [moe_act] (each recomputes something
    # the other does not); [layernorm, moe_act] not fitting rules out [moe_act] and none,
    # not [mla_up_proj, layernorm, moe_act].
    pruning = plan.MemoryPruning(usable_bytes=1.0)

    def layout(ac: str, mods: tuple[str, ...] = (), mbs: int = 2) -> plan.Layout:
        return plan.Layout("megatron", 1, 1, 8, 1, 1, mbs, ac, (), 8, 1, mods)

    fam = plan.Candidate(0, layout("none"), 1).family
    assert pruning.verdict(fam, layout("selective"), 0.5, 2.0) == "estimate"
    assert pruning.dominated(fam, layout("none")) is not None
    assert pruning.dominated(fam, layout("selective", ("moe_act",))) is None
    assert pruning.verdict(fam, layout("selective", ("layernorm", "moe_act")), 0.5, 2.0)
    assert pruning.dominated(fam, layout("selective", ("moe_act",), mbs=4)) is not None
    assert pruning.dominated(fam, layout("selective", ("moe_act",), mbs=1)) is None
    assert pruning.dominated(
        fam, layout("selective", ("mla_up_proj", "layernorm", "moe_act"))) is None
    # The whole MoE layer contains its experts' activation.
    assert plan.covers(plan.recomputed(layout("selective", ("layernorm", "moe"))),
                       plan.recomputed(layout("selective", ("layernorm", "moe_act"))))
    assert plan.covers(plan.recomputed(layout("full")),
                       plan.recomputed(layout("selective", ("layernorm", "moe"))))


# --------------------------------------------------------------------------- a2a overlap
@pytest.mark.usefixtures("no_levers")
@pytest.mark.parametrize("micro_batch, overlap_wins", [(2, True), (1, False)])
def test_plan_keeps_the_faster_of_with_and_without_a2a_overlap(micro_batch: int,
                                                               overlap_wins: bool) -> None:
    # ep 8, 32 sequences: at micro-batch 2 the combined 1F1B schedule hides each micro-batch's
    # dispatch and combine all-to-alls under the other's compute and wins. At micro-batch 1
    # the x86 host paces the step and the schedule's extra issue work costs more than it hides
    # (Megatron-Bridge PR 1760 turned the overlap off on DGX B200 "due to CPU overhead"): the
    # planner keeps the layout without it.
    base = _dsv2("training.global_batch_size=32")
    pin = dict(FAMILY, **{"training.micro_batch_size": micro_batch})
    result = plan.search(base, "time", top=2, workers=1, max_simulations=3,
                         compare_baseline=False, pin=pin)
    overlap = [c for c in result.candidates if dict(c.layout.options)["moe_a2a_overlap"]]
    assert overlap and all(c.layout.activation_checkpointing != "full" for c in overlap)
    # Megatron-Core refuses moe_shared_expert_overlap with it: the planner turns it off.
    assert all(dict(c.layout.options)["moe_shared_expert_overlap"] is False for c in overlap)
    ranked = result.ranked()
    assert len(ranked) == 2
    fast, slow = ranked
    assert dict(fast.layout.options)["moe_a2a_overlap"] is overlap_wins
    assert dict(slow.layout.options)["moe_a2a_overlap"] is not overlap_wins
    with_overlap = fast if overlap_wins else slow
    assert "a2a-overlap" in with_overlap.layout.label()
    assert with_overlap.layout.varied()["framework.moe_a2a_overlap"] is True
    assert (fast.layout.micro_batch_size, fast.layout.activation_checkpointing) == \
        (slow.layout.micro_batch_size, slow.layout.activation_checkpointing)
    assert fast.summary is not None and slow.summary is not None
    assert fast.summary["step_time_s"] < slow.summary["step_time_s"]
    assert fast.lower_bound_s <= fast.summary["step_time_s"]


def test_a2a_overlap_only_where_megatron_allows_it() -> None:
    # Qwen3-30B-A3B (48 layers, 128 experts) on 8 GPUs: Megatron-Core refuses the combined
    # schedule with ep 1 and with pp > 1 unless vp > 1 (a2a_overlap.check_a2a_overlap); the
    # planner does not enumerate those, and builds the others.
    base = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100")
    layouts = plan.enumerate_layouts(base, ["megatron"])
    overlap = [x for x in layouts if dict(x.options)["moe_a2a_overlap"]]
    assert overlap
    assert all(x.ep > 1 and (x.pp == 1 or x.vp > 1) for x in overlap)
    assert any(x.pp > 1 for x in overlap)
    assert not any(x.activation_checkpointing == "full" for x in overlap)
    # Every other (ep > 1) layout is tried without it too.
    without = {x for x in layouts if not dict(x.options)["moe_a2a_overlap"]}
    for x in overlap:
        opts = tuple((k, False if k == "moe_a2a_overlap" else v) for k, v in x.options
                     if k != "moe_shared_expert_overlap")
        assert plan.Layout(x.framework, x.tp, x.pp, x.dp, x.cp, x.vp, x.micro_batch_size,
                           x.activation_checkpointing, opts, x.ep, x.etp,
                           x.recompute) in without
    rates = plan.LinkRates.of(base)
    pp2 = next(x for x in overlap if x.pp == 2 and x.tp == 4 and x.micro_batch_size == 1
               and x.activation_checkpointing == "none")
    ev = plan.evaluate_layout(base, pp2, rates, math.inf, 32 // pp2.dp)
    assert ev.refused is None, ev.message


# --------------------------------------------------------------------------- dense models
def test_dense_plans_search_the_same_points() -> None:
    # The 6-layer model of test_plan.py's ODD: no light sets, no a2a option, the layouts
    # and layer profiles counted before them (main @ a3c9329: 1,464 layouts, 396 of them
    # Megatron's, 306 profiles).
    from test_plan import ODD

    layouts = plan.enumerate_layouts(make_scenario(ODD))
    assert len(layouts) == 1464
    assert sum(x.framework == "megatron" for x in layouts) == 396
    assert len({plan._profile_key(x) for x in layouts}) == 306
    assert all(x.recompute == () and not x.moe for x in layouts)
    assert not any("moe_a2a_overlap" in dict(x.options) for x in layouts)
    assert {x.activation_checkpointing for x in layouts if x.framework == "megatron"} == \
        {"none", "selective", "full"}


def test_moe_layouts_are_judged_with_what_nvidia_smi_adds() -> None:
    # The simulation runs out of memory when the allocator's reserve plus the CUDA context
    # and NCCL's buffers pass the usable memory; the planner adds the same context and
    # buffers (the engine's own function) to its estimate for MoE layouts.
    base = _dsv2("training.seq_len=4608")
    x = next(x for x in plan.enumerate_layouts(base, ["megatron"])
             if (x.tp, x.pp, x.cp, x.ep, x.micro_batch_size) == (1, 1, 1, 8, 2)
             and x.recompute == ("moe_act",) and not dict(x.options)["moe_a2a_overlap"])
    ev = plan.evaluate_layout(base, x, plan.LinkRates.of(base), math.inf, 1)
    summary = simulate(plan.layout_scenario(base, x)).summary
    gib = 2.0**30
    outside = summary["peak_nvidia_smi_gib"] - summary["peak_reserved_gib"]
    assert outside > 0.5         # a CUDA context alone is ~0.5 GiB
    assert (ev.smi_bytes - ev.memory_bytes) / gib == pytest.approx(outside, rel=1e-6)
    assert ev.memory_bytes / gib == pytest.approx(summary["peak_memory_gib"], rel=0.02)
