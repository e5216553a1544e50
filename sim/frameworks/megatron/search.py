"""What ``fabricsim plan`` searches for Megatron-LM, and how Megatron splits layers over
pipeline chunks (the ``search`` and ``stage_split`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sim.frameworks.common.search import Options, SearchPoint, divisors

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
    recipe splits 126 layers over 8 x 8 chunks); None when no split is even.

    Examples
    --------
    >>> [value for _, value in megatron_split(126, 8, 8)]     # embedding and loss count
    [True, True]
    """
    n = pp * vp
    if layers % n == 0:
        return ()
    for emb, loss in ((True, True), (True, False), (False, True)):
        extra = int(emb) + int(loss)
        if (layers + extra) % n == 0 and (layers + extra) // n > 1:
            return (("account_for_embedding_in_pipeline_split", emb),
                    ("account_for_loss_in_pipeline_split", loss))
    return None


def megatron_chunks_split(layers: int, pp: int, vp: int) -> bool:
    """Megatron splits ``pp x vp`` chunks only evenly (possibly counting embedding and loss)."""
    return megatron_split(layers, pp, vp) is not None


def megatron_options(pt: SearchPoint) -> Iterable[Options]:
    split = megatron_split(pt.layers, pt.pp, pt.vp) or ()
    extra: Options = (("tp_comm_overlap", True),) if pt.tp > 1 else ()
    yield extra + split


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
