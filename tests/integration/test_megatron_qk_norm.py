"""Qwen3's per-head query/key norms in Megatron-Core (``qk_layernorm``, issue 14).

Independent truths: Megatron-Core's ``SelfAttention`` (megatron/core/transformer/attention.py)
builds ``q_layernorm`` and ``k_layernorm`` over ``hidden_size_per_attention_head`` and applies
them to the split [s, b, heads, head_dim] query and key, so the norms add one memory-bound
kernel per tensor and pass (bytes in closed form below), no GEMM FLOPs, and 2 x head_dim
parameters per layer (Qwen3's ``q_norm``/``k_norm`` weights in its checkpoint); the summary's
model FLOPs are ModelSpec's (6 x active parameters + causal attention per token); the H100's
dense bf16 peak bounds the shipped scenario's step from below.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext
from sim.frameworks.megatron.shape import megatron_shape
from sim.workload.megatron_ops import MegatronLayout, megatron_blocks
from sim.workload.model import ModelSpec

# A small Qwen3-style MoE model: grouped-query attention (8 heads, 2 KV heads of 128),
# query/key RMSNorms, 8 experts of width 512, top-2.
QWEN = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128,
        "ffn_hidden": 2048, "vocab": 32000, "experts": 8, "experts_per_token": 2,
        "moe_ffn_hidden": 512, "qk_norm": True}
SEQ = 2048


def _scn(par: dict, model: dict | None = None, gbs: int = 8, ac: str = "none"):
    return megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), gbs,
                             model=model or QWEN, seq=SEQ, ac=ac)


def _kernels(block, names: tuple[str, ...]):
    return [k for k in block.forward + block.backward if k.name.split(".")[0] in names]


@pytest.mark.parametrize("tp,heads,kv_heads", [(1, 8, 2), (2, 8, 2), (4, 8, 2), (8, 8, 2)])
def test_qk_norm_adds_exactly_its_norm_kernels(tp, heads, kv_heads) -> None:
    with_norm = ModelSpec.from_ref(_scn({"tp": 1}).model, SEQ)
    without = dataclasses.replace(with_norm, qk_norm=False)
    lay = MegatronLayout(tp=tp, sequence_parallel=tp > 1)
    a = megatron_blocks(with_norm, lay, 2, SEQ)["attn_main"]
    b = megatron_blocks(without, lay, 2, SEQ)["attn_main"]
    tokens, d = 2 * SEQ, 128
    # Local rows: tokens x local heads; fewer KV heads than ranks are replicated (1 per rank).
    rows = {"q_norm": tokens * heads // tp, "k_norm": tokens * max(1, kv_heads // tp)}
    # Forward: read x (bf16), write y (bf16) and one fp32 rstd per row. Backward: read the
    # output gradient, x and rstd; write the input gradient and the fp32 weight gradient.
    fwd = sum(r * (2 * d + 2 * d + 4) for r in rows.values())
    bwd = sum(r * (2 * d + 2 * d + 4 + 2 * d) + 4 * d for r in rows.values())
    added = _kernels(a, ("q_norm", "k_norm"))
    assert [k.name for k in added] == ["q_norm.fused", "k_norm.fused", "k_norm.bwd",
                                       "q_norm.bwd"]
    assert sum(k.nbytes for k in added if "bwd" not in k.name) == fwd
    assert sum(k.nbytes for k in added if "bwd" in k.name) == bwd
    # Nothing else moved: the other kernels' bytes, all FLOPs (a norm is memory-bound).
    others = [k for k in a.forward + a.backward if k not in added]
    assert [(k.name, k.nbytes, k.flops) for k in others] == \
        [(k.name, k.nbytes, k.flops) for k in b.forward + b.backward]
    assert (a.flops_fwd, a.flops_bwd) == (b.flops_fwd, b.flops_bwd)
    # Saved for backward: each norm's input and statistics (rope then saves the normed q, k).
    saved = sum(t.nbytes for t in a.saved) - sum(t.nbytes for t in b.saved)
    assert saved == sum(r * (2 * d + 4) for r in rows.values())
    # Parameters: two head_dim weights per layer, replicated on every tensor-parallel rank.
    assert a.params - b.params == 2 * d == with_norm.attention_params - without.attention_params


def test_layer_parameters_match_the_model_count() -> None:
    # tp = pp = ep = 1: the one rank holds the whole model; its dense and expert parameters add
    # up to ModelSpec's total (qk norms included); the vocabulary (32,000 = 250 x 128) needs no
    # padding.
    s = _scn({"tp": 1})
    sh = megatron_shape(JobContext.from_scenario(s, "s.yaml"))
    m = sh.model
    assert sh.stage_params(0) + sh.stage_expert_params(0) == m.total_params
    attn = sh.cost["attn_pre"].params + sh.cost["attn_main"].params
    assert attn == m.attention_params + m.norm_params


@pytest.mark.parametrize("par", [{"tp": 1, "ep": 4}, {"tp": 2, "ep": 2, "etp": 1},
                                 {"tp": 2, "pp": 2, "ep": 2}])
def test_qwen3_moe_step_builds_and_runs(par) -> None:
    s = _scn(par)
    m = ModelSpec.from_ref(s.model, SEQ)
    r = simulate(s)
    summary = r.summary
    # The summary's model FLOPs are ModelSpec's (6 x active matmul parameters, qk norms'
    # weights included as every 6N count includes them, + causal attention) per token.
    assert summary["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(SEQ) * 8 * SEQ, rel=1e-12)
    assert summary["step_time_s"] > 0 and not summary["oom"]
    # Every attention and MoE op ran: 4 layers x micro-batches x (forward + backward).
    names = [op.name for c in r.program.classes for ops in c.streams.values() for op in ops]
    assert any(" moe " in n for n in names) and any("attn L3" in n for n in names)


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_gemm_flops_are_the_model_projection_flops(tp) -> None:
    # Summed over the tensor-parallel ranks, one layer's attention GEMMs run 2 FLOPs per
    # token and projection weight forward (4 backward): ModelSpec's attention_shapes
    # (q, k, v, o); the qk norms' weights, which 6N counts, run no GEMM.
    m = ModelSpec.from_ref(_scn({"tp": 1}).model, SEQ)
    a = megatron_blocks(m, MegatronLayout(tp=tp, sequence_parallel=tp > 1), 2, SEQ)["attn_main"]
    proj = sum(o * i for _, o, i in m.attention_shapes())
    gemm = [k for k in a.forward if k.gemm is not None]
    assert tp * sum(k.flops for k in gemm) == 2 * 2 * SEQ * proj
    assert m.attention_params - proj == 2 * 128


def test_qk_norm_costs_time_and_memory_but_no_model_flops_beyond_its_weights() -> None:
    base = dict(QWEN, qk_norm=False)
    with_norm = simulate(_scn({"tp": 2, "ep": 2})).summary
    without = simulate(_scn({"tp": 2, "ep": 2}, model=base)).summary
    assert with_norm["step_time_s"] > without["step_time_s"]
    assert with_norm["peak_memory_gib"] > without["peak_memory_gib"]
    # 6 x 2 x head_dim x layers per token: the norms' weights in 6N.
    extra = 6 * 2 * 128 * 4 * 8 * SEQ
    assert with_norm["model_flops_per_step"] - without["model_flops_per_step"] == \
        pytest.approx(extra, rel=1e-9)


def test_qwen3_30b_a3b_nemo_layout_on_8_h100_is_physically_plausible() -> None:
    from sim.scenario import load_scenario

    s = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100")
    r = simulate(s).summary
    m = ModelSpec.from_ref("qwen3-30b-a3b", 4096)
    assert r["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(4096) * 32 * 4096, rel=1e-12)
    # Lower bound: the model FLOPs per GPU at the H100 SXM's dense bf16 peak (989 TFLOP/s,
    # NVIDIA H100 datasheet).
    assert r["step_time_s"] > r["model_flops_per_step"] / 8 / 989e12
    assert 0.05 < r["mfu"] < 0.6 and not r["oom"]
    # One node: the tensor-parallel collectives and the all-to-alls ride NVLink only.
    assert r["bytes"]["network"] == 0.0 and r["bytes"]["nvlink"] > 0
    assert r["model_params"] == m.total_params

