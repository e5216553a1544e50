"""Megatron-Core's multi-token prediction modules (``model.mtp_layers``, issue 14 items 1-2).

Independent truths: the module's shape in DeepSeek-V3 (arXiv:2412.19437 section 2.2) and in
``MultiTokenPredictionLayer`` (megatron/core/transformer/multi_token_prediction.py): enorm and
hnorm, ``eh_proj`` 2h -> h, one transformer layer like the decoder's last, a final norm, the
shared embedding and output head, so 2 FLOPs per token and weight forward and 4 backward for
``eh_proj`` and the head again; issue 14's all-to-all closed form (balanced routing: 2 x tokens
x top-k x hidden x bytes x (ep - 1) / ep per MoE layer per pass), one MoE layer more per depth;
conservation of parameters (``ModelSpec.mtp_params``) and of activation bytes (every byte
allocated for backward is freed); ``finalize_model_grads._allreduce_word_embedding_grads``
(the embedding copy's gradient all-reduced between first and last stage); NVIDIA
Megatron-Bridge's DeepSeek-V3 layout for 16 pipeline stages (4 layers first, 1 last).
"""

from __future__ import annotations

import pytest
from helpers import activations_left, megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.pipeline import chunk_layers
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError, load_scenario
from sim.workload.model import ModelSpec

# A small DeepSeek-style model: MLA with a query latent, the first layer dense, 8 routed
# experts (top-2) and one shared expert; vocab a multiple of 128 x tp (no padding).
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
        "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512, "shared_experts": 1,
        "first_k_dense": 1, "attention": "mla", "q_lora_rank": 256, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
SEQ, H, V = 2048, 1024, 32768


def _scn(par: dict, mtp: int = 1, gbs: int = 8, ac: str = "none", fw: dict | None = None,
         gpn: int = 8):
    return megatron_scenario(par, gbs, model=dict(TINY, mtp_layers=mtp), seq=SEQ, ac=ac,
                             gpn=gpn, framework=fw or {"name": "megatron"})


def _ops(program):
    return [(c, op) for c in program.classes for ops in c.streams.values() for op in ops]


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def test_mtp_ops_flops_are_the_closed_forms() -> None:
    # One GPU, one sequence: eh_proj 2h x h and the output head V x h run 2 x tokens x
    # weights forward and twice that backward; the module's MoE layer runs the FLOPs of the
    # decoder's MoE layers (the router over every expert, top-2 + 1 shared experts).
    p = _program(_scn({"tp": 1}, gbs=1, gpn=1))
    mtp = [op for _, op in _ops(p) if op.layer == 4]
    fl = {k: sum(op.flops for op in mtp if k in op.name) for k in ("proj", "head", " moe ")}
    assert fl["proj"] == 6 * SEQ * 2 * H * H
    assert fl["head"] == 6 * SEQ * V * H
    m = ModelSpec.from_ref(_scn({"tp": 1}).model, SEQ)
    assert m.moe is not None
    moe = 6 * SEQ * (m.moe.router_params(H, False) + 3 * m.expert_params)
    assert fl[" moe "] == pytest.approx(moe, rel=1e-12)
    decoder_moe = sum(op.flops for _, op in _ops(p) if op.layer == 3 and " moe " in op.name)
    assert fl[" moe "] == decoder_moe
    # The step's model FLOPs (what MFU divides) count the module (ModelSpec).
    assert p.model_flops_per_step == pytest.approx(m.model_flops_per_token(SEQ) * SEQ,
                                                   rel=1e-12)
    assert m.mtp_flops_per_token(SEQ) > 0


@pytest.mark.parametrize("par", [{"tp": 1}, {"tp": 1, "pp": 2}, {"tp": 2, "pp": 2, "ep": 2,
                                                                 "sequence_parallel": True}])
def test_stage_parameters_add_up_to_the_model_and_its_module(par) -> None:
    # Every rank's parameters times its replicas: the model, the module (ModelSpec.mtp_params)
    # and, with pipeline stages, the last stage's copy of the embedding (V x h).
    sh = megatron_shape(JobContext.from_scenario(_scn(par), "s.yaml"))
    m = sh.model
    dense = sum(sh.stage_params(st) for st in range(sh.p)) * sh.t
    moe = sh.moe
    assert moe is not None
    experts = sum(sh.stage_expert_params(st) for st in range(sh.p)) * moe.etp * moe.ep
    # Replicated over tp: the norms, MLA's down projections and latent norms, the router
    # (counted t times above); tp = 1 has none.
    if sh.t == 1:
        copy = V * H if sh.p > 1 else 0
        assert dense + experts == m.total_params + m.mtp_params + copy
    # The module's routed experts sit on the last stage beside its own MoE layers.
    last = [la for la in sh.stage_layers(sh.p - 1) if moe.is_moe(la)]
    assert sh.stage_expert_params(sh.p - 1) == (len(last) + 1) * moe.expert_params


def test_the_module_adds_one_moe_layer_of_all_to_all() -> None:
    # ep 4, balanced: per MoE layer and pass 2 x tokens x top-k x h x 2 B x (ep-1)/ep on the
    # wire per rank (issue 14); the decoder has 3 MoE layers, the module one more.
    def wire(mtp: int) -> float:
        p = _program(_scn({"tp": 1, "ep": 4}, mtp=mtp))
        return sum(op.nbytes * 3 / 4 * len(c.members) for c, op in _ops(p)
                   if op.collective == "all_to_all" and "probs" not in op.name)
    per_layer_pass = 2 * SEQ * 2 * H * 2 * 3 / 4 * 8      # 8 ranks, 1 micro-batch each
    assert wire(0) == pytest.approx(3 * 2 * per_layer_pass, rel=1e-12)
    assert wire(1) - wire(0) == pytest.approx(2 * per_layer_pass, rel=1e-12)
    assert wire(2) - wire(0) == pytest.approx(2 * 2 * per_layer_pass, rel=1e-12)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_activations_are_freed_and_the_module_costs_memory_and_time(ac) -> None:
    par = {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}
    runs = [simulate(_scn(par, mtp=k, ac=ac)) for k in (0, 1)]
    for r in runs:
        for c in r.program.classes:
            assert activations_left(c) == pytest.approx(0.0, abs=1.0), c.id
    base, mtp = (r.summary for r in runs)
    assert mtp["step_time_s"] > base["step_time_s"]
    assert mtp["peak_memory_gib"] > base["peak_memory_gib"]
    assert mtp["model_params"] == base["model_params"]      # 671B-style: module not counted


def test_full_recomputation_reruns_the_projection_and_the_layer() -> None:
    # _checkpointed_forward: the projection and the layer forward once more (hardware FLOPs),
    # the layer's all-to-alls a third time.
    par = {"tp": 1, "ep": 4}
    none, full = (_program(_scn(par, ac=ac)) for ac in ("none", "full"))
    base, base_full = (_program(_scn(par, mtp=0, ac=ac)) for ac in ("none", "full"))
    extra = (full.hw_flops_per_step - full.model_flops_per_step) - \
        (base_full.hw_flops_per_step - base_full.model_flops_per_step)
    fwd = sum(op.flops * len(c.members) for c, op in _ops(none)
              if op.layer == 4 and op.phase == "fwd" and "head" not in op.name)
    assert extra == pytest.approx(fwd, rel=1e-12)
    assert [op.name for _, op in _ops(full) if op.phase == "recompute" and "proj" in op.name]


def test_tensor_parallel_projection_exchanges() -> None:
    # tp 2, sequence parallel: eh_proj gathers its 2h-wide input and all-gathers its h/tp
    # output slices (gather_from_tensor_model_parallel_region); backward all-gathers the
    # scattered gradient, re-gathers the input and reduce-scatters its 2h gradient.
    p = _program(_scn({"tp": 2, "ep": 2, "sequence_parallel": True}))
    full = 2 * SEQ * H
    got = sorted((op.name.split(" L")[0], op.nbytes) for _, op in _ops(p)
                 if "mtp proj" in op.name and op.kind == "collective" and " mb0" in op.name)
    assert got == sorted([("all_gather fwd mtp proj", 2 * full),
                          ("all_gather fwd mtp proj out", full),
                          ("all_gather bwd mtp proj grad", full),
                          ("all_gather input bwd mtp proj", 2 * full),
                          ("reduce_scatter bwd mtp proj", 2 * full)])
    # The embedding lookup's reduce-scatter, as the first stage's.
    assert [op.nbytes for _, op in _ops(p) if op.name.startswith("mtp embed reduce")] == \
        [full] * 2      # two micro-batches (8 sequences over dp 4)


def test_overlapped_tensor_parallel_exchanges_gate_the_next_op() -> None:
    # tp_comm_overlap puts the exchanges on the tp stream: the layer after the projection
    # waits for the gathered output (a dependency, not stream order).
    # (a dense model: MLA is refused with tp_comm_overlap)
    dense = {"layers": 4, "hidden": H, "heads": 8, "ffn_hidden": 2048, "vocab": V,
             "mtp_layers": 1}
    p = _program(megatron_scenario({"tp": 2, "sequence_parallel": True}, 8, model=dense,
                                   seq=SEQ, framework={"name": "megatron",
                                                       "tp_comm_overlap": True}))
    ops = [op for _, op in _ops(p)]
    gather = next(op for op in ops if op.name == "all_gather fwd mtp proj out L4 mb0")
    attn = next(op for op in ops if op.name.startswith("fwd attn L4 mb0"))
    assert gather.stream == "tp" and gather in attn.deps


def test_embedding_copy_gradient_is_all_reduced_between_first_and_last_stage() -> None:
    fw = {"name": "megatron", "distributed_optimizer": True, "overlap_grad_reduce": True,
          "overlap_param_gather": True}
    p = _program(_scn({"tp": 1, "pp": 2}, fw=fw))
    sh = megatron_shape(JobContext.from_scenario(_scn({"tp": 1, "pp": 2}, fw=fw), "s.yaml"))
    ar = [(c.id, op) for c, op in _ops(p) if op.name == "mtp embedding all-reduce"]
    assert sorted(i for i, _ in ar) == [0, 1]
    assert {op.nbytes for _, op in ar} == {sh.grad_bytes * V * H}
    assert {len(op.all_groups[0]) for _, op in ar} == {2}
    # Without the module, an untied model has none; with one stage, no copy either.
    assert not [op for _, op in _ops(_program(_scn({"tp": 1, "pp": 2}, mtp=0, fw=fw)))
                if "embedding all-reduce" in op.name]
    assert not [op for _, op in _ops(_program(_scn({"tp": 1}, fw=fw)))
                if "embedding all-reduce" in op.name]
    # Gradient buckets conserve the stage's parameters, the module's included.
    grads = [(c.id, op) for c, op in _ops(p) if op.name.startswith("grad ")]
    last = sum(op.nbytes for i, op in grads if i == 1 and op.key.startswith("dp/"))
    assert last == pytest.approx(sh.grad_bytes * sh.stage_params(1), rel=1e-12)


# --------------------------------------------------------------------------- uneven split
def test_uneven_pipeline_split_follows_megatron_core() -> None:
    # get_num_layers_to_build: first and last stages given, the rest split evenly; with vp
    # each stage's count over its chunks, chunk v on stage v % p.
    assert [len(c) for c in chunk_layers(61, 16, 1, first=4, last=1)] == [4] * 15 + [1]
    ch = chunk_layers(10, 3, 2, first=2, last=4)
    assert [len(c) for c in ch] == [1, 2, 2, 1, 2, 2]
    assert [la for c in ch for la in c] == list(range(10))
    with pytest.raises(ValueError):
        chunk_layers(61, 16, 1, first=5, last=1)


@pytest.mark.parametrize("fw,match", [
    ({"decoder_first_pipeline_num_layers": 5}, r"do not split into 2 stages"),
    ({"decoder_last_pipeline_num_layers": 1, "account_for_loss_in_pipeline_split": True},
     r"cannot be combined")])
def test_bad_uneven_splits_name_the_key(fw, match) -> None:
    s = _scn({"tp": 1, "pp": 2}, fw=dict({"name": "megatron"}, **fw))
    key = next(k for k in fw if k.startswith("decoder"))
    with pytest.raises(ScenarioError, match=rf"^s\.yaml: framework\.{key}: .*{match}"):
        _program(s)


# --------------------------------------------------------------------------- shipped
def test_deepseek_v3_scenario_is_megatron_bridges_layout() -> None:
    # Megatron-Bridge deepseek_v3_pretrain_config: TP 2, PP 16, EP 64, expert TP 1, sequence
    # parallel, the layout [E + 4], 14 x [4], [1 + MTP + loss], global batch 4096 of 4096.
    s = load_scenario("deepseek-v3-megatron-tp2pp16ep64-1024xh100")
    ctx = JobContext.from_scenario(s, "s.yaml")
    sh = megatron_shape(ctx)
    assert (sh.t, sh.p, sh.dp, sh.sp, sh.ac, sh.mb_count) == (2, 16, 32, True, "selective", 128)
    assert sh.moe is not None and (sh.moe.ep, sh.moe.etp, sh.moe.edp) == (64, 1, 1)
    assert [len(c) for c in sh.chunks] == [4] * 15 + [1]
    assert sh.mtp is not None and list(sh.mtp.layers) == [61]
    m = ModelSpec.from_ref("deepseek-v3", 4096)
    assert ctx.model_flops_per_step() == pytest.approx(
        m.model_flops_per_token(4096) * 4096 * 4096, rel=1e-12)
    # Memory before the step fits the H100's 80 GB on every stage.
    for st in range(sh.p):
        assert sum(sh.initial_memory(st).values()) < 60e9, st
