"""What ``fabricsim plan`` searches for Megatron-LM, and how Megatron splits layers over
pipeline chunks (the ``search`` and ``stage_split`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sim.frameworks.common.search import Options, SearchPoint

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


def megatron_stage_split(layers: int, pp: int, vp: int, opts: Mapping[str, Any]
                         ) -> list[list[int]]:
    from sim.frameworks.megatron.build import chunk_layers

    return chunk_layers(layers, pp, vp,
                        bool(opts.get("account_for_embedding_in_pipeline_split")),
                        bool(opts.get("account_for_loss_in_pipeline_split")))
