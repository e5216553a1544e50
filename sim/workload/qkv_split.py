"""Megatron-Core's split of the fused QKV projection into query, key and value, and what it
costs: a copy of the query under grouped-query attention, a concatenation in backward."""

from __future__ import annotations

from sim.workload.layer_ops import BF16, Kernel, Tensor, _Builder


def qkv_split(b: _Builder, qkv: Tensor, g_qkv: Tensor, tokens: float, qd: int, kvd: int,
              heads: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value out of the fused QKV projection, as Megatron-Core's
    ``SelfAttention.get_query_key_value_tensors`` takes them.

    The projection's output is viewed ``[s, b, groups, (heads/groups + 2) x head_dim]`` and
    split along the last dimension (TE's ``SplitAlongDim``, or ``torch.split``): three views,
    no kernel. The query view ``[s, b, groups, heads/groups x head_dim]`` is then reshaped to
    ``[s, b, heads, head_dim]``: merging the group dimension with the heads in it needs the
    group stride to be ``heads/groups x head_dim``, and it is ``(heads/groups + 2) x
    head_dim`` (the key and value sit between groups), so with more than one group on the
    rank and more than one query head per group (grouped-query attention) ``reshape`` copies:
    ``clone`` of a non-contiguous view, PyTorch's non-vectorised loop (``legacy_elements``).
    One group a rank (tensor parallelism as wide as the groups) or one head a group (plain
    multi-head attention) keeps it a view. In backward the split's gradient is a
    concatenation of the three gradients along that dimension (``_SplitAlongDim.backward``
    concatenates unless they already sit in one buffer in that layout, which the separate
    query copy, rotary and attention gradients never do; ``torch.split``'s is a ``cat``
    too): a contiguous ``cat`` of 16-byte-aligned rows, a vectorised stream.

    Examples
    --------
    >>> from sim.workload.layer_ops import Style
    >>> b = _Builder("attn_main", Style("bf16"))
    >>> qkv = b.t("qkv.out", 4096 * (4096 + 2 * 512), BF16)
    >>> g = b.t("qkv.g_out", 4096 * (4096 + 2 * 512), BF16)
    >>> _ = qkv_split(b, qkv, g, 4096, 4096, 512, heads=32, groups=4)   # Qwen3-30B-A3B, TP1
    >>> [(k.name, k.legacy_elements) for k in b.block.forward]
    [('split_qkv', 0.0), ('q_reshape_copy', 16777216)]
    >>> [k.name for k in b.finish().backward]
    ['split_qkv.bwd']
    """
    q = b.t("q", tokens * qd, BF16)
    k = b.t("k", tokens * kvd, BF16)
    v = b.t("v", tokens * kvd, BF16)
    b.fwd(Kernel("split_qkv", "tiny", (qkv,), (q, k, v)))
    grads = tuple(b.t(f"g_{n}_split", tokens * w, BF16) for n, w in (("q", qd), ("k", kvd),
                                                                       ("v", kvd)))
    b.bwd(Kernel("split_qkv.bwd", "elementwise", grads, (g_qkv,)))
    if groups > 1 and heads > groups:
        qc = b.t("q_contiguous", tokens * qd, BF16)
        b.fwd(Kernel("q_reshape_copy", "elementwise", (q,), (qc,),
                     legacy_elements=tokens * qd))
        q = qc
    return q, k, v
