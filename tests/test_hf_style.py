"""Hugging Face's Llama under FSDP2 (style ``hf_bf16``), FSDP2 on one GPU, and HF's
recomputation, against closed forms hand-counted from the model code
(``transformers/models/llama/modeling_llama.py``) and torch's FSDP2 collectives."""

from __future__ import annotations

import pytest

from sim.frameworks import JobContext, build_program
from sim.layer_ops import Style, _Builder, attention_block, model_blocks
from sim.model import ModelSpec
from sim.scenario import ScenarioError, scenario_from_dict

M = ModelSpec.from_ref("llama3.2-1b")
B, S = 2, 1024
T = B * S


def _kernels_bytes(ks) -> tuple[int, float]:
    return len(ks), sum(k.nbytes for k in ks)


def test_hf_rmsnorm_in_bf16_is_eight_kernels_of_hand_counted_bytes() -> None:
    # LlamaRMSNorm on bf16 x (n = T*h): to(fp32) 2n+4n, pow 4n+4n, mean 4n+4T, add eps and
    # rsqrt 4T+4T each, mul 4n+4T+4n, to(bf16) 4n+2n, weight mul 2h+2n+2n.
    h = M.hidden
    b = _Builder("attn", Style("hf_bf16"))
    x = b.t("in", T * h, 2)
    y = b.rmsnorm(x, T, h, "norm")
    n = T * h
    count, nbytes = _kernels_bytes(b.block.forward)
    assert count == 8
    assert nbytes == pytest.approx(36 * n + 24 * T + 2 * h)
    assert y.nbytes == 2 * n
    # Saved: the fp32 copy of x (pow and mul), rsqrt per row, the bf16 normalised tensor.
    assert sum(t.nbytes for t in b.block.saved) == pytest.approx(4 * n + 4 * T + 2 * n)
    # The weight gradient comes out bf16 (parameters are bf16 under FSDP2).
    assert sum(t.nbytes for t in b.block.weight_grads) == 2 * h
    # torchtitan's fused kernel moves 2n in and 2n + 4T out, once.
    tb = _Builder("attn", Style("bf16"))
    tb.rmsnorm(tb.t("in", T * h, 2), T, h, "norm")
    assert _kernels_bytes(tb.block.forward) == (1, pytest.approx(4 * n + 4 * T))


def test_hf_rotate_half_rotary_in_bf16_is_five_kernels_of_twenty_bytes_per_element() -> None:
    # q*cos + cat(-x2, x1)*sin on bf16 (n = T*q_dim): neg n+n, cat 2n+2n, muls 2n+2n each,
    # add 4n+2n: 20n bytes; the output stays bf16 (autocast's promotes to fp32).
    b = _Builder("attn", Style("hf_bf16"))
    q = b.t("q", T * M.q_dim, 2)
    out = b.rope(q, T, M.q_dim, "rope_q")
    n = T * M.q_dim
    assert _kernels_bytes(b.block.forward) == (5, pytest.approx(20 * n))
    assert out.nbytes == 2 * n
    # torchtitan: to fp32, complex multiply, back to bf16: 6n + 8n + 6n in three kernels.
    tb = _Builder("attn", Style("bf16"))
    tb.rope(tb.t("q", T * M.q_dim, 2), T, M.q_dim, "rope_q")
    assert _kernels_bytes(tb.block.forward) == (3, pytest.approx(20 * n))


def test_hf_bf16_layer_keeps_a_bf16_kv_cache_and_bf16_residual() -> None:
    a = attention_block(M, Style("hf_bf16"), B, S, kv_cache=True)
    # DynamicCache.update copies k (bf16 after RoPE) and v: 2 x 2 bytes x kv_dim per token.
    assert sum(t.nbytes for t in a.forward_scoped) == pytest.approx(T * M.kv_dim * 4)
    assert a.inputs[0].nbytes == 2 * T * M.hidden
    assert not a.weight_casts
    # Same GEMM and attention FLOPs as torchtitan's code.
    t = attention_block(M, Style("bf16"), B, S, kv_cache=False)
    assert a.flops_fwd == pytest.approx(t.flops_fwd)


def _fsdp2(model_code: str | None = None, gpus: int = 1, **training) -> object:
    fw = {"name": "fsdp2"}
    if model_code:
        fw["model_code"] = model_code
    t = {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": gpus}
    t.update(training)
    return scenario_from_dict({
        "name": "t", "model": "llama3.2-1b",
        "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": gpus, "nics_per_node": 0},
        "framework": fw, "training": t})


def test_model_code_selects_the_style_and_defaults_to_torchtitan() -> None:
    assert build_program(JobContext.from_scenario(_fsdp2())).meta["style"] == "bf16"
    assert build_program(JobContext.from_scenario(_fsdp2("torchtitan"))).meta["style"] == "bf16"
    hf = build_program(JobContext.from_scenario(_fsdp2("huggingface")))
    assert hf.meta["style"] == "hf_bf16"


def test_model_code_huggingface_refuses_torchtitan_only_features() -> None:
    with pytest.raises(ScenarioError, match="framework.model_code"):
        build_program(JobContext.from_scenario(
            _fsdp2("huggingface", activation_checkpointing="selective")))


def test_fsdp2_on_one_gpu_still_copies_in_and_out() -> None:
    # foreach_all_gather has no world-size-1 shortcut: per unit and gather the fp32 shard is
    # cast into a flat bf16 buffer (4 + 2 bytes per parameter) and copied into the
    # all-gather output (2 + 2), then split_with_sizes_copy copies out (2 + 2).
    s = _fsdp2()
    ctx = JobContext.from_scenario(s)
    prog = build_program(ctx)
    ops = prog.ops
    copy_in = [o for o in ops if o.name.startswith("all-gather copy-in")]
    copy_out = [o for o in ops if o.name.startswith("copy-out")]
    units = M.layers + 2
    # Embedding and blocks reshard after forward and gather again in backward; the head not.
    assert len(copy_in) == len(copy_out) == 2 * units - 1
    assert not [o for o in ops if o.kind == "collective"]
    cm = ctx.compute
    layer = next(o for o in copy_in if o.name.startswith("all-gather copy-in L0 (fwd)"))
    numel = M.layer_params
    expect = cm.membound_time(6 * numel) + cm.membound_time(4 * numel)
    assert layer.duration == pytest.approx(expect, rel=1e-3)


def test_model_blocks_of_the_three_styles_share_their_flops() -> None:
    flops = {st: sum(b.flops_fwd for b in model_blocks(M, Style(st), B, S, False))
             for st in ("autocast", "bf16", "hf_bf16")}
    assert flops["autocast"] == pytest.approx(flops["bf16"])
    assert flops["hf_bf16"] == pytest.approx(flops["bf16"])


def _ddp_1gpu(**fw) -> object:
    return scenario_from_dict({
        "name": "t", "model": "llama3.2-1b",
        "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "nics_per_node": 0},
        "framework": {"name": "ddp", **fw},
        "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 1,
                     "activation_checkpointing": "full"}})


def test_reentrant_checkpointing_reruns_one_whole_forward_per_layer() -> None:
    # CheckpointFunction.backward re-runs the layer's forward to the end; non-reentrant
    # checkpointing stops once the last saved tensor (the down projection's input) is back.
    ctx = JobContext.from_scenario(_ddp_1gpu(checkpoint_use_reentrant=True))
    re_ops = build_program(ctx).ops
    nr_ops = build_program(JobContext.from_scenario(_ddp_1gpu())).ops
    costs = ctx.block_costs(Style("autocast"), kv_cache=False)
    a, m = costs["attn"], costs["mlp"]
    name = "bwd mlp L3 mb0"
    re_op = next(o for o in re_ops if o.name == name)
    nr_op = next(o for o in nr_ops if o.name == name)
    assert re_op.duration == pytest.approx(m.bwd_s + a.fwd_s + m.fwd_s)
    assert nr_op.duration == pytest.approx(m.bwd_s + a.fwd_s + m.early_stop_fwd_s)
    # The part skipped by the early stop: at least the down projection's GEMM.
    assert m.fwd_s - m.early_stop_fwd_s > 0
    # Recomputed FLOPs: one whole layer forward (attention + MLP) per layer.
    assert re_op.hw_flops - m.flops_bwd == pytest.approx(a.flops_fwd + m.flops_fwd)
    recomputes = [o for o in re_ops if o.category == "recompute+backward"]
    assert len(recomputes) == M.layers
    extra = sum(o.hw_flops for o in recomputes) - M.layers * m.flops_bwd
    assert extra == pytest.approx(M.layers * (a.flops_fwd + m.flops_fwd))


def test_reentrant_is_refused_for_torchtitan_code() -> None:
    with pytest.raises(ScenarioError, match="framework.checkpoint_use_reentrant"):
        build_program(JobContext.from_scenario(scenario_from_dict({
            "name": "t", "model": "llama3.2-1b",
            "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "nics_per_node": 0},
            "framework": {"name": "fsdp2", "checkpoint_use_reentrant": True},
            "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 1,
                         "activation_checkpointing": "full"}})))
