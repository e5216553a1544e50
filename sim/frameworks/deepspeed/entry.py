"""The registry entry of ``deepspeed`` (:mod:`sim.frameworks.registry`)."""

from __future__ import annotations

from sim.frameworks.common.entry import FrameworkEntry, SearchSpace
from sim.frameworks.deepspeed.build import build_deepspeed
from sim.frameworks.deepspeed.options import DeepSpeedOptions
from sim.frameworks.deepspeed.resolve import job_kernel_style
from sim.frameworks.deepspeed.search import (
    DEEPSPEED_BEST_PRACTICE,
    deepspeed_expert_layouts,
    deepspeed_options,
)

ENTRY = FrameworkEntry(
    "deepspeed", DeepSpeedOptions, build_deepspeed,
    search=SearchSpace(deepspeed_options, recipe=DEEPSPEED_BEST_PRACTICE,
                       data_parallel_only=True, expert_layouts=deepspeed_expert_layouts),
    # DeepSpeed-MoE layers beside ZeRO 1-2 (sim.frameworks.deepspeed.moe); Hugging Face's
    # query/key norms (Qwen3) in the ZeRO path's blocks (Megatron-DeepSpeed's 3D path refuses
    # them: build.py).
    model_features=frozenset({"experts", "qk_norm"}), kernel_style=job_kernel_style)
