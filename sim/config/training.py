"""The job's sections of a scenario: the model, its parallel layout, the training step,
PyTorch's allocator, NCCL's settings, prices, and published claims to check.

Part of the config layer (``sim.scenario`` re-exports these names); the ``cluster:`` section
is :mod:`sim.config.cluster`, the ``framework:`` section each framework package's
``options.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from sim.config import bounds as B
from sim.config.base import StrictModel
from sim.config.moe_keys import MLABlock, MoEBlock, MoeRouting, flat_model_update

# PyTorch release assumed when a scenario does not name one (``training.torch_version``):
# 2.8, the last release of the 2024-2025 span (2.5.1-2.8) that published FSDP2/torchtitan and
# Hugging Face runs used, all of which run SDPA's flash backend (FlashAttention-2) on Hopper.
DEFAULT_TORCH_VERSION = "2.8"


class ModelDims(StrictModel):
    """A decoder-only transformer given by its dimensions (instead of a catalogue name)."""

    layers: int = Field(gt=0, le=B.MAX_LAYERS)
    """Number of transformer blocks."""
    hidden: int = Field(gt=0, le=B.MAX_WIDTH)
    """Model (residual stream) width."""
    heads: int = Field(gt=0, le=B.MAX_HEADS)
    """Attention (query) heads."""
    kv_heads: int | None = Field(default=None, gt=0, le=B.MAX_HEADS)
    """Key/value heads (grouped-query attention); defaults to ``heads``."""
    ffn_hidden: int = Field(gt=0, le=B.MAX_WIDTH)
    """Inner width of the MLP (per gate/up projection for SwiGLU)."""
    vocab: int = Field(gt=0, le=B.MAX_VOCAB)
    """Vocabulary size (embedding rows)."""
    mlp: Literal["swiglu", "gelu", "relu2"] = "swiglu"
    """SwiGLU (Llama: gate, up, down), GELU (GPT: up, down) or squared ReLU (Nemotron-4: up,
    ``relu(x)^2``, down; Megatron only)."""
    tied_embeddings: bool = False
    """The LM head reuses the input embedding matrix."""
    head_dim: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """Per-head width; defaults to ``hidden // heads``."""
    norm: Literal["rmsnorm", "layernorm"] | None = None
    """Normalisation; defaults to RMSNorm for SwiGLU models, LayerNorm for GELU models."""
    position: Literal["rope", "learned"] | None = None
    """Rotary (Llama) or learned absolute positions (GPT); default follows ``mlp``."""
    bias: bool | None = None
    """Linear and norm biases (GPT style); default follows ``mlp``."""
    max_positions: int | None = Field(default=None, gt=0, le=B.MAX_SEQ_LEN)
    """Rows of the learned position table; defaults to the sequence length."""
    name: str | None = None
    """A label for reports."""
    # -- mixture of experts (Hugging Face config.json names in brackets)
    experts: int | None = Field(default=None, gt=0, le=B.MAX_EXPERTS)
    """Routed experts per MoE layer [n_routed_experts, num_experts]; None = a dense model."""
    experts_per_token: int | None = Field(default=None, gt=0, le=B.MAX_EXPERTS)
    """Routed experts each token is sent to, top-k [num_experts_per_tok]."""
    shared_experts: int = Field(default=0, ge=0, le=B.MAX_EXPERTS)
    """Experts every token passes through besides its top-k, each moe_ffn_hidden wide
    [n_shared_experts]."""
    moe_ffn_hidden: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """Inner width of one expert's MLP [moe_intermediate_size]; defaults to ffn_hidden."""
    first_k_dense: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Leading layers with a dense MLP ffn_hidden wide instead of experts
    [first_k_dense_replace]."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Gate scores: softmax (Mixtral, Qwen3, GPT-OSS) or sigmoid with a learned per-expert
    balancing bias (DeepSeek-V3's auxiliary-loss-free routing)."""
    capacity_factor: float | None = Field(default=None, gt=0,
                                            le=B.MAX_CAPACITY_FACTOR)
    """Tokens an expert accepts, as a multiple of its balanced share; None = dropless."""
    # -- attention variants
    attention: Literal["mha", "gqa", "mla"] = "gqa"
    """Grouped-query attention (heads, kv_heads, head_dim; mha: kv_heads = heads) or
    DeepSeek-V2/V3 Multi-head Latent Attention (the low-rank fields below, or ``mla``)."""
    q_lora_rank: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """MLA: rank of the query compression [q_lora_rank]; None = queries projected directly."""
    kv_lora_rank: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """MLA: rank of the joint key/value compression [kv_lora_rank]."""
    qk_nope_head_dim: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """MLA: per-head query/key width without rotary positions [qk_nope_head_dim]."""
    qk_rope_head_dim: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """MLA: per-head query/key width carrying rotary positions [qk_rope_head_dim]."""
    v_head_dim: int | None = Field(default=None, gt=0, le=B.MAX_WIDTH)
    """MLA: per-head value width [v_head_dim]."""
    qk_norm: bool = False
    """RMSNorm on each head's query and key (Qwen3)."""
    attention_sinks: bool = False
    """A learned sink logit per head in the softmax (GPT-OSS)."""
    sliding_window: int | None = Field(default=None, gt=0, le=B.MAX_SEQ_LEN)
    """Keys a sliding-window layer attends to [sliding_window]; None = full context."""
    full_attention_every: int | None = Field(default=None, gt=0, le=B.MAX_LAYERS)
    """With sliding_window: every n-th layer (the n-th, 2n-th, ...) attends to the full
    context (GPT-OSS: 2, alternating); None = every layer slides."""
    mtp_layers: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Multi-token prediction modules trained beside the model [num_nextn_predict_layers]."""
    yarn_factor: float | None = Field(default=None, gt=1, le=B.MAX_ROPE_SCALING)
    """YaRN rotary scaling [rope_scaling.factor] with Megatron-Core's default concentration
    factor ``0.1 ln(factor) + 1`` on cos and sin (``yarn_mscale`` unset; GPT-OSS: 32), which
    keeps Megatron off Transformer Engine's fused RoPE; None = plain RoPE."""
    activation_clamp: float | None = Field(default=None, gt=0, le=B.MAX_ACTIVATION_CLAMP)
    """The gated activation's inputs clamped to this value [swiglu_limit] (GPT-OSS: 7;
    Megatron-Core ``activation_func_clamp_value``, clamped eagerly before the fused
    activation); None = no clamp."""
    moe: MoEBlock | None = None
    """The experts in CONTRACT.md's nested form ({experts, top_k, shared_experts,
    expert_ffn_hidden, dense_layers, router, capacity_factor}), instead of the flat keys."""
    mla: MLABlock | None = None
    """With attention: mla, its widths as one mapping instead of the flat keys."""

    @model_validator(mode="after")
    def _check_variants(self) -> ModelDims:
        # The nested form (sim.config.moe_keys) becomes the flat one first, so the checks
        # and everything after read one set of names.
        update = flat_model_update(self)
        dims = self.model_copy(update=update) if update else self
        problem = _moe_problem(dims) or _attention_problem(dims)
        if problem:
            raise ValueError(problem)
        return dims


_MOE_ONLY = ("experts_per_token", "moe_ffn_hidden", "capacity_factor")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")


def _moe_problem(d: ModelDims) -> str | None:
    """Why the mixture-of-experts fields of ``d`` do not fit together, or None."""
    if d.experts is None:
        extra = [k for k in _MOE_ONLY if getattr(d, k) is not None]
        extra += [k for k in ("shared_experts", "first_k_dense") if getattr(d, k)]
        extra += ["router"] if d.router != "softmax" else []
        if extra:
            return f"model.{extra[0]}: only for mixture-of-experts models (set model.experts)"
        return None
    if d.experts_per_token is None:
        return "model.experts_per_token: required with model.experts (the router's top-k)"
    if d.experts_per_token > d.experts:
        return (f"model.experts_per_token: {d.experts_per_token} is more than the "
                f"{d.experts} routed experts (model.experts)")
    if d.first_k_dense >= d.layers:
        return (f"model.first_k_dense: {d.first_k_dense} leaves none of the {d.layers} "
                "layers with experts")
    return None


def _attention_problem(d: ModelDims) -> str | None:
    """Why the attention fields of ``d`` do not fit together, or None."""
    if d.attention == "mla":
        missing = [k for k in _MLA_FIELDS[1:] if getattr(d, k) is None]
        if missing:
            return f"model.{missing[0]}: required with model.attention: mla"
        unused = [k for k in ("kv_heads", "head_dim") if getattr(d, k) is not None]
        if unused:
            return (f"model.{unused[0]}: not used with model.attention: mla (its widths are "
                    "qk_nope_head_dim, qk_rope_head_dim and v_head_dim)")
    else:
        extra = [k for k in _MLA_FIELDS if getattr(d, k) is not None]
        if extra:
            return f"model.{extra[0]}: only for model.attention: mla"
    if d.full_attention_every is not None and d.sliding_window is None:
        return "model.full_attention_every: needs model.sliding_window"
    return None


class Allocator(StrictModel):
    """PyTorch's CUDA caching allocator settings (``PYTORCH_CUDA_ALLOC_CONF``)."""

    expandable_segments: bool | None = None
    """``expandable_segments:True``: segments grow by mapping pages instead of new
    ``cudaMalloc`` calls (less fragmentation). None: what the framework's launcher does:
    torchtitan's ``run_train.sh`` sets it (``fsdp2``); Megatron-LM, DeepSpeed, FairScale and
    plain PyTorch leave PyTorch's default, off."""


class Nccl(StrictModel):
    """NCCL algorithm, protocol and the settings people tune; ``auto`` lets NCCL's cost model
    choose, as NCCL does."""

    algo: Literal["auto", "ring", "tree", "nvls", "nvls_tree", "pat", "collnet_direct",
                  "collnet_chain"] = "auto"
    """Collective algorithm (NCCL_ALGO): ring, double binary tree, NVLink SHARP, NVLS+tree,
    PAT (all-gather/reduce-scatter, one GPU per node), CollNet Direct/Chain (SHARP)."""
    proto: Literal["auto", "ll", "ll128", "simple"] = "auto"
    """Protocol (NCCL_PROTO): LL (low latency), LL128, or Simple (bandwidth)."""
    buffsize: int = Field(default=4 * 2**20, gt=0, le=B.MAX_NCCL_BUFFSIZE)
    """NCCL_BUFFSIZE in bytes: the per-channel pipeline buffer (8 steps of buffsize/8)."""
    gdr: bool = True
    """GPUDirect RDMA (NCCL_NET_GDR_LEVEL): off, network traffic bounces through host memory."""
    cross_nic: Literal[0, 1, 2] = 2
    """NCCL_CROSS_NIC: 0 keeps each ring on one rail, 1 lets it change rails, 2 (default)
    prefers rails."""
    collnet_enable: bool = False
    """NCCL_COLLNET_ENABLE (default 0 in NCCL): lets NCCL's tuning choose CollNet Direct or
    Chain on a fabric whose switches have SHARP (``cluster.sharp``)."""
    pxn: bool = True
    """PXN (NCCL 2.12+): a send to another node crosses NVLink to the local GPU on the peer's
    rail and leaves by that GPU's NIC; false = NCCL_PXN_DISABLE=1 (the sender's own NIC)."""


class Parallelism(StrictModel):
    """How the GPUs split the work; tp*pp*dp*cp must equal the GPU count."""

    tp: int = Field(default=1, gt=0, le=B.MAX_PARALLEL)
    """Tensor-parallel degree (inside a node)."""
    pp: int = Field(default=1, gt=0, le=B.MAX_PARALLEL)
    """Pipeline stages."""
    dp: int | None = Field(default=None, gt=0, le=B.MAX_PARALLEL)
    """Data-parallel degree; omitted = the GPUs that remain."""
    cp: int = Field(default=1, gt=0, le=B.MAX_PARALLEL)
    """Context-parallel degree."""
    vp: int = Field(default=1, gt=0, le=B.MAX_VIRTUAL_STAGES)
    """Virtual pipeline chunks per stage (interleaved 1F1B)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with tensor parallelism."""
    ep: int = Field(default=1, gt=0, le=B.MAX_PARALLEL)
    """Expert-parallel size: ranks sharing a mixture-of-experts layer's routed experts
    (Megatron ``--expert-model-parallel-size``, default 1). With MoE parallel folding
    (Megatron-Core ``parallel_state.initialize_model_parallel``, arXiv:2504.14960) the experts
    get their own layout over the same ranks: etp x ep x expert-dp x pp = the GPUs."""
    etp: int | None = Field(default=None, gt=0, le=B.MAX_PARALLEL)
    """Expert tensor-parallel size: ranks splitting each local expert's width (Megatron
    ``--expert-tensor-parallel-size``); omitted = ``tp``, as Megatron-LM's ``validate_args``
    defaults it."""

    @property
    def expert_tp(self) -> int:
        """``etp``, or ``tp`` when omitted."""
        return self.etp if self.etp is not None else self.tp


class Routing(StrictModel):
    """How a mixture-of-experts router spreads token copies over the experts
    (:mod:`sim.workload.routing`); the busiest expert-parallel rank sets the pace."""

    distribution: Literal["balanced", "zipf", "histogram", "round_robin"] = "balanced"
    """balanced (every expert its equal share, each token's experts drawn uniformly), zipf
    (the r-th hottest expert's share proportional to r^-s), histogram (measured per-expert
    loads) or round_robin (equal shares, token t taking the top-k consecutive experts from
    t x top-k: NeMo AutoModel's fake balanced gate, torchtitan's debug_moe_force_load_balance)."""
    s: float = Field(default=1.0, ge=0, le=10)
    """Zipf exponent: 0 is balanced, larger is more skewed."""
    seed: int | None = Field(default=None, ge=0, le=B.MAX_SEED)
    """Seed of the zipf ranking's random order of the experts; None = the scenario's seed."""
    histogram: list[float] | str | None = None
    """Per-expert loads (any scale, normalised), one per routed expert in expert order, or
    the path of a text file of them (numbers separated by commas or whitespace, # comments)."""

    @field_validator("histogram")
    @classmethod
    def _read_histogram(cls, v: list[float] | str | None) -> list[float] | None:
        if isinstance(v, str):
            v = read_histogram(v)
        if v is not None and (any(not x >= 0 or x == float("inf") for x in v)
                              or sum(v) <= 0):
            raise ValueError("training.routing.histogram: per-expert loads must be finite, "
                             "non-negative and not all zero")
        return v

    @model_validator(mode="after")
    def _needs_histogram(self) -> Routing:
        if (self.distribution == "histogram") != (self.histogram is not None):
            raise ValueError("training.routing.histogram: give it exactly when "
                             "training.routing.distribution is histogram")
        return self


def read_histogram(path: str) -> list[float]:
    """Per-expert loads from a text file: numbers separated by commas or whitespace,
    anything after ``#`` on a line ignored."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"training.routing.histogram: cannot read {path} "
                         f"({exc.strerror})") from None
    words = " ".join(line.split("#", 1)[0] for line in text.splitlines()).replace(",", " ")
    try:
        out = [float(w) for w in words.split()]
    except ValueError as exc:
        raise ValueError(f"training.routing.histogram: {path}: not a list of numbers "
                         f"({exc})") from None
    if not out:
        raise ValueError(f"training.routing.histogram: {path}: no per-expert loads")
    return out


class Training(StrictModel):
    """The step being simulated."""

    seq_len: int = Field(default=4096, gt=0, le=B.MAX_SEQ_LEN)
    """Tokens per sequence."""
    micro_batch_size: int = Field(default=1, gt=0, le=B.MAX_BATCH)
    """Sequences per GPU per forward/backward."""
    global_batch_size: int | None = Field(default=None, gt=0, le=B.MAX_BATCH)
    """Sequences per optimizer step across all replicas; default = one micro-batch each."""
    precision: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    """Matrix-math precision; bf16/fp16 keep fp32 master weights and optimizer states."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (attention core), full (whole block)."""
    tokens_total: float | None = Field(default=None, gt=0, le=B.MAX_TOKENS_TOTAL)
    """Tokens of the whole run, for run time and cost."""
    optimizer: Literal["adamw_fused", "adamw_foreach"] = "adamw_fused"
    """AdamW implementation (torch.optim.AdamW fused=True, or the default foreach kernels)."""
    attention_backend: Literal["auto", "flash1", "flash2", "flash3", "flash1_triton", "cudnn",
                               "sdpa", "flex"] = "auto"
    """Fused attention kernel; auto: the framework's own choice (sim/hardware/attention_cost.py);
    flash1: FlashAttention 1.x; flash1_triton: flash-attn 1.x's Triton kernel (llm-foundry's
    ``attn_impl: triton``); flex: PyTorch's FlexAttention (NeMo AutoModel's ``attn: flex``)."""
    torch_version: str = Field(default=DEFAULT_TORCH_VERSION, pattern=r"^\d+\.\d+(\.\d+)?$")
    """PyTorch release ("2.8", quoted) whose SDPA kernel order sdpa and auto follow."""
    cudnn_version: str | None = Field(default=None, pattern=r"^\d+\.\d+(\.\d+){0,2}$")
    """cuDNN release the job runs ("9.13.1", quoted; a container's release notes say it):
    Blackwell's fused attention runs at that release's measured speed
    (:func:`sim.hardware.blackwell_attention.cudnn_release_gap`), and Transformer Engine's
    cuDNN attention trains Multi-head Latent Attention on Blackwell from 9.11
    (:mod:`sim.hardware.te_fused_attention`); None: the newest measured."""
    transformer_engine_version: str | None = Field(default=None,
                                                  pattern=r"^\d+\.\d+(\.\d+){0,2}$")
    """Transformer Engine release the job runs ("2.9", quoted; a container's pins say it): which
    MXFP8 GEMM operands have their scales swizzled by a kernel at every GEMM call
    (:func:`sim.workload.mx_swizzle.swizzled_operands`), and whether its cuDNN attention trains
    head dims above 128 on Blackwell (from 2.5; before it MLA runs unfused,
    :mod:`sim.hardware.te_fused_attention`); None: the newest modelled."""
    deterministic: bool = False
    """Bitwise-reproducible steps as Megatron-LM's ``--deterministic-mode`` runs them
    (Transformer Engine's ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``): the attention backward sums
    dQ in a fixed order, and Transformer Engine picks its attention backend by what supports
    that (:func:`sim.hardware.attention_cost.resolve`). Megatron only; needs ``nccl.algo``
    ring or tree, as Megatron-LM asserts."""
    routing: Routing = Routing()
    """Mixture-of-experts routing distribution (balanced by default)."""
    moe_routing: MoeRouting | None = None
    """The routing in CONTRACT.md's form ({distribution: balanced|zipf|file, skew, file}),
    instead of ``routing``."""

    @model_validator(mode="after")
    def _contract_routing(self) -> Training:
        if self.moe_routing is None:
            return self
        if self.routing != Routing():
            raise ValueError("training.moe_routing: the routing is given twice "
                             "(training.routing and training.moe_routing): write one")
        try:
            routing = Routing.model_validate(self.moe_routing.routing_dict())
        except ValidationError as err:
            msg = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(msg.replace("training.routing.histogram",
                                         "training.moe_routing.file")) from None
        return self.model_copy(update={"routing": routing, "moe_routing": None})

    @field_validator("torch_version", "cudnn_version", "transformer_engine_version",
                     mode="before")
    @classmethod
    def _quoted_version(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, (int, float)):
            raise ValueError(f"training.{info.field_name}: write {v} as a quoted string; "
                             "unquoted, YAML reads 2.10 as the number 2.1")
        return v


class Pricing(StrictModel):
    """Prices; omitted fields come from the named instance or cloud, else the GPU catalogue's
    reference price and the defaults below."""

    gpu_hour_usd: float | None = Field(default=None, ge=0, le=B.MAX_USD_PER_GPU_HOUR)
    """On-demand price per GPU-hour."""
    egress_usd_per_gb: float = Field(default=0.01, ge=0, le=B.MAX_USD_PER_GB)
    """Price per GB crossing an availability-zone boundary (each direction billed)."""
    region_egress_usd_per_gb: float = Field(default=0.02, ge=0,
                                            le=B.MAX_USD_PER_GB)
    """Price per GB crossing a region boundary."""
    instance: str | None = None
    """A catalogue instance (aws-p5.48xlarge): its GPU-hour and cloud's transfer prices apply."""
    cloud: Literal["aws", "gcp", "azure"] | None = None
    """Whose transfer prices apply when no instance is named (an instance implies its cloud)."""


class Claims(StrictModel):
    """Figures someone published for this setup, checked against the simulation."""

    source: str
    """Where the figures come from."""
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tokens_per_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    step_time_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    peak_memory_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    peak_memory_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    peak_memory_kind: Literal["reserved", "allocated", "nvidia_smi"] = "reserved"
    """Which peak the memory claims quote: the caching allocator's reserved peak
    (``torch.cuda.max_memory_reserved``, what torchtitan and most publications report), the
    allocated peak (``max_memory_allocated``), or the whole process in ``nvidia-smi``."""
    # A claim above 1 is not refused here: judging it ("physically impossible") is what the
    # claims block is for; only absurd magnitudes are bad input.
    mfu: float | None = Field(default=None, gt=0, le=1e3, allow_inf_nan=False)
    model_state_memory_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Parameters, gradients and optimizer states per GPU, GB (1e9 bytes)."""
    exposed_comm_fraction: float | None = Field(default=None, gt=0, le=1e3,
                                                allow_inf_nan=False)
    """Share of the step spent in communication that computation does not hide."""
    bubble_fraction: float | None = Field(default=None, gt=0, le=1e3, allow_inf_nan=False)
    """Share of the step a pipeline stage sits idle."""
    run_hours: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Hours to train ``training.tokens_total`` tokens."""
    run_usd: float | None = Field(default=None, ge=1e-6, allow_inf_nan=False)
    """US dollars to train ``training.tokens_total`` tokens (a millionth of a dollar at
    least: it is judged by the hours it buys, which a denormal rounds to none)."""
    cross_az_bytes_per_day: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Bytes crossing availability-zone boundaries per day of training."""
    egress_usd_per_day: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """US dollars of cross-zone transfer per day of training."""
    nvlink_gbytes_per_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """NVLink traffic per GPU per direction, GB/s, averaged over the step."""
