"""``fabricsim plan`` pulls Megatron-FSDP as the memory lever of a dense Megatron layout without
a pipeline (sim/frameworks/megatron/search.py ``megatron_memory_lever``,
sim/apps/plan/levers.py; docs/planner.md).

Llama 3 70B on 64 H100 (the shipped Megatron scenario, global batch 64, so one micro-batch a
replica): each search is pinned to one parallel layout and one micro-batch setting, and
builds and simulates in about a second.
"""

from __future__ import annotations

from typing import Any

from sim.api import simulate
from sim.apps import plan
from sim.scenario import load_scenario

SCENARIO = "llama3-70b-megatron-tp8pp4-64xh100"
GIB = 2**30


def _base(*more: str) -> Any:
    return load_scenario(SCENARIO, ["training.global_batch_size=64", *more])


def _pin(tp: int, pp: int, ac: str = "full") -> dict[str, Any]:
    return {"parallelism.tp": tp, "parallelism.pp": pp, "parallelism.cp": 1,
            "training.micro_batch_size": 1, "training.activation_checkpointing": ac}


def test_fsdp_makes_a_layout_without_a_pipeline_fit() -> None:
    # TP1 PP1 DP64: with the distributed optimizer each GPU still holds the whole model's
    # 16-bit weights and fp32 gradients, 70.6e9 x (2 + 4) bytes = 394 GiB, plus its 1/64 of
    # the fp32 master weights and Adam moments (12 bytes / 64): about 406 GiB of model
    # states on an 80 GB part. Megatron-FSDP shards all of it over the 64 ranks:
    # 70.6e9 x 18 / 64 bytes = 18.5 GiB, plus two layers' gathered weights and one layer's
    # gradients. The planner tries the twin only because the layout does not fit, and the
    # simulator agrees on both verdicts.
    base = _base()
    result = plan.search(base, "time", top=1, workers=1, max_simulations=2,
                         compare_baseline=False, pin=_pin(1, 1), frameworks=["megatron"])
    plain, fsdp = result.candidates
    assert plain.status == "memory" and "model states" in plain.reason
    assert dict(fsdp.layout.options)["use_megatron_fsdp"] is True
    assert "fsdp" in fsdp.layout.label().split()
    assert result.ranked() == [fsdp]
    assert plain.evaluation is not None and fsdp.evaluation is not None
    params = 70.55e9
    assert abs(plain.evaluation.states_bytes - params * (6 + 12 / 64)) < 0.03 * \
        plain.evaluation.states_bytes
    assert params * 18 / 64 < fsdp.evaluation.states_bytes < 0.1 * \
        plain.evaluation.states_bytes
    assert simulate(plan.layout_scenario(base, plain.layout)).summary["oom"]
    assert not simulate(plan.layout_scenario(base, fsdp.layout)).summary["oom"]
    assert "use_megatron_fsdp=True" in plan.layout_row(fsdp)["options"]


def test_no_fsdp_twin_where_the_layout_fits_or_has_a_pipeline() -> None:
    # TP8 PP1 fits as it is (1/8 of the model's states a GPU): no twin, the search as
    # before. TP1 PP4 does not fit but has a pipeline, which this model of Megatron-FSDP
    # does not run (nor do NeMo's FSDP recipes): no twin either.
    fits = plan.search(_base(), "time", top=1, workers=1, max_simulations=1,
                       compare_baseline=False, pin=_pin(8, 1), frameworks=["megatron"])
    assert [c.status for c in fits.candidates] == ["simulated"]
    piped = plan.search(_base(), "time", top=1, workers=1, max_simulations=1,
                        compare_baseline=False, pin={**_pin(1, 4), "parallelism.vp": 1},
                        frameworks=["megatron"])
    assert [c.status for c in piped.candidates] == ["memory"]
    assert not dict(piped.candidates[0].layout.options).get("use_megatron_fsdp")


def test_no_fsdp_twin_beside_the_scenarios_cuda_graphs() -> None:
    # Megatron-Bridge turns CUDA graphs off with Megatron-FSDP and this model refuses the
    # pair, so a scenario that runs graphs gets no FSDP twin (its own options hold; without
    # recomputation, which Megatron refuses beside whole-layer graphs).
    result = plan.search(_base("framework.cuda_graph_impl=local"), "time", top=1,
                         workers=1, max_simulations=1, compare_baseline=False,
                         pin=_pin(1, 1, "none"), frameworks=["megatron"])
    assert [c.status for c in result.candidates] == ["memory"]


def test_fsdp_follows_bf16_moments_for_an_moe_layout_without_a_pipeline() -> None:
    # Qwen3-30B-A3B on one DGX H100 at EP4 (expert-dp 2), micro-batch 1, no recomputation:
    # with the distributed optimizer each GPU keeps its quarter of the experts' 16-bit
    # weights and fp32 gradients whole, 92 GiB of model states with fp32 moments (more than
    # the H100's 79.2 usable) and 70 with bf16 ones (too little left for the activations);
    # Megatron-FSDP shards them over expert-dp (and the rest over dp 8), 45 GiB, and the
    # layout fits. The twins come in the lever's order.
    base = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100",
                         ["training.global_batch_size=32"])
    pin = {"parallelism.tp": 1, "parallelism.pp": 1, "parallelism.cp": 1,
           "parallelism.ep": 4, "framework.cuda_graph_impl": "none",
           "training.micro_batch_size": 1, "training.activation_checkpointing": "none",
           "framework.moe_a2a_overlap": False}
    result = plan.search(base, "time", top=1, workers=1, max_simulations=4,
                         compare_baseline=False, pin=pin, frameworks=["megatron"])
    fp32, bf16, fsdp = result.candidates
    assert (fp32.status, bf16.status, fsdp.status) == ("memory", "memory", "simulated")
    assert "bf16-moments" in bf16.layout.label()
    assert {"fsdp", "bf16-moments"} <= set(fsdp.layout.label().split())
    assert fp32.evaluation and bf16.evaluation and fsdp.evaluation
    states = [c.evaluation.states_bytes / GIB for c in (fp32, bf16, fsdp)]
    assert states[0] > 79.2 > states[1] > states[2]
    assert fp32.reason.startswith("model states") and bf16.reason.startswith("estimate")
    assert not simulate(plan.layout_scenario(base, fsdp.layout)).summary["oom"]
