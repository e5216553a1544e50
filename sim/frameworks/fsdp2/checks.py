"""What the FSDP2 builder models, checked before it builds: one clear error naming the key."""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.frameworks.fsdp2.mesh import stage_layers
from sim.scenario import Fsdp2Options


def check(ctx: JobContext, opts: Fsdp2Options) -> None:
    """Refuse layouts and options torchtitan (or this model of it) does not run: head and
    width splits, torchtitan's ``ParallelDims.seq_len_divisor``, HSDP shapes, pipeline
    schedules' micro-batch counts and stage splits, then the options that need each other."""
    _check_layout(ctx, opts)
    _check_options(ctx, opts)
    _check_moe(ctx, opts)


def _check_layout(ctx: JobContext, opts: Fsdp2Options) -> None:
    s = ctx.scenario
    p, m = s.parallelism, ctx.model
    t, pp, cp, vp = p.tp, p.pp, p.cp, p.vp
    ctx.require(s.training.precision in ("bf16", "fp16", "fp8"), "training.precision",
                f"fsdp2 is modelled with 16-bit mixed precision (bf16 or fp16) or torchao "
                f"float8 linears (fp8); {s.training.precision} is not yet")
    ctx.require(m.heads % t == 0, "parallelism.tp",
                f"{m.heads} attention heads do not split over tp={t}")
    ctx.require(m.kv_heads % t == 0, "parallelism.tp",
                f"{m.kv_heads} key/value heads do not split over tp={t} (colwise wk/wv)")
    ctx.require(m.ffn_hidden % t == 0, "parallelism.tp",
                f"ffn_hidden {m.ffn_hidden} does not split over tp={t}")
    # torchtitan's DeepSeek-V3 attention (sim/workload/titan_mla.py) under its tensor-parallel
    # plan (latents replicated, wq_b / wkv_b colwise, wo rowwise: sim/frameworks/fsdp2/tp.py)
    # is modelled with a query latent and 16-bit TP (context parallelism with MLA is refused
    # for every framework: common/base.py _check_latent_attention).
    mla_tp = m.mla is not None and t > 1
    ctx.require(not mla_tp or bool(m.mla and m.mla.q_lora_rank), "parallelism.tp",
                "multi-head latent attention without a query latent (q_lora_rank 0) is "
                "modelled without tensor parallelism in fsdp2 yet (issue 14)")
    ctx.require(not mla_tp or s.training.precision != "fp8", "training.precision",
                "multi-head latent attention with tensor parallelism is modelled in 16-bit "
                "in fsdp2 (torchao's float8 TP styles are not, issue 14)")
    ctx.require(not mla_tp or s.training.activation_checkpointing != "selective",
                "training.activation_checkpointing",
                "multi-head latent attention with tensor parallelism is modelled with none or "
                "full checkpointing in fsdp2 (issue 14)")
    ctx.require(not mla_tp or not opts.async_tp, "framework.async_tp",
                "async tensor parallelism is modelled on Llama-style q/k/v projections, not "
                "multi-head latent attention (issue 14)")
    ctx.require(m.mla is None or opts.model_code != "huggingface", "framework.model_code",
                "multi-head latent attention is modelled in torchtitan's and AutoModel's "
                "DeepSeek-V3 code; Hugging Face's is not yet (issue 14)")
    # GPT-OSS's learned sinks and sliding windows: NeMo AutoModel's module with FlexAttention
    # (sim/workload/automodel_attention.py); torchtitan's experimental GPT-OSS is not modelled.
    gpt_oss_attention = m.attention_sinks or m.sliding_window is not None
    ctx.require(not gpt_oss_attention or opts.model_code == "automodel", "framework.model_code",
                "attention sinks and sliding windows (GPT-OSS) are modelled in fsdp2 with NeMo "
                "AutoModel's model code (model_code: automodel)")
    ctx.require(not gpt_oss_attention or ctx.compute.attention_backend == "flex",
                "training.attention_backend",
                "AutoModel's GPT-OSS attention is modelled with FlexAttention (auto or flex), "
                "not Transformer Engine's sink attention")
    divisor = t * 2 * cp if cp > 1 else t
    ctx.require(ctx.seq % divisor == 0, "training.seq_len",
                f"{ctx.seq} is not a multiple of {divisor} (torchtitan ParallelDims."
                "seq_len_divisor: tp, times 2 x cp for head-tail load balancing)")
    dp = ctx.dp
    shard = opts.hsdp_shard_size or dp
    ctx.require(dp % shard == 0, "framework.hsdp_shard_size",
                f"{shard} does not divide dp={dp}")
    ctx.require(not (shard == 1 and cp == 1 and dp > 1), "framework.hsdp_shard_size",
                "one shard per replica is plain replication: torchtitan applies DDP then "
                "(framework ddp)")
    ctx.require(vp == 1 or pp > 1, "parallelism.vp", "interleaving needs pipeline stages")
    # torchtitan's model config (update_from_config: Qwen3 since #1590, Llama 3 since #2580,
    # now torchtitan/models/common/decoder.py) raises NotImplementedError for a tied
    # embedding with pipeline_parallel_degree > 1.
    ctx.require(not (m.tied_embeddings and pp > 1), "parallelism.pp",
                f"Weight tying is not supported with Pipeline Parallel (torchtitan): "
                f"{m.name} ties its embedding and output weights; use pp=1 or an untied model")
    mbs = ctx.micro_batches
    lbs = opts.local_batch_size
    key = "training.global_batch_size"
    if lbs is not None:
        ctx.require(pp > 1, "framework.local_batch_size",
                    "sets the samples of one pipeline schedule step: needs parallelism.pp > 1 "
                    "(without pipelining the micro-batch is the local batch)")
        ctx.require(lbs % ctx.micro_batch == 0, "framework.local_batch_size",
                    f"{lbs} is not a multiple of training.micro_batch_size "
                    f"({ctx.micro_batch})")
        ctx.require((mbs * ctx.micro_batch) % lbs == 0, "framework.local_batch_size",
                    f"{lbs} does not divide the {mbs * ctx.micro_batch} samples a "
                    "data-parallel rank runs a step (gradient-accumulation steps)")
        mbs, key = lbs // ctx.micro_batch, "framework.local_batch_size"
    if pp > 1:
        if vp > 1:
            ctx.require(mbs % pp == 0, key,
                        f"Interleaved1F1B here needs the micro-batch count ({mbs}) to be a "
                        f"multiple of pp={pp}")
        elif opts.pipeline_schedule == "1f1b":
            ctx.require(mbs >= pp, key,
                        f"Schedule1F1B needs at least pp={pp} micro-batches (got {mbs})")
    try:
        stage_layers(m.layers, pp * vp, opts.pipeline_first_stage_less_layers,
                     opts.pipeline_last_stage_less_layers)
    except ValueError as exc:
        ctx.fail("parallelism.pp", str(exc))


def _check_options(ctx: JobContext, opts: Fsdp2Options) -> None:
    s = ctx.scenario
    par = s.parallelism
    t, pp, cp = par.tp, par.pp, par.cp
    fp8 = s.training.precision == "fp8"
    ctx.require(not opts.float8_all_gather or fp8, "framework.float8_all_gather",
                "needs training.precision fp8 (the float8 converter)")
    ctx.require(opts.float8_recipe == "tensorwise" or fp8, "framework.float8_recipe",
                f"{opts.float8_recipe} needs training.precision fp8 (the float8 converter)")
    ctx.require(opts.float8_recipe != "mxfp8" or not fp8 or ctx.compute.gpu.arch == "blackwell",
                "framework.float8_recipe",
                f"mxfp8 needs a Blackwell GPU (torchao's MX GEMMs need compute capability 10.0); "
                f"{ctx.compute.gpu.name} is {ctx.compute.gpu.arch}")
    ctx.require(opts.float8_recipe != "mxfp8" or not fp8 or t == 1 or not opts.compile,
                "framework.float8_recipe",
                "mxfp8 with tensor parallelism under torch.compile is refused by torchtitan's mx "
                "converter (\"TP not yet supported with torch.compile for mxfp8\", "
                "components/quantization/mx.py)")
    mx_moe = opts.grouped_mm_recipe == "mxfp8"
    ctx.require(not mx_moe or ctx.compute.gpu.arch == "blackwell", "framework.grouped_mm_recipe",
                f"mxfp8 grouped GEMMs need a Blackwell GPU (torchtitan's quantize.grouped_mm.mx "
                f"asserts compute capability 10.0); {ctx.compute.gpu.name} is "
                f"{ctx.compute.gpu.arch}")
    ctx.require(not mx_moe or (ctx.model.moe is not None and opts.model_code == "torchtitan"),
                "framework.grouped_mm_recipe",
                "mxfp8 grouped GEMMs are torchtitan's converter of a mixture-of-experts "
                "model's routed experts (model_code torchtitan, a model with experts)")
    ctx.require(not opts.float8_all_gather or opts.float8_recipe == "tensorwise",
                "framework.float8_all_gather",
                f"FSDP's float8 all-gather is tensorwise only: torchtitan refuses it with "
                f"float8_recipe {opts.float8_recipe}")
    hf = opts.model_code == "huggingface"
    if hf:
        # Hugging Face LlamaForCausalLM wrapped per decoder layer: bf16 parameters from the
        # MixedPrecisionPolicy, the model's eager code (sim.workload.hf_ops). torchtitan's tensor,
        # context and pipeline plans, its float8 converter and op-level SAC are torchtitan's.
        ctx.require(t == 1 and cp == 1 and pp == 1, "framework.model_code",
                    "huggingface is modelled with FSDP (and HSDP) only: tp, cp and pp must be 1")
        ctx.require(not fp8, "framework.model_code",
                    "huggingface is modelled with bf16 or fp16 precision, not torchao float8")
        ctx.require(s.training.activation_checkpointing != "selective",
                    "framework.model_code", "selective (op-level SAC) is torchtitan's")
    if opts.model_code == "automodel":
        _check_automodel(ctx, opts)
    ctx.require(hf or not opts.checkpoint_use_reentrant, "framework.checkpoint_use_reentrant",
                "torchtitan's checkpoint_wrapper is non-reentrant; reentrant checkpointing "
                "is Hugging Face's option (model_code: huggingface)")
    ctx.require(opts.compile or not opts.async_tp, "framework.async_tp",
                "Async TP requires torch.compile (framework.compile true), as torchtitan "
                "raises")
    gpn = s.cluster.gpus_per_node
    ctx.require(not opts.async_tp or t == 1 or gpn % t == 0, "framework.async_tp",
                f"symmetric memory needs each tensor-parallel group inside one node (tp={t}, "
                f"{gpn} GPUs per node): torch's enable_symm_mem_for_group refuses peers on "
                "other hosts")
    ctx.require(opts.compile or not opts.compile_loss, "framework.compile_loss",
                "true needs framework.compile true (torchtitan compiles the loss only when "
                "compiling)")
    ctx.require(opts.cross_entropy == "torch" or t == 1, "framework.cross_entropy",
                f"fused is not modelled with tensor parallelism (tp={t}): vocabulary-sharded "
                "logits take torch's loss_parallel")


def _check_automodel(ctx: JobContext, opts: Fsdp2Options) -> None:
    """What of NeMo AutoModel's path is modelled (:mod:`.automodel`): its "TE + DeepEP"
    backend in bf16, FSDP2 with expert and pipeline parallelism, eager, full or no
    checkpointing; not its tensor or context parallel plans, FP8, torch.compile or CPU
    offload. GPT-OSS runs its own attention module with FlexAttention
    (:func:`_check_layout`)."""
    s = ctx.scenario
    p = s.parallelism
    key = "framework.model_code"
    ctx.require(p.tp == 1 and p.cp == 1, key,
                "automodel is modelled without tensor or context parallelism (tp and cp 1)")
    ctx.require(s.training.precision in ("bf16", "fp16"), key,
                "automodel is modelled with its bf16 model (not FP8)")
    ctx.require(not opts.compile, "framework.compile",
                "automodel is modelled eager (its TE kernels, not torch.compile)")
    ctx.require(s.training.activation_checkpointing != "selective",
                "training.activation_checkpointing",
                "automodel is modelled with none or full (per-block) checkpointing")
    ctx.require(not opts.cpu_offload, "framework.cpu_offload",
                "automodel is modelled without CPU offload")


def _check_moe(ctx: JobContext, opts: Fsdp2Options) -> None:
    """torchtitan's MoE path as modelled (:mod:`.moe`): its own model code, 16-bit
    precision, no op-level SAC, no CPU offload, expert TP 1 (``ep`` then takes every
    tensor-parallel rank); ``ep`` must divide ``dp_shard x cp x tp`` (``efsdp``,
    ``ParallelDims``)."""
    s = ctx.scenario
    p, m = s.parallelism, ctx.model
    if m.moe is None:
        return
    why = "with mixture-of-experts layers fsdp2 is modelled"
    ctx.require(opts.model_code != "huggingface", "framework.model_code",
                f"{why} with torchtitan's or AutoModel's MoE code (model_code: torchtitan "
                "or automodel)")
    # Expert TP 1 with tp > 1: ep borrows every tensor-parallel rank
    # (ReordererSequenceParallel splits each TP group's tokens over its ranks).
    ctx.require(p.ep % p.tp == 0, "parallelism.ep",
                f"ep={p.ep} must be a multiple of tp={p.tp}: with expert TP 1 torchtitan's "
                "expert parallelism borrows every tensor-parallel rank")
    ctx.require(s.training.precision in ("bf16", "fp16"), "training.precision",
                f"{why} with 16-bit mixed precision (torchtitan's float8 linears beside "
                "experts are not modelled; the experts' MXFP8 grouped GEMMs are "
                "framework.grouped_mm_recipe)")
    ctx.require(s.training.activation_checkpointing != "selective",
                "training.activation_checkpointing",
                f"{why} with none or full (per-block) checkpointing")
    ctx.require(not opts.cpu_offload, "framework.cpu_offload", f"{why} without CPU offload")
    ctx.require(p.etp in (None, 1), "parallelism.etp",
                "torchtitan's expert tensor parallelism is not modelled (etp must be 1)")
    # torchtitan's DeepEP path refuses expert TP (etp above) and runs under TP without its
    # token split (moe.py); AutoModel's only runs DeepEP.
    key = "framework.expert_parallel_comm_backend"
    ctx.require(opts.model_code != "automodel"
                or opts.expert_parallel_comm_backend != "standard", key,
                "AutoModel's all-to-all dispatcher (dispatcher: torch) is not modelled; its "
                "\"TE + DeepEP\" backend is (deepep)")
    shard = opts.hsdp_shard_size or ctx.dp
    ctx.require((shard * p.cp * p.tp) % p.ep == 0, "parallelism.ep",
                f"ep={p.ep} must divide dp_shard x cp x tp = {shard} x {p.cp} x {p.tp} "
                "(torchtitan borrows the expert-parallel ranks from them: efsdp = dp_shard x "
                "cp x tp / ep)")
