"""The mixture-of-experts options ``fabricsim plan`` tries on Megatron beyond the expert layout
and the combined 1F1B schedule: the token dispatcher's backend, CUDA graphs, FP8 primary
weights, and the precision-aware optimizer's bf16 moments as a memory lever.

Each is tried only where Megatron allows it and where it can change the answer:

* **DeepEP / HybridEP** (``moe_token_dispatcher_type: flex`` with ``moe_flex_dispatcher_backend``
  ``deepep`` or ``hybridep``) only where the expert-TP x EP group crosses NVLink domains: within
  one domain NCCL's all-to-all already moves every token once over NVLink, and what the fused
  kernels save is the network crossings (one per destination domain, DeepEP's and Hybrid-EP's
  design; :mod:`sim.frameworks.megatron.moe_flex`, :mod:`sim.frameworks.megatron.moe_hybridep`).
  Dropless only (neither backend pads to capacity; token dropping is not modelled with them),
  on Hopper or Blackwell (both backends' GPUs). HybridEP always: Megatron-Bridge's MoE configs
  run it on H100, B200, GB200 and GB300 alike (``scripts/performance/configs/{qwen,deepseek,
  gpt_oss}/*_workload_base_configs.py`` at c8327cfc2~1, ``moe_flex_dispatcher_backend``);
  DeepEP only with FP8 training, where those configs use it (DeepSeek-V3 B200 FP8-MX and
  NVFP4 V2) and where it differs from HybridEP (FP8 dispatch, which HybridEP refuses). Each
  backend is one more layer profile per crossing layout, so the planner tries no more.
* **CUDA graphs**: on Blackwell always, as Megatron-Bridge's MoE configs do there
  (``cuda_graph_impl="transformer_engine"``, ``cuda_graph_scope=["attn", "moe_router",
  "moe_preprocess"]``, same file); elsewhere as a twin of the eager layout, which the planner
  simulates only where its lower bound is shorter (graphs save host time only,
  :mod:`sim.frameworks.megatron.cuda_graphs`, so only a host-bound layout gains). The scopes
  Megatron-Core allows for a dropless layer (``TransformerConfig.__post_init__``): not the
  whole layer (the host reads the tokens per expert), ``moe_preprocess`` not with the
  alltoall dispatcher of a layer with a capacity factor; no full recomputation, no ``moe``
  recompute module with the ``moe_router`` graph under Transformer Engine's graphs.
* **The rank-budget recipe** (Megatron-Bridge 26.06's Blackwell MoE configs,
  ``scripts/performance/configs/{qwen,gpt_oss,deepseek}/*_workload_base_configs.py`` and
  ``*_llm_pretrain.py`` at v0.5.0 fcbb60311): HybridEP with a static rank budget
  (``moe_expert_rank_capacity_factor`` 1.5), paged stashing of the experts' activations
  (pool 1.2x the average rows), Transformer Engine's operation fuser for the grouped experts,
  and one CUDA graph over the whole iteration, which the budget makes possible over a dropless
  layer (the host no longer waits for the token counts;
  :mod:`sim.frameworks.megatron.moe_rank_budget`). On Blackwell, dropless, ep > 1 without
  expert tensor parallelism (the fuser refuses it), inside one NVLink domain too: what it
  saves is host time and the per-expert launches, not network crossings. Where Megatron-Core
  refuses the fuser (an ungated expert MLP) or the budget (skewed routing), the layout is
  refused, naming the key.
* **FP8 primary weights** (``fp8_param_gather``) with ``training.precision: fp8``, as
  Megatron-Bridge's FP8 current-scaling recipe sets it (``bf16_with_fp8_current_scaling_mixed``):
  1-byte weights gathered in FP8 by the distributed optimizer, never more memory or bytes.
* **bf16 moments** (``use_precision_aware_optimizer`` with ``exp_avg_dtype`` /
  ``exp_avg_sq_dtype`` bf16, Megatron-Core ``OptimizerConfig``; Transformer Engine's
  ``FusedAdam`` computes in fp32 either way): Adam's moments at 2 bytes each instead of 4,
  tried by the planner only for a layout that does not fit without them
  (:func:`moe_memory_lever`).
"""

from __future__ import annotations

from collections.abc import Iterable

from sim.frameworks.common.search import Options, SearchPoint

FLEX_ARCHS = ("hopper", "blackwell")
"""GPUs both fused backends run on (HybridEP: H100, B200, GB200, Megatron-Core
moe/README.md; DeepEP also Ampere, which the planner leaves to the alltoall dispatcher)."""

GRAPH_IMPL = "transformer_engine"
"""``cuda_graph_impl`` of Megatron-Bridge's MoE configs (qwen3_workload_base_configs.py)."""

BF16_MOMENTS: Options = (("exp_avg_dtype", "bf16"), ("exp_avg_sq_dtype", "bf16"),
                         ("use_precision_aware_optimizer", True))
"""The memory lever's options (Megatron-Bridge's DeepSeek-V3 and Qwen3 large-scale configs
set ``use_precision_aware_optimizer`` with bf16 ``exp_avg_dtype`` / ``exp_avg_sq_dtype``)."""

OFFLOAD_EXPERTS: Options = (("fine_grained_activation_offloading", True),
                            ("offload_modules", ("expert_fc1", "moe_act")))
"""The second memory lever: the routed experts' saved activations to host memory (the
Megatron Core MoE model zoo's GB200 MXFP8 Qwen3-235B script,
:mod:`sim.frameworks.megatron.activation_offload`)."""


def crosses_domains(pt: SearchPoint) -> bool:
    """Whether the expert-TP x EP group (``etp x ep`` consecutive ranks, Megatron-Core's
    expert layout ``etp x ep x expert-dp x pp``) spans more than one NVLink domain.

    Examples
    --------
    >>> crosses_domains(SearchPoint(1, 1, 1, 16, 1, 48, 128, 768, ep=16, gpus_per_domain=8))
    True
    >>> crosses_domains(SearchPoint(1, 1, 1, 8, 1, 48, 128, 768, ep=8, gpus_per_domain=8))
    False
    """
    return pt.gpus_per_domain > 0 and pt.ep * pt.etp > pt.gpus_per_domain


RANK_BUDGET_RECIPE: Options = (
    ("moe_token_dispatcher_type", "flex"), ("moe_flex_dispatcher_backend", "hybridep"),
    ("moe_expert_rank_capacity_factor", 1.5), ("moe_paged_stash", True),
    ("moe_paged_stash_buffer_size_factor_cuda", 1.2),
    ("use_transformer_engine_op_fuser", True), ("cuda_graph_impl", "full_iteration"),
    ("cuda_graph_scope", ()))
"""Megatron-Bridge 26.06's GB200 MoE recipe (v0.5.0 ``qwen3_workload_base_configs.py``
L388-398 and ``qwen3_llm_pretrain.py``: budget 1.5, paged stash 1.2, ``full_iteration``);
its cuDNN fused grouped MLP (MXFP8 only) and its FP8 attention (``fp8_dot_product_attention``,
whose gain cuDNN measured below 1 for sliding windows) are left to the scenario."""


def dispatchers(pt: SearchPoint) -> list[Options]:
    """The dispatcher option sets of a layout: the alltoall dispatcher (the scenario's or
    the default, no key set), and where the group crosses domains HybridEP, and DeepEP with
    FP8.

    Examples
    --------
    >>> pt = SearchPoint(1, 1, 1, 16, 1, 48, 128, 768, ep=16, gpus_per_domain=8,
    ...                  arch="hopper")
    >>> [dict(o).get("moe_flex_dispatcher_backend") for o in dispatchers(pt)]
    [None, 'hybridep']
    """
    out: list[Options] = [()]
    if crosses_domains(pt) and pt.dropless and pt.arch in FLEX_ARCHS:
        for backend in ("hybridep", "deepep") if pt.fp8 else ("hybridep",):
            out.append((("moe_flex_dispatcher_backend", backend),
                        ("moe_token_dispatcher_type", "flex")))
    return out


def graph_scope(pt: SearchPoint, flex: bool) -> tuple[str, ...]:
    """The CUDA graph scope Megatron-Core allows for the layer (see the module docstring).

    Examples
    --------
    >>> graph_scope(SearchPoint(1, 1, 1, 8, 1, 48, 128, 768, ep=8), False)
    ('attn', 'moe_router', 'moe_preprocess')
    >>> graph_scope(SearchPoint(1, 1, 1, 8, 1, 48, 8, 768, ep=8, dropless=False), False)
    ('attn', 'moe_router')
    """
    preprocess = flex or pt.dropless
    return ("attn", "moe_router") + (("moe_preprocess",) if preprocess else ())


def graph_options(pt: SearchPoint, flex: bool) -> list[Options]:
    """CUDA graph option sets: on Blackwell graphs only (as the scripts run there),
    elsewhere none and graphs (the twin the planner keeps only where the host binds)."""
    graphs: Options = (("cuda_graph_impl", GRAPH_IMPL),
                       ("cuda_graph_scope", graph_scope(pt, flex)))
    if not pt.arch:
        return [()]             # a point without its GPU (doctests): eager only
    # The eager twin says so (``none``): a scenario's own graphs would otherwise hold.
    return [graphs] if pt.arch == "blackwell" else [(("cuda_graph_impl", "none"),), graphs]


def moe_option_sets(pt: SearchPoint) -> Iterable[Options]:
    """Dispatcher x CUDA graphs (x FP8 primary weights with fp8) of a mixture-of-experts
    layout, each to be merged with the layout's other options.

    Examples
    --------
    >>> pt = SearchPoint(1, 1, 1, 8, 1, 48, 128, 768, ep=8, gpus_per_domain=8, arch="hopper")
    >>> [dict(o).get("cuda_graph_impl") for o in moe_option_sets(pt)]
    ['none', 'transformer_engine']

    On Blackwell, graphs always, and the rank-budget recipe's whole-iteration graph:

    >>> gb = SearchPoint(1, 1, 1, 8, 1, 48, 128, 768, ep=8, gpus_per_domain=72,
    ...                  arch="blackwell")
    >>> [dict(o).get("cuda_graph_impl") for o in moe_option_sets(gb)]
    ['transformer_engine', 'full_iteration']
    """
    fp8: Options = (("fp8_param_gather", True),) if pt.fp8 else ()
    for disp in dispatchers(pt):
        for graphs in graph_options(pt, bool(disp)):
            yield disp + graphs + fp8
    if pt.arch == "blackwell" and pt.dropless and pt.ep > 1 and pt.etp == 1:
        yield RANK_BUDGET_RECIPE + fp8


def allows_recomputation(options: Options, ac: str, modules: tuple[str, ...]) -> bool:
    """Whether Megatron-Core runs these options with this recomputation
    (``TransformerConfig.__post_init__``, core_v0.16.0; :func:`sim.frameworks.megatron.
    cuda_graphs.check_cuda_graphs`): no full recomputation with per-layer CUDA graphs (a
    whole-iteration graph allows it), no
    ``moe`` recompute module beside Transformer Engine's ``moe_router`` graph.

    Examples
    --------
    >>> g = (("cuda_graph_impl", "transformer_engine"), ("cuda_graph_scope", ("moe_router",)))
    >>> allows_recomputation(g, "full", ()), allows_recomputation(g, "selective", ("moe",))
    (False, False)
    >>> allows_recomputation((), "full", ())
    True

    A whole-iteration graph is the one Megatron-Core lets full recomputation run under:

    >>> allows_recomputation((("cuda_graph_impl", "full_iteration"),), "full", ())
    True
    """
    o = dict(options)
    impl = o.get("cuda_graph_impl", "none")
    if impl == "none" or impl == "full_iteration" \
            or "full_iteration" in o.get("cuda_graph_scope", ()):
        return True
    if ac == "full":
        return False
    return not (impl == "transformer_engine" and ac == "selective" and "moe" in modules
                and "moe_router" in o.get("cuda_graph_scope", ()))


def moe_memory_lever(options: Options) -> Options | None:
    """The options of the same layout with the next memory lever: bf16 moments, then (where
    it has them and still does not fit) the experts' activations offloaded to host memory
    (:data:`OFFLOAD_EXPERTS`); None where it has both (the planner tries them only for a
    mixture-of-experts layout that does not fit).

    Examples
    --------
    >>> dict(moe_memory_lever((("distributed_optimizer", True),)))["exp_avg_dtype"]
    'bf16'
    >>> dict(moe_memory_lever(BF16_MOMENTS))["offload_modules"]
    ('expert_fc1', 'moe_act')
    >>> moe_memory_lever(BF16_MOMENTS + OFFLOAD_EXPERTS) is None
    True
    """
    o = dict(options)
    if not o.get("use_precision_aware_optimizer"):
        return tuple(sorted(dict(options + BF16_MOMENTS).items()))
    if o.get("fine_grained_activation_offloading"):
        return None
    return tuple(sorted(dict(options + OFFLOAD_EXPERTS).items()))


def graph_twin(options: Options) -> Options | None:
    """The eager options of a layout with CUDA graphs the planner also enumerated (not on
    Blackwell, where only graphs are), or None without graphs."""
    o = dict(options)
    if o.get("cuda_graph_impl", "none") == "none":
        return None
    o["cuda_graph_impl"] = "none"
    o.pop("cuda_graph_scope", None)
    return tuple(sorted(o.items()))
