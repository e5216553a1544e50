"""The ``framework:`` options of ``fsdp2`` (torchtitan's FSDP2, TP, PP and CP). Imports only
the config layer's base: the scenario schema (:mod:`sim.config.scenario`) reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config import bounds as B
from sim.config.base import StrictModel


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
    cross_entropy: Literal["torch", "fused"] = "torch"
    """The loss kernel: PyTorch's ``cross_entropy`` (eager: the logits copied to fp32, a
    log-softmax and its gradient over the vocabulary; compiled with ``compile_loss``), or one
    fused softmax cross-entropy kernel on the 16-bit logits (``fused``: flash-attn's
    ``xentropy``, the default loss of llm-foundry's MPT, ``loss_fn: fused_crossentropy``).
    Not with tensor parallelism (its loss is torch's ``loss_parallel``)."""
    model_code: Literal["torchtitan", "huggingface", "automodel"] = "torchtitan"
    """Whose model code FSDP2 wraps: torchtitan's (fused RMSNorm, complex rotary, no KV
    cache), Hugging Face transformers' LlamaForCausalLM (eager RMSNorm through fp32,
    rotate_half rotary, a KV cache while use_cache is on), one fully_shard per decoder layer,
    or NeMo AutoModel's custom models with its "TE + DeepEP" backend (Transformer Engine
    attention, linears and RMSNorm; DeepEP's dispatch and combine for the experts; bf16
    parameters and Adam states): :mod:`sim.frameworks.fsdp2.automodel`."""
    checkpoint_use_reentrant: bool = False
    """With model_code huggingface and full checkpointing: use_reentrant of HF's
    gradient_checkpointing_kwargs (see DdpOptions); torchtitan's checkpoint_wrapper is
    non-reentrant."""
    float8_all_gather: bool = False
    """With training.precision fp8: all-gather the blocks' weights in FP8 (torchtitan
    float8.enable_fsdp_float8_all_gather), half the bytes, no weight casts in the GEMMs."""
    float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = "tensorwise"
    """With training.precision fp8: torchtitan's ``float8.recipe_name`` (torchao
    ``Float8LinearRecipeName``): dynamic tensorwise scaling (torchtitan's default at 820504e,
    2025-06), or per-row scales (``rowwise``; ``rowwise_with_gw_hp`` keeps the weight-gradient
    GEMM in bf16): :mod:`sim.workload.float8_rowwise`; or ``mxfp8``, torchtitan's ``mx``
    converter (``mx.recipe_name: mxfp8_cublas``, torchao ``MXLinear``, Blackwell only):
    :mod:`sim.workload.float8_mx`. Rowwise and MX recipes run plain tensor parallelism and no
    FSDP float8 all-gather, as torchtitan does."""
    hsdp_shard_size: int | None = Field(default=None, gt=0, le=B.MAX_GPUS)
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
    local_batch_size: int | None = Field(default=None, gt=0, le=B.MAX_BATCH)
    """With parallelism.pp > 1: the samples one pipeline schedule step runs on each
    data-parallel rank (torchtitan's ``training.local_batch_size``, NeMo AutoModel's
    ``step_scheduler.local_batch_size``). The step is then ``global_batch_size /
    (local_batch_size x dp)`` gradient-accumulation steps, each a whole schedule of
    ``local_batch_size / micro_batch_size`` micro-batches that flushes the pipeline and
    reduce-scatters the gradients (parameters gathered again for the next). None: one
    schedule over the whole global batch."""
    pipeline_first_stage_less_layers: int = Field(default=1, ge=0, le=B.MAX_LAYERS)
    """torchtitan's pipeline_parallel_first_stage_less_layers: the embedding counts as this
    many layers when the layers are split over pipeline stages."""
    pipeline_last_stage_less_layers: int = Field(default=1, ge=0, le=B.MAX_LAYERS)
    """torchtitan's pipeline_parallel_last_stage_less_layers: the same for norm + output."""
    moe_score_before_experts: bool = True
    """Mixture-of-experts layers: torchtitan's ``MoEArgs.score_before_experts`` (default
    True: the routed tokens are scaled by their scores in fp32 before the dispatch and
    summed after the combine; Qwen3's configs set False: the combined copies are weighted by
    an fp32 ``bmm`` that keeps an fp32 copy of them for backward)."""
    grouped_mm_recipe: Literal["bf16", "mxfp8"] = "bf16"
    """The routed experts' grouped GEMMs: ``bf16`` (``torch._grouped_mm``) or ``mxfp8``,
    torchtitan's ``quantize.grouped_mm.mx`` converter (``fqns: experts``, ``recipe_name:
    mxfp8``): torchao's MXFP8 grouped GEMMs with dynamic quantization
    (:mod:`sim.workload.mx_grouped_mm`), token groups aligned to 32 rows; Blackwell only. The
    rest of the model keeps ``training.precision``."""
    expert_parallel_comm_backend: Literal["standard", "deepep"] | None = None
    """How MoE tokens reach their experts under parallelism.ep > 1 (torchtitan's
    ``parallelism.expert_parallel_comm_backend``, since its DeepEP integration of 2025-12):
    ``standard`` (all-to-alls of every routed copy), or ``deepep`` (DeepEP's dispatch and
    combine: a token sent once per destination rank, once per node across nodes; Megatron's
    unfused permutation into local-expert order). None: the model code's own (torchtitan:
    standard; AutoModel's "TE + DeepEP" backend: deepep)."""
    async_tp: bool = False
    """torchtitan's ``parallelism.enable_async_tensor_parallel`` (needs ``compile``): Inductor's
    micro-pipeline pass fuses the layers' tensor-parallel all-gathers and reduce-scatters with
    their matmuls on symmetric memory (:mod:`sim.frameworks.fsdp2.async_tp`). No effect with
    tp 1, as in torchtitan."""
    cp_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """Context parallelism: how keys and values reach every rank (torchtitan's
    context_parallel_rotate_method; torch's _cp_options default is allgather)."""
