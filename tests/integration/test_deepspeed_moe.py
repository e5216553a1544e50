"""DeepSpeed-MoE beside ZeRO 1-2 (issue 14 item 3) against closed forms and DeepSpeed's own
rules (commit 38327e07).

Independent truths: ``sharded_moe.py`` ``_capacity`` (ceil(tokens / experts x capacity_factor
x k), at least ``min_capacity``) and ``_AllToAll`` (``all_to_all_single`` of the whole
capacity-padded [e, c, h] buffer: ``(ep - 1) / ep`` of it leaves each rank, twice per pass);
issue 14's closed form (dropless, balanced routing: 2 x tokens x top-k x hidden x bytes x
(ep - 1) / ep per MoE layer per pass); ``groups.py`` ``_create_expert_and_data_parallel``'s
documented example (16 ranks, ep 2: EP groups [0, 1], [2, 3], ...; expert-DP groups
[0, 2, ..., 14], [1, 3, ..., 15]); ``stage_1_and_2.py`` (expert slices of a gradient bucket
all-reduced over the expert-DP group, each parameter group's partition over its own group);
``engine.py`` ("MoE not supported with Stage 3"); Mixtral 8x7B's expert shapes (8 experts of
3 x 4096 x 14336, 32 layers).
"""

from __future__ import annotations

import math

import pytest
from conftest import make_scenario
from helpers import program

from sim.api import simulate
from sim.frameworks.deepspeed.moe import MOE_GROUP_MAX_ELEMENTS
from sim.frameworks.deepspeed.moe_blocks import capacity
from sim.program.ir import Op, Program
from sim.scenario import ModelDims, ScenarioError
from sim.workload.model import ModelSpec

# 4 layers, 8 experts of width 1024, top-2, softmax router.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "mlp": "swiglu", "experts": 8, "experts_per_token": 2,
        "moe_ffn_hidden": 1024}
SEQ, BF16 = 2048, 2


def scn(ep: int = 8, moe: dict | None = None, stage: int = 2, nodes: int = 1, gbs: int = 0,
        model: dict | None = None, routing: dict | None = None, **fw):
    gpus = 8 * nodes
    training = {"seq_len": SEQ, "micro_batch_size": 1, "global_batch_size": gbs or gpus,
                "precision": "bf16"}
    if routing:
        training["routing"] = routing
    return make_scenario({
        "name": "ds-moe", "model": model or TINY,
        "cluster": {"gpu": "h100-sxm", "nodes": nodes, "gpus_per_node": 8,
                    "nics_per_node": 8 if nodes > 1 else 0, "nic_gbps": 400},
        "framework": {"name": "deepspeed", "zero_stage": stage, "moe": moe or {}, **fw},
        "parallelism": {"ep": ep}, "training": training})


def ops(p: Program, kind: str, name: str = "") -> list[Op]:
    return [op for op in p.ops if op.collective == kind and name in op.name]


def a2a_wire_bytes(p: Program) -> float:
    """Bytes one rank sends over all of the step's all-to-alls (its own chunk stays)."""
    return sum(op.nbytes * (len(op.group) - 1) / len(op.group) for op in ops(p, "all_to_all"))


def test_capacity_rule() -> None:
    # _capacity: ceil((tokens / experts) x capacity_factor), top-2/top-k pass factor x k.
    assert capacity(2048, 8, 2, 1.0, 4) == 512
    assert capacity(2048, 8, 2, 1.25, 4) == 640
    assert capacity(2048, 8, 1, 1.0, 4) == 256
    assert capacity(1000, 3, 1, 1.0, 4) == 334              # ceil(333.33)
    assert capacity(8, 8, 1, 1.0, 4) == 4                   # min_capacity floor


@pytest.mark.parametrize("ep,cf", [(8, 1.0), (4, 1.0), (2, 1.25), (8, 2.0)])
def test_padded_all_to_all_bytes(ep: int, cf: float) -> None:
    """2 passes x 2 all-to-alls x e x capacity x hidden x bytes x (ep-1)/ep per MoE layer
    and micro-batch, whatever the routing."""
    p = program(scn(ep=ep, moe={"capacity_factor": cf}))
    c = math.ceil(SEQ / 8 * cf * 2)
    per_layer_pass = 2 * 8 * c * 1024 * BF16 * (ep - 1) / ep
    assert a2a_wire_bytes(p) == pytest.approx(2 * per_layer_pass * TINY["layers"])
    a = ops(p, "all_to_all")
    assert len(a) == 4 * TINY["layers"]
    # EP groups: ep adjacent ranks (groups._create_expert_and_data_parallel).
    assert a[0].all_groups == tuple(tuple(range(i, i + ep)) for i in range(0, 8, ep))


def test_dropless_balanced_matches_issue_closed_form() -> None:
    """drop_tokens: false, balanced routing: capacity = tokens x top-k / experts, so the
    all-to-alls move 2 x tokens x top-k x hidden x bytes x (ep-1)/ep per layer per pass."""
    ep = 4
    p = program(scn(ep=ep, moe={"drop_tokens": False, "capacity_factor": 3.0}))
    closed = 2 * SEQ * 2 * 1024 * BF16 * (ep - 1) / ep
    assert a2a_wire_bytes(p) == pytest.approx(2 * closed * TINY["layers"])
    # The capacity is agreed on by an int64 all-reduce MAX over the EP group and read on
    # the host, once per MoE layer and micro-batch.
    caps = ops(p, "all_reduce", "capacity")
    assert len(caps) == TINY["layers"] and all(op.nbytes == 8 for op in caps)


def test_skew_never_faster() -> None:
    """Padded (drop_tokens): skew changes nothing; dropless: the busiest expert's load sets
    every buffer and expert GEMM, so the step is slower and the bytes grow."""
    zipf = {"distribution": "zipf", "s": 1.2, "seed": 3}
    bal_pad = simulate(scn(ep=8)).summary["step_time_s"]
    skew_pad = simulate(scn(ep=8, routing=zipf)).summary["step_time_s"]
    assert skew_pad == bal_pad
    drop = {"drop_tokens": False}
    pb, ps = program(scn(ep=8, moe=drop)), program(scn(ep=8, moe=drop, routing=zipf))
    assert a2a_wire_bytes(ps) > a2a_wire_bytes(pb)
    bal = simulate(scn(ep=8, moe=drop)).summary["step_time_s"]
    skew = simulate(scn(ep=8, moe=drop, routing=zipf)).summary["step_time_s"]
    assert skew > bal


def test_expert_gradients_reduce_over_expert_data_parallel_group() -> None:
    """16 ranks, ep 2 (groups.py's own example): dense slices of each bucket all-reduced
    over the 16 ranks, expert slices over [0, 2, ..., 14] and [1, 3, ..., 15]; the expert
    bytes are the local experts' parameters (4 of 8 per rank), once per micro-batch."""
    s = scn(ep=2, nodes=2, gbs=16)
    p = program(s)
    exp = ops(p, "all_reduce", "(experts)")
    assert exp and all(op.all_groups == (tuple(range(0, 16, 2)), tuple(range(1, 16, 2)))
                       for op in exp)
    expert_params = 3 * 1024 * 1024
    local = TINY["layers"] * 4 * expert_params
    assert sum(op.nbytes for op in exp) == BF16 * local
    dense = [op for op in ops(p, "all_reduce", "grad bucket") if "(experts)" not in op.name]
    assert all(len(op.group) == 16 for op in dense)
    # The step all-gathers the dense partition over the world, the experts' over expert-DP.
    gathers = ops(p, "all_gather", "updated weights")
    assert [len(op.group) for op in gathers] == [16, 8]
    assert gathers[1].nbytes == BF16 * -(-local // (2 * 8)) * (2 * 8)


def test_expert_state_partitioned_over_expert_dp() -> None:
    """ZeRO-2 memory: 16-bit weights of the dense parameters and of the local experts, fp32
    master + Adam (12 B) of 1/world of the dense and 1/(world/ep) of the experts' (up to the
    flat buffers' padding to 2 x group size)."""
    p = program(scn(ep=4))
    mem = p.classes[0].initial_memory
    expert = 3 * TINY["hidden"] * TINY["moe_ffn_hidden"]
    experts_all = TINY["layers"] * 8 * expert
    dense = ModelSpec.from_ref(ModelDims(**TINY)).total_params - experts_all
    local = experts_all // 4                            # 2 of 8 experts per rank
    assert mem["parameters"] == pytest.approx(BF16 * (dense + local), abs=BF16 * 32)
    assert mem["optimizer"] == pytest.approx(12 * (dense / 8 + local / 2), abs=12 * 32)


def test_moe_groups_split_at_max_group_size() -> None:
    """split_params_into_different_moe_groups_for_optimizer: MoE groups of at most
    178,956,971 elements. Mixtral's 45.1B expert parameters on ep 8: 5.6B per rank in groups
    of whole expert MLPs (176M each): one expert per group."""
    big = {"layers": 2, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
           "vocab": 32000, "mlp": "swiglu", "experts": 8, "experts_per_token": 2}
    p = program(scn(ep=4, model=big))
    gathers = ops(p, "all_gather", "updated weights")
    expert = 3 * 4096 * 14336
    assert expert <= MOE_GROUP_MAX_ELEMENTS < 2 * expert
    assert len(gathers) == 1 + 2 * 2          # dense + one per local expert (2 layers x 2)


def test_use_residual_adds_the_dense_branch() -> None:
    base = simulate(scn(ep=8)).summary
    res = simulate(scn(ep=8, moe={"use_residual": True})).summary
    assert res["step_time_s"] > base["step_time_s"]


def test_refusals() -> None:
    with pytest.raises(ScenarioError, match="Stage 3"):
        program(scn(stage=3))
    with pytest.raises(ScenarioError, match="top-1"):
        program(scn(moe={"use_tutel": True}))
    with pytest.raises(ScenarioError, match="shared experts"):
        program(scn(model=dict(TINY, shared_experts=1)))


def test_qwen3s_query_key_norms_are_counted_and_priced() -> None:
    """Hugging Face's Qwen3-MoE attention (``Qwen3MoeAttention``: ``q_norm`` / ``k_norm``, an
    RMSNorm of head_dim weights over each head's queries and keys) in the ZeRO path's blocks:
    2 x head_dim more 16-bit weights a layer on every rank, and the norms' kernels in the
    step. Megatron-DeepSpeed's 3D path has no such norm and refuses it."""
    qk = dict(TINY, qk_norm=True)
    head_dim = TINY["hidden"] // TINY["heads"]
    base, normed = (program(scn(ep=4, model=m)).classes[0].initial_memory["parameters"]
                    for m in (TINY, qk))
    assert normed - base == pytest.approx(BF16 * TINY["layers"] * 2 * head_dim, abs=BF16 * 32)
    names = {op.name for op in program(scn(ep=4, model=qk)).ops}
    assert simulate(scn(ep=4, model=qk)).summary["step_time_s"] > \
        simulate(scn(ep=4)).summary["step_time_s"]
    assert names == {op.name for op in program(scn(ep=4)).ops}   # inside the blocks' ops
    dense = {k: v for k, v in qk.items() if k not in ("experts", "experts_per_token",
                                                     "moe_ffn_hidden")}
    pipe = make_scenario({
        "name": "ds-qk", "model": dense,
        "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8, "nics_per_node": 0},
        "framework": {"name": "deepspeed", "zero_stage": 1},
        "parallelism": {"tp": 2},
        "training": {"seq_len": SEQ, "micro_batch_size": 1, "global_batch_size": 4,
                     "precision": "bf16"}})
    with pytest.raises(ScenarioError, match=r"model\.qk_norm: Megatron-DeepSpeed"):
        program(pipe)


def test_dense_model_unchanged_by_moe_options() -> None:
    """framework.moe is ignored without experts: same program as without it."""
    dense = {k: v for k, v in TINY.items() if k not in ("experts", "experts_per_token",
                                                         "moe_ffn_hidden")}
    a = program(scn(ep=1, model=dense))
    b = program(scn(ep=1, model=dense, moe={"capacity_factor": 2.0}))
    assert [(op.name, op.nbytes) for op in a.ops] == [(op.name, op.nbytes) for op in b.ops]


def test_experts_are_a_loop_of_linears_and_einsums_are_gemms() -> None:
    """Experts.forward: one nn.Linear GEMM per projection per local expert over ep x c rows
    (no grouped GEMM); the dispatch and combine einsums are GEMMs of 2 x e x c x s x h FLOPs
    each way."""
    from sim.frameworks.deepspeed.moe_blocks import DsMoELayout, moe_blocks

    m = ModelSpec.from_ref(ModelDims(**TINY))
    ep, c = 4, capacity(SEQ, 8, 2, 1.0, 4)
    gate, experts, combine = moe_blocks(m, DsMoELayout(tokens=SEQ, ep=ep, capacity=c))
    gemms = [k for k in experts.forward if k.klass == "gemm"]
    assert len(gemms) == (8 // ep) * 3 and not any(k.group for k in gemms)
    assert all(k.gemm is not None and k.gemm[0] == ep * c for k in gemms)
    einsum = 2.0 * 8 * c * SEQ * 1024
    assert [k.flops for k in gate.forward if k.name == "dispatch_einsum"] == [einsum]
    assert [k.flops for k in combine.forward if k.name == "combine_einsum"] == [einsum]
    # The expert GEMMs run over the padded capacity: 2 x ep x c x 3 x h x f forward FLOPs.
    assert experts.flops_fwd == pytest.approx(2 * ep * c * (8 // ep) * 3 * 1024 * 1024)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_activations_balance_and_checkpointing_reruns_the_all_to_alls(ac: str) -> None:
    """Every activation byte a micro-batch allocates is freed by its backward; with full
    checkpointing the MoE forward (its two all-to-alls included) runs again before each
    layer's backward: 6 all-to-alls per layer and micro-batch instead of 4."""
    s = scn(ep=4, gbs=16)
    s = s.model_copy(update={"training": s.training.model_copy(
        update={"activation_checkpointing": ac})})
    p = program(s)
    alloc = sum(b for op in p.ops for k, b in op.alloc if k == "activations")
    free = sum(b for op in p.ops for k, b in op.free if k == "activations")
    assert alloc == pytest.approx(free)
    per = 6 if ac == "full" else 4
    assert len(ops(p, "all_to_all")) == per * TINY["layers"] * 2      # 2 micro-batches


def test_checkpointing_saves_memory_costs_time() -> None:
    base = scn(ep=8)
    ck = base.model_copy(update={"training": base.training.model_copy(
        update={"activation_checkpointing": "full"})})
    a, b = simulate(base).summary, simulate(ck).summary
    assert b["peak_memory_gib"] < a["peak_memory_gib"]
    assert b["step_time_s"] > a["step_time_s"] and b["hfu"] > b["mfu"]
