"""The registry entry of ``fsdp2`` (:mod:`sim.frameworks.registry`)."""

from __future__ import annotations

from sim.frameworks.common.entry import FrameworkEntry, SearchSpace
from sim.frameworks.fsdp2.build import build_fsdp2, kernel_style
from sim.frameworks.fsdp2.options import Fsdp2Options
from sim.frameworks.fsdp2.search import (
    fsdp2_expert_layouts,
    fsdp2_options,
    torchtitan_stage_split,
)

ENTRY = FrameworkEntry(
    "fsdp2", Fsdp2Options, build_fsdp2,
    search=SearchSpace(fsdp2_options, layer_profile=True, short_step_with_pipeline=False,
                       expert_layouts=fsdp2_expert_layouts),
    stage_split=torchtitan_stage_split,
    # torchtitan's run_train.sh exports PYTORCH_ALLOC_CONF="expandable_segments:True".
    expandable_segments=True,
    # torchtitan's MoE layers with expert parallelism (fsdp2/moe.py), Qwen3's per-head
    # query/key RMSNorm (sim/workload/layer_ops.py qkv_projections) and DeepSeek's
    # Multi-head Latent Attention (sim/workload/titan_mla.py; key "attention"); GPT-OSS's
    # sinks and sliding windows in NeMo AutoModel's code (sim/workload/automodel_attention.py).
    model_features=frozenset({"experts", "qk_norm", "attention", "attention_sinks",
                              "sliding_window"}), kernel_style=kernel_style)
