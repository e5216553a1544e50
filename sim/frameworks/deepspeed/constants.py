"""DeepSpeed's sizes and limits (dtype widths, bucket and alignment sizes, ZeRO-3 throttles,
ZeRO++ quantisation, offload limits) and the padding rule of its flat buffers, each read from
the DeepSpeed source file it names (commit 38327e07)."""

from __future__ import annotations

W16 = 2
"""Bytes of the model dtype (bf16/fp16) and of the communication dtype."""
FP64 = 8
INT8 = 1

ENGINE_ALLREDUCE_ELEMENTS = 500_000_000
"""engine.py MEMORY_OPT_ALLREDUCE_SIZE: bucket of buffered_allreduce_fallback (stage 0)."""
NCCL_START_ALIGNMENT_FACTOR = 2
"""stage_1_and_2.py / bf16_optimizer.py: flat buffers padded to 2 x world elements."""
MAX_ONGOING_FETCH_EVENTS = 2
"""partitioned_param_coordinator.py __max_ongoing_fetch_events."""
MAX_PARAM_REDUCE_EVENTS = 2
"""stage3.py max_param_reduce_events."""
QWZ_TARGET_GROUP = 8000
"""partition_parameters.py CUDAQuantizer.target_group_size (int8, one fp32 scale a group)."""
OFFLOAD_PARAM_MAX_IN_CPU = 1_000_000_000
"""offload_config.py max_in_cpu: partition elements kept in host memory under NVMe offload."""
INT4_BYTES = 0.5
FP32_SCALE = 4


def _pad(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (DeepSpeed's flat-buffer padding)."""
    return -(-numel // multiple) * multiple
