"""Megatron-Bridge's H100 sanity check of Qwen3-30B-A3B with ``moe_permute_fusion`` off (the
``mbridge-docs-*-unfused-permute`` row of sim/catalog/reference/published_moe.yaml; Megatron-
Bridge docs/training/moe-optimization.md @ 29ec9101b).

Independent truths: the same 16-GPU layout measured 45.65 s a step with PyTorch's
permutations against 41.36 s with Transformer Engine's fused ones (PR 3868, eager), so the
unfused path costs time, at most that 10.4% (the two runs also differ in their CUDA-graph
scopes, which measured 1.5% apart on this layout); its peak allocated memory was
61.351 GB (Megatron-Bridge divides bytes by 1e9: 57.14 GiB).
"""

from __future__ import annotations

import copy

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of
from sim.scenario import ScenarioError

ROW = "mbridge-docs-qwen3-30b-a3b-16xh100-bf16-ep16-alltoall-unfused-permute"


def _row() -> dict:
    return copy.deepcopy({r["id"]: r for r in entries()}[ROW])


def test_unfused_permutation_costs_time_within_the_measured_difference() -> None:
    row = _row()
    unfused = simulate(scenario_of(row)).summary
    row["scenario"]["framework"]["moe_permute_fusion"] = True
    fused = simulate(scenario_of(row)).summary
    ratio = unfused["step_time_s"] / fused["step_time_s"]
    assert 1.0 < ratio <= 45.65 / 41.36
    # Allocated peak against the published 61.351e9 bytes.
    assert unfused["peak_memory_gib"] == pytest.approx(61.351e9 / 2**30, rel=0.05)


def test_unfused_permutation_is_refused_off_the_alltoall_dispatcher() -> None:
    row = _row()
    row["scenario"]["framework"]["moe_token_dispatcher_type"] = "allgather"
    with pytest.raises(ScenarioError, match="framework.moe_permute_fusion"):
        simulate(scenario_of(row))
