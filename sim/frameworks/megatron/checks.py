"""The checks of a scenario's Megatron options that decide whether the job can be shaped at
all: precisions, the splits of heads and widths over tp, of layers over pp x vp (even, uneven
or a custom layout), and the options Megatron-LM's ``validate_args`` refuses together.
:func:`~sim.frameworks.megatron.shape.megatron_shape` runs them first; each refusal names
its key."""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.attention_checks import check_fp8_attention
from sim.frameworks.megatron.fsdp import check_megatron_fsdp
from sim.frameworks.megatron.layout import as_layout, check_layout
from sim.frameworks.megatron.optimizer_precision import check_fp8_recipe
from sim.frameworks.megatron.pipeline import chunk_layers
from sim.scenario import MegatronOptions


def check_options(ctx: JobContext, opts: MegatronOptions) -> None:
    """Refuse the precisions and splits Megatron-LM (and this model of it) cannot run (heads,
    key/value heads, FFN width over tp; layers over pp x vp; tp_comm_overlap without SP)."""
    s = ctx.scenario
    m = ctx.model
    par = s.parallelism
    t, p, cp, vp = par.tp, par.pp, par.cp, par.vp
    sp = par.sequence_parallel and t > 1
    precision = s.training.precision
    ctx.require(precision in ("bf16", "fp16", "fp8"), "training.precision",
                "megatron is modelled with 16-bit parameters (bf16 or fp16) or FP8 layers")
    ctx.require(precision != "fp8" or opts.implementation == "transformer_engine",
                "framework.implementation",
                "FP8 training needs Transformer Engine layers (implementation: "
                "transformer_engine)")
    check_fp8_recipe(ctx, opts.fp8_recipe, precision)
    check_megatron_fsdp(ctx, opts)
    # Megatron-LM's validate_args: --deterministic-mode asserts NCCL_ALGO is Ring or Tree.
    ctx.require(not s.training.deterministic or s.nccl.algo in ("ring", "tree"), "nccl.algo",
                "training.deterministic needs nccl.algo ring or tree (Megatron-LM's "
                "--deterministic-mode asserts NCCL_ALGO is Ring or Tree)")
    ctx.require(m.heads % t == 0, "parallelism.tp",
                f"{m.heads} attention heads do not split over tp={t}")
    ctx.require(m.kv_heads % t == 0 or t % m.kv_heads == 0, "parallelism.tp",
                f"{m.kv_heads} key/value heads do not split over tp={t}")
    ctx.require(m.ffn_hidden % t == 0, "parallelism.tp",
                f"ffn_hidden {m.ffn_hidden} does not split over tp={t}")
    extra = int(opts.account_for_embedding_in_pipeline_split) + \
        int(opts.account_for_loss_in_pipeline_split)
    first, last = opts.decoder_first_pipeline_num_layers, opts.decoder_last_pipeline_num_layers
    if opts.pipeline_model_parallel_layout is not None:
        _check_layout(ctx, opts, p, vp, extra)
    elif first is not None or last is not None:
        _check_uneven(ctx, m.layers, p, vp, extra, first, last)
    else:
        # One layer a chunk is allowed with the embedding and loss counted: the first and last
        # chunks then hold only those (Megatron-Bridge's Llama 3.1 405B GB200 MXFP8 and NVFP4
        # configs run 126 layers + 2 over PP 16 x VP 8, llama31_workload_base_configs.py).
        ctx.require((m.layers + extra) % (p * vp) == 0
                    or extra == 0 and m.layers % (p * vp) == 0, "parallelism.pp",
                    f"{m.layers} layers{f' + {extra} (embedding/loss)' if extra else ''} do "
                    f"not split into pp x vp = {p * vp} equal chunks (an uneven split: "
                    "framework.decoder_first_pipeline_num_layers / "
                    "decoder_last_pipeline_num_layers or pipeline_model_parallel_layout)")
    ctx.require(vp == 1 or p > 1, "parallelism.vp", "interleaving needs pipeline stages")
    check_fp8_attention(ctx, opts, precision, m, ctx.seq)
    ctx.require(not opts.fp8_output_proj or (precision == "fp8" and opts.fp8_recipe == "mxfp8"),
                "framework.fp8_output_proj",
                "fp8_output_proj requires FP8 training with fp8_recipe mxfp8 (Megatron-Core)")
    ctx.require(not opts.tp_comm_overlap or sp, "framework.tp_comm_overlap",
                "tensor-parallel communication/GEMM overlap needs sequence parallelism with "
                "tp > 1 (Megatron-LM validate_args)")
    # Megatron-LM's validate_args: with cp > 1 the sequence is cut into 2 x cp chunks (each
    # rank holds a chunk from each end, for the causal load balance).
    ctx.require(cp == 1 or ctx.seq % (2 * cp) == 0, "parallelism.cp",
                f"seq_len {ctx.seq} does not split into 2 x cp = {2 * cp} chunks "
                "(Megatron-LM: seq-length should be a multiple of 2 * context-parallel-size)")
    # Sequence parallelism scatters each rank's [s / cp, b, h] activations along the sequence
    # over tp (Megatron-Core tensor_parallel/mappings.py _split_along_first_dim asserts it).
    ctx.require(not sp or (ctx.seq // cp) % t == 0, "training.seq_len",
                f"sequence parallelism splits each rank's {ctx.seq // cp} tokens (seq_len "
                f"{ctx.seq} over cp={cp}) over tp={t}: not a multiple of {t}")
    # Transformer Engine runs sliding windows and learned sinks under context parallelism only
    # with cp_comm_type a2a (TE tests/pytorch/attention/test_attention_with_cp.py: "No support
    # for SWA with cp_comm_type={p2p, a2a+p2p}", non-vanilla softmax only with a2a); the
    # builder models the p2p ring.
    ctx.require(cp == 1 or (m.sliding_window is None and not m.attention_sinks),
                "parallelism.cp", "context parallelism with sliding-window attention or "
                "attention sinks runs only as Transformer Engine's all-to-all (cp_comm_type "
                "a2a), which the megatron builder does not model")
    ctx.require(m.sliding_window is None or m.mla is None, "model.sliding_window",
                "sliding windows over multi-head latent attention are not modelled")
    # Learned sinks run in TE's FusedAttention (cuDNN) or Megatron's unfused attention; the
    # flash-attn package the local implementation calls has no softmax offset (TE's backend
    # table: non-vanilla softmax_type is no candidate for FlashAttention 2/3).
    ctx.require(not m.attention_sinks or opts.implementation == "transformer_engine"
                or not opts.flash_attention, "framework.flash_attention",
                "attention sinks need Transformer Engine's fused attention or Megatron's "
                "unfused path (flash_attention: false); flash-attn has no learned softmax "
                "offset")


def _check_uneven(ctx: JobContext, layers: int, p: int, vp: int, extra: int,
                  first: int | None, last: int | None) -> None:
    """Megatron-Core's uneven pipeline split (TransformerConfig ``num_layers_in_first/last_
    pipeline_stage``): pipeline stages needed, not with the embedding or loss counted as
    layers, and every stage's count split evenly over its model chunks."""
    key = "framework.decoder_" + ("first" if first is not None else "last") + \
        "_pipeline_num_layers"
    ctx.require(p > 1, key, "an uneven pipeline split needs pipeline stages (pp > 1)")
    ctx.require(extra == 0, key, "cannot be combined with account_for_embedding/loss_in_"
                "pipeline_split (Megatron-Core TransformerConfig)")
    try:
        chunk_layers(layers, p, vp, first=first, last=last)
    except ValueError as e:
        ctx.fail(key, str(e))


def _check_layout(ctx: JobContext, opts: MegatronOptions, p: int, vp: int, extra: int
                  ) -> None:
    """A custom pipeline layout (:mod:`sim.frameworks.megatron.layout`): alone (Megatron-LM's
    ``validate_args`` refuses it beside the uneven and embedding/loss split options), with
    the scenario's vp its own, and valid for the model's layers and MTP modules."""
    key = "framework.pipeline_model_parallel_layout"
    ctx.require(extra == 0 and opts.decoder_first_pipeline_num_layers is None
                and opts.decoder_last_pipeline_num_layers is None, key,
                "cannot be combined with decoder_first/last_pipeline_num_layers or "
                "account_for_embedding/loss_in_pipeline_split (Megatron-LM validate_args)")
    try:
        layout = as_layout(opts.pipeline_model_parallel_layout)  # type: ignore[arg-type]
        chunk_layers(ctx.model.layers, p, vp, layout=layout)
        check_layout(layout, p, ctx.model.layers, ctx.model.mtp_layers)
    except ValueError as e:
        ctx.fail(key, f"{e} (parallelism pp = {p}, vp = {vp})")
