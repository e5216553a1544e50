"""What ``fabricsim plan`` searches for DeepSpeed (the ``search`` of its registry entry)."""

from __future__ import annotations

from collections.abc import Iterable

from sim.frameworks.common.search import Options, SearchPoint

DEEPSPEED_BEST_PRACTICE: Options = (
    # Reduce gradients on a side stream while backward continues: the ds_config of
    # DeepSpeed's ZeRO tutorials and Hugging Face's ds_config_zero2/3.json set it for every
    # stage (DeepSpeed's own default is on only for stage 3).
    ("overlap_comm", True),
)


def deepspeed_options(pt: SearchPoint) -> Iterable[Options]:
    for stage in (1, 2, 3):
        yield (("zero_stage", stage),)
