"""What ``fabricsim plan`` searches for each built-in framework, and how each splits layers
over pipeline stages: the ``search`` and ``stage_split`` of their registry entries
(:mod:`sim.frameworks.registry`).

They live here, beside the builders, until each framework becomes a package with its own
``search.py`` (``ARCHITECTURE.md``, "Layout"); the planner reads them only through the
registry. Moved unchanged from ``sim/plan.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Options = tuple[tuple[str, Any], ...]
"""Framework options as sorted ``(key, value)`` pairs (``framework.<key>``)."""


@dataclass(frozen=True)
class SearchPoint:
    """The parallel layout a search space adds its options to."""

    tp: int
    pp: int
    vp: int
    dp: int
    cp: int
    layers: int
    """Transformer layers of the model."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------- Megatron-LM
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
    from sim.frameworks.megatron import chunk_layers

    return chunk_layers(layers, pp, vp,
                        bool(opts.get("account_for_embedding_in_pipeline_split")),
                        bool(opts.get("account_for_loss_in_pipeline_split")))


# --------------------------------------------------------------------------- FSDP2 (torchtitan)
def fsdp2_options(pt: SearchPoint) -> Iterable[Options]:
    # HSDP shard groups: every divisor of dp below dp (None = plain FSDP over all dp
    # ranks); a shard of one rank is plain replication (torchtitan applies DDP then),
    # which the builder refuses unless context parallelism shards the states.
    shards: list[int | None] = [None] + [d for d in _divisors(pt.dp)[:-1]
                                         if d > 1 or pt.cp > 1]
    for shard in shards:
        for reshard in (True, False):
            opts: list[tuple[str, Any]] = [("reshard_after_forward", reshard)]
            if shard is not None:
                opts.append(("hsdp_shard_size", shard))
            yield tuple(opts)


def torchtitan_stage_split(layers: int, pp: int, vp: int, opts: Mapping[str, Any]
                           ) -> list[list[int]]:
    # The planner sets no pipeline_*_stage_less_layers: torchtitan's defaults (1 and 1).
    from sim.frameworks.fsdp2.mesh import stage_layers

    return stage_layers(layers, pp * vp)


# --------------------------------------------------------------------------- DeepSpeed
DEEPSPEED_BEST_PRACTICE: Options = (
    # Reduce gradients on a side stream while backward continues: the ds_config of
    # DeepSpeed's ZeRO tutorials and Hugging Face's ds_config_zero2/3.json set it for every
    # stage (DeepSpeed's own default is on only for stage 3).
    ("overlap_comm", True),
)


def deepspeed_options(pt: SearchPoint) -> Iterable[Options]:
    for stage in (1, 2, 3):
        yield (("zero_stage", stage),)


# --------------------------------------------------------------------------- FairScale, DDP
def fairscale_options(pt: SearchPoint) -> Iterable[Options]:
    for reshard in (True, False):
        yield (("reshard_after_forward", reshard),)


DDP_BEST_PRACTICE: Options = (
    # Gradients alias the bucket buffers: one gradient-sized buffer and two copies less, as
    # PyTorch's DDP notes recommend for memory.
    ("gradient_as_bucket_view", True),
)


def no_options(pt: SearchPoint) -> Iterable[Options]:
    """One layout per parallel point, with the recipe options only."""
    yield ()
