"""Megatron-FSDP (``framework.use_megatron_fsdp``, sim/frameworks/megatron/fsdp.py) against
closed forms and the order Megatron-Core issues its collectives in.

Independent truths: ZeRO-3 (``optim_grads_params``) moves, every micro-batch, each unit's
parameters twice (all-gathered before its forward and again before its backward) and its
gradients once (reduce-scattered after its backward): 2 x m x 16-bit parameters and
m x gradient bytes a step for m micro-batches; a rank holds 1/(dp x cp) of parameters,
gradients and optimizer state (Rajbhandari et al. 2020, "ZeRO", sec. 5); a unit's forward
cannot start before its gather, and the next unit's gather is dispatched there (prefetch of
one unit, Megatron-FSDP's pre-forward hook).
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario, program

from sim.config.base import ScenarioError
from sim.frameworks import JobContext
from sim.frameworks.megatron.shape import megatron_shape

FSDP = {"name": "megatron", "use_megatron_fsdp": True, "distributed_optimizer": True,
        "overlap_grad_reduce": True, "overlap_param_gather": True}
MICRO_BATCHES = 2


def _scn(fsdp: bool = True, **over: object):
    fw = dict(FSDP) if fsdp else {k: v for k, v in FSDP.items() if k != "use_megatron_fsdp"}
    fw.update(over)
    return megatron_scenario({"tp": 1}, gbs=8 * MICRO_BATCHES, framework=fw)


def _ops(s, collective: str):
    return [o for o in program(s).ops if o.name.startswith("fsdp") and
            o.collective == collective]


def test_bytes_moved_are_zero3s() -> None:
    s = _scn()
    sh = megatron_shape(JobContext.from_scenario(s))
    n = sh.stage_params(0)
    gathers, scatters = _ops(s, "all_gather"), _ops(s, "reduce_scatter")
    # embed, 32 layers, head: a gather forward and one backward, a reduce-scatter, per mb.
    assert len(gathers) == 2 * MICRO_BATCHES * 34 and len(scatters) == MICRO_BATCHES * 34
    assert sum(o.nbytes for o in gathers) == pytest.approx(2 * MICRO_BATCHES * sh.act * n)
    assert sum(o.nbytes for o in scatters) == pytest.approx(MICRO_BATCHES * sh.grad_bytes * n)


def test_a_rank_holds_a_shard_of_everything() -> None:
    full = megatron_shape(JobContext.from_scenario(_scn(fsdp=False))).initial_memory(0)
    sh = megatron_shape(JobContext.from_scenario(_scn()))
    mem = sh.initial_memory(0)
    dp = sh.dp * sh.cp
    assert dp == 8
    for key in ("parameters", "gradients"):
        assert mem[key] == pytest.approx(full[key] / dp)
    # The distributed optimizer already shards the optimizer state over dp x cp.
    assert mem["optimizer"] == pytest.approx(full["optimizer"])
    # Two gathered layers (the running one and the prefetched one) and one whole gradient.
    assert mem["buffers"] == pytest.approx((2 * sh.act + sh.grad_bytes) * sh.layer_params)


def test_each_forward_waits_for_its_gather_dispatched_one_unit_ahead() -> None:
    ops = program(_scn()).ops
    by_name = {o.name: o for o in ops}
    order = {id(o): i for i, o in enumerate(ops)}
    g0 = by_name["fsdp param all_gather fwd mb0 0"]
    g1 = by_name["fsdp param all_gather fwd mb0 1"]
    layer0 = next(o for o in ops if g0 in o.deps)
    layer1 = next(o for o in ops if g1 in o.deps)
    assert layer0.phase == layer1.phase == "fwd" and layer0.layer == 0 and layer1.layer == 1
    # Gather 1 is issued right before layer 0's first op (its pre-hook), after gather 0.
    assert order[id(g0)] < order[id(g1)] < order[id(layer0)] < order[id(layer1)]


def test_no_gather_follows_the_optimizer() -> None:
    ops = program(_scn()).ops
    opt = next(i for i, o in enumerate(ops) if o.phase == "optimizer")
    assert not any(o.collective == "all_gather" for o in ops[opt + 1:])


@pytest.mark.parametrize("over,par,key", [
    ({}, {"tp": 1, "pp": 2}, "framework.use_megatron_fsdp"),
    ({"distributed_optimizer": False}, {"tp": 1}, "framework.use_megatron_fsdp"),
    ({"overlap_param_gather": False}, {"tp": 1}, "framework.use_megatron_fsdp"),
    ({"cuda_graph_impl": "local"}, {"tp": 1}, "framework.cuda_graph_impl"),
    ({"delay_wgrad_compute": True}, {"tp": 1}, "framework.delay_wgrad_compute"),
])
def test_refusals_name_the_key(over: dict, par: dict, key: str) -> None:
    fw = dict(FSDP)
    fw.update(over)
    s = megatron_scenario(par, gbs=16, framework=fw)
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        program(s)


def test_simulates_with_its_communication_hidden_behind_compute() -> None:
    from sim.api import simulate

    summary = simulate(_scn()).summary
    assert not summary["oom"] and summary["tokens_per_s_per_gpu"] > 0
    # Every gather is prefetched one unit ahead and every reduce-scatter trails its unit's
    # backward, so at most the first gather and the last reduce-scatter are exposed.
    assert summary["exposed_comm_s"] < 0.5 * summary["comm_time_s"]


def test_unfused_gradient_accumulation_adds_one_kernel_a_linear() -> None:
    # gradient_accumulation_fusion off (NeMo's Megatron-FSDP recipes): each linear's wgrad GEMM
    # writes a 16-bit gradient (2 bytes a weight) that one kernel adds into the fp32 main_grad
    # (read 4 + 2, write 4 bytes a weight); fused, the GEMM accumulates and no kernel is added.
    from sim.workload.megatron_ops import MegatronLayout, mlp_block
    from sim.workload.model import ModelSpec

    m = ModelSpec.from_ref("llama3-8b")
    fused = mlp_block(m, MegatronLayout(), 1, 4096)[1]
    unfused = mlp_block(m, MegatronLayout(grad_accumulation_fusion=False), 1, 4096)[1]
    adds = [k for k in unfused.backward if k.name.endswith("main_grad_add")]
    assert not [k for k in fused.backward if k.name.endswith("main_grad_add")]
    assert [k.name for k in adds] == ["fc2.main_grad_add", "fc1.main_grad_add"]
    weights = {"fc1": 2 * m.ffn_hidden * m.hidden, "fc2": m.ffn_hidden * m.hidden}
    for k in adds:
        assert k.nbytes == pytest.approx(10 * weights[k.name.split(".")[0]])   # fp32 main_grad
    wgrad = next(k for k in unfused.backward if k.name == "fc1.wgrad")
    assert wgrad.writes[0].nbytes == pytest.approx(2 * weights["fc1"])


def test_unfused_accumulation_into_16_bit_main_grads() -> None:
    # grad_reduce_in_fp32 off: Megatron's main_grad buffers are bf16, so the add reads 2 + 2
    # and writes 2 bytes a weight.
    from sim.workload.megatron_ops import MegatronLayout, mlp_block
    from sim.workload.model import ModelSpec

    m = ModelSpec.from_ref("llama3-8b")
    lay = MegatronLayout(grad_accumulation_fusion=False, main_grad_bytes=2)
    add = next(k for k in mlp_block(m, lay, 1, 4096)[1].backward
               if k.name == "fc2.main_grad_add")
    assert add.nbytes == pytest.approx(6 * m.ffn_hidden * m.hidden)


@pytest.mark.parametrize("gpu,fp8_gather,share", [
    ("h100-sxm", False, 1.0),   # gathered in 16 bits: cast every micro-batch
    ("b200", False, 1.0),
    ("b200", True, 0.0),        # FP8 parameters on Blackwell: used as they arrive
])
def test_weight_casts_follow_what_the_gather_brings(gpu: str, fp8_gather: bool,
                                                    share: float) -> None:
    from conftest import make_scenario

    s = make_scenario({
        "model": {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 4096, "vocab": 1024},
        "cluster": {"gpu": gpu, "nodes": 1, "gpus_per_node": 8},
        "framework": {**FSDP, "fp8_param_gather": fp8_gather, "fp8_recipe": "tensorwise"},
        "parallelism": {"tp": 1},
        "training": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 32,
                     "precision": "fp8", "activation_checkpointing": "none"}})
    assert megatron_shape(JobContext.from_scenario(s)).lay.weight_cast_share == share


# ---------------------------------------------------------------- with experts
# 4 layers, 8 experts of width 1024, top-2 (test_moe_rank_memory.py's small model), on two
# 8-GPU nodes: EP 4 x expert-dp 4 for the experts, dp 16 for the rest (MoE parallel folding).
TINY_MOE = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
            "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}


def _moe(fsdp: bool = True, ep: int = 4, **over: object):
    fw = dict(FSDP) if fsdp else {k: v for k, v in FSDP.items() if k != "use_megatron_fsdp"}
    fw.update(over)
    return megatron_scenario({"tp": 1, "ep": ep}, gbs=16 * MICRO_BATCHES, framework=fw,
                             model=TINY_MOE, nodes=2)


def test_experts_are_sharded_over_expert_dp_and_move_zero3s_bytes() -> None:
    # Each MoE layer's routed experts (8 / ep = 2 local experts of 3 x 1024 x 1024 weights)
    # are gathered over expert-dp before the layer's forward and its backward and their
    # gradients reduce-scattered there, every micro-batch; the rest over dp x cp. A rank
    # holds 1/expert-dp of the experts' 16-bit weights and gradients and 1/dp of the rest.
    s = _moe()
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.moe is not None and (sh.dp, sh.moe.edp) == (16, 4)
    e, n = sh.stage_expert_params(0), sh.stage_params(0)
    assert e == 4 * 2 * 3 * 1024 * 1024
    ops = [o for o in program(s).ops if o.name.startswith("fsdp expert")]
    gathers = [o for o in ops if o.collective == "all_gather"]
    scatters = [o for o in ops if o.collective == "reduce_scatter"]
    assert len(gathers) == 2 * MICRO_BATCHES * 4 and len(scatters) == MICRO_BATCHES * 4
    assert sum(o.nbytes for o in gathers) == pytest.approx(2 * MICRO_BATCHES * sh.act * e)
    assert sum(o.nbytes for o in scatters) == pytest.approx(MICRO_BATCHES * sh.grad_bytes * e)
    assert all(len(o.group) == 4 for o in ops)
    dense = [o for o in program(s).ops if o.name.startswith("fsdp param all_gather")]
    assert sum(o.nbytes for o in dense) == pytest.approx(2 * MICRO_BATCHES * sh.act * n)
    assert all(len(o.group) == 16 for o in dense)
    mem, full = sh.initial_memory(0), megatron_shape(
        JobContext.from_scenario(_moe(fsdp=False))).initial_memory(0)
    assert mem["parameters"] == pytest.approx(sh.act * (n / 16 + e / 4))
    assert mem["gradients"] == pytest.approx(sh.grad_bytes * (n / 16 + e / 4))
    assert mem["optimizer"] == pytest.approx(full["optimizer"])


def test_an_moe_layer_waits_for_both_its_gathers() -> None:
    ops = program(_moe()).ops
    by_name = {o.name: o for o in ops}
    dense, expert = by_name["fsdp param all_gather fwd mb0 1"], \
        by_name["fsdp expert param all_gather fwd mb0 1"]
    hook = next(o for o in ops if dense in o.deps)
    assert expert in hook.deps and hook.layer == 1 and hook.phase == "fwd"


def test_whole_experts_move_nothing() -> None:
    # Expert TP 2 x EP 8 over the 16 GPUs: expert-dp 1, each rank's expert shards are its
    # own, whole; only the rest of the model is gathered and reduced (over dp 8).
    s = megatron_scenario({"tp": 2, "ep": 8, "etp": 2, "sequence_parallel": True},
                          gbs=16 * MICRO_BATCHES, framework=dict(FSDP), model=TINY_MOE,
                          nodes=2)
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.moe is not None and (sh.dp, sh.moe.edp) == (8, 1)
    ops = program(s).ops
    assert not any(o.name.startswith("fsdp expert") for o in ops)
    assert any(o.name.startswith("fsdp param all_gather") for o in ops)
    assert sh.initial_memory(0)["gradients"] == pytest.approx(
        sh.grad_bytes * (sh.stage_params(0) / 8 + sh.stage_expert_params(0)))


@pytest.mark.parametrize("over,more,key", [
    ({"moe_a2a_overlap": True}, {}, "framework.moe_a2a_overlap"),
    ({}, {"precision": "fp8"}, "framework.use_megatron_fsdp"),
])
def test_refusals_with_experts_name_the_key(over: dict, more: dict, key: str) -> None:
    fw = {**FSDP, **over}
    s = megatron_scenario({"tp": 1, "ep": 4}, gbs=32, framework=fw, model=TINY_MOE, nodes=2,
                          **more)
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        program(s)
