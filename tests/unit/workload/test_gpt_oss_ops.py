"""GPT-OSS's eager expert kernels and its sink-attention backend (sim/workload/gpt_oss_ops.py)
against closed forms and the sources' rules.

Independent truths: Megatron-Core ``megatron/core/fusions/fused_bias_geglu.py``
``weighted_bias_quick_geglu_impl`` (chunk, two clamps and a cat before the fused activation,
bf16) and ``megatron/core/transformer/moe/experts.py`` ``TEGroupedMLP._apply_bias`` (per local
expert ``t + b * p`` with fp32 probs, a cat of the fp32 pieces, a cast to bf16), the same at
Megatron-Core 0d8e0714 (NeMo 25.11), b0cc2706 (26.02) and 55ac7082 (26.02.01); Transformer
Engine ``grouped_linear.py`` (bf16: bias gradient fused in the wgrad GEMM; ``return_bias``: none
at all); TE ``fused_attn.cpp`` / ``dot_product_attention/utils.py`` (sinks need cuDNN >= 9.13.1)
and Megatron-Bridge ``GPTOSSProvider.provide`` (TE < 2.8: Megatron-Core's local attention).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sim.config.training import ModelDims
from sim.workload.gpt_oss_ops import sink_attention_backend
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

OSS = ModelSpec.from_ref("gpt-oss-120b")
TOKENS = 4096


def _kernels(block, prefix, pass_="fwd"):
    ks = block.forward if pass_ == "fwd" else block.backward
    return [k for k in ks if k.name.startswith(prefix)]


def _bytes(ks, klass_not="tiny"):
    return sum(k.nbytes for k in ks if k.klass != klass_not)


def test_the_catalogue_model_clamps_at_seven() -> None:
    # openai/gpt-oss-120b config.json swiglu_limit 7.0; Megatron-Bridge
    # GPTOSSProvider.activation_func_clamp_value 7.0.
    assert OSS.activation_clamp == 7.0
    assert ModelSpec.from_ref("qwen3-30b-a3b").activation_clamp is None


def test_a_non_positive_clamp_is_refused() -> None:
    base = {"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100}
    with pytest.raises(ValidationError, match="activation_clamp"):
        ModelDims(**base, activation_clamp=0.0)


@pytest.mark.parametrize("ep", [8, 64])
def test_the_clamp_moves_sixteen_then_thirty_bytes_per_gate_element(ep) -> None:
    ops = moe_layer_ops(OSS, MoELayout(ep=ep), TOKENS)
    rows = TOKENS * OSS.moe.top_k        # balanced: every rank receives tokens x top-k rows
    f = OSS.moe.ffn_hidden
    fwd = _kernels(ops.experts, "weighted_act.c")
    assert [k.name.split(".")[1] for k in fwd] == ["clamp_gate", "clamp_linear", "cat"]
    # Two clamps read and write rows x f each, the cat reads and writes rows x 2f: 8 rows f
    # bf16 elements.
    assert _bytes(fwd) == pytest.approx(16 * rows * f, rel=1e-12)
    # Backward, PyTorch's clamp_backward: where(mask, g, 0) on each half, the mask from
    # self <= max (gate) and self >= min, self <= max, logical_and_ (linear). A comparison
    # reads a bf16 half and writes a bool (3 bytes an element), a where reads the bool and
    # the bf16 gradient and writes bf16 (5), the and reads two bools and writes one (3), the
    # chunk's concatenation reads and writes 2 rows f bf16 (8 per rows f): 30 bytes in all.
    bwd = [k for k in ops.experts.backward if k.name.startswith(("weighted_act.clamp",
                                                                 "weighted_act.chunk"))]
    assert _bytes(bwd) == pytest.approx(30 * rows * f, rel=1e-12)
    # The halves are chunk views and the gradients slices of the cat's: every kernel with a
    # half or its gradient as an operand takes PyTorch's non-vectorised loop (two forward,
    # five backward); the and of two contiguous masks and the cats do not.
    legacy = [k.name for k in fwd + bwd if k.legacy_elements]
    assert legacy == ["weighted_act.clamp_gate", "weighted_act.clamp_linear",
                      "weighted_act.clamp_gate.le", "weighted_act.clamp_gate.bwd",
                      "weighted_act.clamp_linear.ge", "weighted_act.clamp_linear.le",
                      "weighted_act.clamp_linear.bwd"]
    assert all(k.legacy_elements == rows * f for k in fwd + bwd if k.legacy_elements)
    # The fused activation reads the clamped concatenation, not fc1's output.
    act = _kernels(ops.experts, "weighted_act")[-1]
    assert act.name == "weighted_act" and act.reads[0].name.endswith("glu_clamped")


@pytest.mark.parametrize("ep", [8, 32])
def test_fc2s_bias_is_added_per_local_expert_in_fp32(ep) -> None:
    ops = moe_layer_ops(OSS, MoELayout(ep=ep), TOKENS)
    rows, h = TOKENS * OSS.moe.top_k, OSS.hidden
    local = OSS.moe.experts // ep
    fwd = _kernels(ops.experts, "apply_bias")
    assert sum(k.name == "apply_bias.mul" for k in fwd) == local
    assert sum(k.name == "apply_bias.add" for k in fwd) == local
    # 28 bytes an output element (mul: 4 out; add: 2 + 4 in, 4 out; cat: 4 + 4; cast: 4 + 2)
    # plus each expert's probs (4 bytes a row) and bias (2 bytes a column).
    assert _bytes(fwd) == pytest.approx(28 * rows * h + 4 * rows + 2 * h * local, rel=1e-12)
    # b * p broadcasts both operands (the bias over rows, the prob over h), and so do the
    # backward's g * p and g * b: PyTorch's non-vectorised loop, one element an output.
    muls = [k for k in fwd + _kernels(ops.experts, "apply_bias", "bwd")
            if ".mul" in k.name]
    assert len(muls) == 3 * local
    assert sum(k.legacy_elements for k in muls) == pytest.approx(3 * rows * h, rel=1e-12)
    bwd = _kernels(ops.experts, "apply_bias", "bwd")
    # cast 6, add 6, the bias gradient's mul 8 + sum 4, the prob's mul 8 + sum 4, split 4:
    # 40 bytes an element; the probs read and their gradient written (8 a row), the bias read
    # and its fp32 gradient written (6 a column per expert).
    assert _bytes(bwd) == pytest.approx(40 * rows * h + 8 * rows + 6 * h * local, rel=1e-12)
    assert sum(k.klass == "tiny" for k in bwd) == 2 * local


def test_empty_experts_launch_nothing() -> None:
    counts = [0.0, 512.0, 0.0, 1024.0] + [256.0] * 12
    ops = moe_layer_ops(OSS, MoELayout(ep=8), TOKENS, tokens_per_expert=counts)
    assert sum(k.name == "apply_bias.mul" for k in ops.experts.forward) == 14


def test_bias_gradients_come_from_the_gemm_or_from_apply_bias() -> None:
    # bf16: no bias-gradient kernel for fc1 (fused in the wgrad GEMM) nor fc2 (return_bias).
    bf16 = moe_layer_ops(OSS, MoELayout(ep=8), TOKENS).experts
    assert not [k for k in bf16.backward if k.name.endswith(".g_bias")]
    # FP8 current scaling: TE's bgrad_quantize per expert keeps fc1's; fc2 still has none.
    fp8 = moe_layer_ops(OSS, MoELayout(ep=8, fp8="tensorwise"), TOKENS).experts
    assert [k.name for k in fp8.backward if k.name.endswith(".g_bias")] == ["fc1.g_bias"]


def test_models_without_bias_or_clamp_keep_their_kernels() -> None:
    q = ModelSpec.from_ref("qwen3-30b-a3b")
    names = {k.name for k in moe_layer_ops(q, MoELayout(ep=8), TOKENS).experts.forward}
    assert not {n for n in names if n.startswith(("apply_bias", "weighted_act."))}
    unclamped = ModelSpec(**{**OSS.__dict__, "activation_clamp": None})
    ops = moe_layer_ops(unclamped, MoELayout(ep=8), TOKENS)
    assert not _kernels(ops.experts, "weighted_act.c")
    assert _kernels(ops.experts, "apply_bias.cast")


def test_the_clamped_input_is_saved_beside_fc1s_output() -> None:
    ops = moe_layer_ops(OSS, MoELayout(ep=8), TOKENS)
    rows, f = TOKENS * OSS.moe.top_k, OSS.moe.ffn_hidden
    saved = {t.name.split(".", 1)[1]: t.nbytes for t in ops.experts.saved}
    # WeightedBiasQuickGeGLUFunction saves its (clamped) input; the clamps save fc1's output.
    assert saved["glu_clamped"] == saved["fc1.out"] == 2 * rows * f * 2


@pytest.mark.parametrize("te,cudnn,sm,want", [
    ((2, 9), (9, 13, 1), 100, "cudnn"),     # NeMo 25.11 (software-versions.md @ v0.2.0)
    ((2, 9), (9, 13, 1), 90, "cudnn"),
    ((2, 12), (9, 18, 0), 100, "cudnn"),    # NeMo 26.02 (@ v0.3.0)
    ((2, 9), (9, 13, 0), 90, "te_unfused"),  # "pre-9.13.1: vanilla"
    ((2, 9), (9, 14, 0), 80, "cudnn"),
    ((2, 9), (9, 6, 0), 100, "te_unfused"),  # sm100 needs cuDNN >= 9.7 (and 9.13.1 anyway)
    ((2, 7), (9, 11, 0), 90, "mcore_local"),  # NeMo 25.09: TE 2.7
])
def test_the_sink_backend_follows_the_stack(te, cudnn, sm, want) -> None:
    assert sink_attention_backend(te, cudnn, sm) == want


def test_sinks_under_context_parallelism_need_a2a_and_fused_attention() -> None:
    assert sink_attention_backend((2, 9), (9, 13, 1), 90, cp=2, cp_comm_type="a2a") == "cudnn"
    with pytest.raises(ValueError, match="cp_comm_type a2a"):
        sink_attention_backend((2, 9), (9, 13, 1), 90, cp=2, cp_comm_type="p2p")
    with pytest.raises(ValueError, match="cp_comm_type a2a"):
        sink_attention_backend((2, 9), (9, 12, 0), 90, cp=2, cp_comm_type="a2a")
    with pytest.raises(ValueError, match="FP8"):
        sink_attention_backend((2, 9), (9, 13, 1), 90, fp8_dpa=True)


# --------------------------------------------------------------------------- YaRN RoPE
def _attn(m, tp=1):
    from sim.workload.megatron_ops import MegatronLayout, attention_block
    return attention_block(m, MegatronLayout(tp=tp), 2, 4096)[1]


@pytest.mark.parametrize("tp", [1, 2])
def test_yarn_runs_megatrons_unfused_rope_on_query_and_key(tp) -> None:
    # GPT-OSS: YaRN factor 32, concentration 0.1 ln 32 + 1 != 1: rope_utils.py falls back to
    # _apply_rotary_pos_emb_bshd for the query and the key (24 bytes an element forward, 34
    # backward, bf16), plus cos/sin of the [s, d] fp32 table (fp32 cos, x mscale, to bf16).
    blk = _attn(OSS, tp)
    tokens, d = 2 * 4096, OSS.head_dim
    q_n = tokens * OSS.heads // tp * d
    k_n = tokens * OSS.kv_heads // tp * d
    table = 4096 * d
    for name, n in (("q", q_n), ("k", k_n)):
        fwd = _kernels(blk, f"{name}_rope.")
        big = [k for k in fwd if not k.name.split(".")[1].startswith(("cos", "sin"))]
        assert _bytes(big) == pytest.approx(24 * n + 2 * 2 * table, rel=1e-12)
        tab = [k for k in fwd if k not in big]
        assert _bytes(tab) == pytest.approx(2 * (8 + 8 + 6) * table, rel=1e-12)
        bwd = _kernels(blk, f"{name}_rope.", "bwd")
        assert _bytes(bwd) == pytest.approx(34 * n + 2 * 2 * table, rel=1e-12)
        # Broadcast or sliced operands: the products (n each), the negation (n / 2) and the
        # rotate cat (n) forward, their gradients backward, in the non-vectorised loop.
        assert sum(k.legacy_elements for k in fwd) == pytest.approx(3.5 * n, rel=1e-12)
        assert sum(k.legacy_elements for k in bwd) == pytest.approx(3.5 * n, rel=1e-12)
    assert not [k for k in blk.forward if k.name == "rope"]


def test_plain_rope_stays_fused() -> None:
    blk = _attn(ModelSpec.from_ref("qwen3-30b-a3b"))
    assert [k.name for k in blk.forward if "rope" in k.name] == ["rope"]
    no_yarn = ModelSpec(**{**OSS.__dict__, "yarn_factor": None})
    assert [k.name for k in _attn(no_yarn).forward if "rope" in k.name] == ["rope"]
