"""sim.frameworks.common.accounting: per-block model FLOPs and the tied-embedding gradient split
that
the DDP, FSDP2, FairScale and DeepSpeed builders share, checked against closed forms from the
model's dimensions and against the builders' programs."""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim import catalog
from sim.frameworks import JobContext, build_program
from sim.frameworks.common.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.hardware.compute import ComputeModel
from sim.scenario import ModelDims
from sim.workload.layer_ops import BlockCost, Style, model_blocks, price_block
from sim.workload.model import ModelSpec

H, Q, KV, F, V, L = 512, 512, 128, 1536, 32000, 3   # hidden, q_dim, kv_dim, ffn, vocab, layers
SEQ, MBS = 1024, 2


def dims(tied: bool) -> dict:
    """A small Llama-shaped model: 8 heads of 64 (q_dim 512), 2 KV heads (kv_dim 128)."""
    return {"name": "acc", "layers": L, "hidden": H, "heads": 8, "kv_heads": 2,
            "ffn_hidden": F, "vocab": V, "mlp": "swiglu", "tied_embeddings": tied}


def model(tied: bool) -> ModelSpec:
    return ModelSpec.from_ref(ModelDims(**dims(tied)))


def priced(m: ModelSpec) -> dict[str, BlockCost]:
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    style = Style("bf16")
    return {b.name: price_block(b, style, cm) for b in model_blocks(m, style, MBS, SEQ, False)}


@pytest.mark.parametrize("tied", [False, True])
def test_block_flops_are_six_per_weight_plus_causal_attention(tied: bool) -> None:
    m = model(tied)
    f = block_model_flops(m, priced(m), MBS, SEQ)
    tokens = MBS * SEQ
    # Closed forms from the dimensions: Q, K, V, O projections and an RMSNorm scale; SwiGLU's
    # gate, up and down and its norm; causal attention 2 x seq x q_dim forward per token
    # (QK^T and PV, half of 4 S q_dim under the mask); forward 2 per weight, backward 4.
    attn_params = H * Q + 2 * H * KV + Q * H + H
    mlp_params = 3 * H * F + H
    assert f["attn"][0] == pytest.approx(tokens * (2 * attn_params + 2 * SEQ * Q), rel=1e-15)
    assert f["mlp"][0] == pytest.approx(tokens * 2 * mlp_params, rel=1e-15)
    assert f["head"][0] == pytest.approx(tokens * 2 * V * H, rel=1e-15)   # tied or not
    assert f["embed"] == (0.0, 0.0)                                       # a lookup
    for fwd, bwd in f.values():
        assert bwd == 2 * fwd


@pytest.mark.parametrize("tied", [False, True])
def test_block_flops_add_up_to_the_model_flops(tied: bool) -> None:
    """All blocks of a micro-batch make ModelSpec.model_flops_per_token's total, less the
    final norm's scale (H parameters in matmul_params that no block is credited with)."""
    m = model(tied)
    f = block_model_flops(m, priced(m), MBS, SEQ)
    total = sum(f["embed"]) + sum(f["head"]) + L * (sum(f["attn"]) + sum(f["mlp"]))
    expect = (m.model_flops_per_token(SEQ) - 6.0 * m.norm_params) * MBS * SEQ
    assert total == pytest.approx(expect, rel=1e-14)


@pytest.mark.parametrize("tied", [False, True])
def test_gradient_split_conserves_the_parameters(tied: bool) -> None:
    m = model(tied)
    costs = priced(m)
    g = block_grad_params(m, costs)
    # Every parameter's gradient appears in exactly one block's backward.
    assert g["embed"] + L * (g["attn"] + g["mlp"]) + g["head"] == m.total_params
    # A tied matrix's gradient first appears in the LM head's backward (head runs first).
    assert g["embed"] == (0 if tied else V * H)
    assert g["head"] == V * H + H                       # output matrix + final norm either way


def test_tied_gradient_sum_is_one_add_of_two_gradients() -> None:
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    assert tied_grad_sum_s(cm, model(False), 4) == 0.0
    # InputBuffer::add reads the head's and the lookup's V x H gradients and writes the sum.
    t4 = tied_grad_sum_s(cm, model(True), 4)
    assert t4 == cm.membound_time(3 * 4 * V * H) > 0.0
    assert tied_grad_sum_s(cm, model(True), 2) < t4    # bf16 gradients move half the bytes


def _program(framework: dict, tied: bool):
    s = make_scenario(name="acc", model=dims(tied), cluster__gpu="h200",
                      cluster__gpus_per_node=4, framework=framework,
                      training={"seq_len": SEQ, "micro_batch_size": MBS,
                                "global_batch_size": 2 * 4 * MBS})
    ctx = JobContext.from_scenario(s, "<test>")
    return ctx, build_program(ctx)


@pytest.mark.parametrize("framework", [
    {"name": "ddp"}, {"name": "fsdp2"}, {"name": "fairscale"},
    {"name": "deepspeed", "zero_stage": 1}, {"name": "deepspeed", "zero_stage": 3}])
@pytest.mark.parametrize("tied", [False, True])
def test_builders_credit_the_shared_block_flops(framework: dict, tied: bool) -> None:
    """Each builder's compute ops carry block_model_flops: over a step and all ranks they
    make the program's model FLOPs less the final norm's share (see above)."""
    ctx, p = _program(framework, tied)
    (cls,) = p.classes
    credited = sum(op.flops for op in p.ops) * len(cls.members)
    expect = p.model_flops_per_step - 6.0 * ctx.model.norm_params * p.tokens_per_step
    assert credited == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_012_charges_the_tied_gradient_sum(stage: int) -> None:
    """ZeRO 0-2 run the model under plain autograd: a tied matrix's two gradients are added
    (tied_grad_sum_s, 16-bit) in the embedding's backward, as DDP, FSDP2 and FairScale are
    charged; an untied model pays nothing."""
    def embed_bwd(tied: bool) -> float:
        ctx, p = _program({"name": "deepspeed", "zero_stage": stage}, tied)
        # The first micro-batch: no AccumulateGrad add yet (it differs with the tie).
        return sum(op.duration for op in p.ops if op.phase == "bwd"
                   and op.name.startswith("bwd embed") and op.micro_batch == 0)

    ctx, _ = _program({"name": "deepspeed", "zero_stage": stage}, True)
    added = tied_grad_sum_s(ctx.compute, ctx.model, 2)
    assert added > 0
    assert embed_bwd(True) - embed_bwd(False) == pytest.approx(added, rel=1e-9)
