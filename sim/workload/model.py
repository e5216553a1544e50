"""A decoder-only transformer: exact parameter counts and model FLOPs, for any dimensions.

Llama-style models (SwiGLU MLP, RMSNorm, rotary positions, no biases) and GPT-style models
(GELU MLP, LayerNorm with biases, learned positions) are both described by :class:`ModelSpec`,
and so are mixture-of-experts models (DeepSeek, Mixtral, Qwen3-MoE, GPT-OSS) with their
attention variants: Multi-head Latent Attention, query/key norms, attention sinks, sliding
windows and multi-token prediction (the shapes are in :mod:`sim.workload.moe`).
The kernels a training step runs per layer live in :mod:`sim.workload.layer_ops` (dense
models) and, for Megatron-LM, :mod:`sim.workload.megatron_ops` (query/key norms too),
:mod:`sim.workload.megatron_mla` (Multi-head Latent Attention) and
:mod:`sim.workload.moe_ops` (the experts); builders refuse the features they do not model
(:meth:`ModelSpec.beyond_dense`, issue 14).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sim import catalog
from sim.hardware.attention_cost import window_pairs
from sim.scenario import ModelDims
from sim.workload.moe import (
    BEYOND_DENSE,
    MLASpec,
    MoESpec,
    linear_params,
    mlp_shapes,
)


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer.

    Examples
    --------
    >>> m = ModelSpec.from_ref("llama3-8b")
    >>> m.total_params
    8030261248

    A mixture-of-experts model: all parameters, those a token multiplies with, and the
    model FLOPs of one trained token at 4,096 tokens per sequence (MTP module included):

    >>> v3 = ModelSpec.from_ref("deepseek-v3")
    >>> v3.total_params, v3.active_matmul_params, v3.mtp_params
    (671026419200, 36625618432, 11610068224)
    >>> round(v3.model_flops_per_token(4096) / 1e9, 1)
    260.6
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    mlp: str = "swiglu"
    tied_embeddings: bool = False
    norm: str = "rmsnorm"
    position: str = "rope"
    bias: bool = False
    max_positions: int = 0
    moe: MoESpec | None = None
    """The experts, for a mixture-of-experts model."""
    mla: MLASpec | None = None
    """Multi-head Latent Attention instead of grouped-query attention."""
    qk_norm: bool = False
    """RMSNorm on each head's query and key (Qwen3)."""
    attention_sinks: bool = False
    """A learned sink logit per head (GPT-OSS)."""
    sliding_window: int | None = None
    """Keys a sliding-window layer sees; None = full context everywhere."""
    full_attention_every: int | None = None
    """With a window: every n-th layer attends to the full context."""
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3: 1)."""
    yarn_factor: float | None = None
    """YaRN rotary scaling with the default concentration factor (GPT-OSS: 32)."""
    activation_clamp: float | None = None
    """The gated activation's inputs clamped (GPT-OSS: 7; :mod:`sim.workload.gpt_oss_ops`)."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dims(cls, dims: ModelDims, seq_len: int = 0) -> ModelSpec:
        gelu = dims.mlp == "gelu"
        head_dim = dims.head_dim or dims.hidden // dims.heads
        return cls(
            name=dims.name or "custom",
            layers=dims.layers,
            hidden=dims.hidden,
            heads=dims.heads,
            kv_heads=dims.kv_heads or dims.heads,
            head_dim=head_dim,
            ffn_hidden=dims.ffn_hidden,
            vocab=dims.vocab,
            mlp=dims.mlp,
            tied_embeddings=dims.tied_embeddings,
            norm=dims.norm or ("layernorm" if gelu else "rmsnorm"),
            position=dims.position or ("learned" if gelu else "rope"),
            bias=dims.bias if dims.bias is not None else gelu,
            max_positions=dims.max_positions or (seq_len if gelu else 0),
            moe=_moe_spec(dims),
            mla=_mla_spec(dims),
            qk_norm=dims.qk_norm,
            attention_sinks=dims.attention_sinks,
            sliding_window=dims.sliding_window,
            full_attention_every=dims.full_attention_every,
            mtp_layers=dims.mtp_layers,
            activation_clamp=dims.activation_clamp,
            yarn_factor=dims.yarn_factor,
        )

    @classmethod
    def from_ref(cls, ref: str | ModelDims, seq_len: int = 0) -> ModelSpec:
        """A catalogue name or a :class:`~sim.scenario.ModelDims` mapping."""
        if isinstance(ref, ModelDims):
            return cls.from_dims(ref, seq_len)
        entry = catalog.model_entry(ref)
        entry.pop("source", None)
        return cls.from_dims(ModelDims(name=ref, **entry), seq_len)

    # ------------------------------------------------------------------ shapes
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) of each attention projection in one block."""
        if self.mla is not None:
            return self.mla.linear_shapes(self.hidden, self.heads)
        h = self.hidden
        return [("q", self.q_dim, h), ("k", self.kv_dim, h), ("v", self.kv_dim, h),
                ("o", h, self.q_dim)]

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) of each linear layer in one block with a dense
        MLP (every block of a dense model)."""
        return self.attention_shapes() + mlp_shapes(self.mlp, self.hidden, self.ffn_hidden)

    def parameter_tensors(self) -> list[tuple[str, int, str, int]]:
        """(name, numel, block, layer) of every parameter tensor in ``model.parameters()``
        order (Hugging Face Llama layout: embedding, per layer q, k, v, o, Qwen3's q_norm and
        k_norm, gate, up, down and the two norms, final norm, untied LM head). Biases are
        folded into their weight. ``block`` is the block whose backward produces the
        gradient: embed, attn, mlp, head; ``layer`` is -1 outside the transformer layers."""
        h = self.hidden
        out = [("embed", self.embedding_params, "embed", -1)]
        for layer in range(self.layers):
            for name, o, i in self.linear_shapes():
                block = "attn" if name in ("q", "k", "v", "o") else "mlp"
                out.append((f"l{layer}.{name}", o * i + (o if self.bias else 0), block, layer))
                if name == "o" and self.qk_norm:
                    # Qwen3Attention registers q_norm and k_norm after its projections.
                    out += [(f"l{layer}.{n}", self.head_dim, "attn", layer)
                            for n in ("q_norm", "k_norm")]
            out.append((f"l{layer}.norm1", self.norm_params, "attn", layer))
            out.append((f"l{layer}.norm2", self.norm_params, "mlp", layer))
        out.append(("norm", self.norm_params, "head", -1))
        if not self.tied_embeddings:
            out.append(("lm_head", self.vocab * h, "head", -1))
        return out

    # ------------------------------------------------------------------ parameters
    @property
    def norm_params(self) -> int:
        """One normalisation layer (scale, plus shift for LayerNorm with bias)."""
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    @property
    def attention_params(self) -> int:
        """One block's attention: projections (with biases when the model has them), MLA's
        latent norms, Qwen3's per-head query and key norms, GPT-OSS's per-head sinks."""
        extra = self.mla.norm_params if self.mla is not None else 0
        extra += 2 * self.head_dim if self.qk_norm else 0
        extra += self.heads if self.attention_sinks else 0
        return linear_params(self.attention_shapes(), self.bias) + extra

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block with a dense MLP (every block of a dense
        model; DeepSeek's first ``first_k_dense``)."""
        mlp = linear_params(mlp_shapes(self.mlp, self.hidden, self.ffn_hidden), self.bias)
        return self.attention_params + mlp + 2 * self.norm_params

    @property
    def expert_params(self) -> int:
        """One expert (routed or shared): an MLP ``moe_ffn_hidden`` wide."""
        assert self.moe is not None
        return linear_params(mlp_shapes(self.mlp, self.hidden, self.moe.ffn_hidden), self.bias)

    def moe_layer_params(self, experts: int) -> int:
        """One block with experts, counting ``experts`` of them besides the shared ones:
        attention, the router (computed for every expert), the experts, two norms."""
        assert self.moe is not None
        return (self.attention_params + self.moe.router_params(self.hidden, self.bias)
                + (experts + self.moe.shared) * self.expert_params + 2 * self.norm_params)

    @property
    def moe_layers(self) -> int:
        """Blocks with experts (0 for a dense model)."""
        return self.moe.moe_layers(self.layers) if self.moe is not None else 0

    def _blocks_params(self, active: bool) -> int:
        """All transformer blocks; ``active``: only the routed experts a token uses."""
        dense = (self.layers - self.moe_layers) * self.layer_params
        if self.moe is None:
            return dense
        routed = self.moe.top_k if active else self.moe.experts
        return dense + self.moe_layers * self.moe_layer_params(routed)

    @property
    def embedding_params(self) -> int:
        """Input token embedding plus learned positions, if any."""
        pos = self.max_positions * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    @property
    def lm_head_params(self) -> int:
        """Output projection (zero when tied to the input embedding)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Every parameter of the model, multi-token prediction modules excepted (as DeepSeek
        counts V3's 671B: ``mtp_params`` holds them)."""
        return (self._blocks_params(active=False) + self.embedding_params + self.norm_params
                + self.lm_head_params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``total_params`` with only the top-k routed experts of
        each MoE layer. The whole input embedding counts, as Mistral's 12.9B (Mixtral 8x7B)
        and Qwen's 3.3B (Qwen3-30B-A3B) do; equal to ``total_params`` for a dense model."""
        return (self._blocks_params(active=True) + self.embedding_params + self.norm_params
                + self.lm_head_params)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matrix multiplies: everything but the input embedding
        lookup tables (the convention of PaLM's MFU and torchtitan's FLOP counter). A tied
        embedding is counted once, as the LM head that multiplies with it."""
        return self.total_params - self._lookup_params

    @property
    def active_matmul_params(self) -> int:
        """``active_params`` without the embedding lookup: what a token multiplies with (the
        convention of GPT-OSS's 5.1B and DeepSeek's 37B active)."""
        return self.active_params - self._lookup_params

    @property
    def _lookup_params(self) -> int:
        return self.embedding_params - (self.vocab * self.hidden if self.tied_embeddings else 0)

    @property
    def mtp_block_params(self) -> int:
        """One multi-token prediction module's own parameters (DeepSeek-V3 report section
        2.2; ``DeepseekV3`` checkpoint layer 61): norms of the hidden state and of the next
        token's embedding, the 2h -> h projection, one transformer block like the last layer,
        and its output norm. It shares the embedding and the output head with the model."""
        return 3 * self.norm_params + 2 * self.hidden * self.hidden + self._last_block(False)

    def _last_block(self, active: bool) -> int:
        """The last layer's parameters (MoE layers come last), ``active``: top-k experts."""
        if self.moe is None:
            return self.layer_params
        return self.moe_layer_params(self.moe.top_k if active else self.moe.experts)

    @property
    def mtp_params(self) -> int:
        """Parameters of the ``mtp_layers`` prediction modules, besides ``total_params``."""
        return self.mtp_layers * self.mtp_block_params

    def beyond_dense(self, allowed: Collection[str] = ()) -> str | None:
        """The scenario key of the first feature a dense Llama/GPT block lacks (experts, MLA,
        MTP, query/key norms, sinks, sliding windows, a squared-ReLU MLP), or None for a dense
        model; features
        named in ``allowed`` (a builder models them) are skipped.

        Examples
        --------
        >>> ModelSpec.from_ref("mixtral-8x7b").beyond_dense()
        'experts'
        >>> ModelSpec.from_ref("llama3-8b").beyond_dense() is None
        True
        """
        present = {"experts": self.moe is not None, "attention": self.mla is not None,
                   "mtp_layers": self.mtp_layers > 0, "qk_norm": self.qk_norm,
                   "attention_sinks": self.attention_sinks,
                   "sliding_window": self.sliding_window is not None,
                   "mlp": self.mlp == "relu2"}
        return next((key for key in BEYOND_DENSE if present[key] and key not in allowed),
                    None)

    # ------------------------------------------------------------------ FLOPs
    def windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) attends over the sliding window: every layer of a
        windowed model but each ``full_attention_every``-th (the n-th, 2n-th, ... counting
        from 1), as Megatron-Core's ``is_layer_window_attention`` (megatron/core/transformer/
        utils.py: 1-based ``layer_number % window_attn_skip_freq != 0``) and GPT-OSS's
        ``layer_types`` (sliding, full, sliding, ...) have it.

        Examples
        --------
        >>> m = ModelSpec.from_ref("gpt-oss-120b")
        >>> [m.windowed(la) for la in range(4)]
        [True, False, True, False]
        """
        if self.sliding_window is None:
            return False
        every = self.full_attention_every
        return every is None or (layer + 1) % every != 0

    def window_of(self, layer: int) -> int | None:
        """The keys layer ``layer``'s queries see at most (None: the full causal context)."""
        return self.sliding_window if self.windowed(layer) else None

    def _attention_layer_flops(self, seq_len: int, window: int | None) -> float:
        """Score and value FLOPs of one layer, forward plus backward, per token.

        Forward QK^T costs 2 x keys x qk_head_dim and PV 2 x keys x v_head_dim per query and
        head; a causal query sees S/2 keys on average, a windowed one ``window_pairs / S``
        (:func:`~sim.hardware.attention_cost.window_pairs`, the one home of the window rule);
        backward is twice forward. Grouped-query heads are head_dim wide both ways:
        6 x S x q_dim. MLA's queries and keys are qk_nope + qk_rope wide, its values
        v_head_dim (training runs the unabsorbed form).
        """
        if self.mla is not None:
            qk, v = self.mla.qk_head_dim, self.mla.v_head_dim
        else:
            qk = v = self.head_dim
        keys = window_pairs(seq_len, window) / seq_len if seq_len else 0.0
        return 6.0 * keys * self.heads * (qk + v)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Causal attention score and value FLOPs of all layers, forward plus backward, per
        token: 6 x S x q_dim per layer for full-context grouped-query attention.

        With ``sliding_window``, a layer attends to at most that many keys, except every
        ``full_attention_every``-th layer (:meth:`windowed`; GPT-OSS: the odd layers,
        counting from 0). Megatron-Bridge's FLOP counters count the windowed layers over
        their window too, so MFU credits only the scores the kernels compute: its
        ``gpt_oss_flops_calculator`` the band exactly, as here; ``training/utils/
        flop_utils.py`` (``window_size``, ``window_attn_skip_freq``) with min(W + 1, S) / 2
        keys a query (half the band; 0.2% of GPT-OSS-120B's model FLOPs at S = 4096).
        """
        return sum(self._attention_layer_flops(seq_len, self.window_of(la))
                   for la in range(self.layers))

    def mtp_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of the multi-token prediction modules per trained token: 6 x (the
        module's active parameters plus the shared output head it multiplies with again) plus
        its block's full-context attention."""
        if not self.mtp_layers:
            return 0.0
        active = self.mtp_block_params - self._last_block(False) + self._last_block(True)
        per_module = 6.0 * (active + self.vocab * self.hidden)
        return self.mtp_layers * (per_module + self._attention_layer_flops(seq_len, None))

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token: 6 x active matmul parameters (all of them for a dense
        model; the router's GEMM over every expert included) plus causal attention, plus the
        multi-token prediction modules' (``mtp_flops_per_token``), which a training step
        runs too (Megatron-LM's ``num_floating_point_operations`` counts them as well)."""
        return (6.0 * self.active_matmul_params + self.attention_flops_per_token(seq_len)
                + self.mtp_flops_per_token(seq_len))

    def forward_flops_per_token(self, seq_len: int) -> float:
        """One forward pass (a third of the model FLOPs)."""
        return self.model_flops_per_token(seq_len) / 3.0


def _moe_spec(dims: ModelDims) -> MoESpec | None:
    if dims.experts is None:
        return None
    assert dims.experts_per_token is not None   # the schema requires it with experts
    return MoESpec(experts=dims.experts, top_k=dims.experts_per_token,
                   ffn_hidden=dims.moe_ffn_hidden or dims.ffn_hidden,
                   shared=dims.shared_experts, first_k_dense=dims.first_k_dense,
                   router=dims.router, capacity_factor=dims.capacity_factor)


def _mla_spec(dims: ModelDims) -> MLASpec | None:
    if dims.attention != "mla":
        return None
    assert dims.kv_lora_rank and dims.qk_nope_head_dim and dims.qk_rope_head_dim \
        and dims.v_head_dim   # the schema requires them with attention: mla
    return MLASpec(q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank,
                   qk_nope_head_dim=dims.qk_nope_head_dim,
                   qk_rope_head_dim=dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim)
