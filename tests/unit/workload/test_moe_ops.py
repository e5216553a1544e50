"""The kernels of a Megatron-Core MoE layer (sim/workload/moe_ops.py) against closed forms."""

from __future__ import annotations

import random

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import price_block
from sim.workload.grouped_gemm import grouped_gemm_time
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, balanced_tokens_per_expert, moe_layer_ops

CM = ComputeModel(catalog.gpu("h100-sxm"))
ST = Style("bf16")


def _gemm_flops(block, pass_):
    return sum(k.flops for k in (block.forward if pass_ == "fwd" else block.backward)
               if k.klass == "gemm")


@pytest.mark.parametrize("name,lay,tokens", [
    ("deepseek-v3", MoELayout(ep=64), 4096),
    ("deepseek-v3", MoELayout(ep=32, etp=2, fp8="delayed"), 4096),
    ("mixtral-8x7b", MoELayout(ep=8, tp=2), 2048),
    ("qwen3-30b-a3b", MoELayout(ep=16, router_fusion=False, z_loss=True), 8192),
    ("gpt-oss-120b", MoELayout(ep=8), 4096),
])
def test_expert_and_router_flops_closed_form(name, lay, tokens):
    m = ModelSpec.from_ref(name)
    assert m.moe is not None
    ops = moe_layer_ops(m, lay, tokens)
    h, f, k, e = m.hidden, m.moe.ffn_hidden, m.moe.top_k, m.moe.experts
    mats = 3 if m.mlp == "swiglu" else 2
    # Every routed token through top-k experts of `mats` h x f matrices, 2 FLOPs per MAC;
    # expert TP splits the width but gathers etp ranks' tokens: the same per rank.
    expert = 2.0 * tokens * k * mats * h * f
    # FP8 pads rows per expert to 16; balanced counts here are multiples of 16.
    assert _gemm_flops(ops.experts, "fwd") == pytest.approx(expert, rel=1e-12)
    assert _gemm_flops(ops.experts, "bwd") == pytest.approx(2 * expert, rel=1e-12)
    router = 2.0 * tokens * h * e
    assert _gemm_flops(ops.router, "fwd") == pytest.approx(router, rel=1e-12)
    assert _gemm_flops(ops.router, "bwd") == pytest.approx(2 * router, rel=1e-12)


@pytest.mark.parametrize("name,ep,tokens", [("deepseek-v3", 64, 4096), ("mixtral-8x7b", 8, 4096),
                                            ("qwen3-235b-a22b", 4, 8192)])
def test_alltoall_bytes_closed_form(name, ep, tokens):
    m = ModelSpec.from_ref(name)
    assert m.moe is not None
    ops = moe_layer_ops(m, MoELayout(ep=ep), tokens)
    # Issue 14: per MoE layer per pass, bytes sent per rank by each of dispatch and combine
    # = tokens x top-k x hidden x bytes x (ep-1)/ep (bf16 tokens with the alltoall dispatcher).
    closed = tokens * m.moe.top_k * m.hidden * 2 * (ep - 1) / ep
    for name_ in ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd"):
        a = ops.alltoall[name_]
        assert a.sent_bytes == pytest.approx(closed, rel=1e-12)
        assert a.received_bytes == pytest.approx(closed, rel=1e-12)
        assert len(a.send_bytes) == ep
    # and the per-pass total of both
    fwd = ops.alltoall["dispatch_fwd"].sent_bytes + ops.alltoall["combine_fwd"].sent_bytes
    assert fwd == pytest.approx(2 * closed, rel=1e-12)


def test_no_alltoall_bytes_without_expert_parallelism():
    m = ModelSpec.from_ref("mixtral-8x7b")
    ops = moe_layer_ops(m, MoELayout(ep=1), 4096)
    assert all(a.sent_bytes == 0 and a.received_bytes == 0 for a in ops.alltoall.values())
    assert ops.etp_gather_bytes == 0


def test_per_rank_work_follows_the_token_vector():
    m = ModelSpec.from_ref("deepseek-v3")
    lay = MoELayout(ep=64)
    counts = (20000.0, 8000.0, 4000.0, 768.0)      # 32768 rows, as balanced (4 x 8192)
    ops = moe_layer_ops(m, lay, 4096, tokens_per_expert=counts)
    g = [k for k in ops.experts.forward if k.klass == "gemm"]
    assert all(k.group == counts for k in g)
    assert ops.tokens_per_expert == counts
    doubled = moe_layer_ops(m, lay, 4096, tokens_per_expert=tuple(2 * c for c in counts))
    assert doubled.experts.flops_fwd == pytest.approx(2 * ops.experts.flops_fwd)
    with pytest.raises(ValueError):
        moe_layer_ops(m, lay, 4096, tokens_per_expert=(1.0, 2.0))


def _zipf_loads(experts: int, total: float, s: float, seed: int) -> list[float]:
    """Tokens per expert, Zipf-like with exponent s, experts in a random order (seeded)."""
    w = [1.0 / (i + 1) ** s for i in range(experts)]
    random.Random(seed).shuffle(w)
    return [total * x / sum(w) for x in w]


@pytest.mark.parametrize("name,ep,s", [("deepseek-v3", 8, 1.0), ("deepseek-v3", 64, 0.6),
                                       ("mixtral-8x7b", 8, 1.0), ("mixtral-8x7b", 4, 0.5),
                                       ("qwen3-30b-a3b", 16, 0.8)])
def test_skew_never_makes_the_slowest_rank_faster(name, ep, s):
    """A skewed routing of the same total tokens: the busiest EP rank's experts take no less
    than a balanced rank's. (Within one rank, moving tokens between its own experts at the
    same total may be faster -- bigger GEMMs are more efficient -- so the guarantee is on
    the slowest rank, which sets the pace.)"""
    m = ModelSpec.from_ref(name)
    assert m.moe is not None
    tokens = 4096
    lay = MoELayout(ep=ep)
    local = m.moe.experts // ep
    total = tokens * m.moe.top_k * ep             # rows over the whole EP group
    bal = price_block(moe_layer_ops(m, lay, tokens).experts, ST, CM)
    for seed in range(3):
        loads = _zipf_loads(m.moe.experts, total, s, seed)
        ranks = [tuple(loads[r * local:(r + 1) * local]) for r in range(ep)]
        costs = [price_block(moe_layer_ops(m, lay, tokens, tokens_per_expert=c).experts, ST, CM)
                 for c in ranks]
        assert sum(sum(c) for c in ranks) == pytest.approx(total)
        assert max(c.fwd_s for c in costs) >= bal.fwd_s
        assert max(c.bwd_s for c in costs) >= bal.bwd_s


def test_grouped_gemm_is_per_expert_not_one_gemm():
    # Each expert's GEMM pays its own small-M cost: 32 experts of 128 rows read 32 weights
    # and cannot beat their HBM traffic; one expert is exactly one GEMM.
    k, n = 7168, 4096
    assert grouped_gemm_time(CM, [4096.0], k, n) == CM.gemm_time(4096, k, n)
    weights = 32 * k * n * 2
    assert grouped_gemm_time(CM, [128.0] * 32, k, n) >= CM.membound_time(weights)
    assert grouped_gemm_time(CM, [0.0, 0.0], k, n) == 0.0


@pytest.mark.parametrize("name,lay", [
    ("deepseek-v3", MoELayout(ep=64)),
    ("deepseek-v3", MoELayout(ep=8, etp=2, tp=2, fp8="tensorwise")),
    ("mixtral-8x7b", MoELayout(ep=8)), ("mixtral-8x7b", MoELayout(ep=2, etp=4)),
    ("deepseek-v2-lite", MoELayout(ep=8)), ("mixtral-8x22b", MoELayout(ep=4)),
])
def test_shipped_moe_layers_build_and_price(name, lay):
    m = ModelSpec.from_ref(name)
    assert m.moe is not None
    ops = moe_layer_ops(m, lay, 4096)
    assert (ops.shared is not None) == (m.moe.shared > 0)
    for b in ops.blocks:
        c = price_block(b, ST, CM)
        assert c.fwd_s > 0 and c.bwd_s > 0
    # Parameters on the rank: local experts' share of the expert weights (expert TP splits
    # them), the router, the shared experts' TP share.
    local = m.moe.experts // lay.ep
    assert ops.experts.params * lay.etp == local * m.expert_params
    if ops.shared is not None:
        assert ops.shared.params * lay.tp == m.moe.shared * m.expert_params
    assert ops.router.params == m.moe.experts * m.hidden + (m.moe.experts if m.bias else 0)
    if lay.etp > 1:
        assert ops.etp_gather_bytes == pytest.approx(4096 * m.moe.top_k * m.hidden * 2)


def test_balanced_counts_and_bad_layouts():
    assert balanced_tokens_per_expert(1024, 2, 8, ep=4, etp=2) == (2048.0, 2048.0)
    m = ModelSpec.from_ref("mixtral-8x7b")
    with pytest.raises(ValueError):
        moe_layer_ops(m, MoELayout(ep=3), 4096)
    with pytest.raises(ValueError):
        moe_layer_ops(ModelSpec.from_ref("llama3-8b"), MoELayout(), 4096)


def test_uneven_peer_splits_carry_through():
    # Item 4 will give Megatron's input_splits/output_splits per EP peer; the bytes follow
    # them exactly, this rank's own chunk (index ep_rank) never on the wire, and the
    # backward all-to-alls are the forward ones reversed.
    m = ModelSpec.from_ref("mixtral-8x7b")
    send = (100.0, 2000.0, 3000.0, 2092.0)         # 4096 tokens x top-2 = 8192 rows
    recv = (500.0, 700.0, 4000.0, 2992.0)
    ops = moe_layer_ops(m, MoELayout(ep=4), 4096, send_tokens=send, recv_tokens=recv,
                        ep_rank=2)
    row = m.hidden * 2
    d, c = ops.alltoall["dispatch_fwd"], ops.alltoall["combine_fwd"]
    assert d.sent_bytes == pytest.approx((100 + 2000 + 2092) * row)
    assert d.received_bytes == pytest.approx((500 + 700 + 2992) * row)
    assert c.sent_bytes == d.received_bytes and c.received_bytes == d.sent_bytes
    assert ops.alltoall["combine_bwd"].send_bytes == d.send_bytes
    assert ops.alltoall["dispatch_bwd"].send_bytes == c.send_bytes
    # probs travel with the tokens in fp32 (moe_router_dtype)
    assert ops.alltoall["dispatch_probs_fwd"].sent_bytes == pytest.approx((100 + 2000 + 2092) * 4)
    with pytest.raises(ValueError):
        moe_layer_ops(m, MoELayout(ep=4), 4096, send_tokens=(1.0, 2.0))


def test_expert_saved_activations_from_the_source():
    # TEGroupedMLP in bf16 keeps for backward: fc1's input (GroupedLinear saves its inputs),
    # fc1's output and the probs (weighted_bias_swiglu saves both), fc2's input: per routed
    # row 2h + 2 x 2f + 4 + 2f bytes (SwiGLU, width f per expert-TP rank).
    m = ModelSpec.from_ref("deepseek-v3")
    assert m.moe is not None
    lay = MoELayout(ep=16, etp=2)
    ops = moe_layer_ops(m, lay, 4096)
    rows = sum(ops.tokens_per_expert)
    f = m.moe.ffn_hidden // lay.etp
    cost = price_block(ops.experts, ST, CM)
    assert cost.saved_bytes == pytest.approx(rows * (2 * m.hidden + 4 * f + 4 + 2 * f))


def test_host_sync_point_as_the_dispatcher_chooses():
    # MoEAlltoAllTokenDispatcher.preprocess: dropless with ep or expert-TP > 1 waits for the
    # splits before the all-to-all; a single rank only before returning.
    m = ModelSpec.from_ref("mixtral-8x7b")
    assert moe_layer_ops(m, MoELayout(ep=8), 1024).host_sync == "before_ep_alltoall"
    assert moe_layer_ops(m, MoELayout(ep=1, tp=8), 1024).host_sync == "before_finish"


def test_automodel_adds_fc1s_bias_eagerly_and_clamps_inside_its_activation():
    # NeMo AutoModel's GroupedExpertsDeepEP (GPT-OSS): grouped_gemm has no bias, so fc1's is
    # added per local expert (a broadcast add each) and the rows concatenated; its compiled
    # quick-GEGLU clamps inside the one activation kernel. Megatron adds the bias in the
    # GEMM epilogue and clamps in eager kernels first. Same parameters, same GEMMs.
    m = ModelSpec.from_ref("gpt-oss-20b")
    lay = MoELayout(ep=8, permute="te", router_fusion=False, aux_loss=False)
    am = moe_layer_ops(m, MoELayout(**{**lay.__dict__, "eager_fc1_bias": True}), 8192)
    mc = moe_layer_ops(m, lay, 8192)
    ea, em = (next(b for b in ops.blocks if b.name == "moe_experts") for ops in (am, mc))
    assert ea.params == em.params
    assert _gemm_flops(ea, "fwd") == _gemm_flops(em, "fwd")
    names = [k.name for k in ea.forward]
    local = m.moe.experts // 8
    assert names.count("fc1_bias.add") == local and "fc1_bias.cat" in names
    assert not any("clamp" in n for n in names)
    assert any("clamp" in k.name for k in em.forward)
    # The adds write fc1's whole output once, the cat copies it once more.
    rows = sum(k.writes[0].nbytes for k in ea.forward if k.name == "fc1_bias.add")
    cat = next(k for k in ea.forward if k.name == "fc1_bias.cat")
    assert cat.writes[0].nbytes == pytest.approx(rows)
