"""HybridEP's rank budget (``moe_expert_rank_capacity_factor``), paged stashing and
full-iteration CUDA graphs over a dropless MoE (:mod:`sim.frameworks.megatron.moe_rank_budget`).

Independent truths: Megatron-Core's ``_HybridEPManager.setup_metadata`` (the budget is
``int(tokens x top_k x factor)`` rounded up to 256 rows on the grouped-tensor path), its
refusals (``TransformerConfig.__post_init__``: the budget needs the hybridep backend and the
operation fuser, paged
stashing needs the budget and excludes offloading the experts' activations;
``cuda_graph_modules`` must be empty under ``cuda_graph_impl="full_iteration"``), and
conservation: what the budget adds to the saved activations is the experts' saved bytes
times (budget / rows - 1), what the stash pool adds is the same bytes times (factor - 1), so
the two differences stand in that ratio whatever the experts save.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.moe_rank_budget import budget_rows
from sim.scenario import ScenarioError

MOE = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
       "vocab": 32000, "experts": 32, "experts_per_token": 4, "moe_ffn_hidden": 512}
K, SEQ = 4, 1024


def _scn(model: dict | None = None, **fw: object):
    fw = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
          "distributed_optimizer": True, "use_transformer_engine_op_fuser": True, **fw}
    return megatron_scenario({"tp": 1, "ep": 8}, 8, model=model or MOE, seq=SEQ, nodes=1, gpn=8,
                             framework={"name": "megatron", **fw})


def _program(**fw: object):
    return build_program(JobContext.from_scenario(_scn(**fw), "s.yaml"))


def _activations(p) -> float:
    return sum(n for op in p.ops for cat, n in op.alloc if cat == "activations")


def test_the_budget_takes_the_host_off_the_dispatch() -> None:
    # Dropless HybridEP waits on the host for the token counts before each dispatch
    # (cuda_sync_point); with a budget the counts stay on the device.
    syncs = [op.name for op in _program().ops if op.host_sync and "token count" in op.name]
    assert syncs
    assert not [op for op in _program(moe_expert_rank_capacity_factor=1.5).ops
                if op.host_sync and "token count" in op.name]


def test_budget_and_stash_hold_the_experts_saved_bytes_at_their_closed_forms() -> None:
    base = _activations(_program())
    f = 1.5
    budget = _activations(_program(moe_expert_rank_capacity_factor=f))
    stash = _activations(_program(moe_expert_rank_capacity_factor=f, moe_paged_stash=True,
                                  moe_paged_stash_buffer_size_factor_cuda=1.2))
    rows = SEQ * K                         # balanced: every copy lands on some rank
    assert budget_rows(SEQ, K, f) == 6144  # int(1024 x 4 x 1.5), already a multiple of 256
    scale = budget_rows(SEQ, K, f) / rows
    assert budget > stash > base
    assert (budget - base) / (stash - base) == pytest.approx((scale - 1) / 0.2, rel=1e-9)


def test_paged_stash_pays_one_copy_each_way_and_never_speeds_the_step() -> None:
    fw = {"moe_expert_rank_capacity_factor": 1.5}
    # Experts wide enough for the GPU to pace the step (at MOE's width the host's Python does,
    # and the stash's copies hide behind it).
    wide = dict(MOE, moe_ffn_hidden=8192)
    plain = simulate(_scn(wide, **fw)).summary["step_time_s"]
    stashed = simulate(_scn(wide, **fw, moe_paged_stash=True)).summary["step_time_s"]
    assert stashed > plain
    names = [op.name for op in _program(**fw, moe_paged_stash=True).ops]
    assert names == [op.name for op in _program(**fw).ops]   # inside the experts' ops


def test_full_iteration_graph_over_a_dropless_layer_needs_the_budget() -> None:
    with pytest.raises(ScenarioError, match="moe_expert_rank_capacity_factor"):
        _program(cuda_graph_impl="full_iteration")
    old = simulate(_scn(moe_expert_rank_capacity_factor=1.5, cuda_graph_impl="local",
                        cuda_graph_scope=["full_iteration"])).summary
    new = simulate(_scn(moe_expert_rank_capacity_factor=1.5,
                        cuda_graph_impl="full_iteration")).summary
    # Megatron-Core 2026's cuda_graph_impl "full_iteration" is local + scope full_iteration.
    assert new["step_time_s"] == old["step_time_s"]
    assert new["peak_memory_gib"] == old["peak_memory_gib"]
    eager = simulate(_scn(moe_expert_rank_capacity_factor=1.5)).summary["step_time_s"]
    assert new["step_time_s"] <= eager
    with pytest.raises(ScenarioError, match="cuda_graph_scope must be empty"):
        _program(moe_expert_rank_capacity_factor=1.5, cuda_graph_impl="full_iteration",
                 cuda_graph_scope=["attn"])


@pytest.mark.parametrize(("fw", "key"), [
    ({"moe_flex_dispatcher_backend": "deepep"}, "moe_expert_rank_capacity_factor"),
    ({"moe_token_dispatcher_type": "alltoall"}, "moe_expert_rank_capacity_factor"),
])
def test_the_budget_is_hybrideps(fw, key) -> None:
    with pytest.raises(ScenarioError, match=f"framework.{key}"):
        _program(moe_expert_rank_capacity_factor=1.5, **fw)


def test_refusals_name_their_key() -> None:
    with pytest.raises(ScenarioError, match="framework.moe_paged_stash"):
        _program(moe_paged_stash=True)
    # Megatron-Core core_r0.18.0: the budget runs on the operation fuser's grouped tensors.
    with pytest.raises(ScenarioError, match="use_transformer_engine_op_fuser"):
        _program(moe_expert_rank_capacity_factor=1.5, use_transformer_engine_op_fuser=False)
    s = _scn(moe_expert_rank_capacity_factor=1.5)
    s = s.model_copy(update={"training": s.training.model_copy(update={
        "routing": s.training.routing.model_copy(update={"distribution": "zipf", "s": 1.0})})})
    with pytest.raises(ScenarioError, match="skewed routing"):
        build_program(JobContext.from_scenario(s, "s.yaml"))
    # TEGroupedMLP._is_fused_impl_supported: no expert tensor parallelism under the fuser.
    etp = megatron_scenario({"tp": 1, "ep": 4, "etp": 2}, 8, model=MOE, seq=SEQ, nodes=1, gpn=8,
                            framework={"name": "megatron", "use_transformer_engine_op_fuser": True})
    with pytest.raises(ScenarioError, match="framework.use_transformer_engine_op_fuser"):
        build_program(JobContext.from_scenario(etp, "s.yaml"))
