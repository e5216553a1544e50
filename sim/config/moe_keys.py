"""The mixture-of-experts keys in the nested form CONTRACT.md fixes (``model.moe``,
``model.mla``, ``model.attention: mha``, ``training.moe_routing``), as another spelling of
the flat keys the model and routing sections hold (Hugging Face ``config.json`` names).

A scenario may write either form, not both; validation turns the nested form into the flat
one, so everything past the schema reads one set of names and a scenario written back (a
sweep's variant, ``--json``) loads again.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sim.config import bounds as B
from sim.config.base import StrictModel


class MoEBlock(StrictModel):
    """``model.moe``: the mixture-of-experts layers (CONTRACT.md's names)."""

    experts: int = Field(gt=0, le=B.MAX_EXPERTS)
    """Routed experts per MoE layer (flat key: ``model.experts``)."""
    top_k: int = Field(gt=0, le=B.MAX_EXPERTS)
    """Routed experts each token is sent to (``model.experts_per_token``)."""
    shared_experts: int = Field(default=0, ge=0, le=B.MAX_EXPERTS)
    """Experts every token passes through besides its top-k (``model.shared_experts``)."""
    expert_ffn_hidden: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """Inner width of one expert's MLP; defaults to ``ffn_hidden`` (``model.moe_ffn_hidden``)."""
    dense_layers: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Leading layers with a dense MLP instead of experts (``model.first_k_dense``)."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Gate scores: softmax, or sigmoid with a balancing bias (``model.router``)."""
    capacity_factor: float | None = Field(default=None, gt=0, le=B.MAX_CAPACITY_FACTOR)
    """Tokens an expert accepts, as a multiple of its balanced share; None = dropless."""

    def flat(self) -> dict[str, Any]:
        """The same experts under the flat keys of :class:`sim.config.training.ModelDims`."""
        return {"experts": self.experts, "experts_per_token": self.top_k,
                "shared_experts": self.shared_experts, "moe_ffn_hidden": self.expert_ffn_hidden,
                "first_k_dense": self.dense_layers, "router": self.router,
                "capacity_factor": self.capacity_factor}


class MLABlock(StrictModel):
    """``model.mla``: Multi-head Latent Attention's low-rank widths (with
    ``model.attention: mla``; the same names as the flat keys)."""

    q_lora_rank: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """Rank of the query compression; None = queries projected directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = Field(gt=0, le=B.MAX_WIDTH)
    """Rank of the joint key/value compression."""
    qk_nope_head_dim: int = Field(gt=0, le=B.MAX_WIDTH)
    """Per-head query/key width without rotary positions."""
    qk_rope_head_dim: int = Field(gt=0, le=B.MAX_WIDTH)
    """Per-head query/key width carrying rotary positions."""
    v_head_dim: int = Field(gt=0, le=B.MAX_WIDTH)
    """Per-head value width."""


# The flat keys each nested block stands for, and their defaults (a key away from its
# default was written, so both forms were).
MOE_FLAT_DEFAULTS: dict[str, Any] = {
    "experts": None, "experts_per_token": None, "shared_experts": 0, "moe_ffn_hidden": None,
    "first_k_dense": 0, "router": "softmax", "capacity_factor": None}
MLA_FLAT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")


def flat_model_update(dims: Any) -> dict[str, Any]:
    """What to set on a :class:`~sim.config.training.ModelDims` so that its nested keys
    (``moe``, ``mla``, ``attention: mha``) read as the flat ones; raises ``ValueError`` with
    the key to blame when a scenario gives both forms or an ``mha`` with fewer key/value heads.
    """
    update: dict[str, Any] = {}
    if dims.moe is not None:
        both = [k for k, v in MOE_FLAT_DEFAULTS.items() if getattr(dims, k) != v]
        if both:
            raise ValueError(f"model.moe: the experts are given twice (model.moe and "
                             f"model.{both[0]}): write one form")
        update.update(dims.moe.flat(), moe=None)
    if dims.mla is not None:
        if dims.attention != "mla":
            raise ValueError("model.mla: only with model.attention: mla")
        both = [k for k in MLA_FLAT_KEYS if getattr(dims, k) is not None]
        if both:
            raise ValueError(f"model.mla: the latent attention widths are given twice "
                             f"(model.mla and model.{both[0]}): write one form")
        update.update(dims.mla.model_dump(), mla=None)
    if dims.attention == "mha":
        if dims.kv_heads is not None and dims.kv_heads != dims.heads:
            raise ValueError(f"model.kv_heads: {dims.kv_heads} with model.attention: mha "
                             f"(multi-head attention has as many key/value heads as query "
                             f"heads, {dims.heads}); use attention: gqa")
        update["attention"] = "gqa"
    return update


class MoeRouting(StrictModel):
    """``training.moe_routing``: the routing distribution as CONTRACT.md names it (another
    spelling of ``training.routing``)."""

    distribution: Literal["balanced", "zipf", "file", "round_robin"] = "balanced"
    """balanced, zipf (skewed by ``skew``), file (per-expert loads measured, in ``file``) or
    round_robin (balanced loads, each token on consecutive experts: routing.distribution's)."""
    skew: float | None = Field(default=None, ge=0, le=10)
    """Zipf exponent (routing.s): 0 is balanced, larger is more skewed; default 1."""
    file: str | None = None
    """Text file of per-expert loads (routing.histogram), relative to the scenario's folder."""
    seed: int | None = Field(default=None, ge=0, le=B.MAX_SEED)
    """Seed of the zipf ranking's order of the experts; None = the scenario's seed."""

    def routing_dict(self) -> dict[str, Any]:
        """The same routing as a ``training.routing`` mapping; raises ``ValueError`` on keys
        that do not go with the distribution."""
        if self.skew is not None and self.distribution != "zipf":
            raise ValueError("training.moe_routing.skew: only with distribution: zipf")
        if (self.file is not None) != (self.distribution == "file"):
            raise ValueError("training.moe_routing.file: give it exactly when distribution "
                             "is file")
        out: dict[str, Any] = {"seed": self.seed}
        if self.distribution == "zipf":
            out.update(distribution="zipf", s=1.0 if self.skew is None else self.skew)
        elif self.distribution == "file":
            out.update(distribution="histogram", histogram=self.file)
        elif self.distribution == "round_robin":
            out.update(distribution="round_robin")
        return out
