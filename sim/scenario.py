"""The scenario file: pydantic models, loading, ``--set`` overrides and one-line errors.

No simulation logic lives here. A scenario is validated once, frozen, and handed to the
builders. Every model forbids unknown keys, so a misspelt key is an error that names itself.

The public contract for these keys is ``CONTRACT.md``: keys may be added, never renamed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from sim import resources
from sim.attention_cost import DEFAULT_TORCH_VERSION


class ScenarioError(Exception):
    """Bad input: the message is one line naming the file and the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- model
class ModelDims(_Strict):
    """A decoder-only transformer given by its dimensions (instead of a catalogue name)."""

    layers: int = Field(gt=0)
    """Number of transformer blocks."""
    hidden: int = Field(gt=0)
    """Model (residual stream) width."""
    heads: int = Field(gt=0)
    """Attention (query) heads."""
    kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads (grouped-query attention); defaults to ``heads``."""
    ffn_hidden: int = Field(gt=0)
    """Inner width of the MLP (per gate/up projection for SwiGLU)."""
    vocab: int = Field(gt=0)
    """Vocabulary size (embedding rows)."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """SwiGLU (Llama: gate, up, down) or GELU (GPT: up, down)."""
    tied_embeddings: bool = False
    """The LM head reuses the input embedding matrix."""
    head_dim: int | None = Field(default=None, gt=0)
    """Per-head width; defaults to ``hidden // heads``."""
    norm: Literal["rmsnorm", "layernorm"] | None = None
    """Normalisation; defaults to RMSNorm for SwiGLU models, LayerNorm for GELU models."""
    position: Literal["rope", "learned"] | None = None
    """Rotary (Llama) or learned absolute positions (GPT); default follows ``mlp``."""
    bias: bool | None = None
    """Linear and norm biases (GPT style); default follows ``mlp``."""
    max_positions: int | None = Field(default=None, gt=0)
    """Rows of the learned position table; defaults to the sequence length."""
    name: str | None = None
    """A label for reports."""


# --------------------------------------------------------------------------- cluster
GpuName = Literal["v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "h800",
                  "gb200", "h100-hbm2e-96gb"]


class Cluster(_Strict):
    """The machines and the fabric between them. Fields left out come from the topology file
    (when one is named) or from the GPU catalogue."""

    topology: str | None = None
    """A file in ``topologies/`` (by name) or a path; inline fields override it."""
    gpu: GpuName = "h100-sxm"
    """GPU model, a name from the GPU catalogue."""
    nodes: int = Field(default=1, gt=0)
    """Number of servers."""
    gpus_per_node: int = Field(default=8, gt=0)
    """GPUs in each server, joined by NVLink through NVSwitch."""
    nvlink_gbytes_per_s: float | None = Field(default=None, gt=0)
    """NVLink bandwidth per GPU per direction; defaults to the GPU's datasheet figure."""
    pcie_gbytes_per_s: float | None = Field(default=None, gt=0)
    """PCIe x16 bandwidth per direction; defaults to the GPU's PCIe generation."""
    nics_per_node: int = Field(default=8, ge=0)
    """Network adapters per server, rail-aligned to GPUs."""
    nic_gbps: float = Field(default=400.0, gt=0)
    """Line rate of each NIC, gigabits per second."""
    nodes_per_leaf: int = Field(default=16, gt=0)
    """Servers whose NICs share one leaf switch (per rail when rail-optimised)."""
    oversubscription: float = Field(default=1.0, ge=1.0)
    """Leaf downlink over uplink capacity (1 = full bisection)."""
    rail_optimized: bool = True
    """NIC k of every server in a leaf group connects to that group's rail-k leaf."""
    azs: int = Field(default=1, gt=0)
    """Availability zones the servers are spread over, round robin by node."""
    az_link_gbps: float = Field(default=100.0, gt=0)
    """Capacity between two zones, gigabits per second per direction."""
    az_latency_ms: float = Field(default=1.0, ge=0)
    """One-way latency between two zones."""
    nic_latency_us: float | None = Field(default=None, ge=0)
    """NIC plus cable latency per traversal; defaults to the transport's figure."""
    switch_latency_us: float | None = Field(default=None, ge=0)
    """Per network switch hop; defaults to the transport's figure."""
    nic_transport: Literal["infiniband", "roce", "efa", "tcp"] = "infiniband"
    """What the NICs speak: InfiniBand verbs, RoCE v2, AWS EFA (SRD), or plain TCP sockets."""
    pcie_switches_per_node: int | None = Field(default=None, gt=0)
    """PCIe switches per server (GPUs and NICs spread evenly over them); default one per NIC."""
    regions: int = Field(default=1, gt=0)
    """Cloud regions the zones are spread over, round robin by zone."""
    region_link_gbps: float = Field(default=100.0, gt=0)
    """Capacity between two regions, gigabits per second per direction."""
    region_latency_ms: float = Field(default=30.0, ge=0)
    """One-way latency between two regions."""
    cpu_cores: int | None = Field(default=None, gt=0)
    """CPU cores per server (both sockets); default from the host catalogue."""
    host_memory_gib: float | None = Field(default=None, gt=0)
    """CPU memory per server; default from the host catalogue."""
    host_memory_gbytes_per_s: float | None = Field(default=None, gt=0)
    """Achievable CPU memory bandwidth per server (STREAM-like); default from the host
    catalogue."""
    nvme_read_gbytes_per_s: float | None = Field(default=None, gt=0)
    """Local NVMe read bandwidth per server (all drives striped); default from the host
    catalogue."""
    nvme_write_gbytes_per_s: float | None = Field(default=None, gt=0)
    """Local NVMe write bandwidth per server; default from the host catalogue."""
    cpu_vendor: Literal["intel", "amd", "arm", "power", "zhaoxin", "mixed"] = "intel"
    """Host CPU vendor (architecture for Arm and POWER): NCCL indexes its LL bandwidth
    limit across nodes and its network overhead by it (tuning.cc). Intel where unknown."""
    routing: Literal["ecmp", "adaptive"] | None = None
    """How flows spread over the spine switches: ``ecmp`` (static per-flow hash) or
    ``adaptive`` (per-packet spreading, as InfiniBand adaptive routing and EFA's SRD do);
    default by ``nic_transport`` (:data:`sim.topology.routing.ROUTING_BY_TRANSPORT`)."""
    sharp: bool = False
    """The network switches do in-network reductions (InfiniBand SHARP) and NCCL's CollNet
    plugin is set up: CollNet Direct/Chain become available (with ``nccl.collnet_enable``)."""
    gpu_power_w: float | None = Field(default=None, gt=0)
    """The GPUs' power cap in watts (default: the part's TDP). A cap lowers the sustained SM
    clock and so the matrix (GEMM, attention) rates; memory-bound kernels barely change
    (:mod:`sim.power`)."""

    @model_validator(mode="after")
    def _check_power(self) -> Cluster:
        if self.gpu_power_w is not None:
            from sim import catalog
            from sim.power import PowerCapError, check_cap
            try:
                check_cap(catalog.gpu(self.gpu), self.gpu_power_w)
            except PowerCapError as e:
                raise ValueError(f"cluster.gpu_power_w: {e}") from None
        return self


# --------------------------------------------------------------------------- framework
class DdpOptions(_Strict):
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


class Fsdp2Options(_Strict):
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


class ZeroPlusPlus(_Strict):
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


class DeepSpeedPipeline(_Strict):
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


class DeepSpeedOptions(_Strict):
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


class FairscaleOptions(_Strict):
    """FairScale's FullyShardedDataParallel (archived 2023), wrapped per transformer block."""

    name: Literal["fairscale"]
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gather again in backward)."""
    mixed_precision: bool = True
    """Gather and compute in 16-bit, keep fp32 shards."""
    fp32_reduce_scatter: bool = False
    """Reduce-scatter gradients in fp32 (default: in the compute dtype)."""


class MegatronOptions(_Strict):
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
a framework adds its options model to ``Scenario.framework`` (:func:`set_framework_options`)."""
BUILTIN_FRAMEWORK_OPTIONS: tuple[type[BaseModel], ...] = (
    DdpOptions, Fsdp2Options, MegatronOptions, DeepSpeedOptions, FairscaleOptions)


class Allocator(_Strict):
    """PyTorch's CUDA caching allocator settings (``PYTORCH_CUDA_ALLOC_CONF``)."""

    expandable_segments: bool | None = None
    """``expandable_segments:True``: segments grow by mapping pages instead of new
    ``cudaMalloc`` calls (less fragmentation). None: what the framework's launcher does:
    torchtitan's ``run_train.sh`` sets it (``fsdp2``); Megatron-LM, DeepSpeed, FairScale and
    plain PyTorch leave PyTorch's default, off."""


class Nccl(_Strict):
    """NCCL algorithm, protocol and the settings people tune; ``auto`` lets NCCL's cost model
    choose, as NCCL does."""

    algo: Literal["auto", "ring", "tree", "nvls", "nvls_tree", "pat", "collnet_direct",
                  "collnet_chain"] = "auto"
    """Collective algorithm (NCCL_ALGO): ring, double binary tree, NVLink SHARP, NVLS+tree,
    PAT (all-gather/reduce-scatter, one GPU per node), CollNet Direct/Chain (SHARP)."""
    proto: Literal["auto", "ll", "ll128", "simple"] = "auto"
    """Protocol (NCCL_PROTO): LL (low latency), LL128, or Simple (bandwidth)."""
    buffsize: int = Field(default=4 * 2**20, gt=0)
    """NCCL_BUFFSIZE in bytes: the per-channel pipeline buffer (8 steps of buffsize/8)."""
    gdr: bool = True
    """GPUDirect RDMA (NCCL_NET_GDR_LEVEL): off, network traffic bounces through host memory."""
    cross_nic: Literal[0, 1, 2] = 2
    """NCCL_CROSS_NIC: 0 keeps each ring on one rail, 1 lets it change rails, 2 (default)
    prefers rails."""
    collnet_enable: bool = False
    """NCCL_COLLNET_ENABLE (default 0 in NCCL): lets NCCL's tuning choose CollNet Direct or
    Chain on a fabric whose switches have SHARP (``cluster.sharp``)."""


class Parallelism(_Strict):
    """How the GPUs split the work; tp*pp*dp*cp must equal the GPU count."""

    tp: int = Field(default=1, gt=0)
    """Tensor-parallel degree (inside a node)."""
    pp: int = Field(default=1, gt=0)
    """Pipeline stages."""
    dp: int | None = Field(default=None, gt=0)
    """Data-parallel degree; omitted = the GPUs that remain."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel degree."""
    vp: int = Field(default=1, gt=0)
    """Virtual pipeline chunks per stage (interleaved 1F1B)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with tensor parallelism."""


class Training(_Strict):
    """The step being simulated."""

    seq_len: int = Field(default=4096, gt=0)
    """Tokens per sequence."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Sequences per GPU per forward/backward."""
    global_batch_size: int | None = Field(default=None, gt=0)
    """Sequences per optimizer step across all replicas; default = one micro-batch each."""
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    """Matrix-math precision; bf16/fp16 keep fp32 master weights and optimizer states."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (attention core), full (whole block)."""
    tokens_total: float | None = Field(default=None, gt=0)
    """Tokens of the whole run, for run time and cost."""
    optimizer: Literal["adamw_fused", "adamw_foreach"] = "adamw_fused"
    """AdamW implementation (torch.optim.AdamW fused=True, or the default foreach kernels)."""
    attention_backend: Literal["auto", "flash2", "flash3", "cudnn", "sdpa"] = "auto"
    """Fused attention kernel; auto: the framework's own choice (sim/attention_cost.py)."""
    torch_version: str = Field(default=DEFAULT_TORCH_VERSION, pattern=r"^\d+\.\d+(\.\d+)?$")
    """PyTorch release ("2.8", quoted) whose SDPA kernel order sdpa and auto follow."""

    @field_validator("torch_version", mode="before")
    @classmethod
    def _quoted_version(cls, v: Any) -> Any:
        if isinstance(v, (int, float)):
            raise ValueError(f"training.torch_version: write {v} as a quoted string; "
                             "unquoted, YAML reads 2.10 as the number 2.1")
        return v


class Pricing(_Strict):
    """Prices; omitted fields come from the named instance or cloud, else the GPU catalogue's
    reference price and the defaults below."""

    gpu_hour_usd: float | None = Field(default=None, ge=0)
    """On-demand price per GPU-hour."""
    egress_usd_per_gb: float = Field(default=0.01, ge=0)
    """Price per GB crossing an availability-zone boundary (each direction billed)."""
    region_egress_usd_per_gb: float = Field(default=0.02, ge=0)
    """Price per GB crossing a region boundary."""
    instance: str | None = None
    """A catalogue instance (aws-p5.48xlarge): its GPU-hour and cloud's transfer prices apply."""
    cloud: Literal["aws", "gcp", "azure"] | None = None
    """Whose transfer prices apply when no instance is named (an instance implies its cloud)."""


class Claims(_Strict):
    """Figures someone published for this setup, checked against the simulation."""

    source: str
    """Where the figures come from."""
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)
    tokens_per_s: float | None = Field(default=None, gt=0)
    step_time_s: float | None = Field(default=None, gt=0)
    peak_memory_gib: float | None = Field(default=None, gt=0)
    peak_memory_gb: float | None = Field(default=None, gt=0)
    peak_memory_kind: Literal["reserved", "allocated", "nvidia_smi"] = "reserved"
    """Which peak the memory claims quote: the caching allocator's reserved peak
    (``torch.cuda.max_memory_reserved``, what torchtitan and most publications report), the
    allocated peak (``max_memory_allocated``), or the whole process in ``nvidia-smi``."""
    mfu: float | None = Field(default=None, gt=0)
    model_state_memory_gb: float | None = Field(default=None, gt=0)
    """Parameters, gradients and optimizer states per GPU, GB (1e9 bytes)."""
    exposed_comm_fraction: float | None = Field(default=None, gt=0)
    """Share of the step spent in communication that computation does not hide."""
    bubble_fraction: float | None = Field(default=None, gt=0)
    """Share of the step a pipeline stage sits idle."""
    run_hours: float | None = Field(default=None, gt=0)
    """Hours to train ``training.tokens_total`` tokens."""
    run_usd: float | None = Field(default=None, gt=0)
    """US dollars to train ``training.tokens_total`` tokens."""
    cross_az_bytes_per_day: float | None = Field(default=None, gt=0)
    """Bytes crossing availability-zone boundaries per day of training."""
    egress_usd_per_day: float | None = Field(default=None, gt=0)
    """US dollars of cross-zone transfer per day of training."""
    nvlink_gbytes_per_s: float | None = Field(default=None, gt=0)
    """NVLink traffic per GPU per direction, GB/s, averaged over the step."""


class Scenario(_Strict):
    """One training job on one cluster."""

    name: str = "scenario"
    """A label for reports."""
    model: str | ModelDims
    """A catalogue name (``llama3-70b``) or a mapping of dimensions."""
    cluster: Cluster = Cluster()
    framework: FrameworkOptions = Field(default_factory=lambda: DdpOptions(name="ddp"))
    nccl: Nccl = Nccl()
    allocator: Allocator = Allocator()
    """PyTorch's caching allocator (``sim.allocator``)."""
    parallelism: Parallelism = Parallelism()
    training: Training = Training()
    pricing: Pricing = Pricing()
    claims: Claims | None = None
    seed: int = 0
    """Seed for every random choice (ECMP hashing); same seed, same numbers."""

    @property
    def gpus(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @model_validator(mode="after")
    def _check_layout(self) -> Scenario:
        if self.cluster.nodes > 1 and self.cluster.nics_per_node < 1:
            raise ValueError("cluster.nics_per_node: servers need a NIC to reach each other "
                             f"({self.cluster.nodes} nodes, 0 NICs)")
        p = self.parallelism
        n = self.gpus
        fixed = p.tp * p.pp * p.cp
        if p.dp is None:
            if n % fixed:
                raise ValueError(
                    f"parallelism: tp*pp*cp = {fixed} does not divide the {n} GPUs"
                )
        elif fixed * p.dp != n:
            raise ValueError(
                f"parallelism: tp*pp*dp*cp = {fixed * p.dp} but the cluster has {n} GPUs"
            )
        return self

    @property
    def dp(self) -> int:
        p = self.parallelism
        return p.dp if p.dp is not None else self.gpus // (p.tp * p.pp * p.cp)


# --------------------------------------------------------------------------- frameworks
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


_framework_options: tuple[type[BaseModel], ...] = BUILTIN_FRAMEWORK_OPTIONS
_BUILTIN_FRAMEWORK_FIELD = Scenario.model_fields["framework"]


def framework_names() -> tuple[str, ...]:
    """``framework.name`` values the schema accepts, in the registry's order."""
    return tuple(options_name(m) for m in _framework_options)


def set_framework_options(models: tuple[type[BaseModel], ...]) -> None:
    """Make ``Scenario.framework`` the discriminated union of ``models`` (by ``name``).

    Called by :mod:`sim.frameworks.registry` whenever its entries change, so the schema,
    ``fabricsim schema`` and the "unknown framework" message list exactly the registered
    frameworks; config itself imports no framework. A no-op when nothing changed."""
    global _framework_options
    models = tuple(models)
    if models == _framework_options:
        return
    names = [options_name(m) for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"two options models for one framework name: {names}")
    if models == BUILTIN_FRAMEWORK_OPTIONS:
        field = _BUILTIN_FRAMEWORK_FIELD          # exactly the field the class was built with
    else:
        union: Any = Union[models] if len(models) > 1 else models[0]  # noqa: UP007 (runtime)
        field = FieldInfo.merge_field_infos(
            _BUILTIN_FRAMEWORK_FIELD,
            annotation=Annotated[union, Field(discriminator="name")] if len(models) > 1
            else union)
    Scenario.__pydantic_fields__["framework"] = field
    Scenario.model_rebuild(force=True)
    _framework_options = models


# Kept for older imports: the built-in frameworks (the registry may hold more).
FRAMEWORK_NAMES = framework_names()


# --------------------------------------------------------------------------- loading
_UNION_TAGS = {"model": ("str", "ModelDims")}


def _union_tags(field: Any) -> tuple[str, ...]:
    return framework_names() if field == "framework" else _UNION_TAGS.get(field, ())


def _format_loc(loc: tuple[Any, ...]) -> str:
    # Drop the branch tags pydantic inserts after a union field ("model" -> "ModelDims",
    # "framework" -> "fsdp2"), and only there: a user's key may be called anything.
    parts: list[str] = []
    prev: Any = None
    for item in loc:
        if isinstance(prev, str) and item in _union_tags(prev):
            prev = None
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
        prev = item
    return "".join(parts) or "(top level)"


def _first_error(err: ValidationError, data: dict[str, Any]) -> str:
    errors = err.errors()
    # An inline model mapping fails both union branches; the string branch's complaint
    # ("should be a valid string") says nothing useful, so report the mapping's own error.
    if isinstance(data.get("model"), dict):
        dims = [e for e in errors if tuple(e["loc"][:2]) == ("model", "ModelDims")]
        others = [e for e in errors if e["loc"][:1] != ("model",)]
        errors = others + dims if others else dims or errors
    e = errors[0]
    loc = _format_loc(tuple(e["loc"]))
    if e["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    if e["type"] == "union_tag_invalid":
        return (f"{loc}.name: unknown framework {e['input'].get('name')!r} "
                f"(available: {', '.join(framework_names())})")
    if e["type"] == "union_tag_not_found":
        return f"{loc}.name: missing"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "value_error":
        return msg
    return f"{loc}: {msg} (got {e.get('input')!r})"


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c = value`` in nested dicts, creating mappings on the way.

    Examples
    --------
    >>> d = {"cluster": {"nodes": 1}}
    >>> set_dotted(d, "cluster.nic_gbps", 100); d
    {'cluster': {'nodes': 1, 'nic_gbps': 100}}
    """
    parts = key.split(".")
    if not all(parts):
        raise ScenarioError(f"--set {key}: empty key path")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict):
            if part not in node or node[part] is None:
                node[part] = {}
            elif isinstance(node[part], str) and part in ("model", "framework"):
                # `model: llama3-8b` or `framework: fsdp2` shorthand turned into a mapping.
                node[part] = {"name": node[part]}
            node = node[part]
        if not isinstance(node, dict):
            path = ".".join(parts[: i + 1])
            raise ScenarioError(f"--set {key}: {path} is not a mapping")
    node[parts[-1]] = value


def parse_set(assignment: str) -> tuple[str, Any]:
    """Split ``key.path=value``; the value is a YAML scalar (``100``, ``true``, ``ring``)."""
    if "=" not in assignment:
        raise ScenarioError(f"--set {assignment}: expected KEY=VALUE")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{path}:{where} not valid YAML") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: top level must be a mapping")
    return data


TOPOLOGY_META_KEYS = ("name", "description", "sources")


def _merge_topology(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """Fill cluster fields from the named topology file; inline fields win."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict) or not cluster.get("topology"):
        return data
    ref = cluster["topology"]
    if not isinstance(ref, str):
        raise ScenarioError(f"{origin}: cluster.topology: expected a name or a path")
    path = resources.resolve("topologies", ref)
    if path is None:
        names = ", ".join(resources.available("topologies")) or "none"
        raise ScenarioError(
            f"{origin}: cluster.topology: no topology {ref!r} (shipped: {names})"
        )
    topo = read_yaml(path)
    fields = {k: v for k, v in topo.items() if k not in TOPOLOGY_META_KEYS}
    unknown = sorted(set(fields) - set(Cluster.model_fields))
    if unknown:
        raise ScenarioError(f"{path}: {unknown[0]}: unknown key")
    merged = dict(fields)
    merged.update(cluster)
    out = dict(data)
    out["cluster"] = merged
    return out


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    # `framework: fsdp2` is accepted as shorthand for `framework: {name: fsdp2}`.
    if isinstance(data.get("framework"), str):
        data = dict(data)
        data["framework"] = {"name": data["framework"]}
    return data


def scenario_from_dict(data: dict[str, Any], origin: str = "<scenario>") -> Scenario:
    """Validate a scenario mapping; raise ScenarioError with one line on bad input."""
    data = _merge_topology(_normalise(data), origin)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(f"{origin}: {_first_error(err, data)}") from None
    from sim import catalog  # late import: catalogue loading is not needed for validation

    if isinstance(scenario.model, str) and scenario.model not in catalog.model_names():
        names = ", ".join(catalog.model_names())
        raise ScenarioError(f"{origin}: model: unknown model {scenario.model!r} (known: {names})")
    return scenario


def load_scenario(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Load a scenario by path or shipped name and apply ``key.path=value`` overrides.

    Examples
    --------
    >>> s = load_scenario("llama3.2-1b-1xh200", ["training.seq_len=2048"])
    >>> s.training.seq_len
    2048
    """
    path = resources.resolve("scenarios", ref)
    if path is None:
        names = ", ".join(resources.available("scenarios")) or "none"
        raise ScenarioError(f"{ref}: no such file or shipped scenario (shipped: {names})")
    data = read_yaml(path)
    for assignment in overrides:
        key, value = parse_set(assignment)
        set_dotted(data, key, value)
    return scenario_from_dict(data, origin=str(path))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file."""
    return Scenario.model_json_schema()
