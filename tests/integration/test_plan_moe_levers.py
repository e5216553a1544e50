"""``fabricsim plan`` on Megatron mixture-of-experts layouts: the DeepEP / HybridEP dispatchers,
CUDA graphs, FP8 primary weights and bf16 Adam moments, each tried only where Megatron allows
it and where it can change the answer (sim/frameworks/megatron/search_moe.py,
sim/apps/plan/levers.py; docs/planner.md).

DeepSeek-V2-Lite (64 routed experts, MLA) on one or two DGX H100 servers, small global
batches: one layout simulates in well under a second; each search is pinned to one layout
of the enumeration (and the twins the search adds to it).
"""

from __future__ import annotations

import math
from typing import Any

from sim.api import simulate
from sim.apps import plan
from sim.scenario import load_scenario

DSV2 = "deepseek-v2-lite-megatron-ep8-8xh100"
QWEN = "qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100"


def _pin(ep: int, mbs: int, **more: Any) -> dict[str, Any]:
    return {"parallelism.tp": 1, "parallelism.pp": 1, "parallelism.cp": 1,
            "parallelism.ep": ep, "framework.cuda_graph_impl": "none",
            "training.micro_batch_size": mbs, "training.activation_checkpointing": "none",
            "framework.moe_a2a_overlap": False, **more}


def _opts(x: plan.Layout) -> dict[str, Any]:
    return dict(x.options)


# --------------------------------------------------------------------------- where allowed
def test_options_are_enumerated_only_where_megatron_allows_them() -> None:
    # Qwen3-30B-A3B (128 experts, dropless) on one DGX H100: every expert-parallel group stays
    # in the server's NVLink domain, so no DeepEP / HybridEP; CUDA graphs as a twin of each
    # eager layout (Hopper), never with full recomputation nor with the whole MoE layer
    # recomputed under Transformer Engine's moe_router graph (Megatron-Core
    # TransformerConfig.__post_init__ refuses both); bf16 training: no FP8 primary weights;
    # no bf16 moments enumerated (the search adds them only to layouts that do not fit).
    layouts = plan.enumerate_layouts(load_scenario(QWEN), ["megatron"])
    assert not any(_opts(x).get("moe_token_dispatcher_type") == "flex" for x in layouts)
    graphs = [x for x in layouts if _opts(x)["cuda_graph_impl"] != "none"]
    assert graphs and len(graphs) < len(layouts)
    assert all(x.activation_checkpointing != "full" and "moe" not in x.recompute
               for x in graphs)
    assert all(_opts(x)["cuda_graph_scope"] == ("attn", "moe_router", "moe_preprocess")
               for x in graphs)
    eager = set(layouts)
    for x in graphs:
        twin = plan.Layout(**{**x.__dict__, "options": tuple(sorted(
            {**_opts(x), "cuda_graph_impl": "none"}.items() - {("cuda_graph_scope",
                                                                _opts(x)["cuda_graph_scope"])}
        ))})
        assert twin in eager, x.label()
    assert not any("fp8_param_gather" in _opts(x) or "exp_avg_dtype" in _opts(x)
                   for x in layouts)


def test_flex_dispatchers_only_across_nvlink_domains() -> None:
    # Two servers: HybridEP exactly where the expert-TP x EP group spans both NVLink domains
    # (etp x ep > 8 GPUs), beside the alltoall layout (Megatron-Bridge's MoE configs run
    # HybridEP on H100 too); DeepEP only with FP8 (where the configs use it).
    base = load_scenario(QWEN, ["cluster.nodes=2"])
    layouts = plan.enumerate_layouts(base, ["megatron"])
    flex = [x for x in layouts if _opts(x).get("moe_token_dispatcher_type") == "flex"]
    assert flex and all(x.ep * x.etp > 8 for x in flex)
    crossing = [x for x in layouts if x.ep * x.etp > 8]
    backends = {_opts(x).get("moe_flex_dispatcher_backend") for x in crossing}
    assert backends == {None, "hybridep"}
    fp8 = plan.enumerate_layouts(load_scenario(QWEN, ["cluster.nodes=2",
                                                      "training.precision=fp8"]), ["megatron"])
    assert {_opts(x).get("moe_flex_dispatcher_backend") for x in fp8 if x.ep * x.etp > 8} \
        == {None, "deepep", "hybridep"}
    # Each backend is one more layer profile of each crossing layout, no more.
    assert len({plan._profile_key(x) for x in crossing}) == \
        2 * len({plan._profile_key(x) for x in crossing if "moe_flex_dispatcher_backend"
                 not in _opts(x)})
    # What is enumerated the builder accepts (a HybridEP layout with CUDA graphs).
    x = next(x for x in flex if _opts(x)["moe_flex_dispatcher_backend"] == "hybridep"
             and _opts(x)["cuda_graph_impl"] != "none" and x.pp == 1
             and x.micro_batch_size == 1 and x.activation_checkpointing == "none")
    ev = plan.evaluate_layout(base, x, plan.LinkRates.of(base), math.inf, 32 // x.dp)
    assert ev.refused is None, ev.message


def test_blackwell_runs_graphs_and_fp8_gathers_fp8_weights() -> None:
    # On B200 every MoE layout runs CUDA graphs, as Megatron-Bridge's B200/GB200 MoE configs
    # do (qwen3_workload_base_configs.py); with fp8 every layout gathers FP8 primary weights.
    base = load_scenario(QWEN, ["cluster.gpu=b200", "training.precision=fp8"])
    layouts = plan.enumerate_layouts(base, ["megatron"])
    assert layouts
    assert all(_opts(x)["cuda_graph_impl"] in ("transformer_engine", "full_iteration")
               for x in layouts)
    assert all(_opts(x)["fp8_param_gather"] is True for x in layouts)
    # The whole-iteration graph only with Megatron-Bridge 26.06's rank-budget recipe, which
    # makes it possible over a dropless layer: HybridEP's budget, paged stash, TE's fuser.
    whole = [x for x in layouts if _opts(x)["cuda_graph_impl"] == "full_iteration"]
    assert whole
    for x in whole:
        o = _opts(x)
        assert (o["moe_flex_dispatcher_backend"], o["moe_expert_rank_capacity_factor"],
                o["moe_paged_stash"], o["use_transformer_engine_op_fuser"]) == \
            ("hybridep", 1.5, True, True)
        assert x.ep > 1 and x.etp == 1
    # The bf16 enumeration on H100 has twice the layouts: eager and graphs.
    h100 = plan.enumerate_layouts(load_scenario(QWEN), ["megatron"])
    assert sum(_opts(x)["cuda_graph_impl"] == "none" for x in h100) >= len(h100) // 2


# --------------------------------------------------------------------------- bf16 moments
def test_bf16_moments_make_an_out_of_memory_layout_fit() -> None:
    # ep 4, micro-batch 2, no recomputation on 8 H100: with fp32 moments the estimate is
    # 83.5 GiB of the H100's 79.2 usable, so it does not fit; the planner then tries the same
    # layout with the precision-aware optimizer's bf16 moments (Adam's two moments 2 bytes
    # each instead of 4), which fits and is the one it picks. The simulator agrees on both
    # verdicts, independently of the planner's estimate.
    base = load_scenario(DSV2, ["training.global_batch_size=16"])
    result = plan.search(base, "time", top=1, workers=1, max_simulations=2,
                         compare_baseline=False, pin=_pin(4, 2))
    fp32, bf16 = result.candidates
    assert fp32.status == "memory"
    assert _opts(bf16.layout)["use_precision_aware_optimizer"] is True
    assert (_opts(bf16.layout)["exp_avg_dtype"], _opts(bf16.layout)["exp_avg_sq_dtype"]) == \
        ("bf16", "bf16")
    assert result.ranked() == [bf16]
    assert "bf16-moments" in bf16.layout.label()
    assert fp32.evaluation is not None and bf16.evaluation is not None
    assert bf16.evaluation.states_bytes < fp32.evaluation.states_bytes
    assert simulate(plan.layout_scenario(base, fp32.layout)).summary["oom"]
    assert not simulate(plan.layout_scenario(base, bf16.layout)).summary["oom"]
    row = plan.layout_row(bf16)
    assert (row["exp_avg_dtype"], row["exp_avg_sq_dtype"]) == ("bf16", "bf16")
    assert plan.layout_row(fp32)["exp_avg_dtype"] == ""


def test_no_bf16_moments_where_the_layout_fits() -> None:
    # ep 8, micro-batch 1 fits with fp32 moments: no twin is added (the search as before).
    base = load_scenario(DSV2, ["training.global_batch_size=16"])
    result = plan.search(base, "time", top=1, workers=1, max_simulations=1,
                         compare_baseline=False, pin=_pin(8, 1))
    assert [c.status for c in result.candidates] == ["simulated"]


# --------------------------------------------------------------------------- DeepEP / HybridEP
def test_fused_dispatch_wins_over_alltoall_across_nodes() -> None:
    # ep 16 over two DGX H100 servers: NCCL's all-to-all sends each token once per
    # destination GPU, half of them over the network; HybridEP sends it once per destination
    # server and spreads it over NVLink there, so the step is shorter (simulated: alltoall
    # 0.58 s, HybridEP 0.44 s) and the planner picks it.
    base = load_scenario(DSV2, ["cluster.nodes=2", "training.global_batch_size=32"])
    result = plan.search(base, "time", top=2, workers=1, max_simulations=2,
                         compare_baseline=False, pin=_pin(16, 1))
    ranked = result.ranked()
    assert len(ranked) == 2
    by = {plan.layout_row(c)["token_dispatcher"]: c.summary["step_time_s"]
          for c in ranked if c.summary is not None}
    assert set(by) == {"", "flex-hybridep"}
    assert plan.layout_row(ranked[0])["token_dispatcher"] == "flex-hybridep"
    assert "hybridep" in ranked[0].layout.label()
    assert by["flex-hybridep"] < by[""]


# --------------------------------------------------------------------------- CUDA graph twins
def test_graph_twin_is_simulated_only_where_its_bound_is_shorter() -> None:
    # A CUDA-graph layout saves host time only: the planner simulates it only when its built
    # lower bound (which runs the host clock) beats its eager twin's by HOST_GAIN; it waits
    # while the twin is unsettled, and is not built where the twin does not fit.
    from sim.apps.plan.evaluate import Evaluation
    from sim.apps.plan.levers import HOST_GAIN, Levers

    def layout(impl: str) -> plan.Layout:
        opts = (("cuda_graph_impl", impl),) + (
            (("cuda_graph_scope", ("attn", "moe_router", "moe_preprocess")),)
            if impl != "none" else ())
        return plan.Layout("megatron", 1, 1, 8, 1, 1, 1, "none", opts, 8, 1)

    def built(c: plan.Candidate, bound: float) -> None:
        c.evaluation = Evaluation(None, None, 1.0, 1.0, bound, 1, 0.0)
        c.status = "building"

    eager, graphs = plan.Candidate(0, layout("none"), 4), plan.Candidate(1, layout("te"), 4)
    levers = Levers([eager, graphs], plan.Candidate)
    assert levers.host_verdict(graphs, 0) == ("wait", "")
    assert levers.host_verdict(graphs, 0, force=True) is None
    built(eager, 1.0)
    verdict = levers.host_verdict(graphs, 0)                  # the host issues for 0 s
    assert verdict is not None and verdict[0] == "bound"
    eager.evaluation = Evaluation(None, None, 1.0, 1.0, 1.0, 1, 0.0, host_s=0.2)
    assert levers.host_verdict(graphs, 0) is None           # 20% of the step: build it
    built(graphs, 1.0 - HOST_GAIN / 2)                        # launch latency only
    verdict = levers.host_verdict(graphs, 1)
    assert verdict is not None and verdict[0] == "bound"
    built(graphs, 0.9)                                        # host-bound: simulate
    assert levers.host_verdict(graphs, 1) is None
    eager.status = "memory"
    assert levers.host_verdict(graphs, 0) == (
        "memory", "implied (the same layout without CUDA graphs does not fit)")
    assert levers.host_verdict(eager, 1) is None              # no twin of its own


def test_activation_offloading_is_the_next_lever_where_bf16_moments_do_not_fit() -> None:
    # pp 2 x vp 2, ep 4, micro-batch 4: out of memory with fp32 moments and with bf16 ones
    # (the activations of the micro-batches in flight), so the bf16 twin gets a twin of its
    # own with the experts' activations offloaded to host memory, which fits and is the one
    # the planner keeps. The simulator agrees on both verdicts.
    base = load_scenario(DSV2, ["training.global_batch_size=128"])
    result = plan.search(base, "time", top=1, workers=1, max_simulations=3,
                         compare_baseline=False,
                         pin=dict(_pin(4, 4), **{"parallelism.pp": 2, "parallelism.vp": 2}))
    fp32, bf16, offload = result.candidates
    assert fp32.status == bf16.status == "memory"
    assert _opts(bf16.layout)["use_precision_aware_optimizer"] is True
    opts = _opts(offload.layout)
    assert opts["fine_grained_activation_offloading"] is True
    assert tuple(opts["offload_modules"]) == ("expert_fc1", "moe_act")
    assert "offload(expert_fc1,moe_act)" in offload.layout.label()
    assert plan.layout_row(offload)["offload_modules"] == "expert_fc1;moe_act"
    assert result.ranked() == [offload]
    assert simulate(plan.layout_scenario(base, bf16.layout)).summary["oom"]
    assert not simulate(plan.layout_scenario(base, offload.layout)).summary["oom"]


def test_rank_budget_recipe_takes_the_host_out_of_a_graphed_blackwell_step() -> None:
    # Qwen3-30B-A3B on eight GB200 as the model zoo runs it (per-layer TE graphs, HybridEP,
    # micro-batch 1: the Grace host paces the eager experts). The planner's rank-budget option
    # set on the same layout runs the whole iteration as one graph (Megatron-Bridge 26.06):
    # faster, and it fits.
    name = "qwen3-30b-a3b-megatron-ep8-a2a-overlap-8xgb200"
    base = load_scenario(name)
    mine = [x for x in plan.enumerate_layouts(base, ["megatron"])
            if _opts(x)["cuda_graph_impl"] == "full_iteration" and x.ep == 8 and x.dp == 8
            and x.micro_batch_size == 1 and _opts(x).get("moe_a2a_overlap")
            and x.activation_checkpointing == "none" and x.cp == 1 and x.tp == 1]
    assert mine
    sets = [f"framework.{k}={list(v) if isinstance(v, tuple) else v}"
            for k, v in _opts(mine[0]).items()]
    recipe = simulate(load_scenario(name, sets)).summary
    given = simulate(base).summary
    assert recipe["step_time_s"] < 0.5 * given["step_time_s"]
    assert not recipe["oom"]
