"""The ``framework:`` section of a scenario: the five built-in frameworks' options models.

Part of the config layer (``sim.scenario`` re-exports these names), not of
:mod:`sim.frameworks`: config imports no framework. The framework registry
(:mod:`sim.frameworks.registry`) points its entries at these models and pushes the union of
its entries' models into ``Scenario.framework`` (:func:`sim.scenario.set_framework_options`).
Each model's ``name: Literal[...]`` field is the union's discriminator (:func:`options_name`).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args, get_origin

from pydantic import BaseModel, Field

from sim.config_base import StrictModel


class DdpOptions(StrictModel):
    """PyTorch DistributedDataParallel (one GPU: plain PyTorch training, no communication)."""

    name: Literal["ddp"]
    bucket_mb: float | None = Field(default=None, gt=0)
    """Gradient bucket cap in MiB; None = torch's default (25 MiB, first bucket 1 MiB)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the bucket buffers (saves one gradient-sized buffer and two copies)."""
    compile: bool = False
    """torch.compile: memory-bound elementwise chains fused into single kernels."""
    checkpoint_use_reentrant: bool = False
    """With full activation checkpointing, Hugging Face's gradient_checkpointing_kwargs
    use_reentrant: True re-runs each decoder layer's whole forward in backward
    (transformers 4.36 to 4.57's default); False (transformers 5's default, PR #43203) stops
    recomputing once the last saved tensor is back."""


class Fsdp2Options(StrictModel):
    """PyTorch FSDP2 (``fully_shard``) applied per transformer block, torchtitan style."""

    name: Literal["fsdp2"]
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gather again in backward)."""
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    """MixedPrecisionPolicy.param_dtype: dtype of gathered parameters and of compute."""
    reduce_dtype: Literal["bf16", "fp32"] = "fp32"
    """MixedPrecisionPolicy.reduce_dtype: dtype of the gradient reduce-scatter."""
    compile: bool = False
    """torch.compile of each block: memory-bound elementwise chains fused."""
    compile_loss: bool | None = None
    """With compile: whether the loss (final norm, output layer and cross-entropy) is
    compiled too. None = as torchtitan does since ``torchtitan/components/loss.py`` (2025,
    e.g. 820504e): ``loss_fn = torch.compile(loss_fn)`` when compiling. False = torchtitan
    before it (e.g. 9dec370, 2024-12: "compiling loss function causes CUDA errors, turning off
    for now" in train.py): only the transformer blocks are compiled and the loss runs eagerly,
    materialising the fp32 logits and their gradients."""
    model_code: Literal["torchtitan", "huggingface"] = "torchtitan"
    """Whose Llama code FSDP2 wraps: torchtitan's (fused RMSNorm, complex rotary, no KV
    cache) or Hugging Face transformers' LlamaForCausalLM (eager RMSNorm through fp32,
    rotate_half rotary, a KV cache while use_cache is on), one fully_shard per decoder layer."""
    checkpoint_use_reentrant: bool = False
    """With model_code huggingface and full checkpointing: use_reentrant of HF's
    gradient_checkpointing_kwargs (see DdpOptions); torchtitan's checkpoint_wrapper is
    non-reentrant."""
    float8_all_gather: bool = False
    """With training.precision fp8: all-gather the blocks' weights in FP8 (torchtitan
    float8.enable_fsdp_float8_all_gather), half the bytes, no weight casts in the GEMMs."""
    hsdp_shard_size: int | None = Field(default=None, gt=0)
    """HSDP: shard inside groups of this many ranks and all-reduce gradients across the
    dp / hsdp_shard_size replicas (torchtitan's data_parallel_shard_degree); None = plain
    FSDP over every data-parallel rank."""
    cpu_offload: bool = False
    """CPUOffloadPolicy: sharded parameters, gradients and optimizer states live in pinned
    host memory; parameters are copied in before each all-gather, gradients copied out after
    each reduce-scatter, and the optimizer steps on the CPU."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """torch.distributed.pipelining schedule with parallelism.pp > 1 (torchtitan's
    pipeline_parallel_schedule); with parallelism.vp > 1, Interleaved1F1B."""
    pipeline_first_stage_less_layers: int = Field(default=1, ge=0)
    """torchtitan's pipeline_parallel_first_stage_less_layers: the embedding counts as this
    many layers when the layers are split over pipeline stages."""
    pipeline_last_stage_less_layers: int = Field(default=1, ge=0)
    """torchtitan's pipeline_parallel_last_stage_less_layers: the same for norm + output."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """Context parallelism: how keys and values reach every rank (torchtitan's
    context_parallel_rotate_method; torch's _cp_options default is allgather)."""


class ZeroPlusPlus(StrictModel):
    """ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant
    Model Training", 2023); each part may be used alone."""

    qwz: bool = False
    """zero_quantized_weights: all-gather int8 block-quantized weights (quantize and
    dequantize kernels around each gather)."""
    hpz: bool = False
    """zero_hpz_partition_size > 1: keep a secondary copy of the weights sharded over the
    GPUs of a node, so backward all-gathers stay on NVLink, at a memory cost."""
    hpz_partition_size: int | None = Field(default=None, gt=1)
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
    reduce_bucket_size: int = Field(default=500_000_000, gt=0)
    """Elements reduced at once (ds_config zero_optimization.reduce_bucket_size)."""
    allgather_bucket_size: int = Field(default=500_000_000, gt=0)
    """Accepted as in ds_config, without effect: since all_gather_into_tensor exists,
    runtime/utils.py all_gather_dp_groups gathers each parameter group in one call."""
    stage3_prefetch_bucket_size: int = Field(default=50_000_000, ge=0)
    """Stage 3: elements of upcoming parameters fetched ahead of use."""
    stage3_param_persistence_threshold: int = Field(default=100_000, ge=0)
    """Stage 3: parameters with fewer elements stay gathered on every rank (not partitioned)."""
    stage3_max_live_parameters: int = Field(default=1_000_000_000, gt=0)
    """Stage 3: most gathered elements held at once before releasing."""
    stage3_max_reuse_distance: int = Field(default=1_000_000_000, ge=0)
    """Stage 3: a parameter used again within this many elements of upcoming modules is
    kept gathered instead of released."""
    sub_group_size: int = Field(default=1_000_000_000, gt=0)
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


class FairscaleOptions(StrictModel):
    """FairScale's FullyShardedDataParallel (archived 2023), wrapped per transformer block."""

    name: Literal["fairscale"]
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gather again in backward)."""
    mixed_precision: bool = True
    """Gather and compute in 16-bit, keep fp32 shards."""
    fp32_reduce_scatter: bool = False
    """Reduce-scatter gradients in fp32 (default: in the compute dtype)."""


class MegatronOptions(StrictModel):
    """NVIDIA Megatron-LM: tensor, pipeline, context and data parallelism."""

    name: Literal["megatron"]
    implementation: Literal["transformer_engine", "local"] = "transformer_engine"
    """Megatron's --transformer-impl: Transformer Engine's fused modules (Megatron-Core's
    default), or the local apex/PyTorch layers (older Megatron and Megatron-DeepSpeed, whose
    timers also synchronise the device around every micro-batch)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam states over data-parallel ranks (reduce-scatter
    gradients, all-gather parameters)."""
    overlap_grad_reduce: bool = False
    """Reduce gradients bucket by bucket during the last micro-batch's backward."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather parameters bucket by bucket in forward."""
    align_param_gather: bool | None = None
    """Interleaved schedule: every stage dispatches its first two chunks' gathers at step start
    and chunk c's at one point; default Megatron-LM's: on with vp > 1 (no effect without)."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Interleaved, distributed optimizer: chunk 0's gathers start after its own optimizer step."""
    num_distributed_optimizer_instances: int = Field(default=1, gt=0)
    """Distributed optimizer sharded within dp*cp/k ranks, gradient shards all-reduced across k."""
    overlap_p2p_comm: bool | None = None
    """Interleaved schedule: post pipeline sends/receives and wait later; default
    Megatron-LM's: on with vp > 1 (non-interleaved 1F1B cannot)."""
    batch_p2p_comm: bool | None = None
    """Blocking pipeline calls as one batch_isend_irecv plus torch.cuda.synchronize; default
    not overlap_p2p_comm (Megatron-LM)."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with the GEMMs around it (TE userbuffers)."""
    flash_attention: bool = True
    """Fused flash attention; false: baddbmm, fused softmax, dropout, bmm."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Hidden and attention dropout (Megatron-DeepSpeed's default is 0.1)."""
    grad_reduce_in_fp32: bool | None = None
    """fp32 gradient buffers and all-reduce; default: true for bf16, false for fp16."""
    bucket_size: int | None = Field(default=None, gt=0)
    """Gradient bucket in parameters; default max(40M, 1M x dp) with overlap, else one."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule; with parallelism.vp > 1, 1F1B is interleaved."""
    fp8_recipe: Literal["delayed", "tensorwise"] = "delayed"
    """With training.precision fp8: Transformer Engine's scaling (--fp8-recipe): delayed
    (amax history) or tensorwise (current scaling, NeMo's FP8-CS)."""
    account_for_embedding_in_pipeline_split: bool = False
    """The embedding counts as one layer when layers are split over pipeline chunks."""
    account_for_loss_in_pipeline_split: bool = False
    """The loss and output layer count as one layer when layers are split over chunks."""
    scatter_gather_tensors_in_pipeline: bool | None = None
    """Without sequence parallelism, each tensor-parallel rank sends 1/tp of the activation
    to the next stage, which all-gathers it; default: on for ``local`` (older Megatron,
    Megatron-DeepSpeed), off for ``transformer_engine`` (Megatron-Core dropped it)."""


FrameworkOptions = Annotated[DdpOptions | Fsdp2Options | MegatronOptions | DeepSpeedOptions
                             | FairscaleOptions,
                             Field(discriminator="name")]
"""The built-in frameworks' options, for type checkers and for the schema before
:mod:`sim.frameworks.registry` is imported. The registry owns the list: its entries point at
these models (they move into their framework packages with the restructure), and registering
a framework adds its options model to ``Scenario.framework``
(:func:`sim.scenario.set_framework_options`)."""
BUILTIN_FRAMEWORK_OPTIONS: tuple[type[BaseModel], ...] = (
    DdpOptions, Fsdp2Options, MegatronOptions, DeepSpeedOptions, FairscaleOptions)


def options_name(model: type[BaseModel]) -> str:
    """The ``framework.name`` an options model answers to: its ``name: Literal[...]`` field.

    Examples
    --------
    >>> options_name(Fsdp2Options)
    'fsdp2'
    """
    field = model.model_fields.get("name")
    args = get_args(field.annotation) if field is not None else ()
    if field is None or get_origin(field.annotation) is not Literal or len(args) != 1 \
            or not isinstance(args[0], str):
        raise TypeError(f"{model.__name__}: a framework's options need a field "
                        "name: Literal['<framework name>']")
    return str(args[0])
