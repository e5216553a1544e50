"""Layer profiles: a step-time lower bound for every layout before it is built.

:func:`layer_profile` builds a two-layer copy of the model once per framework x tensor/context
split x micro-batch size x recomputation and times one layer; :func:`profile_bound` turns that
into a lower bound on a layout's step (its busiest pipeline stage plus the pipeline ramp).
Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sim.apps.plan.bound import LinkRates, collective_lower_bound
from sim.apps.plan.layouts import PLAN_ORIGIN, Layout, _space, layout_scenario, refusal_key
from sim.frameworks import registry
from sim.scenario import Scenario, ScenarioError
from sim.workload.moe import MoESpec

PROFILE_LAYERS = 2
"""Layers of the model copy a profile is built with: the per-layer ops do not depend on the
layer count, and two give a minimum over layers."""
_MATH_CATEGORIES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class Profile:
    """One transformer layer's work per micro-batch on the stream that computes it, for a
    framework, tensor/context split, micro-batch size and recomputation (the same for every
    pipeline and data-parallel layout around it)."""

    layer_s: float
    """Forward + backward (+ recomputation) kernels of one layer for one micro-batch, plus
    the lower bound of the tensor/context-parallel exchanges that block that stream."""
    embed_s: float = 0.0
    """The same for the embedding (forward and backward), on the first pipeline stage."""
    head_s: float = 0.0
    """The same for the final norm, output layer and loss, on the last pipeline stage."""
    refused: str | None = None
    """The key path the framework refused this split with (then ``layer_s`` is inf)."""
    message: str | None = None


def _layer_options(layout: Layout) -> tuple[tuple[str, Any], ...]:
    # Options that change a layer's ops (the search space's ``layer_options``): Megatron's
    # tensor-parallel overlap moves the exchanges off the compute stream; the rest (pipeline
    # split, sharding, resharding) changes other streams or other ops.
    space = _space(layout.framework)
    keys = space.layer_options if space is not None else ()
    return tuple((k, v) for k, v in layout.options if k in keys)


def _profile_key(layout: Layout) -> tuple[Any, ...]:
    opts = _layer_options(layout)
    key: tuple[Any, ...] = (layout.framework, layout.tp, layout.cp, layout.micro_batch_size,
                            layout.activation_checkpointing, opts)
    # A mixture-of-experts layer's ops on one rank depend on its expert layout too (local
    # experts, tokens received, expert-TP exchanges), and on the modules recomputed; dense
    # layouts keep their key.
    if layout.moe:
        key += (layout.ep, layout.etp)
    return key + (layout.recompute,) if layout.recompute else key


def layer_profile(base: Scenario, layout: Layout, rates: LinkRates) -> Profile:
    """Build a :data:`PROFILE_LAYERS`-layer copy of the model under the layout's framework,
    tensor/context split, micro-batch size and recomputation (no pipeline, one micro-batch,
    the remaining GPUs data-parallel) and time one layer: the minimum over its layers of the
    forward, backward and recompute kernels of micro-batch 0 on the compute stream, plus the
    collectives blocking that stream (:func:`collective_lower_bound`). Data-parallel
    communication, copies and the optimizer are left out, so a pipeline stage of L layers
    running m micro-batches computes for at least ``L x m x layer_s``."""
    from sim.frameworks import JobContext, build_program
    from sim.workload.model import ModelSpec

    m = ModelSpec.from_ref(base.model, base.training.seq_len)
    dims = {"layers": PROFILE_LAYERS, "hidden": m.hidden, "heads": m.heads,
            "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
            "mlp": m.mlp, "tied_embeddings": m.tied_embeddings, "head_dim": m.head_dim,
            "norm": m.norm, "position": m.position, "bias": m.bias,
            "max_positions": m.max_positions or None, "name": f"{m.name} (profile)"}
    if m.moe is not None:
        dims.update(_moe_dims(m.moe))
    if m.sliding_window is not None:
        # Layer 0 of the copy is a windowed one (ModelSpec.windowed), so the minimum over its
        # layers stays below the cheapest layer of the model.
        dims.update(sliding_window=m.sliding_window,
                    full_attention_every=m.full_attention_every)
    if m.attention_sinks:
        dims["attention_sinks"] = True
    if m.mla is not None:
        # Multi-head Latent Attention (DeepSeek-V2/V3): the copy's layers are the model's
        # (and Megatron's mla_up_proj recomputation applies to them).
        mla = m.mla
        for key in ("kv_heads", "head_dim"):
            dims.pop(key)       # MLA's widths are its own
        dims.update(attention="mla", q_lora_rank=mla.q_lora_rank,
                    kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                    qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
    dp = base.gpus // (layout.tp * layout.cp)
    opts = _layer_options(layout)
    probe = Layout(layout.framework, layout.tp, 1, dp, layout.cp, 1, layout.micro_batch_size,
                   layout.activation_checkpointing, opts, layout.ep, layout.etp,
                   layout.recompute)
    try:
        scenario = layout_scenario(base, probe, global_batch=layout.micro_batch_size * dp,
                                   model=dims)
        program = build_program(JobContext.from_scenario(scenario, PLAN_ORIGIN))
    except ScenarioError as exc:
        key, message = refusal_key(exc)
        return Profile(math.inf, refused=key, message=message)
    per_layer: dict[int, float] = defaultdict(float)
    # Work outside the layers, by position on the stream: before the first layer op the
    # embedding's forward, after the last its backward, in between the head and the loss.
    outside: list[tuple[int, float]] = []
    first = last = -1
    stream = program.classes[0].streams.get("compute", [])
    for pos, op in enumerate(stream):
        if op.micro_batch not in (0, None):
            continue
        if op.kind == "compute" and op.category in _MATH_CATEGORIES:
            t = op.duration
        elif op.kind in ("collective", "send") and op.phase == "comm" and \
                op.category != "optimizer":
            if op.layer is None:
                continue       # data-parallel traffic of the whole model, not per layer
            t = collective_lower_bound(op, rates)
        else:
            continue
        if op.layer is None:
            outside.append((pos, t))
            continue
        per_layer[op.layer] += t
        first = pos if first < 0 else first
        last = pos
    embed = sum(t for pos, t in outside if pos < first or pos > last)
    head = sum(t for pos, t in outside if first < pos < last)
    return Profile(min(per_layer.values(), default=0.0), embed, head)


def _moe_dims(moe: MoESpec) -> dict[str, Any]:
    """The mixture-of-experts fields of the profile's model copy: the same experts, and at
    most one leading dense layer, so that with :data:`PROFILE_LAYERS` layers the minimum over
    layers is no more than a dense layer's or an MoE layer's (a lower bound for a model with
    both, DeepSeek-V3's three dense layers first)."""
    return {"experts": moe.experts, "experts_per_token": moe.top_k,
            "shared_experts": moe.shared, "moe_ffn_hidden": moe.ffn_hidden,
            "first_k_dense": min(moe.first_k_dense, PROFILE_LAYERS - 1),
            "router": moe.router, "capacity_factor": moe.capacity_factor}


def stage_layer_split(layout: Layout, layers: int) -> list[list[int]] | None:
    """Layers of each virtual pipeline chunk (chunk v on stage v % pp), as the framework
    splits them (its registry entry's ``stage_split``); None if it cannot."""
    entry = registry.framework(layout.framework)
    return entry.chunks(layers, layout.pp, layout.vp, dict(layout.options))


def profile_bound(layout: Layout, profile: Profile, layers: int, micro_batches: int
                  ) -> float:
    """Step-time lower bound from a layer profile, before building the layout.

    Stage s computes its layers for every micro-batch, and cannot start before micro-batch
    0's forward has crossed the first chunk of every stage before it, nor finish before the
    last micro-batch's backward has crossed them back:
    ``max_s (layer_s x sum_{s'<s} |chunk_s'| + m x work_s)``, where a stage's work per
    micro-batch is its layers' plus the embedding (first stage) or head (last stage). With
    even stages and no interleaving that is ``(m + p - 1)`` stage-micro-batches: the bubble share
    ``(p - 1) / (m + p - 1)``; interleaving divides the ramp by vp.

    Examples
    --------
    >>> x = Layout("megatron", 8, 4, 2, 1, 1, 1, "none")
    >>> profile_bound(x, Profile(0.01), 80, 32)     # 20 layers x (32 + 3) x 10 ms
    7.0
    """
    if profile.refused is not None or not math.isfinite(profile.layer_s):
        return math.inf
    split = stage_layer_split(layout, layers)
    if split is None:
        return math.inf
    p = layout.pp
    n_chunks = len(split)
    work = [profile.layer_s * sum(len(split[v]) for v in range(s, n_chunks, p))
            for s in range(p)]
    work[0] += profile.embed_s
    work[(n_chunks - 1) % p] += profile.head_s
    ramp = 0.0
    worst = 0.0
    for s in range(p):
        worst = max(worst, ramp + micro_batches * work[s])
        ramp += profile.layer_s * len(split[s]) + (profile.embed_s if s == 0 else 0.0)
    return worst


def _profiles_task(base: Scenario, layouts: list[Layout], rates: LinkRates
                   ) -> list[Profile]:
    """The layer profiles of ``layouts``, in order (one worker task)."""
    return [layer_profile(base, x, rates) for x in layouts]
