"""What ``fabricsim plan`` searches for FSDP2 (torchtitan), and how torchtitan splits layers
over pipeline stages (the ``search`` and ``stage_split`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sim.frameworks.common.search import Options, SearchPoint, divisors


def fsdp2_options(pt: SearchPoint) -> Iterable[Options]:
    # HSDP shard groups: every divisor of dp below dp (None = plain FSDP over all dp
    # ranks); a shard of one rank is plain replication (torchtitan applies DDP then),
    # which the builder refuses unless context parallelism shards the states.
    shards: list[int | None] = [None] + [d for d in divisors(pt.dp)[:-1]
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


def fsdp2_expert_layouts(pt: SearchPoint) -> Iterable[tuple[int, int]]:
    """``(ep, etp)`` of a mixture-of-experts model under torchtitan: ``ep`` borrows ranks from
    ``dp_shard x cp x tp`` (``ParallelDims``: ``efsdp = dp_shard x cp x tp / (ep x etp)``), so
    it divides the routed experts and dp x cp x tp and, with ``etp`` 1, takes every
    tensor-parallel rank (a multiple of tp).

    Examples
    --------
    >>> pt = SearchPoint(tp=1, pp=1, vp=1, dp=16, cp=1, layers=48, experts=128,
    ...                  expert_width=768)              # Qwen3-30B-A3B on 16 GPUs
    >>> [ep for ep, _ in fsdp2_expert_layouts(pt)]
    [1, 2, 4, 8, 16]
    >>> [ep for ep, _ in fsdp2_expert_layouts(SearchPoint(2, 1, 1, 8, 1, 48, 128, 768))]
    [2, 4, 8, 16]
    >>> [ep for ep, _ in fsdp2_expert_layouts(SearchPoint(1, 1, 1, 2, 4, 48, 8, 768))]
    [1, 2, 4, 8]
    """
    for ep in divisors(pt.experts):
        if ep % pt.tp == 0 and (pt.dp * pt.cp * pt.tp) % ep == 0:
            yield ep, 1
