"""GPT-OSS's attention as NeMo AutoModel's own model code runs it with ``attn: flex``.

NeMo AutoModel's ``GptOssAttention`` (``nemo_automodel/components/models/gpt_oss/layers.py``
at 8d9bfb90e, 2025-10, the commit of its GPT-OSS benchmark configs
``examples/benchmark/configs/gptoss_{20b,120b}_te_deepep.yaml`` and of the performance
summary that quotes them; it asserts ``backend.attn == "flex"``: "Only Flex Attention is
supported for GPT-OSS"), one layer on one GPU without tensor parallelism:

* ``input_layernorm``: Transformer Engine's RMSNorm (``rms_norm: te``);
* ``q_proj``, ``k_proj``, ``v_proj``: three Transformer Engine ``Linear`` modules with biases
  (``linear: te``; the bias in the GEMM's epilogue), each ``.view`` as ``[b, s, heads, d]``;
  autograd sums their three input gradients (two adds);
* ``_apply_rotary_emb`` on the queries and on the keys, eager: ``cos`` and ``sin`` cast to
  bf16, ``torch.chunk`` into halves (views), ``x1 * cos - x2 * sin`` and
  ``x2 * cos + x1 * sin`` (four products and a sum and a difference over half the elements)
  and ``torch.cat`` of the two (:func:`eager_half_rope`);
* ``q``, ``k``, ``v`` ``.transpose(1, 2).contiguous()``: a copy each; backward, the gradient
  of each ``.view`` arrives transposed and ``reshape`` copies it;
* ``FlexAttention``: ``torch.compile(flex_attention)`` with a causal block mask, or the
  sliding-window one on GPT-OSS's sliding layers (``q - kv < window``), cached per shape
  (``create_block_mask`` once per run), ``return_lse=True``; its backward computes
  ``delta = rowsum(dO * O)`` before the template kernel;
* the learned sinks applied after the kernel: ``out * sigmoid(lse - w)`` (a bf16 output
  times an fp32 scale: an fp32 tensor) and ``.to(bf16)``; backward, the product's two
  gradients (the output's cast back to bf16, the scale's summed over the head dim) and the
  cast's;
* the output ``.transpose(1, 2).contiguous()`` (a copy), ``o_proj`` (TE ``Linear`` with
  bias) and the block's residual add ``x + attn_out``.

The kernel is the scenario's attention backend (``flex``:
:func:`sim.hardware.attention_cost.flex_share`), over the window's band on the
sliding layers (:func:`sim.hardware.attention_cost.causal_tiles`).
"""

from __future__ import annotations

from functools import lru_cache

from sim.hardware.attention_cost import window_pairs
from sim.workload.kernels import BF16, FP32, Block, Kernel, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.megatron_ops import STYLE, _linear, _norm
from sim.workload.model import ModelSpec


def eager_half_rope(b: _Builder, x: Tensor, n: float, table: float, name: str) -> Tensor:
    """AutoModel GPT-OSS's ``_apply_rotary_emb`` of one ``[b, s, heads, d]`` bf16 tensor of
    ``n`` elements; ``table``: elements of its ``[b, s, d/2]`` fp32 ``cos`` (and ``sin``).

    Forward: ``cos`` and ``sin`` cast to bf16 (``.to(x.dtype)``), four products of a half
    (``chunk`` view) with a broadcast table, the difference and the sum (half each), and the
    ``cat`` of the two halves. Backward: the four products' gradients, the difference's
    negation, the two sums of each half's two gradients and the ``chunk``'s concatenation.
    Every product reads a strided half and a broadcast table, so they and their gradients
    take PyTorch's non-vectorised loop (``legacy_elements``), as
    :func:`sim.workload.gpt_oss_ops.unfused_rope` prices Megatron-Core's.

    Examples
    --------
    >>> b = _Builder("a", STYLE)
    >>> y = eager_half_rope(b, Tensor("a.q", 200.0), 100, 0, "q")
    >>> len(b.block.forward), len(b.finish().backward)
    (9, 8)
    """
    def new(tag: str, numel: float = n / 2, nbytes: int = BF16) -> Tensor:
        return b.t(f"{name}_rope.{tag}", numel, nbytes)

    tab = {}
    for fn in ("cos", "sin"):
        tab[fn] = new(f"{fn}16", table)
        b.fwd(Kernel(f"{name}_rope.{fn}_bf16", "elementwise", (new(fn, table, FP32),),
                     (tab[fn],)))
    # torch.chunk: two views of x, each read as its own strided half.
    x1, x2 = (Tensor(f"{x.name}.{half}", x.nbytes / 2) for half in ("x1", "x2"))
    prods = {}
    for tag, half, fn in (("x1_cos", x1, "cos"), ("x2_sin", x2, "sin"), ("x2_cos", x2, "cos"),
                          ("x1_sin", x1, "sin")):
        prods[tag] = new(tag)
        b.fwd(Kernel(f"{name}_rope.{tag}", "elementwise", (half, tab[fn]), (prods[tag],),
                     legacy_elements=n / 2, legacy_operands=3))
    o1, o2, out = new("o1"), new("o2"), new("out", n)
    b.fwd(Kernel(f"{name}_rope.sub", "elementwise", (prods["x1_cos"], prods["x2_sin"]), (o1,)))
    b.fwd(Kernel(f"{name}_rope.add", "elementwise", (prods["x2_cos"], prods["x1_sin"]), (o2,)))
    b.fwd(Kernel(f"{name}_rope.cat", "elementwise", (o1, o2), (out,)))
    g1, g2 = new("g_o1"), new("g_o2")          # views of the cat's gradient
    gp = {tag: new(f"g_{tag}") for tag in prods}
    g_neg = new("g_neg")
    gx1, gx2, gx = new("g_x1"), new("g_x2"), new("g_in", n)
    b.bwd(Kernel(f"{name}_rope.sub.bwd", "elementwise", (g1,), (g_neg,)),
          *(Kernel(f"{name}_rope.{tag}.bwd", "elementwise",
                   (g_neg if tag == "x2_sin" else g1 if tag == "x1_cos" else g2, tab[fn]),
                   (gp[tag],), legacy_elements=n / 2, legacy_operands=3)
            for tag, fn in (("x1_cos", "cos"), ("x2_sin", "sin"), ("x2_cos", "cos"),
                            ("x1_sin", "sin"))),
          Kernel(f"{name}_rope.g_x1_sum", "elementwise", (gp["x1_cos"], gp["x1_sin"]), (gx1,)),
          Kernel(f"{name}_rope.g_x2_sum", "elementwise", (gp["x2_sin"], gp["x2_cos"]), (gx2,)),
          Kernel(f"{name}_rope.chunk.bwd", "elementwise", (gx1, gx2), (gx,)))
    return out


@lru_cache(maxsize=32)
def flex_sink_attention_block(m: ModelSpec, batch: int, seq: int,
                              window: int | None = None) -> Block:
    """Norm, projections, RoPE, FlexAttention with learned sinks, output projection and
    residual add of one layer and micro-batch on one GPU (module docstring); ``window``: the
    sliding layers' keys per query (None: causal over the sequence). Each op's backward is
    added right after its forward (the builder runs the groups reversed).

    Examples
    --------
    >>> m = ModelSpec.from_ref("gpt-oss-20b")
    >>> full = flex_sink_attention_block(m, 2, 4096)
    >>> band = flex_sink_attention_block(m, 2, 4096, m.sliding_window)
    >>> full.params == m.attention_params + m.norm_params
    True
    >>> round(full.flops_fwd / band.flops_fwd, 2) > 1
    True
    """
    tokens = batch * seq
    h, qd, kvd, heads = m.hidden, m.q_dim, m.kv_dim, m.heads
    rows = batch * heads * seq
    b = _Builder("attn", STYLE)
    x = b.t("in", tokens * h, BF16)
    b.block.inputs.append(x)
    # The layer input feeds the norm and the residual add: autograd sums its two gradients.
    b.bwd(Kernel("in.g_sum", "elementwise", (b.t("in.g_norm", tokens * h, BF16),
                                             b.t("in.g_resid", tokens * h, BF16)),
                 (b.t("in.g", tokens * h, BF16),)))
    y = _norm(b, m, x, tokens, "norm")
    # The three projections' input gradients, summed into the norm's output gradient.
    parts = [b.t(f"{n}_proj.g_in", tokens * h, BF16) for n in ("q", "k", "v")]
    acc = b.t("norm.g_out", tokens * h, BF16)
    b.bwd(Kernel("qkv_in.g_sum0", "elementwise", (parts[0], parts[1]), (acc,)),
          Kernel("qkv_in.g_sum1", "elementwise", (acc, parts[2]), (acc,)))
    widths = {"q": qd, "k": kvd, "v": kvd}
    proj = {n: _linear(b, y, tokens, h, w, f"{n}_proj", True, bias_in_epilogue=True)
            for n, w in widths.items()}
    # Each .view's gradient arrives transposed (the heads-first copy's): reshape copies it.
    for n, w in widths.items():
        b.bwd(Kernel(f"{n}.g_reshape", "elementwise", (b.t(f"{n}.g_bshd_strided", tokens * w,
                                                            BF16),),
                     (b.t(f"{n}.g_bshd", tokens * w, BF16),)))
    table = tokens * m.head_dim / 2
    rotated = {"q": eager_half_rope(b, proj["q"], tokens * qd, table, "q"),
               "k": eager_half_rope(b, proj["k"], tokens * kvd, table, "k"), "v": proj["v"]}
    # transpose(1, 2).contiguous(): a copy each (its backward is a view).
    qkv = []
    for n, w in widths.items():
        c = b.t(f"{n}_bhsd", tokens * w, BF16)
        b.fwd(Kernel(f"{n}.contiguous", "elementwise", (rotated[n],), (c,)))
        qkv.append(c)
    o = b.t("flex.out", tokens * qd, BF16)
    lse = b.t("flex.lse", rows, FP32)
    fl = 2.0 * batch * seq * seq * qd if window is None or window >= seq else \
        4.0 * batch * qd * window_pairs(seq, window)
    b.fwd(Kernel("flex.fwd", "attention", tuple(qkv), (o, lse), fl,
                 attn=(batch, heads, seq, m.head_dim, "fwd"), attn_window=window))
    b.save(*qkv, o, lse)
    g_o, g_lse, delta = b.t("flex.g_out", tokens * qd, BF16), b.t("flex.g_lse", rows, FP32), \
        b.t("flex.delta", rows, FP32)
    b.bwd(Kernel("flex.delta", "elementwise", (g_o, o), (delta,)),
          Kernel("flex.bwd", "attention", (g_o, *qkv, o, lse, delta, g_lse),
                 tuple(b.t(f"flex.g_{n}", tokens * w, BF16) for n, w in widths.items()),
                 2.5 * fl, attn=(batch, heads, seq, m.head_dim, "bwd"), attn_window=window))
    # The learned sinks (one logit per head, a parameter of the block): out * sigmoid(lse - w).
    b.block.params += heads
    g_sink = b.t("sinks.g", heads, FP32)
    b.block.weight_grads.append(g_sink)
    shifted, scale = b.t("sink.lse_minus_w", rows, FP32), b.t("sink.scale", rows, FP32)
    g_shift, g_scale = b.t("sink.g_shift", rows, FP32), b.t("sink.g_scale", rows, FP32)
    b.fwd(Kernel("sink.sub", "elementwise", (lse,), (shifted,)))
    b.bwd(Kernel("sink.sub.bwd", "elementwise", (g_shift,), (g_lse, g_sink)))
    b.fwd(Kernel("sink.sigmoid", "elementwise", (shifted,), (scale,)))
    b.save(scale)
    b.bwd(Kernel("sink.sigmoid.bwd", "elementwise", (g_scale, scale), (g_shift,)))
    # bf16 output times the fp32 scale broadcast over the head dim: an fp32 product.
    n_out = tokens * qd
    scaled = b.t("sink.out_fp32", n_out, FP32)
    b.fwd(Kernel("sink.mul", "elementwise", (o, scale), (scaled,), legacy_elements=n_out,
                 legacy_operands=3))
    g32, g_o32, g_prod = (b.t(f"sink.{t}", n_out, FP32) for t in ("g_out", "g_o", "g_prod"))
    b.bwd(Kernel("sink.mul.bwd_out", "elementwise", (g32, scale), (g_o32,),
                 legacy_elements=n_out, legacy_operands=3),
          Kernel("sink.mul.bwd_out_bf16", "elementwise", (g_o32,), (g_o,)),
          Kernel("sink.mul.bwd_scale", "elementwise", (g32, o), (g_prod,),
                 cast_elements=n_out),
          Kernel("sink.mul.bwd_scale_sum", "elementwise", (g_prod,), (g_scale,)))
    out16 = b.t("sink.out", n_out, BF16)
    b.fwd(Kernel("sink.to_bf16", "elementwise", (scaled,), (out16,)))
    b.bwd(Kernel("sink.to_bf16.bwd", "elementwise", (b.t("sink.g_out16", n_out, BF16),),
                 (g32,)))
    ctx = b.t("ctx", n_out, BF16)
    b.fwd(Kernel("out.contiguous", "elementwise", (out16,), (ctx,)))
    attn_out = _linear(b, ctx, tokens, qd, h, "o_proj", True, bias_in_epilogue=True)
    res = b.t("resid.out", tokens * h, BF16)
    b.fwd(Kernel("resid", "elementwise", (x, attn_out), (res,)))
    b.block.outputs.append(res)
    return b.finish()
