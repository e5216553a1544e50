"""The unfused parts of GPT-OSS's experts and its attention backend, as Megatron-Core and
Transformer Engine run them.

GPT-OSS-120B (Megatron-Bridge ``GPTOSSProvider``, ``src/megatron/bridge/models/gpt_oss/
gpt_oss_provider.py``, the same from v0.2.0 (NeMo 25.11) to v0.3.1 (26.02.01)) is a
``TEGroupedMLP`` with ``add_bias_linear``, a gated quick-GELU with ``glu_linear_offset`` 1 and
``activation_func_clamp_value`` 7, ``bias_activation_fusion`` on, and attention with a learned
sink per head (``softmax_type="learnable"``) over a 128-token window on every other layer.
Two pieces of its expert path are eager PyTorch, not the fused kernels the other MoE models
run (Megatron-Core ``megatron/core/transformer/moe/experts.py`` and
``megatron/core/fusions/fused_bias_geglu.py``, unchanged at 0d8e0714 (25.11), b0cc2706
(26.02) and 55ac7082 (26.02.01)):

* :func:`clamped_glu_input`: ``weighted_bias_quick_geglu_impl`` clamps outside the compiled
  activation: ``input.chunk(2, -1)``, ``clamp(max=c)`` on the gate half, ``clamp(-c, c)`` on
  the linear half, ``torch.cat`` back (three kernels and a new ``2 f``-wide tensor), then the
  fused ``WeightedBiasQuickGeGLUFunction`` on the concatenation;
* :func:`expert_output_bias`: fc2 is built with ``skip_bias_add=True`` (Transformer Engine's
  ``GroupedLinear`` with ``return_bias``: no bias in the GEMM and none of its gradient), and
  ``TEGroupedMLP._apply_bias`` adds it in Python, per local expert, ``t + b * p`` over
  ``torch.split`` of the rows (``p`` the fp32 routing probs, so both results are fp32), a
  ``torch.cat`` of the fp32 pieces and a cast back to bf16.

fc1's bias stays in the grouped GEMM (``skip_bias_add=False``): in bf16 Transformer Engine
adds it in the cuBLASLt epilogue and takes its gradient from the wgrad GEMM
(``grouped_linear.py``: "Grad bias is fused with wgrad GEMM"), no kernel of its own.

:func:`sink_attention_backend` is which kernel runs the sink attention for a given software
stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from sim.workload.kernels import BF16, BOOL, FP32, Kernel, Tensor
from sim.workload.layer_builder import _Builder

SinkBackend = Literal["cudnn", "te_unfused", "mcore_local"]

SINK_MIN_TE = (2, 8)
"""Transformer Engine release from which Megatron-Bridge runs GPT-OSS's sinks in TE's
attention: ``GPTOSSProvider.provide`` falls back to ``AttnBackend.local`` below it ("Fused sink
attention requires TE >= 2.8. Falling back to MCore local sink attention")."""
SINK_MIN_CUDNN = (9, 13, 1)
"""cuDNN release from which TE's fused attention takes ``softmax_type`` off-by-one or
learnable (TE ``transformer_engine/common/fused_attn/fused_attn.cpp``
``nvte_get_fused_attn_backend``: "9.13.1+: vanilla, off-by-one, learnable", same at v2.9 and
v2.12)."""


def sink_attention_backend(te: tuple[int, ...], cudnn: tuple[int, ...], sm: int,
                           cp: int = 1, cp_comm_type: str = "p2p", fp8_dpa: bool = False
                           ) -> SinkBackend:
    """The kernel that runs attention with learned sinks and a causal (or ``(w, 0)``
    sliding-window) mask on one software stack.

    Transformer Engine's ``get_attention_backend`` (``pytorch/attention/dot_product_attention/
    utils.py``, "Filter: Softmax type", v2.9): a non-vanilla softmax disables FlashAttention;
    FusedAttention stays if cuDNN supports the softmax type (:data:`SINK_MIN_CUDNN`), the
    arbitrary-sequence-length sub-backend runs on sm80 and newer (cuDNN >= 9.7 for sm100),
    with context parallelism only over ``a2a``, and not with FP8 attention; otherwise
    ``UnfusedDotProductAttention`` (which also refuses context parallelism and FP8 attention
    with sinks). Below TE 2.8 Megatron-Bridge picks Megatron-Core's local attention.

    Parameters
    ----------
    te, cudnn : tuple of int
        Transformer Engine and cuDNN versions, e.g. ``(2, 9)`` and ``(9, 13, 1)``.
    sm : int
        Compute capability as ``10 * major + minor`` (90 Hopper, 100 B200 / GB200).
    cp, cp_comm_type, fp8_dpa
        Context-parallel size and ``cp_comm_type``; FP8 dot-product attention.

    Examples
    --------
    NeMo 25.11 ships TE 2.9 with cuDNN 9.13.1.26, 26.02 TE 2.12 with cuDNN 9.18.0.50
    (Megatron-Bridge ``docs/releases/software-versions.md`` at v0.2.0 and v0.3.0):

    >>> sink_attention_backend((2, 9), (9, 13, 1), 100)
    'cudnn'
    >>> sink_attention_backend((2, 12), (9, 18, 0), 90)
    'cudnn'
    >>> sink_attention_backend((2, 9), (9, 13, 0), 100)       # one cuDNN patch too old
    'te_unfused'
    >>> sink_attention_backend((2, 7), (9, 11, 0), 90)        # NeMo 25.09's TE 2.7
    'mcore_local'
    """
    if te < SINK_MIN_TE:
        return "mcore_local"
    if fp8_dpa:
        raise ValueError("sink attention: Transformer Engine runs no backend with FP8 "
                         "dot-product attention and softmax_type learnable")
    fused = cudnn >= SINK_MIN_CUDNN and sm >= 80 and (sm < 100 or cudnn >= (9, 7, 0))
    if cp > 1:
        if fused and cp_comm_type == "a2a":
            return "cudnn"
        raise ValueError("sink attention with context parallelism: only FusedAttention with "
                         "cp_comm_type a2a (Transformer Engine disables the unfused backend)")
    return "cudnn" if fused else "te_unfused"


def clamped_glu_input(b: _Builder, fc1: Tensor, rows: float, f: int) -> Tensor:
    """The eager clamp in front of the fused gated activation: returns the clamped
    ``rows x 2f`` bf16 tensor the activation reads (and saves).

    Forward, three kernels: ``clamp`` of the gate half and of the linear half (each reads
    and writes ``rows x f``) and ``torch.cat`` (reads ``2 rows f``, writes ``2 rows f``):
    ``16 rows f`` bytes in all. The halves are ``chunk`` views of fc1's output, not
    contiguous, so both clamps run PyTorch's non-vectorised loop (``legacy_elements``,
    :meth:`sim.hardware.compute.ComputeModel.legacy_loop_time`). Backward: PyTorch's
    ``clamp_backward`` is ``where(mask, g, 0)`` with the mask from comparisons of the saved
    input: ``self <= max`` for the gate half, ``self >= min``, ``self <= max`` and a
    ``logical_and_`` for the linear half; every comparison reads a half of fc1's output and
    every ``where`` a slice of the ``cat``'s gradient, so five of the six kernels take the
    non-vectorised loop (the ``logical_and_`` of two contiguous masks does not); then the
    ``chunk``'s backward (``SplitBackward``) concatenates the two halves' gradients
    (``8 rows f``). The clamps save fc1's output (their input).

    Examples
    --------
    >>> from sim.workload.megatron_ops import STYLE
    >>> b = _Builder("e", STYLE)
    >>> x = clamped_glu_input(b, Tensor("e.fc1", 2 * 10 * 4 * 2), 10, 4)
    >>> [k.name for k in b.block.forward], sum(k.nbytes for k in b.block.forward)
    (['weighted_act.clamp_gate', 'weighted_act.clamp_linear', 'weighted_act.cat'], 640.0)
    >>> blk = b.finish(); [k.name for k in blk.backward][:2], len(blk.backward)
    (['weighted_act.clamp_gate.le', 'weighted_act.clamp_gate.bwd'], 7)
    >>> sum(k.legacy_elements for k in blk.forward + blk.backward) / (10 * 4)
    7.0
    """
    half = rows * f
    gate, lin = b.t("fc1.gate_half", half, BF16), b.t("fc1.linear_half", half, BF16)
    gc, lc = b.t("glu_gate_clamped", half, BF16), b.t("glu_linear_clamped", half, BF16)
    out = b.t("glu_clamped", 2 * half, BF16)
    b.fwd(Kernel("weighted_act.clamp_gate", "elementwise", (gate,), (gc,),
                 legacy_elements=half))
    b.fwd(Kernel("weighted_act.clamp_linear", "elementwise", (lin,), (lc,),
                 legacy_elements=half))
    b.save(fc1)
    b.fwd(Kernel("weighted_act.cat", "elementwise", (gc, lc), (out,)))
    g = [b.t(f"g_clamped_{n}", half, BF16) for n in ("gate", "linear")]
    gi = [b.t(f"g_fc1_{n}", half, BF16) for n in ("gate", "linear")]
    gfc1 = b.t("g_fc1_clamp", 2 * half, BF16)
    mask = [b.t(f"clamp_{n}_mask", half, BOOL) for n in ("gate", "ge", "le")]
    b.bwd(Kernel("weighted_act.clamp_gate.le", "elementwise", (gate,), (mask[0],),
                 legacy_elements=half),
          Kernel("weighted_act.clamp_gate.bwd", "elementwise", (mask[0], g[0]), (gi[0],),
                 legacy_elements=half, legacy_operands=3),
          Kernel("weighted_act.clamp_linear.ge", "elementwise", (lin,), (mask[1],),
                 legacy_elements=half),
          Kernel("weighted_act.clamp_linear.le", "elementwise", (lin,), (mask[2],),
                 legacy_elements=half),
          Kernel("weighted_act.clamp_linear.and", "elementwise", (mask[1], mask[2]),
                 (mask[1],)),
          Kernel("weighted_act.clamp_linear.bwd", "elementwise", (mask[1], g[1]), (gi[1],),
                 legacy_elements=half, legacy_operands=3),
          Kernel("weighted_act.chunk.bwd", "elementwise", tuple(gi), (gfc1,)))
    return out


def expert_output_bias(b: _Builder, out: Tensor, probs: Tensor, counts: Sequence[float],
                       h: int) -> Tensor:
    """``TEGroupedMLP._apply_bias``: fc2's bias, times each row's routing prob, added per
    local expert in eager PyTorch; returns the bf16 output.

    Per expert with ``c`` rows: ``b * p`` (reads the fp32 probs and the bf16 bias, writes
    ``c x h`` fp32) and ``t + b p`` (reads the bf16 rows and that, writes ``c x h`` fp32); then
    ``torch.cat`` of the fp32 pieces and ``.to(bf16)``: ``28`` bytes per output element.
    Every piece lives until the ``cat`` (the list holds them), so the forward's transient
    peak is two fp32 copies of the output. Backward: the cast's (bf16 gradient to fp32), per
    expert the add's gradient cast to the rows' bf16, the mul's two gradients (``g p``
    summed over rows for the bias, ``g b`` summed over ``h`` for the prob: a mul and a
    reduction each) and the bias gradient's cast and accumulation (tiny), then the split's
    backward concatenating the rows' gradients (bf16): ``40`` bytes per element in all.
    Saved: nothing beyond the probs and the bias (parameters and the block's input).

    Examples
    --------
    >>> from sim.workload.megatron_ops import STYLE
    >>> b = _Builder("e", STYLE)
    >>> y = expert_output_bias(b, Tensor("e.o", 2 * 6 * 4), Tensor("e.p", 4 * 6), (2, 4), 4)
    >>> sum(k.nbytes for k in b.block.forward if k.klass != "tiny")  # 28 B x 24 + probs, bias
    712.0
    >>> [k.name.split(".")[1] for k in b.block.forward]
    ['mul', 'add', 'mul', 'add', 'cat', 'cast']
    """
    rows = float(sum(counts))
    pieces: list[Tensor] = []
    grads: list[Kernel] = []
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        p = b.t(f"probs_{i}", c, FP32)
        bias = b.t(f"fc2.bias_{i}", h, BF16)
        rows_i = b.t(f"fc2_rows_{i}", c * h, BF16)
        bp = b.t(f"bias_x_prob_{i}", c * h, FP32)
        s = b.t(f"biased_{i}", c * h, FP32)
        # Both multiplies broadcast an operand (the bias over rows, the prob over h): PyTorch's
        # non-vectorised loop, forward and backward.
        b.fwd(Kernel("apply_bias.mul", "elementwise", (p, bias), (bp,), legacy_elements=c * h,
                     legacy_operands=3))
        b.fwd(Kernel("apply_bias.add", "elementwise", (rows_i, bp), (s,)))
        pieces.append(s)
        g = b.t(f"g_biased_{i}", c * h, FP32)
        gp_full, gb_full = b.t(f"g_p_full_{i}", c * h, FP32), b.t(f"g_b_full_{i}", c * h, FP32)
        gb32, gb16 = b.t(f"g_bias_{i}", h, FP32), b.t(f"g_bias16_{i}", h, BF16)
        grads += [Kernel("apply_bias.add.bwd", "elementwise", (g,),
                         (b.t(f"g_rows_{i}", c * h, BF16),)),
                  Kernel("apply_bias.mul.bwd_bias", "elementwise", (g, p), (gb_full,),
                         legacy_elements=c * h, legacy_operands=3),
                  Kernel("apply_bias.sum_bias", "elementwise", (gb_full,), (gb32,)),
                  Kernel("apply_bias.mul.bwd_prob", "elementwise", (g, bias), (gp_full,),
                         legacy_elements=c * h, legacy_operands=3),
                  Kernel("apply_bias.sum_prob", "elementwise", (gp_full,),
                         (b.t(f"g_probs_{i}", c, FP32),)),
                  Kernel("apply_bias.cast_bias_grad", "tiny", (gb32,), (gb16,)),
                  Kernel("apply_bias.accumulate_bias_grad", "tiny", (gb16,), ())]
    cat = b.t("biased", rows * h, FP32)
    b.fwd(Kernel("apply_bias.cat", "elementwise", tuple(pieces), (cat,)))
    y = b.t("biased_bf16", rows * h, BF16)
    b.fwd(Kernel("apply_bias.cast", "elementwise", (cat,), (y,)))
    b.save(probs)
    gy, gcat = b.t("g_biased_bf16", rows * h, BF16), b.t("g_biased_cat", rows * h, FP32)
    g_rows = [k.writes[0] for k in grads if k.name == "apply_bias.add.bwd"]
    b.bwd(Kernel("apply_bias.cast.bwd", "elementwise", (gy,), (gcat,)), *grads,
          Kernel("apply_bias.split.bwd", "elementwise", tuple(g_rows),
                 (b.t("g_fc2_out_bias", rows * h, BF16),)))
    return y


def expert_input_bias(b: _Builder, fc1: Tensor, counts: Sequence[float], width: int
                      ) -> Tensor:
    """NeMo AutoModel's ``GroupedExpertsDeepEP._apply_bias`` without probs: fc1's bias added
    per local expert in eager PyTorch after ``grouped_gemm``'s GEMM (which has none), as
    ``torch.cat([t + b for t, b in zip(torch.split(rows, counts), bias)])``; returns the
    bf16 rows. Forward: per expert an add broadcasting the bias over its rows (PyTorch's
    non-vectorised loop), then the ``cat``. Backward: the add passes the rows' gradient on
    (a view of the ``cat``'s) and sums it over the rows for the bias (a reduction per
    expert), and the ``split``'s backward concatenates the pieces' gradients. The bias
    parameters are ``grouped_linear``'s when it is told the GEMM has a bias; here the
    caller adds them.

    Examples
    --------
    >>> from sim.workload.megatron_ops import STYLE
    >>> b = _Builder("e", STYLE)
    >>> y = expert_input_bias(b, Tensor("e.fc1", 2 * 6 * 8), (2, 4), 8)
    >>> [k.name.split(".")[1] for k in b.block.forward]
    ['add', 'add', 'cat']
    >>> [k.name.split(".")[1] for k in b.finish().backward]
    ['sum_bias', 'sum_bias', 'split']
    """
    rows = float(sum(counts))
    pieces: list[Tensor] = []
    sums: list[Kernel] = []
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        out = b.t(f"fc1_biased_{i}", c * width, BF16)
        b.fwd(Kernel("fc1_bias.add", "elementwise", (b.t(f"fc1_rows_{i}", c * width, BF16),
                                                      b.t(f"fc1.bias_{i}", width, BF16)),
                     (out,), legacy_elements=c * width, legacy_operands=3))
        pieces.append(out)
        sums.append(Kernel("fc1_bias.sum_bias", "elementwise",
                           (b.t(f"g_fc1_biased_{i}", c * width, BF16),),
                           (b.t(f"g_fc1_bias_{i}", width, BF16),)))
    y = b.t("fc1_biased", rows * width, BF16)
    b.fwd(Kernel("fc1_bias.cat", "elementwise", tuple(pieces), (y,)))
    b.bwd(*sums, Kernel("fc1_bias.split", "elementwise",
                        tuple(k.reads[0] for k in sums),
                        (b.t("g_fc1_out_bias", rows * width, BF16),)))
    return y


def yarn_concentration(factor: float) -> float:
    """YaRN's concentration factor ("mscale") that Megatron-Core multiplies into the rotary
    cos and sin when ``yarn_mscale`` and ``yarn_mscale_all_dim`` are unset, as GPT-OSS's
    provider leaves them: ``0.1 ln(factor) + 1`` (``yarn_rotary_pos_embedding.py``
    ``_yarn_get_concentration_factor`` / ``_yarn_get_mscale``).

    Examples
    --------
    >>> round(yarn_concentration(32.0), 4)       # GPT-OSS: rope_scaling factor 32
    1.3466
    """
    return 0.1 * math.log(factor) + 1.0


def unfused_rope(b: _Builder, x: Tensor, n: float, table: float, name: str) -> Tensor:
    """Megatron-Core's unfused rotary embedding of one ``bshd`` tensor of ``n`` bf16 elements
    (``rope_utils.py`` ``_apply_rotary_pos_emb_bshd``), which ``apply_rotary_pos_emb`` runs
    instead of TE's fused kernel whenever ``mscale != 1`` ("mscale ... is not supported by
    TE's fused RoPE. Using unfused implementation"), as YaRN's concentration factor makes it
    for GPT-OSS (:func:`yarn_concentration`) even under ``apply_rope_fusion``.

    ``table``: elements of the ``[s, 1, 1, d]`` fp32 frequency table. Forward: ``cos``,
    ``* mscale``, ``.to(bf16)`` and the same for ``sin`` on the table; on the tensor
    ``t * cos``, ``_rotate_half`` (``-x2`` over half, ``torch.cat``), ``* sin``, the add and
    ``torch.cat((t, t_pass))`` with the empty pass-through part (a copy): 24 bytes an element.
    Backward: the two products' gradients (4 + 4), the negation's (2), the ``chunk``'s
    concatenation (4), the sum of ``t``'s two gradients (6), and the two slices'
    (``SliceBackward``: zeros of the full size and a copy into them for ``t[..., :d]``, zeros
    for the empty ``t[..., d:]``, then their sum: 6 + 2 + 6): 34 bytes an element. The
    kernels with a broadcast or sliced operand (both products, the negation and the rotate
    ``cat``, and their gradients) run PyTorch's non-vectorised loop: 3.5 ``n`` elements each
    way (``legacy_elements``).

    Examples
    --------
    >>> from sim.workload.megatron_ops import STYLE
    >>> b = _Builder("a", STYLE)
    >>> y = unfused_rope(b, Tensor("a.q", 200.0), 100, 0, "q")
    >>> sum(k.nbytes for k in b.block.forward), sum(k.nbytes for k in b.finish().backward)
    (2400.0, 3400.0)
    """
    t16 = b.t(f"{name}_rope.table16", table, BF16)
    for fn in ("cos", "sin"):
        f32 = b.t(f"{name}_rope.freqs", table, FP32)
        raw, scaled = b.t(f"{name}_rope.{fn}", table, FP32), b.t(f"{name}_rope.{fn}_m", table, FP32)
        b.fwd(Kernel(f"{name}_rope.{fn}", "elementwise", (f32,), (raw,)))
        b.fwd(Kernel(f"{name}_rope.{fn}_mscale", "elementwise", (raw,), (scaled,)))
        b.fwd(Kernel(f"{name}_rope.{fn}_bf16", "elementwise", (scaled,),
                     (b.t(f"{name}_rope.{fn}16", table, BF16),)))

    def new(tag: str, numel: float = n) -> Tensor:
        return b.t(f"{name}_rope.{tag}", numel, BF16)

    tc, neg, rot, rs, add, out = new("t_cos"), new("neg", n / 2), new("rot"), new("rot_sin"), \
        new("sum"), new("out")
    # Non-contiguous operands take PyTorch's non-vectorised loop (legacy_elements): the
    # products broadcast the [s, 1, 1, d] table, the negation reads a chunk view, the cat
    # copies a chunk view; the add and the pass-through cat of contiguous tensors do not.
    b.fwd(Kernel(f"{name}_rope.mul_cos", "elementwise", (x, t16), (tc,), legacy_elements=n,
                 legacy_operands=3))
    b.fwd(Kernel(f"{name}_rope.neg", "elementwise", (new("x2", n / 2),), (neg,),
                 legacy_elements=n / 2))
    b.fwd(Kernel(f"{name}_rope.rotate_cat", "elementwise", (neg, new("x1", n / 2)), (rot,),
                 legacy_elements=n))
    b.fwd(Kernel(f"{name}_rope.mul_sin", "elementwise", (rot, t16), (rs,), legacy_elements=n,
                 legacy_operands=3))
    b.fwd(Kernel(f"{name}_rope.add", "elementwise", (tc, rs), (add,)))
    b.fwd(Kernel(f"{name}_rope.cat_pass", "elementwise", (add,), (out,)))
    g = new("g_out")
    g_cos, g_sin, g_neg, g_rot, g_t = new("g_t_cos"), new("g_rot"), new("g_x2", n / 2), \
        new("g_chunk"), new("g_t")
    zeros, zeros_pass, g_in = new("g_slice"), new("g_slice_pass"), new("g_in")
    # Backward likewise: the products' gradients broadcast the table, the negation's reads a
    # slice of the rotate cat's gradient, and the chunk's cat copies one.
    b.bwd(Kernel(f"{name}_rope.mul_sin.bwd", "elementwise", (g, t16), (g_sin,),
                 legacy_elements=n, legacy_operands=3),
          Kernel(f"{name}_rope.neg.bwd", "elementwise", (new("g_neg", n / 2),), (g_neg,),
                 legacy_elements=n / 2),
          Kernel(f"{name}_rope.chunk.bwd", "elementwise", (new("g_x1", n / 2), g_neg), (g_rot,),
                 legacy_elements=n),
          Kernel(f"{name}_rope.mul_cos.bwd", "elementwise", (g, t16), (g_cos,),
                 legacy_elements=n, legacy_operands=3),
          Kernel(f"{name}_rope.grad_sum", "elementwise", (g_cos, g_rot), (g_t,)),
          Kernel(f"{name}_rope.slice.zeros", "elementwise", (), (zeros,)),
          Kernel(f"{name}_rope.slice.copy", "elementwise", (g_t,), (zeros,)),
          Kernel(f"{name}_rope.slice_pass.zeros", "elementwise", (), (zeros_pass,)),
          Kernel(f"{name}_rope.slice.sum", "elementwise", (zeros, zeros_pass), (g_in,)))
    return out
