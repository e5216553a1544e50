"""Multi-head Latent Attention in Megatron-Core (``MLASelfAttention``, issue 14).

Independent truths: the projections of DeepSeek-V2 (arXiv:2405.04434 section 2.1) as the
Hugging Face checkpoints hold them (``ModelSpec.attention_shapes``: q or q_a/q_b, kv_a, kv_b,
o, and the latent norms), 2 FLOPs per token and weight forward; causal attention with queries
and keys nope + rope wide and values v_head_dim wide (ModelSpec's MLA attention FLOPs); the
published DeepSeek-V2-Lite parameter count (15,706,484,224, its safetensors); the H100's dense
bf16 peak for a lower bound on the step.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError
from sim.workload.megatron_ops import MegatronLayout, megatron_blocks
from sim.workload.model import ModelSpec

# A small DeepSeek-style model: MLA with a query latent, the first layer dense, 8 routed
# experts (top-2) and one shared expert.
TINY_MLA = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32000,
            "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512, "shared_experts": 1,
            "first_k_dense": 1, "attention": "mla", "q_lora_rank": 256, "kv_lora_rank": 128,
            "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
SEQ = 2048


def _scn(par: dict, model: dict | str | None = None, gbs: int = 8):
    return megatron_scenario(par, gbs, model=model or TINY_MLA, seq=SEQ)  # type: ignore[arg-type]


@pytest.mark.parametrize("ref", ["deepseek-v2-lite", "deepseek-v3"])
def test_mla_kernel_flops_are_the_model_attention_flops(ref) -> None:
    # One layer, one micro-batch of 4,096 tokens: the forward GEMMs run 2 x tokens x the
    # projection weights; core attention 2 x tokens x (S/2 keys) x heads x (qk + v); both x 3
    # for forward plus backward are ModelSpec's attention part of the model FLOPs.
    m = ModelSpec.from_ref(ref, 4096)
    a = megatron_blocks(m, MegatronLayout(), 1, 4096)["attn_main"]
    tokens = 4096
    gemm = sum(k.flops for k in a.forward if k.gemm is not None)
    core = sum(k.flops for k in a.forward if k.klass == "attention")
    proj = sum(o * i for _, o, i in m.attention_shapes())
    assert gemm == 2 * tokens * proj
    assert 3 * core == pytest.approx(m._attention_layer_flops(4096, None) * tokens, rel=1e-12)
    # Every weight of attention_shapes is one GEMM's: q (V2-Lite) or q_a/q_b, kv_a, kv_b, o.
    gemm_names = [k.name.split(".")[0] for k in a.forward if k.gemm is not None]
    assert len(gemm_names) == len(m.attention_shapes())


@pytest.mark.parametrize("ref", ["deepseek-v2-lite", "deepseek-v3"])
def test_mla_layer_parameters_match_the_model(ref) -> None:
    m = ModelSpec.from_ref(ref, 4096)
    bl = megatron_blocks(m, MegatronLayout(), 1, 4096)
    assert bl["attn_pre"].params + bl["attn_main"].params == m.attention_params + m.norm_params
    # DeepSeek-V3: q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256,
    # o 16384 x 7168 and the two latent norms (1536 + 512): 187,107,328 per layer
    # (DeepseekV3Attention in modeling_deepseek_v3.py).
    if ref == "deepseek-v3":
        assert m.attention_params == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
                                      + 512 * 128 * 256 + 16384 * 7168 + 1536 + 512)


def test_stage_parameters_add_up_to_the_model() -> None:
    # tp = pp = ep = 1: the one rank holds every parameter ModelSpec counts.
    sh = megatron_shape(JobContext.from_scenario(_scn({"tp": 1}), "s.yaml"))
    assert sh.stage_params(0) + sh.stage_expert_params(0) == sh.model.total_params


@pytest.mark.parametrize("par", [{"tp": 1, "ep": 4}, {"tp": 1, "pp": 2, "ep": 2},
                                 {"tp": 1, "ep": 8}])
def test_mla_moe_step_builds_and_runs(par) -> None:
    s = _scn(par)
    m = ModelSpec.from_ref(s.model, SEQ)
    r = simulate(s).summary
    assert r["model_flops_per_step"] == pytest.approx(m.model_flops_per_token(SEQ) * 8 * SEQ,
                                                      rel=1e-12)
    assert r["step_time_s"] > 0 and not r["oom"]


def test_mla_is_slower_with_a_wider_latent() -> None:
    # More latent width, more GEMM FLOPs and bytes: never faster.
    t = [simulate(_scn({"tp": 1, "ep": 4}, model=dict(TINY_MLA, kv_lora_rank=r))).summary[
        "step_time_s"] for r in (128, 512)]
    assert t[1] > t[0]


@pytest.mark.parametrize("par,fw,key", [
    ({"tp": 2, "ep": 2, "sequence_parallel": False}, None, "parallelism.sequence_parallel"),
    ({"tp": 1, "cp": 2, "ep": 2}, None, "parallelism.cp"),
    ({"tp": 2, "ep": 2, "sequence_parallel": True},
     {"name": "megatron", "tp_comm_overlap": True}, "framework.tp_comm_overlap")])
def test_mla_layouts_not_modelled_are_refused(par, fw, key) -> None:
    s = megatron_scenario(par, 8, model=TINY_MLA, seq=SEQ, framework=fw)
    with pytest.raises(ScenarioError, match=rf"^s\.yaml: {key}: multi-head latent attention"):
        JobContext.from_scenario(s, "s.yaml")


@pytest.mark.parametrize("ref,tp", [("deepseek-v2-lite", 2), ("deepseek-v3", 4),
                                    ("deepseek-v3", 8)])
def test_tensor_parallel_mla_splits_the_heads_and_shards_the_down_projections(ref, tp) -> None:
    # Sequence parallel: each rank runs the duplicated down projections on its tokens / tp
    # and the column-parallel up projections on every token for heads / tp, so the ranks'
    # GEMM and attention FLOPs add up to one rank's at tp = 1.
    m = ModelSpec.from_ref(ref, 4096)
    one = megatron_blocks(m, MegatronLayout(), 1, 4096)["attn_main"]
    split = megatron_blocks(m, MegatronLayout(tp=tp, sequence_parallel=True), 1, 4096)[
        "attn_main"]
    assert tp * split.flops_fwd == pytest.approx(one.flops_fwd, rel=1e-12)
    assert tp * split.flops_bwd == pytest.approx(one.flops_bwd, rel=1e-12)
    # Parameters per rank: the down projections and latent norms whole (duplicated), the
    # q (or q up), kv up and output projections split over the heads.
    mla = m.mla
    assert mla is not None
    h, n = m.hidden, m.heads
    dup = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
    q_in = h
    if mla.q_lora_rank:
        dup += h * mla.q_lora_rank + mla.q_lora_rank
        q_in = mla.q_lora_rank
    heads = (q_in * n * mla.qk_head_dim
             + mla.kv_lora_rank * n * (mla.qk_nope_head_dim + mla.v_head_dim)
             + n * mla.v_head_dim * h)
    assert split.params == dup + heads // tp
    assert one.params == dup + heads == m.attention_params


def test_sequence_parallel_mla_gathers_its_latents() -> None:
    # tp = 2, sequence parallel: the attention's forward all-gather carries the query latent,
    # the key/value latent and the shared rotary key per token (256 + 128 + 32 wide, bf16)
    # instead of the hidden state (1,024); the output projection's reduce-scatter stays
    # hidden-wide (MLASelfAttention: linear_q_up_proj, linear_kv_up_proj column-parallel
    # over gathered latents, gather_from_sequence_parallel_region for the rotary key).
    s = _scn({"tp": 2, "ep": 2, "sequence_parallel": True})
    r = simulate(s)
    ops = [op for c in r.program.classes for o in c.streams.values() for op in o]
    gathers = {op.nbytes for op in ops if op.name.startswith("all_gather fwd attn")}
    tokens = 1 * SEQ
    assert gathers == {2 * tokens * (256 + 128 + 32)}
    scatters = {op.nbytes for op in ops if op.name.startswith("reduce_scatter fwd attn")}
    assert scatters == {2 * tokens * 1024}
    # Backward: the latents' input gradients are reduce-scattered, their inputs re-gathered.
    back = {op.nbytes for op in ops if op.name.startswith("reduce_scatter bwd attn")}
    assert back == {2 * tokens * (256 + 128 + 32)}
    m = ModelSpec.from_ref(s.model, SEQ)
    assert r.summary["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(SEQ) * 8 * SEQ, rel=1e-12)


def test_deepseek_v3_builds_with_its_mtp_module() -> None:
    # Once refused for its multi-token prediction module (model.mtp_layers), DeepSeek-V3's
    # dimensions now build: tests/integration/test_megatron_mtp.py checks the module.
    sh = megatron_shape(JobContext.from_scenario(
        _scn({"tp": 1, "ep": 8}, model="deepseek-v3"), "s.yaml"))
    assert sh.mtp is not None and sh.mtp.depths == 1


def test_deepseek_v2_lite_nemo_layout_on_8_h100_is_physically_plausible() -> None:
    from sim.scenario import load_scenario

    s = load_scenario("deepseek-v2-lite-megatron-ep8-8xh100")
    r = simulate(s).summary
    m = ModelSpec.from_ref("deepseek-v2-lite", 4096)
    assert r["model_params"] == m.total_params == 15_706_484_224
    assert r["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(4096) * 512 * 4096, rel=1e-12)
    # Lower bound: the model FLOPs per GPU at the H100 SXM's dense bf16 peak (989 TFLOP/s).
    assert r["step_time_s"] > r["model_flops_per_step"] / 8 / 989e12
    assert 0.1 < r["mfu"] < 0.7 and not r["oom"]
    assert r["bytes"]["network"] == 0.0 and r["bytes"]["nvlink"] > 0
