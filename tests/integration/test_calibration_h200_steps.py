"""The composed model against the single-GPU H200 steps measured on 2026-12-04 (issue 11).

``sim/catalog/calibration/h200-train-steps.json`` (``tools/measure_train_step.py``): Hugging
Face LlamaForCausalLM at Llama 3.2 1B and at Llama 3 8B's layer with 4 layers, plain bf16
autocast (DDP's code path on one GPU) and FSDP2 on one rank, with and without full
recomputation, eager and ``torch.compile``. Nothing was fitted to these steps. Targets are the
issue's: step time MAPE <= 8% with a mean signed error within +-4%, compile's gain within
5 points. ``h200-train-steps-profiled.json`` holds the same runs again with their kernels.
The runs set ``use_cache=False``; the scenarios keep Hugging Face's default, whose two
key/value copies a layer the model charges eagerly (about 1 GB of traffic in the 1B step,
under 0.1% of it; the measured peaks with and without the cache were equal).
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from conftest import make_scenario

from sim import catalog
from sim.api import simulate

DATA = catalog.calibration("h200-train-steps.json")
RUNS = {r["name"]: r for r in DATA["runs"]}
PROFILED = {r["name"]: r for r in catalog.calibration("h200-train-steps-profiled.json")["runs"]}
EAGER = [n for n, r in RUNS.items() if not r["compiled"]]
assert DATA["meta"]["torch"].startswith("2.11") and DATA["meta"]["gpu"] == "NVIDIA H200"


def scenario_of(run: dict[str, Any]):
    """The run as a scenario: plain autocast is DDP's code on one GPU (``compile``: the whole
    model); FSDP2 wraps Hugging Face's code and compiles each decoder layer, the loss eager."""
    c = run["config"]
    if run["wrapper"] == "plain":
        framework: dict[str, Any] = {"name": "ddp", "compile": run["compiled"] == "model"}
    else:
        framework = {"name": "fsdp2", "model_code": "huggingface",
                     "compile": run["compiled"] == "layers"}
        if run["compiled"]:
            framework["compile_loss"] = False
    return make_scenario({
        "name": run["name"],
        "model": {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"],
                  "heads": c["num_attention_heads"], "kv_heads": c["num_key_value_heads"],
                  "ffn_hidden": c["intermediate_size"], "vocab": c["vocab_size"],
                  "tied_embeddings": c["tie_word_embeddings"]},
        "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "nics_per_node": 0},
        "framework": framework,
        "training": {"seq_len": run["seq"], "micro_batch_size": run["micro_batch"],
                     "activation_checkpointing": "full" if run["activation_checkpointing"]
                     else "none", "torch_version": "2.11"}})


_SUMMARIES: dict[str, dict[str, Any]] = {}


def summary(name: str) -> dict[str, Any]:
    if name not in _SUMMARIES:
        _SUMMARIES[name] = simulate(scenario_of(RUNS[name])).summary
    return _SUMMARIES[name]


def step_error(name: str) -> float:
    return summary(name)["step_time_s"] / RUNS[name]["step_s"] - 1.0


@pytest.mark.parametrize("name", sorted(RUNS))
def test_parameter_count_matches_the_measured_model(name: str) -> None:
    assert summary(name)["model_params"] == RUNS[name]["params"]


@pytest.mark.parametrize("name", EAGER)
def test_eager_step_within_8_percent(name: str) -> None:
    assert abs(step_error(name)) <= 0.08


def test_eager_steps_are_not_optimistic_on_average() -> None:
    errors = [step_error(n) for n in EAGER]
    assert abs(statistics.mean(errors)) <= 0.04
    assert statistics.mean(abs(e) for e in errors) <= 0.08


@pytest.mark.parametrize("name", EAGER)
def test_eager_reserved_peak_within_10_percent(name: str) -> None:
    s = summary(name)
    assert s["peak_reserved_gib"] * 2**30 == pytest.approx(RUNS[name]["peak_reserved_bytes"],
                                                           rel=0.10)


def test_fsdp2_per_layer_compile_gain_within_5_points() -> None:
    measured = 1 - RUNS["1b-fsdp2-compile"]["step_s"] / RUNS["1b-fsdp2"]["step_s"]
    simulated = 1 - (summary("1b-fsdp2-compile")["step_time_s"]
                     / summary("1b-fsdp2")["step_time_s"])
    assert simulated == pytest.approx(measured, abs=0.05)


@pytest.mark.parametrize("model", ["1b", "8b4l"])
def test_whole_model_compile_gain_within_5_points(model: str) -> None:
    measured = 1 - RUNS[f"{model}-compile"]["step_s"] / RUNS[f"{model}-plain"]["step_s"]
    simulated = 1 - (summary(f"{model}-compile")["step_time_s"]
                     / summary(f"{model}-plain")["step_time_s"])
    assert simulated == pytest.approx(measured, abs=0.05)


@pytest.mark.parametrize("name", ["1b-compile", "8b4l-compile", "1b-plain", "8b4l-plain"])
def test_attention_kernels_of_the_profiled_step(name: str) -> None:
    """The fused-attention kernels of one profiled step (cuDNN's, by name) against the sim's
    priced attention kernels: whole-model compile hands SDPA Hugging Face's mask (the masked
    slowdown was read from ``h200-masked-attention.json``, a different measurement). Eager
    steps' backward is 15-25% fast in the model (the H200 fit's attention form, head dim 64),
    hence the wider bound there."""
    from sim.workload.block_pricing import kernel_time
    from sim.workload.kernels import Style
    from sim.workload.layer_ops import attention_block

    run = PROFILED[name]
    measured = sum(k["us"] for k in run["profile"]["top"] if "sdpa" in k["name"]) / 1e6
    ctx = simulate(scenario_of(run)).context
    compiled = run["compiled"] == "model"
    block = attention_block(ctx.model, Style("autocast", compile=compiled, sdpa_mask=compiled),
                            ctx.micro_batch, ctx.seq, kv_cache=False)
    simulated = ctx.model.layers * sum(kernel_time(ctx.compute, k)
                                       for k in block.forward + block.backward
                                       if k.klass == "attention")
    assert simulated == pytest.approx(measured, rel=0.10 if compiled else 0.20)
