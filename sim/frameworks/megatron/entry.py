"""The registry entry of ``megatron`` (:mod:`sim.frameworks.registry`)."""

from __future__ import annotations

from sim.frameworks.common.entry import FrameworkEntry, SearchSpace
from sim.frameworks.megatron.build import build_megatron
from sim.frameworks.megatron.options import MegatronOptions
from sim.frameworks.megatron.search import (
    MEGATRON_BEST_PRACTICE,
    megatron_chunks_split,
    megatron_expert_layouts,
    megatron_memory_lever,
    megatron_options,
    megatron_recomputation,
    megatron_stage_split,
)
from sim.frameworks.megatron.search_moe import graph_twin

ENTRY = FrameworkEntry(
    "megatron", MegatronOptions, build_megatron,
    search=SearchSpace(megatron_options, recipe=MEGATRON_BEST_PRACTICE,
                       chunks_split=megatron_chunks_split, sequence_parallel=True,
                       layer_profile=True,
                       split_options=("account_for_embedding_in_pipeline_split",
                                      "account_for_loss_in_pipeline_split",
                                      "decoder_first_pipeline_num_layers",
                                      "decoder_last_pipeline_num_layers",
                                      "pipeline_model_parallel_layout"),
                       layer_options=("tp_comm_overlap", "moe_a2a_overlap",
                                      "moe_shared_expert_overlap",
                                      "moe_token_dispatcher_type",
                                      "moe_flex_dispatcher_backend"),
                       memory_lever=megatron_memory_lever, host_twin=graph_twin,
                       weight_casts_per_step=True, recomputation=megatron_recomputation,
                       expert_layouts=megatron_expert_layouts),
    stage_split=megatron_stage_split,
    async_checkpoint_stages_write_share=True,   # dist-ckpt's async writer (entry.py)
    # Megatron-Core's MoE layers with the alltoall dispatcher (megatron/moe.py), its per-head
    # query/key norms (qk_layernorm, sim/workload/megatron_ops.py) and Multi-head Latent
    # Attention (sim/workload/megatron_mla.py), multi-token prediction modules
    # (sim/frameworks/megatron/mtp.py), and GPT-OSS's learned attention sinks and alternating
    # sliding-window layers (softmax_type="learnable", window_size, window_attn_skip_freq;
    # sim/workload/megatron_ops.py, the window rule in sim/hardware/attention_cost.py).
    model_features=frozenset({"experts", "qk_norm", "attention", "mtp_layers",
                              "attention_sinks", "sliding_window", "mlp"}))
