"""What ``fabricsim plan`` searches for Megatron-LM, and how Megatron splits layers over
pipeline chunks (the ``search`` and ``stage_split`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sim.frameworks.common.search import (
    Options,
    Recomputation,
    SearchPoint,
    default_recomputation,
    divisors,
)
from sim.frameworks.megatron.search_moe import (
    allows_recomputation,
    moe_memory_lever,
    moe_option_sets,
)

MEGATRON_BEST_PRACTICE: Options = (
    # Shard fp32 master weights and Adam states over data-parallel ranks: 12 bytes/param
    # become 12/dp for the same bytes moved (reduce-scatter + all-gather = all-reduce).
    ("distributed_optimizer", True),
    # Reduce gradients bucket by bucket while the last micro-batch's backward runs, and
    # gather parameters bucket by bucket in the next forward: NeMo's recipes
    # (DistributedDataParallelConfig overlap_grad_reduce / overlap_param_gather = True).
    ("overlap_grad_reduce", True),
    ("overlap_param_gather", True),
)
"""Megatron options fixed for every layout (``tp_comm_overlap`` is added when tp > 1:
NeMo's Llama 3 recipes turn on Transformer Engine's userbuffer overlap of the
tensor-parallel exchanges with their GEMMs on H100)."""


def megatron_split(layers: int, pp: int, vp: int) -> Options | None:
    """Megatron's pipeline split options for ``pp x vp`` chunks: an even split of the
    layers, else the embedding and/or the loss counted as a layer
    (``account_for_embedding_in_pipeline_split`` / ``..._loss_...``, as NeMo's Llama 3.1 405B
    recipe splits 126 layers over 8 x 8 chunks), else without interleaving an uneven first
    and last stage (:func:`uneven_split`); None when there is none.

    Examples
    --------
    >>> [value for _, value in megatron_split(126, 8, 8)]     # embedding and loss count
    [True, True]
    >>> megatron_split(61, 16, 1)                              # DeepSeek-V3
    (('decoder_first_pipeline_num_layers', 4), ('decoder_last_pipeline_num_layers', 1))
    """
    n = pp * vp
    if layers % n == 0:
        return ()
    for emb, loss in ((True, True), (True, False), (False, True)):
        extra = int(emb) + int(loss)
        if (layers + extra) % n == 0 and (layers + extra) // n > 1:
            return (("account_for_embedding_in_pipeline_split", emb),
                    ("account_for_loss_in_pipeline_split", loss))
    return uneven_split(layers, pp) if vp == 1 else None


def uneven_split(layers: int, pp: int) -> Options | None:
    """Megatron-Core's uneven split (``decoder_first_pipeline_num_layers`` /
    ``..._last_...``) for ``layers`` that no even split takes: the middle stages hold
    ``ceil(layers / pp)`` each (else ``floor``), the first as many or what is left, the last
    the rest, no stage above ``ceil(layers / pp) + 1``; as the shipped DeepSeek-V3 scenario
    splits 61 layers over 16 stages (4, 14 x 4, 1). None where no such split exists.

    Examples
    --------
    >>> uneven_split(61, 8)
    (('decoder_first_pipeline_num_layers', 8), ('decoder_last_pipeline_num_layers', 5))
    >>> uneven_split(61, 12)        # middle stages of 5: 5 first, 6 last
    (('decoder_first_pipeline_num_layers', 5), ('decoder_last_pipeline_num_layers', 6))
    >>> uneven_split(4, 8) is None
    True
    """
    if pp < 3:
        return None
    most = -(-layers // pp)
    for per in (most, layers // pp):
        rest = layers - per * (pp - 2)
        if per < 1 or rest < 2:
            continue
        first = min(per, rest - 1)
        if rest - first <= most + 1:
            return (("decoder_first_pipeline_num_layers", first),
                    ("decoder_last_pipeline_num_layers", rest - first))
    return None


def megatron_chunks_split(layers: int, pp: int, vp: int) -> bool:
    """Megatron splits ``pp x vp`` chunks only evenly (possibly counting embedding and loss)."""
    return megatron_split(layers, pp, vp) is not None


def megatron_options(pt: SearchPoint) -> Iterable[Options]:
    """The option sets of one layout: the pipeline split and ``tp_comm_overlap`` (tp > 1);
    for a mixture-of-experts model each without and, where Megatron-Core allows it
    (:func:`a2a_overlap_allowed`), with ``moe_a2a_overlap`` (the combined 1F1B schedule;
    Megatron-Bridge's MoE recipes run both: Qwen3-235B-A22B on H100 with it, Qwen3-30B-A3B on
    H100 without, scripts/performance/configs/qwen/qwen3_workload_base_configs.py).

    Examples
    --------
    >>> pt = SearchPoint(1, 1, 1, 16, 1, 48, experts=128, expert_width=768, ep=8)
    >>> [dict(o).get("moe_a2a_overlap") for o in megatron_options(pt)]
    [False, True]
    >>> pp2 = SearchPoint(1, 2, 1, 8, 1, 48, experts=128, expert_width=768, ep=8)
    >>> [dict(o).get("moe_a2a_overlap") for o in megatron_options(pp2)]   # pp 2 needs vp
    [False]
    """
    split = megatron_split(pt.layers, pt.pp, pt.vp) or ()
    extra: Options = (("tp_comm_overlap", True),) if pt.tp > 1 else ()
    if not pt.experts:
        yield extra + split
        return
    # Each with the dispatcher backends, CUDA graphs and FP8 primary weights Megatron
    # allows here (sim/frameworks/megatron/search_moe.py).
    for moe in moe_option_sets(pt):
        # Without the overlap explicitly, so that a scenario that sets it still gets layouts
        # without it (and those Megatron refuses it for).
        yield extra + split + (("moe_a2a_overlap", False),) + moe
        if a2a_overlap_allowed(pt):
            # Megatron-Core refuses moe_shared_expert_overlap with the combined schedule (the
            # shared experts run in the pre-dispatch node beside the other micro-batch's
            # all-to-alls instead).
            shared: Options = ((("moe_shared_expert_overlap", False),) if pt.shared_experts
                               else ())
            yield extra + split + (("moe_a2a_overlap", True),) + shared + moe


MEGATRON_FSDP: Options = (("use_megatron_fsdp", True),)
"""Megatron-FSDP with ``optim_grads_params`` sharding (sim/frameworks/megatron/fsdp.py): a
memory lever of layouts without a pipeline."""


def megatron_memory_lever(pt: SearchPoint, options: Options) -> Options | None:
    """The options of the same layout that keep less state, tried where it does not fit.

    A dense layout: Megatron-FSDP (:data:`MEGATRON_FSDP`), which shards the 16-bit
    parameters and the gradients too, as NVIDIA's GB200 Llama 3 70B and 405B recipes run at
    TP 1-2 without a pipeline (NeMo 25.04-25.07, Megatron-Bridge 25.09: ``use_mcore_fsdp``).
    A mixture-of-experts layout: bf16 Adam moments first; then Megatron-FSDP where this model
    runs it with experts (16-bit, no MTP, no combined 1F1B overlap: the Megatron-MoE model
    zoo's intra-node-EP Qwen3-235B solution), else the experts' activations offloaded
    (:func:`~sim.frameworks.megatron.search_moe.moe_memory_lever`). Megatron-FSDP needs no
    pipeline (pp and vp 1) and more than one data- (or context-) parallel rank, and stands
    beside no CUDA graphs or delayed weight gradients (Megatron-Bridge turns graphs off with
    it; this model refuses both). None where nothing is left.

    Examples
    --------
    >>> dense = SearchPoint(tp=1, pp=1, vp=1, dp=64, cp=1, layers=80)
    >>> megatron_memory_lever(dense, (("distributed_optimizer", True),))
    (('distributed_optimizer', True), ('use_megatron_fsdp', True))
    >>> megatron_memory_lever(dense, MEGATRON_FSDP) is None          # pulled already
    True
    >>> megatron_memory_lever(SearchPoint(1, 4, 1, 16, 1, 80), ()) is None   # a pipeline
    True
    >>> moe = SearchPoint(2, 1, 1, 128, 1, 94, experts=128, expert_width=1536, ep=8)
    >>> from sim.frameworks.megatron.search_moe import BF16_MOMENTS
    >>> dict(megatron_memory_lever(moe, BF16_MOMENTS)).get("use_megatron_fsdp")
    True
    >>> dict(megatron_memory_lever(moe, MEGATRON_FSDP))["exp_avg_dtype"]   # FSDP as given
    'bf16'
    >>> megatron_memory_lever(moe, BF16_MOMENTS + MEGATRON_FSDP) is None
    True
    """
    o = dict(options)
    if pt.experts:
        if not o.get("use_precision_aware_optimizer"):
            return moe_memory_lever(options)        # bf16 moments first, FSDP or not
        if _fsdp_allowed(pt, o) and not o.get("fine_grained_activation_offloading"):
            return tuple(sorted({**o, **dict(MEGATRON_FSDP)}.items()))
        # Moments and FSDP pulled: offloading beside FSDP is not one of the levers.
        return None if o.get("use_megatron_fsdp") else moe_memory_lever(options)
    if not _fsdp_allowed(pt, o):
        return None
    return tuple(sorted({**o, **dict(MEGATRON_FSDP)}.items()))


def _fsdp_allowed(pt: SearchPoint, o: dict[str, object]) -> bool:
    """Megatron-FSDP as this model runs it (:mod:`sim.frameworks.megatron.fsdp`), not pulled
    yet: no pipeline, more than one data-parallel rank, no CUDA graphs or delayed wgrad;
    with experts also 16-bit, no MTP, no combined 1F1B overlap."""
    if (pt.pp > 1 or pt.vp > 1 or pt.dp * pt.cp == 1 or o.get("use_megatron_fsdp")
            or o.get("cuda_graph_impl", "none") != "none" or o.get("delay_wgrad_compute")):
        return False
    return not pt.experts or not (pt.fp8 or pt.mtp_layers or o.get("moe_a2a_overlap"))


def a2a_overlap_allowed(pt: SearchPoint) -> bool:
    """Whether Megatron-Core runs ``overlap_moe_expert_parallel_comm`` at this layout, by the
    rules of :func:`sim.frameworks.megatron.a2a_overlap.check_a2a_overlap` that the layout
    decides (``TransformerConfig.__post_init__``): expert parallelism (ep > 1), virtual
    stages with pipeline parallelism, at most one MTP layer. The dispatcher (not
    ``allgather``) and the schedule (1F1B) are the scenario's: its builder refuses those."""
    return pt.experts > 0 and pt.ep > 1 and (pt.pp == 1 or pt.vp > 1) and pt.mtp_layers <= 1


MOE_RECOMPUTE: tuple[tuple[str, ...], ...] = (
    # Megatron-Bridge DeepSeek-V3 GB300 BF16 (scripts/performance/configs/deepseek/
    # deepseek_workload_base_configs.py); Megatron-Bridge's activation-recomputation guide:
    # "grouped MoE often starts with moe_act or layernorm plus moe_act".
    ("moe_act",),
    # Qwen3-235B-A22B on H100 and GB200 EP32 (Megatron-Bridge scripts/moe_model_zoo/examples/
    # qwen3/launch_qwen235b.sh; Megatron-MoE-ModelZoo best-practice/qwen3/run_235b.sh).
    ("layernorm", "moe_act"),
    # MLA models: DeepSeek-V3 B200 NVFP4 (deepseek_workload_base_configs.py); the guide:
    # "MLA often benefits from mla_up_proj". Only for a model with MLA (Megatron refuses it).
    ("mla_up_proj", "layernorm", "moe_act"),
    # The whole MoE layer: Qwen3-235B-A22B GB200 EP64 (run_235b.sh: --recompute-modules moe),
    # with the lighter sets' other modules kept so that each set recomputes all the previous
    # one does (moe contains moe_act's activation).
    ("mla_up_proj", "layernorm", "moe"),
)
"""Megatron's ``recompute_modules`` sets the planner tries for a mixture-of-experts model,
least recomputation first (each recomputes what the one before does, and more); without MLA
``mla_up_proj`` is left out of each (and the set then equal to the one before it is)."""


def megatron_recomputation(pt: SearchPoint, options: Options) -> Iterable[Recomputation]:
    """No recomputation; for a mixture-of-experts model the light ``recompute_modules`` sets
    of NVIDIA's MoE recipes (:data:`MOE_RECOMPUTE`, least first); Megatron-Core's selective
    default (``core_attn``); full recomputation, except with ``moe_a2a_overlap`` (Megatron-
    Core's main branch refuses the combined schedule with it; only its dev branch replays each
    layer, :mod:`sim.frameworks.megatron.a2a_overlap`). A dense model's are the default three.

    Examples
    --------
    >>> pt = SearchPoint(1, 1, 1, 16, 1, 48, experts=128, expert_width=768, ep=8)
    >>> [(ac, ",".join(m)) for ac, m in megatron_recomputation(pt, ())]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('none', ''), ('selective', 'moe_act'), ('selective', 'layernorm,moe_act'),
     ('selective', 'layernorm,moe'), ('selective', ''), ('full', '')]
    """
    if not pt.experts:
        yield from default_recomputation(pt, options)
        return
    yield "none", ()
    seen: set[tuple[str, ...]] = set()
    for mods in MOE_RECOMPUTE:
        kept = tuple(m for m in mods if pt.mla or m != "mla_up_proj")
        if kept not in seen and allows_recomputation(options, "selective", kept):
            seen.add(kept)
            yield "selective", kept
    yield "selective", ()
    if not dict(options).get("moe_a2a_overlap") and allows_recomputation(options, "full", ()):
        yield "full", ()


def megatron_expert_layouts(pt: SearchPoint) -> Iterable[tuple[int, int]]:
    """``(ep, etp)`` of a mixture-of-experts model at one parallel layout, by MoE parallel
    folding (arXiv:2504.14960; Megatron-Core ``parallel_state.initialize_model_parallel``
    lays the experts out as ``etp x ep x expert-dp x pp`` over the same ranks as the
    attention's ``tp x cp x dp x pp``, so ep need not divide dp):

    * ``ep`` divides the routed experts (``validate_args``: ``num_experts %
      expert_model_parallel_size == 0``): 1 up to one expert per rank;
    * ``etp`` is 1 (each expert whole on one rank, the folding paper's and DeepSeek-V3's
      choice) or the attention's ``tp`` (``--expert-tensor-parallel-size`` omitted), and
      splits the expert width;
    * ``etp x ep x pp`` divides the world (the expert layout's data-parallel size is what
      is left).

    Examples
    --------
    >>> pt = SearchPoint(tp=2, pp=4, vp=1, dp=8, cp=1, layers=32, experts=8,
    ...                  expert_width=14336)             # Mixtral 8x7B on 64 GPUs
    >>> sorted(megatron_expert_layouts(pt))
    [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)]
    """
    for ep in divisors(pt.experts):
        for etp in sorted({1, pt.tp}):
            if pt.expert_width % etp == 0 and pt.world % (etp * ep * pt.pp) == 0:
                yield ep, etp


def megatron_stage_split(layers: int, pp: int, vp: int, opts: Mapping[str, Any]
                         ) -> list[list[int]]:
    from sim.frameworks.megatron.build import chunk_layers
    from sim.frameworks.megatron.layout import as_layout

    layout = opts.get("pipeline_model_parallel_layout")
    return chunk_layers(layers, pp, vp,
                        bool(opts.get("account_for_embedding_in_pipeline_split")),
                        bool(opts.get("account_for_loss_in_pipeline_split")),
                        opts.get("decoder_first_pipeline_num_layers"),
                        opts.get("decoder_last_pipeline_num_layers"),
                        as_layout(layout) if layout is not None else None)
