"""Whether Transformer Engine's cuDNN attention (``FusedAttention``) can train a layer's head
dims, and what TE runs when it cannot.

TE picks its backend per call (``get_attention_backend``,
``transformer_engine/pytorch/attention/dot_product_attention/utils.py``); whether cuDNN's
arbitrary-sequence-length kernel (``F16_arbitrary_seqlen``) takes a shape is decided in C++ by
``nvte_get_fused_attn_backend`` (``transformer_engine/common/fused_attn/fused_attn.cpp``). Its
head-dim clause, for training (``is_training``: the backward kernel must exist too):

* both head dims <= 128 (multiples of 8): every release, every architecture from sm80;
* Hopper (sm90), dims up to 256: cuDNN 9.0 before TE 2.5 (v2.2's clause does not ask for a
  backward), cuDNN 9.5 from TE 2.5 ("9.5: <= 256 + Hopper + bprop");
* Blackwell (sm100 and later): until TE 2.4 nothing above 128 (``!(sm_arch_ >= 100 &&
  (head_dim_qk > 128 || head_dim_v > 128))``, v2.2 to v2.4); from TE 2.5 (PR #1797, "Add
  support for head_dim > 128", 2025-06-14) Multi-head Latent Attention's 192 / 128 with
  cuDNN 9.11 or newer ("9.11: d_qk = 192, d_v = 128 + Blackwell + bprop + non-paged"), still
  the only wider training shape at v2.16.

Without it TE falls back to FlashAttention where that takes the shape -- never with different
query and value head dims ("Disabling FlashAttention as it does not support MLA") -- and
otherwise to ``UnfusedDotProductAttention``: Q K^T by ``baddbmm`` over the whole score matrix,
the fused scale-mask-softmax, dropout, and the P V ``bmm``. So DeepSeek-V3 on a B200 or GB200
under TE 2.4 or older, or under cuDNN before 9.11, trains its attention unfused (NeMo 25.04's
container pins TE 2.2.0.dev0, ``requirements/manifest.json`` of NeMo v2.3.x: bee4649c1).
"""

from __future__ import annotations

from typing import Literal

Release = tuple[int, int, int]

FIRST_TE_BLACKWELL_WIDE: Release = (2, 5, 0)
"""The first TE release whose cuDNN attention trains a head dim above 128 on Blackwell (and
asks cuDNN 9.5 for Hopper's backward above 128)."""
FIRST_CUDNN_BLACKWELL_MLA: Release = (9, 11, 0)
"""The first cuDNN whose Blackwell attention backward takes 192-wide queries and keys with
128-wide values (TE's support clause, above)."""


def te_fused_attention_trains(arch: str, head_dim_qk: int, head_dim_v: int,
                              te: Release | None, cudnn: Release | None) -> bool:
    """Whether TE's cuDNN attention trains these head dims on ``arch`` under TE release ``te``
    and cuDNN ``cudnn`` (None: the newest, which do whatever any release does).

    Examples
    --------
    >>> te_fused_attention_trains("blackwell", 128, 128, (2, 2, 0), (9, 8, 0))
    True
    >>> te_fused_attention_trains("blackwell", 192, 128, (2, 2, 0), None)
    False
    >>> te_fused_attention_trains("blackwell", 192, 128, (2, 7, 0), (9, 10, 2))
    False
    >>> te_fused_attention_trains("blackwell", 192, 128, (2, 7, 0), (9, 11, 0))
    True
    >>> te_fused_attention_trains("hopper", 192, 128, (2, 2, 0), (9, 1, 0))
    True
    """
    if head_dim_qk <= 128 and head_dim_v <= 128:
        return True
    new_te = te is None or te >= FIRST_TE_BLACKWELL_WIDE
    if arch == "hopper":
        if head_dim_qk > 256 or head_dim_v > 256:
            return False
        return cudnn is None or cudnn >= ((9, 5, 0) if new_te else (9, 0, 0))
    if arch == "blackwell":
        return (new_te and (head_dim_qk, head_dim_v) == (192, 128)
                and (cudnn is None or cudnn >= FIRST_CUDNN_BLACKWELL_MLA))
    return False


def te_fallback(head_dim_qk: int, head_dim_v: int) -> Literal["flash2", "unfused"]:
    """What TE runs when its cuDNN attention cannot: FlashAttention-2 for one head dim,
    ``UnfusedDotProductAttention`` when queries and values differ (module docstring).

    Examples
    --------
    >>> te_fallback(192, 128), te_fallback(256, 256)
    ('unfused', 'flash2')
    """
    return "flash2" if head_dim_qk == head_dim_v else "unfused"
