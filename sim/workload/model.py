"""A decoder-only transformer: exact parameter counts and model FLOPs, for any dimensions.

Llama-style models (SwiGLU MLP, RMSNorm, rotary positions, no biases) and GPT-style models
(GELU MLP, LayerNorm with biases, learned positions) are both described by :class:`ModelSpec`.
The kernels a training step runs per layer live in :mod:`sim.workload.layer_ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim import catalog
from sim.scenario import ModelDims


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer.

    Examples
    --------
    >>> m = ModelSpec.from_ref("llama3-8b")
    >>> m.total_params
    8030261248
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

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) of each linear layer in one block."""
        h, f = self.hidden, self.ffn_hidden
        shapes = [("q", self.q_dim, h), ("k", self.kv_dim, h), ("v", self.kv_dim, h),
                  ("o", h, self.q_dim)]
        if self.mlp == "swiglu":
            shapes += [("gate", f, h), ("up", f, h), ("down", h, f)]
        else:
            shapes += [("up", f, h), ("down", h, f)]
        return shapes

    def parameter_tensors(self) -> list[tuple[str, int, str, int]]:
        """(name, numel, block, layer) of every parameter tensor in ``model.parameters()``
        order (Hugging Face Llama layout: embedding, per layer q, k, v, o, gate, up, down and
        the two norms, final norm, untied LM head). Biases are folded into their weight.
        ``block`` is the block whose backward produces the gradient: embed, attn, mlp, head;
        ``layer`` is -1 outside the transformer layers."""
        h = self.hidden
        out = [("embed", self.embedding_params, "embed", -1)]
        for layer in range(self.layers):
            for name, o, i in self.linear_shapes():
                block = "attn" if name in ("q", "k", "v", "o") else "mlp"
                out.append((f"l{layer}.{name}", o * i + (o if self.bias else 0), block, layer))
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
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        weights = sum(o * i for _, o, i in self.linear_shapes())
        biases = sum(o for _, o, _ in self.linear_shapes()) if self.bias else 0
        return weights + biases + 2 * self.norm_params

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
        return (self.layers * self.layer_params + self.embedding_params + self.norm_params
                + self.lm_head_params)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matrix multiplies: everything but the input embedding
        lookup tables (the convention of PaLM's MFU and torchtitan's FLOP counter). A tied
        embedding is counted once, as the LM head that multiplies with it."""
        lookup = self.embedding_params - (self.vocab * self.hidden if self.tied_embeddings else 0)
        return self.total_params - lookup

    # ------------------------------------------------------------------ FLOPs
    def attention_flops_per_token(self, seq_len: int) -> float:
        """Causal attention score and value FLOPs, forward plus backward, per token.

        Forward QK^T and PV cost 4*S*D*H per token without a mask; causality halves it; backward
        is twice forward: 3 * 2*S*D*H = 6*S*q_dim per layer.
        """
        return 6.0 * self.layers * seq_len * self.q_dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token: 6 x matmul parameters plus causal attention."""
        return 6.0 * self.matmul_params + self.attention_flops_per_token(seq_len)

    def forward_flops_per_token(self, seq_len: int) -> float:
        """One forward pass (a third of the model FLOPs)."""
        return self.model_flops_per_token(seq_len) / 3.0
