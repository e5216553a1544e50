"""The ``framework:`` options of ``deepspeed`` (ZeRO 0-3, ZeRO++, offload, Megatron-DeepSpeed's
pipeline); what DeepSpeed makes of them is :mod:`sim.frameworks.deepspeed.resolve`. Imports
only the config layer's base: the scenario schema (:mod:`sim.config.scenario`) reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config import bounds as B
from sim.config.base import StrictModel


class ZeroPlusPlus(StrictModel):
    """ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant
    Model Training", 2023); each part may be used alone."""

    qwz: bool = False
    """zero_quantized_weights: all-gather int8 block-quantized weights (quantize and
    dequantize kernels around each gather)."""
    hpz: bool = False
    """zero_hpz_partition_size > 1: keep a secondary copy of the weights sharded over the
    GPUs of a node, so backward all-gathers stay on NVLink, at a memory cost."""
    hpz_partition_size: int | None = Field(default=None, gt=1, le=B.MAX_GPUS)
    """Size of the secondary partition; default the GPUs per node."""
    qgz: bool = False
    """zero_quantized_gradients: int4 hierarchical all-to-all gradient reduce-scatter (inside
    the node, then across nodes) instead of the ring reduce-scatter."""


class DeepSpeedPipeline(StrictModel):
    """Megatron-DeepSpeed 3D (``parallelism.tp`` or ``pp`` > 1): DeepSpeed's PipelineEngine
    over Megatron's tensor-parallel layers (``GPTModelPipe``), as BLOOM-176B trained."""

    pipe_partitioned: bool = True
    """ds_config pipeline.pipe_partitioned: with tp > 1 each tensor-parallel rank sends 1/tp
    of the activation; the next stage all-gathers it."""
    grad_partitioned: bool = True
    """ds_config pipeline.grad_partitioned: the same for the gradients sent back."""
    partition_method: Literal["type:transformer", "type:transformer|embedding"] = \
        "type:transformer"
    """PipelineModule partition_method (Megatron-DeepSpeed --pp-partition-method): balance
    transformer layers, or count the two (tied) embedding layers as layers too."""
    flash_attention: bool = False
    """Megatron-DeepSpeed --use-flash-attn; false: baddbmm, fused softmax, bmm."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Hidden and attention dropout (Megatron-DeepSpeed's default is 0.1)."""
    cuda_launch_blocking: bool = False
    """CUDA_LAUNCH_BLOCKING=1 (BLOOM's launch script): every kernel launch waits for the
    kernel to finish, so the host cannot run ahead of the GPU."""
    partition_activations: bool = False
    """ds_config activation_checkpointing.partition_activations (Megatron-DeepSpeed
    --partition-activations): with full checkpointing each tensor-parallel rank keeps 1/tp of
    every layer's input and all-gathers it before the recompute."""


class DeepSpeedMoE(StrictModel):
    """DeepSpeed-MoE layers (``deepspeed.moe.layer.MoE``) on a model with experts: the
    arguments its constructor takes (num_experts and k come from the model, ep_size from
    ``parallelism.ep``)."""

    capacity_factor: float = Field(default=1.0, gt=0.0, le=B.MAX_CAPACITY_FACTOR)
    """MoE(capacity_factor): each expert takes ceil(tokens / experts x capacity_factor x k)
    routed tokens per micro-batch (sharded_moe.py _capacity), the rest are dropped."""
    min_capacity: int = Field(default=4, ge=0, le=B.MAX_ELEMENTS)
    """MoE(min_capacity): the capacity never falls below this many tokens."""
    drop_tokens: bool = True
    """MoE(drop_tokens); false: the capacity is the busiest expert's load over the EP group
    (an all-reduce MAX and a host sync per layer), nothing is dropped."""
    use_residual: bool = False
    """MoE(use_residual): Residual MoE (PR-MoE, arXiv:2201.05596): a dense MLP beside the
    experts on every token, mixed by a learned 2-way coefficient."""
    use_tutel: bool = False
    """MoE(use_tutel) with Tutel installed, top-1 only: gather/scatter dispatch (Tutel's
    fast_dispatcher) instead of the one-hot einsums."""
    use_data_before_expert_parallel: bool = False
    """ds_config use_data_before_expert_parallel_: expert-parallel peers strided instead of
    adjacent (groups._create_expert_and_data_parallel)."""


class DeepSpeedOptions(StrictModel):
    """Microsoft DeepSpeed ZeRO stages 0-3, ZeRO++ and ZeRO-Offload/Infinity (values in
    elements unless the name says otherwise, as in ds_config); with tensor or pipeline
    parallelism, Megatron-DeepSpeed's 3D layout (``pipeline``, stages 0-1)."""

    name: Literal["deepspeed"]
    zero_stage: Literal[0, 1, 2, 3] = 3
    """0: plain data parallelism; 1: optimizer states sharded; 2: + gradients; 3: +
    parameters."""
    overlap_comm: bool | None = None
    """Reduce gradients on a side stream while backward continues; default: true for stage
    3, false otherwise (DeepSpeedZeroConfig)."""
    contiguous_gradients: bool = True
    """Copy reduced gradient shards into one contiguous buffer as they are produced."""
    reduce_bucket_size: int = Field(default=500_000_000, gt=0, le=B.MAX_ELEMENTS)
    """Elements reduced at once (ds_config zero_optimization.reduce_bucket_size)."""
    allgather_bucket_size: int = Field(default=500_000_000, gt=0, le=B.MAX_ELEMENTS)
    """Accepted as in ds_config, without effect: since all_gather_into_tensor exists,
    runtime/utils.py all_gather_dp_groups gathers each parameter group in one call."""
    stage3_prefetch_bucket_size: int = Field(default=50_000_000, ge=0, le=B.MAX_ELEMENTS)
    """Stage 3: elements of upcoming parameters fetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(default=100_000, ge=0,
                                                    le=B.MAX_ELEMENTS)
    """Stage 3: parameters with fewer elements stay gathered on every rank (not partitioned)."""
    stage3_max_live_parameters: int = Field(default=1_000_000_000, gt=0, le=B.MAX_ELEMENTS)
    """Stage 3: most gathered elements held at once before releasing."""
    stage3_max_reuse_distance: int = Field(default=1_000_000_000, ge=0, le=B.MAX_ELEMENTS)
    """Stage 3: a parameter used again within this many elements of upcoming modules is
    kept gathered instead of released."""
    sub_group_size: int = Field(default=1_000_000_000, gt=0, le=B.MAX_ELEMENTS)
    """Stage 3: the optimizer steps the partition in sub-groups of this many elements."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Offload: fp32 master weights and Adam states in CPU memory (or NVMe), the
    optimizer step on the CPU (DeepSpeedCPUAdam); stages 1-3."""
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Infinity, stage 3: 16-bit parameter shards in CPU memory (or NVMe), copied to
    the GPU before each all-gather."""
    zeropp: ZeroPlusPlus = ZeroPlusPlus()
    """ZeRO++ communication optimisations (stage 3)."""
    pipeline: DeepSpeedPipeline = DeepSpeedPipeline()
    """Megatron-DeepSpeed 3D options (used with parallelism.tp or pp > 1)."""
    moe: DeepSpeedMoE = DeepSpeedMoE()
    """DeepSpeed-MoE layer options (models with experts; ZeRO stage 1 or 2)."""
