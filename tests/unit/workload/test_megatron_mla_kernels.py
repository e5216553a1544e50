"""Multi-head latent attention's core-attention and rotary kernels (sim/workload/megatron_mla.py).

Independent truths: the five matrix products of a fused attention backward (FlashAttention-2,
Dao 2023 arXiv 2307.08691 Algorithm 2: S = QK^T again, dP = dO V^T, dV = P^T dO, dQ = dS K,
dK = dS^T Q) and the two of its forward, counted by hand for query/key width qk and value
width v; the tensors Megatron-Core's fused MLA rotary kernels load and store
(megatron/core/fusions/fused_mla_yarn_rope_apply.py at core_v0.14.0: ``rotary_fwd_q_kernel``
rewrites only the rope columns of q in place, ``rotary_fwd_kv_kernel`` reads kv and the shared
rotary key and writes key and value, ``rotary_bwd_kv_kernel`` reads dk and dv and writes dkv and
the rotary key's gradient); DeepSeek-V3's dimensions (arXiv 2412.19437: 128 heads, nope 128,
rope 64, v 128, latent ranks 1536 / 512).
"""

from __future__ import annotations

import pytest

from sim.workload.megatron_mla import attention_head_dims, mla_attention_block
from sim.workload.megatron_ops import MegatronLayout
from sim.workload.model import ModelSpec

SEQ = 4096
HEADS, NOPE, ROPE, V = 128, 128, 64, 128
QK = NOPE + ROPE
B = 2                                   # bytes of a bf16 element


def _main(rope_fusion: bool, tp: int = 1):
    m = ModelSpec.from_ref("deepseek-v3")
    lay = MegatronLayout(tp=tp, sequence_parallel=tp > 1, rope_fusion=rope_fusion)
    return mla_attention_block(m, lay, 1, SEQ)[1]


def _k(kernels, name):
    return next(k for k in kernels if k.name == name)


@pytest.mark.parametrize("qk,v", [(128, 128), (192, 128), (96, 64), (64, 128)])
def test_head_widths_give_the_products_flops(qk, v) -> None:
    fwd, bwd = attention_head_dims(qk, v)
    # Per score: forward S (2 qk) and O (2 v); backward S, dQ, dK over qk, dP, dV over v.
    assert 4 * fwd == pytest.approx(2 * qk + 2 * v)
    assert 10 * bwd == pytest.approx(3 * 2 * qk + 2 * 2 * v)
    if qk == v:
        assert fwd == bwd == qk


def test_flash_kernels_carry_deepseeks_matmul_flops() -> None:
    b = _main(True)
    pairs = SEQ * SEQ / 2                 # causal: seq/2 keys a query on average
    fwd, bwd = _k(b.forward, "flash_fwd"), _k(b.backward, "flash_bwd")
    assert fwd.flops == pytest.approx(2 * pairs * HEADS * (QK + V))
    # 166.4 rounds to a whole 166 in the kernel record: within 0.3% of the exact count.
    assert bwd.flops == pytest.approx(2 * pairs * HEADS * (3 * QK + 2 * V), rel=3e-3)
    assert bwd.flops / fwd.flops > 2.55   # 2.6 x forward, not the equal-width 2.5 x
    assert fwd.attn is not None and bwd.attn is not None
    assert (fwd.attn[3], bwd.attn[3]) == (160, 166)


def test_fused_rope_kernels_move_what_the_triton_kernels_load_and_store() -> None:
    b = _main(True)
    t = SEQ
    assert _k(b.forward, "rope.q").nbytes == 2 * t * HEADS * ROPE * B
    assert _k(b.forward, "rope.kv").nbytes == t * (HEADS * (NOPE + V) + ROPE
                                                   + HEADS * QK + HEADS * V) * B
    assert _k(b.backward, "rope.q.bwd").nbytes == 2 * t * HEADS * ROPE * B
    assert _k(b.backward, "rope.kv.bwd").nbytes == t * (HEADS * QK + HEADS * V
                                                        + HEADS * (NOPE + V) + ROPE) * B
    names = {k.name for k in b.forward + b.backward}
    assert not names & {"rope", "cat_query", "cat_key", "value_contiguous", "cat.bwd",
                        "rope.bwd"}


def test_unfused_path_keeps_its_copies() -> None:
    names = {k.name for k in _main(False).forward}
    assert {"rope", "cat_query", "cat_key", "value_contiguous"} <= names
    assert "rope.kv" not in names


@pytest.mark.parametrize("tp", [1, 2])
def test_fusion_saves_the_same_activations_and_moves_fewer_bytes(tp) -> None:
    # The fused query is q itself (rotated in place): core attention saves as many bytes.
    fused, plain = _main(True, tp), _main(False, tp)
    assert sum(t.nbytes for t in fused.saved) == sum(t.nbytes for t in plain.saved)
    assert "attn_main.q_up.out" in {t.name for t in fused.saved}

    def moved(b):
        return sum(k.nbytes for k in b.forward + b.backward if k.klass == "elementwise")
    heads = HEADS // tp
    # Unfused forward: rope reads q and the rotary key and writes both rotated parts;
    # the query, key and value copies read and write the whole tensors. Fused: the q kernel
    # touches the rope columns twice, the kv kernel reads kv + key and writes key + value.
    t = SEQ
    unfused_fwd = (t * heads * QK + t * ROPE + t * heads * ROPE + t * ROPE
                   + (t * heads * QK + t * heads * ROPE + t * heads * QK)
                   + (t * heads * (NOPE + V) + t * ROPE + t * heads * QK)
                   + (t * heads * (NOPE + V) + t * heads * V)) * B
    fused_fwd = (2 * t * heads * ROPE
                 + t * (heads * (NOPE + V) + ROPE + heads * QK + heads * V)) * B
    fwd_names = {"rope", "cat_query", "cat_key", "value_contiguous", "rope.q", "rope.kv"}
    assert sum(k.nbytes for k in plain.forward if k.name in fwd_names) == unfused_fwd
    assert sum(k.nbytes for k in fused.forward if k.name in fwd_names) == fused_fwd
    assert moved(plain) - moved(fused) > 0


def test_fused_rope_issues_five_fewer_python_calls_each_way() -> None:
    # Unfused: two splits, two rotary applications, expand, two concatenations (7 calls,
    # qkv_up_proj_and_rope_apply); fused: fused_apply_mla_rope_for_q and _for_kv (2).
    from sim.workload.megatron_host_ops import python_ops
    m = ModelSpec.from_ref("deepseek-v3")
    plain, fused = python_ops(m, False), python_ops(m, False, rope_fusion=True)
    assert (plain["attn_main"][0] - fused["attn_main"][0],
            plain["attn_main"][1] - fused["attn_main"][1]) == (5, 5)
    gqa = ModelSpec.from_ref("qwen3-30b-a3b")
    assert python_ops(gqa, False, rope_fusion=True) == python_ops(gqa, False)


def test_unfused_core_attention_runs_the_whole_score_matrix_at_each_width() -> None:
    """Transformer Engine's ``UnfusedDotProductAttention`` (what TE runs MLA with where cuDNN
    cannot train 192 / 128, sim/hardware/te_fused_attention.py): ``baddbmm`` Q K^T over every
    (query, key) pair at the 192-wide query/key dim, a softmax over the bf16 scores, P V at the
    128-wide value dim; no causal skipping, and the probabilities saved for backward."""
    m = ModelSpec.from_ref("deepseek-v3")
    b = mla_attention_block(m, MegatronLayout(flash_attention=False, rope_fusion=True),
                            1, SEQ)[1]
    names = {k.name for k in b.forward}
    assert "flash_fwd" not in names and {"qk_bmm", "softmax", "pv_bmm"} <= names
    pairs = SEQ * SEQ                     # the full matrix: the mask is applied after it
    assert _k(b.forward, "qk_bmm").flops == pytest.approx(2 * pairs * HEADS * QK)
    assert _k(b.forward, "pv_bmm").flops == pytest.approx(2 * pairs * HEADS * V)
    # Backward: each product's two gradients at its own width.
    for name, width in (("qk_bmm", QK), ("pv_bmm", V)):
        for pass_ in ("dgrad", "wgrad"):
            assert _k(b.backward, f"{name}.{pass_}").flops == \
                pytest.approx(2 * pairs * HEADS * width)
    probs = next(t for t in b.saved if t.name.endswith("probs"))
    assert probs.nbytes == pytest.approx(pairs * HEADS * B)
    # Twice the fused kernels' forward matmul FLOPs (the causal half is not skipped).
    flash = _main(True)
    fused = _k(flash.forward, "flash_fwd").flops
    assert (_k(b.forward, "qk_bmm").flops + _k(b.forward, "pv_bmm").flops) == \
        pytest.approx(2 * fused)
