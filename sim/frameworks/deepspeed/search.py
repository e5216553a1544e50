"""What ``fabricsim plan`` searches for DeepSpeed (the ``search`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable

from sim.frameworks.common.search import Options, SearchPoint, divisors

DEEPSPEED_BEST_PRACTICE: Options = (
    # Reduce gradients on a side stream while backward continues: the ds_config of
    # DeepSpeed's ZeRO tutorials and Hugging Face's ds_config_zero2/3.json set it for every
    # stage (DeepSpeed's own default is on only for stage 3).
    ("overlap_comm", True),
)


def deepspeed_options(pt: SearchPoint) -> Iterable[Options]:
    # engine.py: "MoE not supported with Stage 3".
    for stage in (1, 2) if pt.experts else (1, 2, 3):
        yield (("zero_stage", stage),)


def deepspeed_expert_layouts(pt: SearchPoint) -> Iterable[tuple[int, int]]:
    """``(ep, etp)`` of DeepSpeed-MoE: ``ep_size`` divides the experts (``MoE.__init__``)
    and the world (``groups._ensure_divisibility``); experts are never tensor-parallel here.

    Examples
    --------
    >>> pt = SearchPoint(tp=1, pp=1, vp=1, dp=16, cp=1, layers=32, experts=8,
    ...                  expert_width=14336)
    >>> list(deepspeed_expert_layouts(pt))
    [(1, 1), (2, 1), (4, 1), (8, 1)]
    """
    for ep in divisors(pt.experts):
        if pt.world % ep == 0:
            yield ep, 1
