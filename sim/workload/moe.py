"""Mixture-of-experts layers and Multi-head Latent Attention: their parameter arithmetic.

:class:`~sim.workload.model.ModelSpec` holds a :class:`MoESpec` and an :class:`MLASpec` when
the model has them and adds up whole-model counts; this module owns the per-layer shapes.
Names follow the Hugging Face implementations the counts are checked against
(``modeling_deepseek_v3.py``, ``modeling_mixtral.py``, ``modeling_qwen3_moe.py``,
``modeling_gpt_oss.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

# The key each feature beyond a dense Llama/GPT block is written under in a scenario, and
# what it is, for the refusal of a builder whose registry entry's model_features lacks it
# (megatron models experts, MLA, qk_norm, mtp_layers, attention sinks and sliding windows:
# issue 14; and Nemotron-4's squared-ReLU MLP, ``mlp: relu2``).
BEYOND_DENSE = {
    "experts": "mixture-of-experts layers",
    "attention": "multi-head latent attention",
    "mtp_layers": "multi-token prediction",
    "qk_norm": "query/key normalisation",
    "attention_sinks": "attention sinks",
    "sliding_window": "sliding-window attention",
    "mlp": "a squared-ReLU MLP",
}
# The open issue behind each mixture-of-experts feature, for refusals.
ISSUE_OF = {key: " (issue 14)" for key in BEYOND_DENSE if key != "mlp"}


def mlp_shapes(mlp: str, hidden: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one MLP ``ffn`` wide: SwiGLU's gate, up and
    down, or GELU's (or squared ReLU's) up and down. An expert is such an MLP (Mixtral's
    w1/w3/w2, DeepSeek's gate/up/down_proj, GPT-OSS's fused gate_up_proj and down_proj).

    Examples
    --------
    >>> mlp_shapes("swiglu", 4096, 14336)
    [('gate', 14336, 4096), ('up', 14336, 4096), ('down', 4096, 14336)]
    """
    if mlp == "swiglu":
        return [("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)]
    return [("up", ffn, hidden), ("down", hidden, ffn)]


def linear_params(shapes: list[tuple[str, int, int]], bias: bool) -> int:
    """Weights of ``shapes``, plus one bias per output feature when ``bias``.

    Examples
    --------
    >>> linear_params([("up", 3, 2), ("down", 2, 3)], bias=True)
    17
    """
    return sum(o * i + (o if bias else 0) for _, o, i in shapes)


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a model: which layers have experts and how many.

    Examples
    --------
    >>> moe = MoESpec(experts=8, top_k=2, ffn_hidden=14336)   # Mixtral 8x7B
    >>> moe.router_params(4096, bias=False)
    32768
    """

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts per token."""
    ffn_hidden: int
    """Inner width of one expert (routed or shared)."""
    shared: int = 0
    """Shared experts every token passes through."""
    first_k_dense: int = 0
    """Leading layers with a dense MLP instead."""
    router: str = "softmax"
    """softmax, or sigmoid with a per-expert balancing bias."""
    capacity_factor: float | None = None
    """Tokens an expert accepts per balanced share; None = dropless."""

    def router_params(self, hidden: int, bias: bool) -> int:
        """The gate: an experts x hidden linear (with a bias when the model's linears have
        them, GPT-OSS), plus DeepSeek-V3's per-expert score-correction bias with the sigmoid
        router (``e_score_correction_bias``, a parameter in its checkpoint)."""
        extra = (self.experts if bias else 0) + (self.experts if self.router == "sigmoid" else 0)
        return self.experts * hidden + extra

    def moe_layers(self, layers: int) -> int:
        """Layers with experts (DeepSeek: all but the first ``first_k_dense``)."""
        return layers - self.first_k_dense


@dataclass(frozen=True)
class MLASpec:
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434 section 2.1): queries
    and keys/values pass through low-rank latents; each head's query and key are a part
    without positions and a shared rotary part.

    Examples
    --------
    >>> mla = MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    ...               qk_rope_head_dim=64, v_head_dim=128)          # DeepSeek-V3
    >>> [s for s in mla.linear_shapes(7168, 128)]       # doctest: +NORMALIZE_WHITESPACE
    [('q_a', 1536, 7168), ('q_b', 24576, 1536), ('kv_a', 576, 7168), ('kv_b', 32768, 512),
     ('o', 7168, 16384)]
    >>> mla.norm_params
    2048
    """

    q_lora_rank: int | None
    """Query latent width; None = queries projected directly from the hidden state."""
    kv_lora_rank: int
    """Key/value latent width."""
    qk_nope_head_dim: int
    """Per-head query/key width without positions."""
    qk_rope_head_dim: int
    """Per-head query/key width with rotary positions (the key part shared by all heads)."""
    v_head_dim: int
    """Per-head value width."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def linear_shapes(self, hidden: int, heads: int) -> list[tuple[str, int, int]]:
        """(name, out, in) of each projection, as ``DeepseekV3Attention`` holds them:
        q_a/q_b (or q without a query latent), kv_a_proj_with_mqa (latent plus the shared
        rotary key), kv_b (per-head keys without positions and values), o."""
        qk = heads * self.qk_head_dim
        if self.q_lora_rank:
            q = [("q_a", self.q_lora_rank, hidden), ("q_b", qk, self.q_lora_rank)]
        else:
            q = [("q", qk, hidden)]
        kv_b = heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + [("kv_a", self.kv_lora_rank + self.qk_rope_head_dim, hidden),
                    ("kv_b", kv_b, self.kv_lora_rank),
                    ("o", hidden, heads * self.v_head_dim)]

    @property
    def norm_params(self) -> int:
        """RMSNorm scales on the latents (q_a_layernorm, kv_a_layernorm)."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank
