"""The planner's search points: :class:`Layout`, their enumeration and their scenarios.

A layout is a set of overrides of the scenario (:meth:`Layout.varied`);
:func:`enumerate_layouts` lists every one the planner builds for a model, cluster, batch and
precision, from each framework's registry search space; :func:`layout_scenario` turns one into
the scenario its builder runs, and :func:`refusal_key` reads a builder's refusal of it.
Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sim.frameworks import registry
from sim.frameworks.registry import SearchPoint, SearchSpace
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

PLAN_ORIGIN = "plan"
"""The origin the planner's builds report in their ScenarioError (``plan: KEY: message``)."""

CP_MAX = 8
"""Context-parallel degrees searched: powers of two up to this. Context parallelism splits
the sequence; beyond 8 ranks the per-rank sequence of the common 4k-8k training lengths is a
few hundred tokens, where attention no longer dominates (Megatron-LM's context-parallel
guide uses cp 2-8 for 8k-128k sequences)."""
VP_MAX = 8
"""Interleaved pipeline chunks per stage searched at most: each chunk adds p2p transfers per
micro-batch; NeMo's recipes use 2-8 (Llama 3 70B: 5 on pp 4; 405B: 8 on pp 8)."""


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the search: the keys of the scenario the planner sets."""

    framework: str
    tp: int
    pp: int
    dp: int
    cp: int
    vp: int
    micro_batch_size: int
    activation_checkpointing: str
    options: tuple[tuple[str, Any], ...] = ()
    """Framework options the planner sets (``framework.<key>``), sorted by key."""
    ep: int = 1
    """Expert-parallel size (``parallelism.ep``; mixture-of-experts models only)."""
    etp: int = 0
    """Expert tensor-parallel size (``parallelism.etp``); 0 for a dense model's layouts,
    which set neither key (their scenarios and outputs stay as before MoE)."""
    recompute: tuple[str, ...] = ()
    """The modules recomputed under ``selective`` (``framework.recompute_modules``: Megatron's
    light sets for mixture-of-experts models); () leaves the framework's own selection."""

    @property
    def moe(self) -> bool:
        """The layout sets the expert layout (``parallelism.ep`` and ``etp``)."""
        return self.etp > 0

    def parallelism(self) -> dict[str, Any]:
        """The ``parallelism:`` section this layout sets."""
        out: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp,
                               "vp": self.vp, "sequence_parallel": self.sequence_parallel}
        if self.moe:
            out.update(ep=self.ep, etp=self.etp)
        return out

    def varied(self) -> dict[str, Any]:
        """The scenario keys this layout sets, as dotted paths (usable as ``--set KEY=V``).

        Examples
        --------
        >>> Layout("fsdp2", 1, 1, 8, 1, 1, 1, "full",
        ...        (("reshard_after_forward", True),)).varied()["framework.reshard_after_forward"]
        True
        """
        out: dict[str, Any] = {"framework.name": self.framework}
        out.update({f"framework.{k}": v for k, v in self.options})
        if self.recompute:
            out["framework.recompute_modules"] = list(self.recompute)
        out.update({f"parallelism.{k}": v for k, v in self.parallelism().items()})
        out.update({"training.micro_batch_size": self.micro_batch_size,
                    "training.activation_checkpointing": self.activation_checkpointing})
        return out

    @property
    def sequence_parallel(self) -> bool:
        # Megatron's sequence parallelism whenever tensor parallelism is used (Korthikanti et
        # al., "Reducing Activation Recomputation in Large Transformer Models", 2022: the
        # norms' and dropouts' activations split t ways for the same bytes moved, an
        # all-reduce becoming a reduce-scatter plus an all-gather). torchtitan's tensor
        # parallelism always shards the sequence (the flag is Megatron's only): the
        # registry entry's search space says which framework sets it.
        space = _space(self.framework)
        return space is not None and space.sequence_parallel and self.tp > 1

    def label(self) -> str:
        """A short name: ``megatron tp8 pp4 vp2 dp2 mbs1 selective``.

        Examples
        --------
        >>> Layout("deepspeed", 1, 1, 64, 1, 1, 1, "full", (("zero_stage", 3),)).label()
        'deepspeed zero3 dp64 mbs1 full'
        """
        parts = [self.framework]
        opts = dict(self.options)
        if opts.get("use_megatron_fsdp"):
            parts.append("fsdp")
        if "zero_stage" in opts:
            parts.append(f"zero{opts['zero_stage']}")
        for key, short in (("tp", "tp"), ("pp", "pp"), ("vp", "vp"), ("cp", "cp")):
            value = getattr(self, key)
            if value > 1:
                parts.append(f"{short}{value}")
        if self.moe:
            parts.append(f"ep{self.ep} etp{self.etp}")
        parts.append(f"dp{self.dp}")
        if opts.get("hsdp_shard_size"):
            parts.append(f"hsdp{opts['hsdp_shard_size']}")
        if opts.get("reshard_after_forward") is False:
            parts.append("no-reshard")
        if opts.get("account_for_embedding_in_pipeline_split") or \
                opts.get("account_for_loss_in_pipeline_split"):
            parts.append("emb/loss-split")
        if opts.get("moe_a2a_overlap"):
            parts.append("a2a-overlap")
        if opts.get("moe_token_dispatcher_type") == "flex":
            parts.append(str(opts.get("moe_flex_dispatcher_backend", "deepep")))
        if opts.get("moe_expert_rank_capacity_factor"):
            parts.append("rank-budget")
        if opts.get("cuda_graph_impl", "none") == "full_iteration":
            parts.append("iteration-graph")
        elif opts.get("cuda_graph_impl", "none") != "none":
            parts.append("cuda-graphs")
        if opts.get("fp8_param_gather"):
            parts.append("fp8-params")
        if opts.get("use_precision_aware_optimizer"):
            parts.append("bf16-moments")
        if opts.get("fine_grained_activation_offloading"):
            mods = opts.get("offload_modules")   # unset: the scenario's own modules
            parts.append("offload" + (f"({','.join(mods)})" if mods else ""))
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append(self.activation_checkpointing + (f"({','.join(self.recompute)})"
                                                      if self.recompute else ""))
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order.

    Examples
    --------
    >>> _divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Shape:
    """What the enumeration needs to know about the scenario."""

    gpus: int
    gpus_per_node: int
    layers: int
    global_batch: int
    seq_len: int
    experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    expert_width: int = 0
    """Inner width of one expert (what expert tensor parallelism splits)."""
    mla: bool = False
    shared_experts: int = 0
    mtp_layers: int = 0
    arch: str = ""
    """The GPU's architecture (what the Megatron MoE options depend on)."""
    fp8: bool = False
    dropless: bool = True

    def point(self, tp: int, pp: int, vp: int, dp: int, cp: int, ep: int,
              etp: int = 1) -> SearchPoint:
        """The search point of one parallel layout of this model (the NVLink domain: a
        node of the cluster, as the fabric builds it)."""
        return SearchPoint(tp, pp, vp, dp, cp, self.layers, self.experts, self.expert_width,
                           ep, self.mla, self.shared_experts, self.mtp_layers, etp,
                           self.gpus_per_node, self.arch, self.fp8, self.dropless)


def _shape(base: Scenario) -> _Shape:
    from sim import catalog
    from sim.workload.model import ModelSpec

    m = ModelSpec.from_ref(base.model, base.training.seq_len)
    experts, width, shared = ((m.moe.experts, m.moe.ffn_hidden, m.moe.shared)
                              if m.moe is not None else (0, 0, 0))
    dropless = m.moe is None or m.moe.capacity_factor is None
    return _Shape(base.gpus, base.cluster.gpus_per_node, m.layers, step_sequences(base),
                  base.training.seq_len, experts, width, m.mla is not None, shared,
                  m.mtp_layers, catalog.gpu(base.cluster.gpu).arch,
                  base.training.precision == "fp8", dropless)


def step_sequences(base: Scenario) -> int:
    """Sequences per optimizer step: the scenario's ``global_batch_size``, else one
    micro-batch per replica of its own layout. Every layout keeps it."""
    t = base.training
    return t.global_batch_size or t.micro_batch_size * base.dp


def _space(framework: str) -> SearchSpace | None:
    """The planner's search space of ``framework`` (its registry entry's), if any."""
    try:
        return registry.framework(framework).search
    except KeyError:
        return None


def _vp_values(layers: int, pp: int, space: SearchSpace) -> list[int]:
    """Interleaving degrees worth building for ``pp`` stages: 1, and each ``vp`` up to
    :data:`VP_MAX` whose ``pp x vp`` chunks split the layers (Megatron: evenly, possibly
    counting the embedding and loss; torchtitan: ``stage_layers`` spreads them unevenly, so
    every chunk needs a layer)."""
    if pp == 1:
        return [1]
    out = [1]
    for vp in range(2, VP_MAX + 1):
        if not space.chunks_split(layers, pp, vp):
            continue
        if layers // (pp * vp) < 1:
            continue
        out.append(vp)
    return out


# Framework options every layout of a framework gets, at the values the frameworks' own
# recipes use for large models: each registry entry's ``search.recipe``
# (each framework's sim/frameworks/<name>/search.py says why). Kept here for older imports.
MEGATRON_BEST_PRACTICE = registry.framework("megatron").search.recipe  # type: ignore[union-attr]


def enumerate_layouts(base: Scenario, frameworks: Sequence[str] | None = None
                      ) -> list[Layout]:
    """Every layout the planner builds for ``base``'s model, cluster, batch and precision.

    Enumerated by construction (never refused later): tp divides the GPUs of a node (tensor
    parallelism stays on NVLink), tp x pp x cp divides the GPU count (dp fills the rest),
    the micro-batch size divides the sequences each replica runs per step. The framework's
    own rules (heads over tp, layers over pp x vp, micro-batch counts for interleaving, HSDP
    divisibility, ...) are left to its builder, which refuses what it does not run.

    Pure data-parallel frameworks (DeepSpeed, FairScale, DDP) are modelled with tp = pp =
    cp = 1 and without selective recomputation, so only those are enumerated for them.
    ``frameworks``: names of registered frameworks with a search space (default: all of
    them, :func:`sim.frameworks.registry.searchable`).

    Examples
    --------
    >>> from sim.scenario import load_scenario
    >>> s = load_scenario("llama3.2-1b-ddp-8xh100")
    >>> layouts = enumerate_layouts(s, ["deepspeed"])
    >>> sorted({(x.micro_batch_size, dict(x.options)["zero_stage"]) for x in layouts})[:3]
    [(1, 1), (1, 2), (1, 3)]
    """
    shape = _shape(base)
    out: list[Layout] = []
    for fw in plan_frameworks(base, frameworks)[0]:
        out.extend(_framework_layouts(fw, shape, base))
    return out


def plan_frameworks(base: Scenario, frameworks: Sequence[str] | None = None
                    ) -> tuple[list[str], dict[str, str]]:
    """The frameworks searched for ``base``'s model: those named (default: every one with a
    search space) whose builder models it, and the others with the model key they do not
    model (``experts`` for a mixture-of-experts model on any framework but Megatron: the
    registry entries' ``model_features``, the rule their builders refuse by). Raises
    ScenarioError for a name that is not a searchable framework."""
    from sim.workload.model import ModelSpec

    searchable = registry.searchable()
    model = ModelSpec.from_ref(base.model, base.training.seq_len)
    kept: list[str] = []
    skipped: dict[str, str] = {}
    for fw in searchable if frameworks is None else frameworks:
        if fw not in searchable:
            raise ScenarioError(f"--framework {fw}: unknown framework "
                                f"(available: {', '.join(searchable)})")
        key = registry.framework(fw).builds(model)
        if key is None:
            kept.append(fw)
        else:
            skipped[fw] = key
    return kept, skipped


def _micro_batch_sizes(shape: _Shape, dp: int) -> list[int]:
    if shape.global_batch % dp:
        return [1]      # the builder refuses it (global batch not a multiple of dp)
    return _divisors(shape.global_batch // dp)


def _framework_layouts(fw: str, shape: _Shape, base: Scenario) -> Iterable[Layout]:
    n = shape.gpus
    space = _space(fw)
    assert space is not None
    data_parallel_only = space.data_parallel_only
    tps = [1] if data_parallel_only else _divisors(shape.gpus_per_node)
    cps = [1] if data_parallel_only else [c for c in (1, 2, 4, 8, 16, 32)
                                          if c <= CP_MAX]
    for tp in tps:
        for cp in cps:
            if n % (tp * cp):
                continue
            pps = [1] if data_parallel_only else [p for p in _divisors(n // (tp * cp))
                                                  if p <= shape.layers]
            for pp in pps:
                dp = n // (tp * cp * pp)
                for vp in _vp_values(shape.layers, pp, space) if not data_parallel_only \
                        else [1]:
                    yield from _point_layouts(fw, space, shape, tp, pp, vp, dp, cp)


def _point_layouts(fw: str, space: SearchSpace, shape: _Shape, tp: int, pp: int, vp: int,
                   dp: int, cp: int) -> Iterable[Layout]:
    """The layouts of one parallel point: each expert layout (a mixture-of-experts model),
    each option set of the search space at it, micro-batch size and recomputation."""
    point = shape.point(tp, pp, vp, dp, cp, 1)
    experts = list(space.expert_layouts(point)) if shape.experts else [(1, 0)]
    for ep, etp in experts:
        at = shape.point(tp, pp, vp, dp, cp, ep, etp) if shape.experts else point
        for varied in space.options(at):
            options = tuple(sorted(space.recipe + varied))
            if space.data_parallel_only:
                # Modelled without selective recomputation.
                recompute: list[tuple[str, tuple[str, ...]]] = [("none", ()), ("full", ())]
            else:
                recompute = list(space.recomputation(at, options))
            for mbs in _micro_batch_sizes(shape, dp):
                for ac, mods in recompute:
                    yield Layout(fw, tp, pp, dp, cp, vp, mbs, ac, options, ep, etp, mods)


def layout_scenario(base: Scenario, layout: Layout, global_batch: int | None = None,
                    model: dict[str, Any] | None = None) -> Scenario:
    """``base`` with the layout's keys set.

    The framework section is replaced by the layout's; options the planner does not set keep
    the scenario's values when the framework is the scenario's own (a user can pin
    ``implementation: local`` or ``compile: true``), else the framework's defaults. The
    ``claims`` block is dropped: it describes the scenario's own layout. ``global_batch``
    and ``model`` replace the scenario's (for :func:`layer_profile`'s small copies only).
    """
    data = base.model_dump(mode="json", exclude_unset=True)
    data.pop("claims", None)
    fw: dict[str, Any] = {"name": layout.framework}
    if base.framework.name == layout.framework:
        fw.update(base.framework.model_dump(mode="json", exclude_unset=True))
        if (layout.pp, layout.vp) != (base.parallelism.pp, base.parallelism.vp):
            # The scenario's pipeline split is for its own pp x vp (DeepSeek-V3's 4 first and
            # 1 last layers over 16 stages refuse every other pp).
            space = registry.framework(layout.framework).search
            for key in space.split_options if space is not None else ():
                fw.pop(key, None)
    fw.update(dict(layout.options))
    if layout.recompute:
        fw["recompute_modules"] = list(layout.recompute)
    elif layout.activation_checkpointing != "selective":
        # A scenario's own recompute_modules hold only under selective recomputation.
        fw.pop("recompute_modules", None)
    data["framework"] = fw
    data["parallelism"] = layout.parallelism()
    training = dict(data.get("training", {}))
    training["micro_batch_size"] = layout.micro_batch_size
    training["activation_checkpointing"] = layout.activation_checkpointing
    training["global_batch_size"] = global_batch or step_sequences(base)
    data["training"] = training
    if model is not None:
        data["model"] = model
    data["name"] = f"{base.name} [{layout.label()}]"
    return scenario_from_dict(data, origin=PLAN_ORIGIN)


def refusal_key(exc: ScenarioError) -> tuple[str, str]:
    """(key path, message) of a builder's refusal ``plan: KEY: message``.

    Examples
    --------
    >>> refusal_key(ScenarioError("plan: parallelism.tp: 6 heads do not split"))
    ('parallelism.tp', '6 heads do not split')
    """
    text = str(exc)
    if text.startswith(PLAN_ORIGIN + ": "):
        text = text[len(PLAN_ORIGIN) + 2:]
    key, _, message = text.partition(": ")
    if not message or " " in key:
        return "scenario", text
    return key, message
