"""Hugging Face's Llama under FSDP2 (style ``hf_bf16``), FSDP2 on one GPU, and HF's
recomputation, against closed forms hand-counted from the model code
(``transformers/models/llama/modeling_llama.py``) and torch's FSDP2 collectives."""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim.frameworks import JobContext, build_program
from sim.scenario import ScenarioError
from sim.workload.layer_ops import Style, _Builder, attention_block, model_blocks
from sim.workload.model import ModelSpec

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
    return make_scenario(model="llama3.2-1b", cluster__gpu="h200", cluster__gpus_per_node=gpus,
                         cluster__nics_per_node=0, framework=fw,
                         training__global_batch_size=gpus,
                         **{f"training.{k}": v for k, v in training.items()})


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
    return make_scenario(model="llama3.2-1b", cluster__gpu="h200", cluster__gpus_per_node=1,
                         cluster__nics_per_node=0, framework={"name": "ddp", **fw},
                         training__global_batch_size=1,
                         training__activation_checkpointing="full")


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
        build_program(JobContext.from_scenario(make_scenario(
            model="llama3.2-1b", cluster__gpu="h200", cluster__gpus_per_node=1,
            cluster__nics_per_node=0,
            framework={"name": "fsdp2", "checkpoint_use_reentrant": True},
            training__global_batch_size=1, training__activation_checkpointing="full")))


# --------------------------------------------------------------------------- torch.compile
def _tensor(name: str, nbytes: float):
    from sim.workload.layer_ops import Tensor
    return Tensor(name, nbytes)


def test_inductor_fuses_only_kernels_that_share_a_buffer() -> None:
    # A norm chain and an unrelated weight cast in one run: two kernels, not one
    # (Scheduler.get_possible_fusions pairs nodes by shared buffers).
    from sim.workload.inductor import fuse_run
    from sim.workload.layer_ops import Kernel
    x, y, z = _tensor("x", 8e6), _tensor("y", 8e6), _tensor("z", 4e6)
    w, wb = _tensor("w", 4e6), _tensor("wb", 2e6)
    run = [Kernel("a", "elementwise", (x,), (y,)), Kernel("cast", "elementwise", (w,), (wb,)),
           Kernel("b", "elementwise", (y,), (z,))]
    fused = fuse_run(run, {id(z), id(wb)}, set())
    assert len(fused) == 2
    # y stays in registers: the chain reads x and writes z, the cast reads w, writes wb.
    assert sorted(k.nbytes for k in fused) == [6e6, 12e6]


def test_inductor_token_reduction_is_its_own_kernel_and_rereads_its_inputs() -> None:
    # RMSNorm backward's weight gradient (sum over tokens of g_out * xn) cannot share the
    # row-wise kernel: it takes its producer along and reads g_out and xn again.
    from sim.workload.inductor import fuse_run
    from sim.workload.layer_ops import Kernel
    n, h = 4e6, 1e3
    g, xn, prod, gw, gx = (_tensor("g", n), _tensor("xn", n), _tensor("prod", n),
                           _tensor("gw", h), _tensor("gx", n))
    run = [Kernel("mul_w", "elementwise", (g,), (gx,)),
           Kernel("w_prod", "elementwise", (g, xn), (prod,)),
           Kernel("w_sum", "elementwise", (prod,), (gw,))]
    fused = fuse_run(run, {id(gx), id(gw)}, {id(gw)})
    assert len(fused) == 2
    assert sum(k.nbytes for k in fused) == pytest.approx((n + n) + (n + n + h))


def test_inductor_looped_softmax_reads_the_logits_twice() -> None:
    # Head forward: logits.float() -> log_softmax over 128k columns: online softmax's
    # max-and-sum loop and the output loop each read the bf16 logits.
    from sim.workload.layer_ops import Style, _fuse, _needed_outside, head_block
    blk = head_block(M, Style("autocast", compile=True), B, S)
    fwd = _fuse(blk.forward, _needed_outside(blk.forward, blk), blk)
    loss = next(k for k in fwd if "log_softmax" in k.name)
    n = T * M.vocab
    logits_reads = sum(t.nbytes for t in loss.reads if t.name.endswith("lm_head.out"))
    assert logits_reads == pytest.approx(2 * 2 * n)


def test_compile_gain_on_one_h200_lies_between_none_and_one_kernel_per_run() -> None:
    # Step-level bounds for Llama 3.2 1B, 4 x 4096 on one H200 (the calibration run's
    # setup): compile must help, but by less than fusing every run into a single kernel.
    # Each decoder layer compiled (FSDP2 over Hugging Face's code), so the causal mask is
    # built eagerly and SDPA keeps is_causal: compiling the whole model also hands SDPA the
    # mask (sim/hardware/masked_attention.py), which can cost more than fusion saves.
    from sim.api import simulate
    from sim.workload import layer_ops

    def step(compile_: bool) -> float:
        s = make_scenario(model="llama3.2-1b", cluster__gpu="h200", cluster__gpus_per_node=1,
                          cluster__nics_per_node=0,
                          framework={"name": "fsdp2", "model_code": "huggingface",
                                     "compile": compile_},
                          training={"seq_len": 4096, "micro_batch_size": 4,
                                    "global_batch_size": 4})
        return simulate(s).summary["step_time_s"]

    eager, compiled = step(False), step(True)
    gain = 1 - compiled / eager
    assert 0.0 < gain < 0.25
    # One kernel per run (the old rule) is an upper bound on what fusion can remove.
    from sim.workload import inductor
    orig = inductor.fuse_run

    def one_kernel(run, keep, token):
        made = {id(t) for k in run for t in k.writes}
        reads = {id(t): t for k in run for t in k.reads if id(t) not in made}
        return [layer_ops.Kernel("all", "elementwise", tuple(reads.values()),
                                 tuple(t for k in run for t in k.writes if id(t) in keep),
                                 reduction=any(layer_ops.is_reduction(k) for k in run))]
    inductor.fuse_run = one_kernel
    layer_ops.model_blocks.cache_clear()
    try:
        ideal = step(True)
    finally:
        inductor.fuse_run = orig
        layer_ops.model_blocks.cache_clear()
    assert ideal < compiled


def test_fsdp2_copy_in_runs_before_every_all_gather_on_the_shard() -> None:
    # With 8 shards each all-gather waits for its copy-in: the fp32 shard cast to bf16
    # (4 + 2 bytes per local parameter) and copied into the output's slice (2 + 2).
    s = _fsdp2(gpus=8)
    ctx = JobContext.from_scenario(s)
    ops = build_program(ctx).ops
    ags = [o for o in ops if o.kind == "collective" and o.collective == "all_gather"]
    assert ags and all(len(o.deps) == 1 and o.deps[0].name.startswith("all-gather copy-in")
                       for o in ags)
    layer = next(o for o in ops if o.name.startswith("all-gather copy-in L0 (fwd)"))
    local = M.layer_params / 8
    cm = ctx.compute
    assert layer.duration == pytest.approx(cm.membound_time(6 * local)
                                           + cm.membound_time(4 * local), rel=1e-3)


def test_cpu_offload_on_one_gpu_computes_only_after_the_parameters_arrive() -> None:
    s = make_scenario(model="llama3.2-1b", cluster__gpus_per_node=1, cluster__nics_per_node=0,
                      framework={"name": "fsdp2", "cpu_offload": True},
                      training__global_batch_size=1)
    ops = build_program(JobContext.from_scenario(s)).ops
    out = next(o for o in ops if o.name == "copy-out L0 (fwd) mb0")
    copy_in = out.deps[0]
    assert copy_in.name.startswith("all-gather copy-in L0")
    assert any(d.name.startswith("H2D params L0") for d in copy_in.deps)


def test_compiled_launch_cost_is_inductors_measured_per_kernel_overhead() -> None:
    # tritonbench PR #1017: CachingAutotuner.run per kernel 6.8 us (no arguments) to 9.1 us
    # (19 arguments); a block takes at least its launches' CPU time.
    from sim import catalog
    from sim.hardware.compute import COMPILED_OP_CPU_S, ComputeModel
    from sim.workload.layer_ops import mlp_block, price_block
    assert 6.8e-6 <= COMPILED_OP_CPU_S <= 9.1e-6
    st = Style("autocast", compile=True)
    blk = mlp_block(M, st, 1, 16)
    c = price_block(blk, st, ComputeModel(catalog.gpu("h200")))
    # The block takes the longer of its GPU time and the launches' CPU time (no CUDA graphs).
    assert c.fwd_s == pytest.approx(max(c.fwd_gpu_s, c.fwd_kernels * COMPILED_OP_CPU_S))
    assert c.bwd_s == pytest.approx(max(c.bwd_gpu_s, c.bwd_kernels * COMPILED_OP_CPU_S))
