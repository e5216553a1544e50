"""The framework registry: the built-ins, registration, and docs/adding-a-framework.md.

The walk-through test runs every ``python`` block of the doc, in order, so the doc cannot rot:
it registers the toy framework, simulates and plans over it, and unregisters it; the checks
below it hold the toy to closed forms (a single stream overlaps nothing; a ring all-reduce
moves 2(n-1)/n of the buffer per rank).
"""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict

from sim import scenario as config
from sim.frameworks import JobContext, registry
from sim.frameworks.registry import FrameworkEntry, register_framework, unregister_framework
from sim.scenario import ScenarioError, scenario_from_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding-a-framework.md"
BUILTINS = ("ddp", "fsdp2", "megatron", "deepspeed", "fairscale")


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _scenario(framework: dict[str, Any], gpus: int = 8) -> dict[str, Any]:
    # The doc's toy job, with NCCL pinned to ring / Simple so the bytes have a closed form.
    return {"name": "toy", "model": {"layers": 4, "hidden": 1024, "heads": 8,
                                     "ffn_hidden": 2816, "vocab": 32000},
            "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": gpus},
            "framework": framework, "nccl": {"algo": "ring", "proto": "simple"},
            "training": {"seq_len": 1024, "micro_batch_size": 2, "global_batch_size": 32}}


@pytest.fixture
def walkthrough():
    """The doc's blocks run up to and including "Run it"; the toy is unregistered after."""
    blocks = _doc_blocks()
    assert len(blocks) == 7, "the walk-through's steps changed: update this test"
    ns: dict[str, Any] = {}
    try:
        for block in blocks[:5]:
            exec(compile(block, str(DOC), "exec", dont_inherit=True), ns)
        yield ns, blocks
    finally:
        if "toy" in registry.names():
            unregister_framework("toy")


def test_the_doc_walkthrough_runs(walkthrough):
    ns, blocks = walkthrough
    # Registered: the schema, the loader's messages and the planner know the toy.
    assert registry.names() == BUILTINS + ("toy",)
    schema = json.dumps(config.json_schema())
    assert '"toy"' in schema
    with pytest.raises(ScenarioError, match=r"framework\.grad_dtype: Input should be"):
        scenario_from_dict(_scenario({"name": "toy", "grad_dtype": "fp8"}))
    with pytest.raises(ScenarioError, match=r"framework\.grad_dtype2: unknown key"):
        scenario_from_dict(_scenario({"name": "toy", "grad_dtype2": "fp32"}))
    with pytest.raises(ScenarioError, match=r"\(available: ddp, fsdp2, megatron, "
                                            r"deepspeed, fairscale, toy\)"):
        scenario_from_dict(_scenario({"name": "toi"}))
    summary = ns["summary"]
    assert summary["framework"] == "toy" and summary["step_time_s"] > 0
    # One stream: the all-reduce waits for the backward and the optimizer for it.
    assert summary["comm_time_s"] > 0
    assert summary["exposed_comm_s"] == pytest.approx(summary["comm_time_s"], rel=1e-12)

    exec(compile(blocks[5], str(DOC), "exec", dont_inherit=True), ns)  # plan over it
    result = ns["result"]
    ranked = result.ranked()
    assert ranked and all(c.layout.framework == "toy" for c in ranked)
    assert {dict(c.layout.options)["grad_dtype"] for c in result.candidates} == \
        {"bf16", "fp32"}
    assert all(c.layout.tp == c.layout.pp == c.layout.cp == 1 for c in result.candidates)

    exec(compile(blocks[6], str(DOC), "exec", dont_inherit=True), ns)  # remove it
    assert registry.names() == BUILTINS
    with pytest.raises(ScenarioError, match=r"framework\.name: unknown framework 'toy' "
                                            r"\(available: ddp, fsdp2, megatron, deepspeed, "
                                            r"fairscale\)$"):
        scenario_from_dict(_scenario({"name": "toy"}))


def test_toy_single_stream_against_closed_forms(walkthrough):
    """The toy's all-reduce moves what NCCL's ring moves, in its options' dtype, and is all
    exposed; DDP on the same job hides part of its all-reduce behind backward."""
    from sim.api import simulate

    n = 8
    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        run = simulate(scenario_from_dict(_scenario({"name": "toy", "grad_dtype": dtype}, n)))
        size = nbytes * run.context.model.total_params
        # Ring all-reduce: each rank sends 2(n-1)/n of the buffer (nccl-tests
        # PERFORMANCE.md's bus bandwidth factor); inside a node every byte crosses two NVLink
        # hops, GPU to NVSwitch and NVSwitch to GPU: n x 2(n-1)/n x 2 = 4(n-1) buffers.
        assert run.summary["bytes"]["nvlink"] == pytest.approx(4 * (n - 1) * size, rel=1e-9)
        assert run.summary["overlap_fraction"] == pytest.approx(0.0, abs=1e-12)
    ddp = simulate(scenario_from_dict(_scenario({"name": "ddp"}, n))).summary
    assert ddp["exposed_comm_s"] < 0.5 * ddp["comm_time_s"]


def test_builtins_are_the_schema_and_the_builders():
    """The registry's built-ins are the schema's union (before and after the registry is
    imported), and each entry is its package's ``entry.py`` with that package's options,
    builder and search space."""
    assert registry.names() == BUILTINS
    assert config.framework_names() == BUILTINS
    assert tuple(e.options for e in registry.frameworks()) == config.BUILTIN_FRAMEWORK_OPTIONS
    for e in registry.frameworks():
        package = f"sim.frameworks.{e.name}"
        assert importlib.import_module(f"{package}.entry").ENTRY is e
        assert e.options.__module__ == f"{package}.options"
        assert e.build.__module__.startswith(package + ".")
        assert config.options_name(e.options) == e.name
    assert registry.searchable() == BUILTINS


def test_registration_is_checked_and_leaves_the_schema_as_it_was():
    before = json.dumps(config.json_schema())

    class Wrong(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        name: Literal["other"]

    ddp = registry.framework("ddp")
    with pytest.raises(ValueError, match="already registered"):
        register_framework(ddp)
    with pytest.raises(ValueError, match=r"Wrong\.name is 'other', not 'mine'"):
        register_framework(FrameworkEntry("mine", Wrong, ddp.build))
    register_framework(FrameworkEntry("other", Wrong, ddp.build))
    try:
        assert "other" in json.dumps(config.json_schema())
        assert "other" not in registry.searchable()     # no search space: not planned
    finally:
        unregister_framework("other")
    assert json.dumps(config.json_schema()) == before


def test_stage_splits():
    # NeMo's Llama 3.1 405B recipe: 126 layers over pp 8 x vp 8 chunks with the embedding
    # and the loss counted as layers: 128 / 64 = 2 per chunk, the first and last chunk one
    # transformer layer each.
    opts = {"account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True}
    chunks = registry.framework("megatron").chunks(126, 8, 8, opts)
    assert chunks is not None and len(chunks) == 64
    assert [len(c) for c in chunks] == [1] + [2] * 62 + [1]
    assert sum(chunks, []) == list(range(126))
    # Without them 126 layers do not split evenly: the split is refused (None), not guessed.
    assert registry.framework("megatron").chunks(126, 8, 8, {}) is None
    # A framework without a pipeline split keeps every layer on one stage.
    assert registry.framework("ddp").chunks(6, 1, 1, {}) == [list(range(6))]


def test_a_frameworks_model_features_decide_what_it_may_build():
    # JobContext refuses a model by the entry's model_features (the one home the planner
    # reads too): a registered framework that declares experts is let through, one that does
    # not is refused naming the key.
    class Experts(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        name: Literal["moe_toy"]

    ddp = registry.framework("ddp")
    moe = {"name": "m", "model": "mixtral-8x7b",
           "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8},
           "training": {"seq_len": 1024, "micro_batch_size": 1}}
    register_framework(FrameworkEntry("moe_toy", Experts, ddp.build,
                                      model_features=frozenset({"experts"})))
    try:
        s = scenario_from_dict({**moe, "framework": {"name": "moe_toy"}})
        assert JobContext.from_scenario(s, "s.yaml").model.moe is not None
        with pytest.raises(ScenarioError, match=r"model\.experts: ddp does not model"):
            JobContext.from_scenario(scenario_from_dict({**moe, "framework": {"name": "ddp"}}),
                                     "s.yaml")
    finally:
        unregister_framework("moe_toy")
