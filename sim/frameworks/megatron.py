"""NVIDIA Megatron-LM: tensor, sequence, context, pipeline and data parallelism.

What the step does, as ``megatron/core`` runs it:

* Ranks are laid out ``tp-cp-ep-dp-pp`` (``parallel_state.py``): tensor-parallel peers are
  adjacent (inside a node), pipeline stages outermost. Every rank of a pipeline stage runs the
  same ops, so each stage is one rank class; its collectives name all their groups.
* Tensor parallelism: each layer's QKV and fc1 are column-parallel, the output projection and
  fc2 row-parallel; the row-parallel outputs are all-reduced across the tensor-parallel group
  (with sequence parallelism: reduce-scattered, and the normalised inputs all-gathered),
  twice in forward and twice in backward per layer, blocking the compute stream; with
  sequence parallelism a column-parallel linear's backward re-gathers its input and
  reduce-scatters its input gradient beside its GEMMs
  (:func:`sim.frameworks.megatron_overlap.column_linear_backward`). With
  ``tp_comm_overlap`` (sequence parallelism required, as Megatron-LM's ``validate_args``
  asks) Transformer Engine's userbuffers overlap each exchange with the GEMM beside it:
  ring-exchange all-gathers under the consuming GEMM's chunks, pipelined reduce-scatters
  under the producing GEMM's (:mod:`sim.frameworks.megatron_overlap`); each exchange still
  waits for its input and its consumer for it.
* Pipeline parallelism: the schedule of ``pipeline_parallel/schedules.py`` — 1F1B with
  min(p - s - 1, m) warm-up forwards on stage s, interleaved 1F1B with ``vp`` model chunks per
  stage ((p - s - 1) * 2 + (vp - 1) * p warm-up units), or GPipe (all forwards, then all
  backwards). Activations go to the next stage and gradients back as point-to-point
  transfers, each a rendezvous of both stages, issued and waited for where Megatron-Core's
  schedules do (:mod:`sim.frameworks.megatron_pipeline`), so bubbles and stalls come out of
  the simulation.
  The embedding sits on the first stage and the output layer with the loss on the last.
* Context parallelism: each rank holds seq/cp tokens (two load-balanced chunks); attention
  runs as Transformer Engine's ring, cp steps each beside the exchange of the next K/V chunk
  (:func:`sim.frameworks.megatron_overlap.cp_ring`).
* Data parallelism: fp32 (bf16 training) or 16-bit (fp16) gradient buffers reduced per
  bucket (:mod:`sim.frameworks.megatron_buckets`: split only on the first stage's first model
  chunk, one bucket per chunk elsewhere), from the backward hooks of the last micro-batch
  (``overlap_grad_reduce``) or after the schedule; with the distributed optimizer a
  reduce-scatter, the optimizer on the shard, and an all-gather of the 16-bit parameters per
  bucket, after the optimizer or in the next forward's pre-hooks (``overlap_param_gather``;
  with ``align_param_gather``, Megatron-LM's default under interleaving, every stage
  dispatches its first two chunks' gathers at step start; ``overlap_param_gather_with_
  optimizer_step`` dispatches chunk 0's after its own optimizer step; with k optimizer
  instances the reduce-scatter and gather run in dp*cp/k ranks and the shard is all-reduced
  across the instances). Tied embeddings are all-reduced between the first and last stage
  (``finalize_model_grads``).
* Memory per parameter (``docs/.../dist_optimizer.md``): 16-bit parameters, gradient
  buffers, and the optimizer's fp32 master weights and Adam moments (12 bytes; 16 when the
  gradients are fp16), the latter sharded over data-parallel ranks by the distributed
  optimizer. Activations per micro-batch in flight, from :mod:`sim.megatron_ops`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sim.frameworks.base import JobContext, register
from sim.frameworks.megatron_buckets import (
    BucketComms,
    StageBuckets,
    assign_buckets,
    bucket_ops,
    bucket_size,
    data_parallel_modes,
    instance_groups,
)
from sim.frameworks.megatron_overlap import (
    TE_PIPELINE_SPLITS,
    column_linear_backward,
    cp_ring,
    pipelined_scatter,
    ring_exchange_gather,
    userbuffer_gemm_spans,
)
from sim.frameworks.megatron_pipeline import (  # noqa: F401 - schedule re-exported
    P2PLink,
    add_stage,
    chunk_layers,
    p2p_modes,
    pipeline_steps,
    schedule,
)
from sim.layer_ops import price_block
from sim.megatron_ops import (
    CHECKPOINT_OPS,
    PYTHON_OPS,
    PYTHON_OPS_TE,
    STYLE,
    MegatronLayout,
    megatron_blocks,
    padded_vocab,
)
from sim.program import Op, Program, RankClass
from sim.scenario import MegatronOptions

# CPU seconds per Python-level torch op in Megatron's eager layers (see PYTHON_OPS). Fitted,
# not measured: the MAPE minimum over vTrain's single-node FIT half only (every 2nd of its 720
# rows; tools/fit_megatron_host.py, golden section: 33.8 us, kept at 34), validated on the
# other half (docs/calibration.md). Earlier it was fitted on rows that also validated it.
MEGATRON_CPU_S_PER_OP = 34e-6
# With the local implementation (older Megatron, Megatron-DeepSpeed), the timers synchronise
# the device around every micro-batch's forward and backward (megatron/timers.py
# _Timer.start/stop call torch.cuda.synchronize in the versions without timing log levels),
# so the host cannot run ahead across micro-batches. Megatron-Core's timers at the default
# log level do not.


@dataclass
class _Unit:
    """The compute and communication ops of one (virtual stage, micro-batch, pass)."""

    ops: list[Op] = field(default_factory=list)
    first: Op | None = None
    last: Op | None = None
    layer_bwd: dict[int, Op] = field(default_factory=dict)
    part_op: dict[int | str, Op] = field(default_factory=dict)
    carry: list[Op] = field(default_factory=list)
    """Ops the unit's next compute op waits for (an overlapped reduce-scatter's handle)."""
    """Forward: the first op of each part (layer number, ``embed``, ``head``: where its
    forward pre-hook runs); backward: the last op of each part (its gradients are ready)."""


@register("megatron")
def build_megatron(ctx: JobContext) -> Program:  # noqa: C901 - one schedule, read top down
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, MegatronOptions)
    par = s.parallelism
    m = ctx.model
    t, p, cp, vp = par.tp, par.pp, par.cp, par.vp
    dp = ctx.dp
    sp = par.sequence_parallel and t > 1
    precision = s.training.precision
    ctx.require(precision in ("bf16", "fp16", "fp8"), "training.precision",
                "megatron is modelled with 16-bit parameters (bf16 or fp16) or FP8 layers")
    ctx.require(precision != "fp8" or opts.implementation == "transformer_engine",
                "framework.implementation",
                "FP8 training needs Transformer Engine layers (implementation: "
                "transformer_engine)")
    ctx.require(m.heads % t == 0, "parallelism.tp",
                f"{m.heads} attention heads do not split over tp={t}")
    ctx.require(m.kv_heads % t == 0 or t % m.kv_heads == 0, "parallelism.tp",
                f"{m.kv_heads} key/value heads do not split over tp={t}")
    ctx.require(m.ffn_hidden % t == 0, "parallelism.tp",
                f"ffn_hidden {m.ffn_hidden} does not split over tp={t}")
    extra = int(opts.account_for_embedding_in_pipeline_split) + \
        int(opts.account_for_loss_in_pipeline_split)
    ctx.require((m.layers + extra) % (p * vp) == 0 and (m.layers + extra) // (p * vp) > 1
                or extra == 0 and m.layers % (p * vp) == 0, "parallelism.pp",
                f"{m.layers} layers{f' + {extra} (embedding/loss)' if extra else ''} do not "
                f"split into pp x vp = {p * vp} equal chunks")
    ctx.require(vp == 1 or p > 1, "parallelism.vp", "interleaving needs pipeline stages")
    ctx.require(not opts.tp_comm_overlap or sp, "framework.tp_comm_overlap",
                "tensor-parallel communication/GEMM overlap needs sequence parallelism with "
                "tp > 1 (Megatron-LM validate_args)")
    ctx.require(ctx.seq % cp == 0, "parallelism.cp",
                f"seq_len {ctx.seq} does not split over cp={cp}")
    mb_count = ctx.micro_batches
    align_gather, k_inst = data_parallel_modes(ctx, opts, vp, ctx.dp * cp)
    overlap_p2p, batch_p2p = p2p_modes(ctx, opts.overlap_p2p_comm, opts.batch_p2p_comm, p, vp)
    ctx.require(vp == 1 or mb_count % p == 0, "training.global_batch_size",
                f"interleaved 1F1B needs the micro-batch count ({mb_count}) to be a multiple "
                f"of pp={p}")
    ac = s.training.activation_checkpointing
    lay = MegatronLayout(tp=t, sequence_parallel=sp, flash_attention=opts.flash_attention,
                         dropout=opts.dropout, selective_recompute=(ac == "selective"), cp=cp,
                         fp8=opts.fp8_recipe if precision == "fp8" else None,
                         weight_cast_share=1.0 / ctx.micro_batches)
    cm = ctx.compute
    mbs, seq = ctx.micro_batch, ctx.seq
    blocks = megatron_blocks(m, lay, mbs, seq)
    cost = {k: price_block(b, STYLE, cm) for k, b in blocks.items()}
    tokens = mbs * seq // cp
    local_tokens = tokens // t if sp else tokens
    h = m.hidden
    act = 2  # 16-bit activations
    grad_fp32 = opts.grad_reduce_in_fp32 if opts.grad_reduce_in_fp32 is not None \
        else precision in ("bf16", "fp8")
    grad_bytes = 4 if grad_fp32 else 2

    def rank(ti: int, ci: int, di: int, pi: int) -> int:
        return ti + t * (ci + cp * (di + dp * pi))

    classes = []
    for st in range(p):
        members = tuple(sorted(rank(ti, ci, di, st) for ti in range(t) for ci in range(cp)
                               for di in range(dp)))
        classes.append(RankClass(st, members, label=f"pipeline stage {st}"))

    def tp_groups(st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(rank(ti, ci, di, st) for ti in range(t))
                     for ci in range(cp) for di in range(dp))

    def cp_groups(st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(rank(ti, ci, di, st) for ci in range(cp))
                     for ti in range(t) for di in range(dp))

    def dp_groups(st: int) -> tuple[tuple[int, ...], ...]:
        # Gradients are reduced over data- and context-parallel ranks together.
        return tuple(tuple(rank(ti, ci, di, st) for di in range(dp) for ci in range(cp))
                     for ti in range(t))

    # ------------------------------------------------------------------ per-stage sizes
    chunks = chunk_layers(m.layers, p, vp, opts.account_for_embedding_in_pipeline_split,
                          opts.account_for_loss_in_pipeline_split)
    stage_layer_count = [sum(len(chunks[v]) for v in range(st, p * vp, p)) for st in range(p)]
    layer_params = cost["attn_pre"].params + cost["attn_main"].params + \
        cost["mlp_pre"].params + cost["mlp_main"].params
    vocab_local = padded_vocab(m, t) // t
    emb_params = vocab_local * h + (m.max_positions * h if m.position == "learned" else 0)
    head_params = m.norm_params + vocab_local * h   # output layer (a tied copy if tied)

    def stage_params(st: int) -> int:
        n = stage_layer_count[st] * layer_params
        if st == 0:
            n += emb_params
        if st == p - 1:
            n += head_params
        return n

    opt_bytes = 12 if grad_fp32 else 16   # fp32 master + Adam moments (+ fp32 grads for fp16)
    shard = dp * cp // k_inst if opts.distributed_optimizer else 1
    # FP8: Transformer Engine keeps each linear weight's E4M3 copy and its transpose between
    # micro-batches (cast once per step): 2 bytes per linear parameter of the stage.
    linear_params = cost["attn_main"].params + cost["mlp_main"].params
    for st, cls in enumerate(classes):
        n = stage_params(st)
        cls.initial_memory = {"parameters": act * n, "gradients": grad_bytes * n,
                              "optimizer": opt_bytes * n / shard}
        if lay.fp8:
            cls.initial_memory["buffers"] = float(2 * stage_layer_count[st] * linear_params)

    # ------------------------------------------------------------------ op makers
    program = Program(classes, ctx.n_ranks, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      0.0)
    program.meta.update(framework="megatron", micro_batches=mb_count, pipeline_stages=p,
                        style="megatron", schedule=(opts.pipeline_schedule if vp == 1
                                                    else "interleaved 1f1b"))
    # GPU time of each block's kernels, and the host time Megatron's Python needs to issue
    # them (PYTHON_OPS x a calibrated cost per op; backward autograd nodes cost half): the
    # engine starts an op only once the host has issued it.
    fwd_s = {k: c.fwd_gpu_s for k, c in cost.items()}
    bwd_s = {k: c.bwd_gpu_s for k, c in cost.items()}
    legacy = opts.implementation == "local"
    py_ops = PYTHON_OPS if legacy else PYTHON_OPS_TE
    fwd_cpu = {k: py_ops[k][0] * MEGATRON_CPU_S_PER_OP for k in cost}
    bwd_cpu = {k: py_ops[k][1] * MEGATRON_CPU_S_PER_OP / 2 for k in cost}
    cpu_call = MEGATRON_CPU_S_PER_OP
    core_names = {"qk_bmm", "softmax", "attn_dropout", "pv_bmm", "flash_fwd"}
    # Selective recomputation drops what core attention saves beyond its inputs: the
    # softmax output and the dropout mask and output (the 5as^2b term; Korthikanti et al.).
    core_saved = float(sum(tn.nbytes for tn in blocks["attn_main"].saved
                           if tn.name.endswith((".probs", "attn_dropout.mask",
                                                "attn_dropout.out"))))
    from sim.layer_ops import kernel_time

    core_fwd_s = sum(kernel_time(cm, k) for k in blocks["attn_main"].forward
                     if k.name.split(".")[0] in core_names)
    # (dgrad, wgrad) GPU seconds of each column-parallel linear (with its FP8 gradient cast).
    col_gemm_s = {lin: tuple(sum(kernel_time(cm, k) for k in blocks[blk].backward
                                 if k.name in names)
                             for names in ({f"{lin}.dgrad", f"{lin}.cast_g", f"{lin}.amax_g"},
                                           {f"{lin}.wgrad"}))
                  for lin, blk in (("qkv", "attn_main"), ("fc1", "mlp_main"))}
    gemm_spans = userbuffer_gemm_spans(blocks, lambda k: kernel_time(cm, k))
    layer_saved = sum(cost[k].saved_bytes for k in ("attn_pre", "attn_main", "mlp_pre",
                                                    "mlp_main"))
    layer_hold: float
    if ac == "full":
        layer_hold = float(act * local_tokens * h)   # the layer input only
    elif ac == "selective":
        layer_hold = layer_saved - core_saved
    else:
        layer_hold = layer_saved

    layer_fwd_flops = sum(blocks[k].flops_fwd for k in ("attn_main", "mlp_main"))
    hw_extra = 0.0
    if ac == "full":
        hw_extra = layer_fwd_flops * m.layers * mb_count * dp * cp
    program.hw_flops_per_step = ctx.model_flops_per_step() + hw_extra

    keyseq = [0]

    def new_key(prefix: str) -> str:
        keyseq[0] += 1
        return f"{prefix}#{keyseq[0]}"

    def compute(name: str, dur: float, **kw: object) -> Op:
        return Op(name=name, kind="compute", stream="compute", duration=dur, **kw)  # type: ignore[arg-type]

    def tp_comm(st: int, op: str, nbytes: float, name: str, mb: int, layer: int | None,
                side: bool = False) -> Op:
        groups = tp_groups(st)
        stream = "tp" if (opts.tp_comm_overlap or side) else "compute"
        return Op(name=name, kind="collective", stream=stream, phase="comm", collective=op,  # type: ignore[arg-type]
                  group=groups[0], groups=groups,
                  nbytes=nbytes, key=new_key(f"tp/{st}"), category=op, micro_batch=mb,
                  layer=layer, cpu_s=cpu_call)

    def block_ops(st: int, unit: _Unit, names: tuple[str, str], comm_after: str | None,
                  comm_before: str | None, dur_pre: float, dur_main: float, label: str,
                  mb: int, layer: int, phase: str, alloc: float = 0.0, free: float = 0.0,
                  flops: float = 0.0, cpu_pre: float = 0.0, cpu_main: float = 0.0,
                  column: str | None = None, ring: str | None = None) -> None:
        """One block's ops: [pre] [comm_before] main [comm_after], chained on the stream.
        ``column``: a backward ending with this column-parallel linear, whose input re-gather
        and gradient reduce-scatter overlap its GEMMs under sequence parallelism."""
        full = act * tokens * h          # a gathered [s, b, h] tensor
        overlap = opts.tp_comm_overlap and t > 1

        def make(name: str, d: float, **kw: object) -> Op:
            return compute(name, d, phase=phase, micro_batch=mb, layer=layer,
                           category=_cat(phase), **kw)

        ops: list[Op] = []
        consumed = 0.0      # seconds of the main block already split off before the core
        if t > 1 and sp and comm_before:
            ops.append(compute(f"{label} {names[0]}", dur_pre, phase=phase, micro_batch=mb,
                               layer=layer, category=_cat(phase), cpu_s=cpu_pre))
            gather = tp_comm(st, comm_before, full, f"{comm_before} {label}", mb, layer)
            main = compute(f"{label} {names[1]}", dur_main, phase=phase, micro_batch=mb,
                           layer=layer, category=_cat(phase), flops=flops, cpu_s=cpu_main)
            if overlap:
                before_s, gemm_s = gemm_spans[names][:2]
                ops += ring_exchange_gather(main, before_s, gemm_s, t, gather, ops[0], make)
                consumed = ops[-2].duration
            else:
                ops += [gather, main]
        else:
            ops.append(compute(f"{label}", dur_pre + dur_main, phase=phase, micro_batch=mb,
                               layer=layer, category=_cat(phase), flops=flops,
                               cpu_s=cpu_pre + cpu_main))
        if cp > 1 and ring:
            before, core = ring_s[ring]
            if ring == "fwd" and len(ops) == 1:
                before += dur_pre           # the norm ran first in the merged op
            ops[-1:] = cp_ring(ops[-1], max(0.0, before - consumed), core, cp,
                               ring_bytes[ring], cp_transfer(st, mb, layer, label), make)
        if alloc:
            ops[0].alloc = (("activations", alloc),)
        if free:
            ops[-1].free = (("activations", free),)
        carry: list[Op] = []
        if t > 1 and sp and column:
            gather = tp_comm(st, "all_gather", full, f"all_gather input {label}", mb, layer,
                             side=True)
            scatter = tp_comm(st, "reduce_scatter", full, f"reduce_scatter {label}", mb,
                              layer, side=True)
            ops[-1:] = column_linear_backward(ops[-1], col_gemm_s[column][0],
                                              col_gemm_s[column][1], gather, scatter, make)
            carry = [scatter]
        elif t > 1 and comm_after:
            comm = tp_comm(st, comm_after, full, f"{comm_after} {label}", mb, layer)
            if overlap:
                gemm_s, after_s = gemm_spans[names][2:]
                splits = TE_PIPELINE_SPLITS
                comm.nbytes = full * (splits - 1) / splits
                tail = tp_comm(st, comm_after, full / splits, f"{comm_after} {label} (last)",
                               mb, layer)
                ops[-1:] = pipelined_scatter(ops[-1], gemm_s, after_s, comm, tail, make,
                                             f"wait {comm_after} {label}", splits)
            else:
                ops.append(comm)
        ops[0].deps = list(ops[0].deps) + unit.carry
        unit.carry = carry
        unit.ops.extend(ops)

    ckpt_cpu = CHECKPOINT_OPS * MEGATRON_CPU_S_PER_OP

    # Context parallelism: Transformer Engine's ring (sim.frameworks.megatron_overlap.cp_ring)
    # passes each rank's K and V (2 x tokens x kv width) to the next rank once per step.
    kv_bytes = 2.0 * act * tokens * max(1, m.kv_heads // t) * m.head_dim
    ring_bytes = {"fwd": [kv_bytes] * (cp - 1),
                  "bwd": [kv_bytes] + [2 * kv_bytes] * (cp - 2) + [kv_bytes]}
    core_bwd = {"flash_bwd", "qk_bmm", "softmax", "attn_dropout", "pv_bmm"}
    fwd_ks = blocks["attn_main"].forward
    first_core = next((i for i, k in enumerate(fwd_ks) if k.name.split(".")[0] in core_names),
                      len(fwd_ks))
    ring_s = {"fwd": (sum(kernel_time(cm, k) for k in fwd_ks[:first_core]), core_fwd_s),
              "bwd": (sum(kernel_time(cm, k) for k in blocks["attn_main"].backward
                          if k.name.split(".")[0] in ("proj", "bda")),
                      sum(kernel_time(cm, k) for k in blocks["attn_main"].backward
                          if k.name.split(".")[0] in core_bwd))}

    def cp_transfer(st: int, mb: int, layer: int, label: str) -> Callable[[float, int], Op]:
        pairs = tuple((rank(ti, ci, di, st), rank(ti, (ci + 1) % cp, di, st))
                      for ti in range(t) for di in range(dp) for ci in range(cp))
        return lambda nbytes, i: Op(
            name=f"cp ring {label} step {i}", kind="send", stream="cp", phase="comm",
            pairs=pairs, nbytes=nbytes, key=new_key(f"cp/{st}"), category="send_recv",
            micro_batch=mb, layer=layer, cpu_s=cpu_call)

    def layer_forward(st: int, unit: _Unit, mb: int, layer: int, recompute: bool) -> None:
        phase = "recompute" if recompute else "fwd"
        alloc = 0.0 if recompute else layer_hold
        block_ops(st, unit, ("norm", "attention"), "reduce_scatter" if sp else "all_reduce",
                  "all_gather", fwd_s["attn_pre"], fwd_s["attn_main"],
                  f"{phase} attn L{layer} mb{mb}", mb, layer, phase, alloc=alloc,
                  flops=0.0 if recompute else blocks["attn_main"].flops_fwd, ring="fwd",
                  cpu_pre=fwd_cpu["attn_pre"] + (ckpt_cpu if recompute else 0.0),
                  cpu_main=fwd_cpu["attn_main"])
        block_ops(st, unit, ("norm", "mlp"), "reduce_scatter" if sp else "all_reduce",
                  "all_gather", fwd_s["mlp_pre"], fwd_s["mlp_main"],
                  f"{phase} mlp L{layer} mb{mb}", mb, layer, phase,
                  flops=0.0 if recompute else blocks["mlp_main"].flops_fwd,
                  cpu_pre=fwd_cpu["mlp_pre"], cpu_main=fwd_cpu["mlp_main"])

    def layer_backward(st: int, unit: _Unit, mb: int, layer: int) -> None:
        if ac == "full":
            layer_forward(st, unit, mb, layer, recompute=True)
            # The recomputed layer's activations live until its backward ends.
            unit.ops[-1].alloc = unit.ops[-1].alloc + (("activations", layer_saved),)
        block_ops(st, unit, ("mlp", "norm"), "reduce_scatter" if sp else "all_reduce",
                  "all_gather", bwd_s["mlp_pre"], bwd_s["mlp_main"],
                  f"bwd mlp L{layer} mb{mb}", mb, layer, "bwd",
                  flops=blocks["mlp_main"].flops_bwd, cpu_pre=bwd_cpu["mlp_pre"],
                  cpu_main=bwd_cpu["mlp_main"], column="fc1")
        extra = core_fwd_s if ac == "selective" else 0.0
        free = layer_hold + (layer_saved if ac == "full" else 0.0)
        block_ops(st, unit, ("attention", "norm"), "reduce_scatter" if sp else "all_reduce",
                  "all_gather", bwd_s["attn_pre"], bwd_s["attn_main"] + extra,
                  f"bwd attn L{layer} mb{mb}", mb, layer, "bwd", free=free,
                  flops=blocks["attn_main"].flops_bwd, cpu_pre=bwd_cpu["attn_pre"],
                  cpu_main=bwd_cpu["attn_main"], column="qkv", ring="bwd")
        unit.layer_bwd[layer] = unit.ops[-1]
        unit.part_op[layer] = unit.ops[-1]

    n_virtual = p * vp
    scatter_gather = opts.scatter_gather_tensors_in_pipeline
    if scatter_gather is None:
        scatter_gather = legacy
    # Megatron's pipeline p2p (Narayanan et al., SC'21, sec. 4.1 "scatter/gather
    # optimization"): without sequence parallelism every tensor-parallel rank holds the same
    # activation, so each sends only its 1/tp slice across the stage boundary.
    p2p_split = t if (scatter_gather and t > 1 and not sp) else 1

    def build_unit(kind: str, v: int, mb: int) -> _Unit:
        st = v % p
        unit = _Unit()
        layers = chunks[v]
        receives = (v > 0) if kind == "F" else (v < n_virtual - 1)
        if receives and p2p_split > 1:
            # The received 1/tp slices are all-gathered in the tensor-parallel group
            # (gather_split_1d_tensor after the recv in Megatron's _communicate).
            unit.ops.append(tp_comm(st, "all_gather", act * tokens * h,
                                    f"gather received {'act' if kind == 'F' else 'grad'} "
                                    f"mb{mb}", mb, None))
        if kind == "F":
            if v == 0:
                unit.ops.append(compute(f"fwd embed mb{mb}", fwd_s["embed"], phase="fwd",
                                        micro_batch=mb, category="forward",
                                        cpu_s=fwd_cpu["embed"],
                                        alloc=(("activations", cost["embed"].saved_bytes),)))
                unit.part_op["embed"] = unit.ops[-1]
                if t > 1:
                    unit.ops.append(tp_comm(st, "reduce_scatter" if sp else "all_reduce",
                                            act * tokens * h, f"embed reduce mb{mb}", mb,
                                            None))
            for layer in layers:
                n_before = len(unit.ops)
                layer_forward(st, unit, mb, layer, recompute=False)
                unit.part_op[layer] = unit.ops[n_before]
            if v == n_virtual - 1:
                c = cost["head"]
                unit.ops.append(compute(f"fwd head+loss mb{mb}", fwd_s["head"], phase="fwd",
                                        micro_batch=mb, category="forward",
                                        cpu_s=fwd_cpu["head"],
                                        alloc=(("activations", c.saved_bytes),),
                                        transient=c.fwd_transient_bytes,
                                        transient_parts=c.fwd_transient_parts,
                                        flops=blocks["head"].flops_fwd))
                unit.part_op["head"] = unit.ops[-1]
        else:
            if v == n_virtual - 1:
                c = cost["head"]
                unit.ops.append(compute(f"bwd head+loss mb{mb}", bwd_s["head"], phase="bwd",
                                        micro_batch=mb, category="backward",
                                        cpu_s=bwd_cpu["head"],
                                        free=(("activations", c.saved_bytes),),
                                        transient=c.bwd_transient_bytes,
                                        transient_parts=c.bwd_transient_parts,
                                        flops=blocks["head"].flops_bwd))
                unit.part_op["head"] = unit.ops[-1]
            for layer in reversed(layers):
                layer_backward(st, unit, mb, layer)
            if v == 0:
                unit.ops.append(compute(f"bwd embed mb{mb}", bwd_s["embed"], phase="bwd",
                                        micro_batch=mb, category="backward",
                                        cpu_s=bwd_cpu["embed"],
                                        free=(("activations", cost["embed"].saved_bytes),),
                                        deps=unit.carry))
                unit.part_op["embed"] = unit.ops[-1]
                unit.carry = []
        if unit.carry:      # the last linear's reduce-scatter, before the send
            unit.ops.append(compute(f"wait {unit.carry[0].name}", 0.0, phase="bwd",
                                    micro_batch=mb, category="backward", deps=unit.carry,
                                    kernels=0))
            unit.carry = []
        unit.first, unit.last = unit.ops[0], unit.ops[-1]
        if legacy:
            unit.last.host_sync = True
        return unit

    # ------------------------------------------------------------------ pipeline
    units: dict[tuple[str, int, int], _Unit] = {}
    for v in range(n_virtual):
        for mb in range(mb_count):
            for kind in ("F", "B"):
                units[(kind, v, mb)] = build_unit(kind, v, mb)
    link = P2PLink(pairs=lambda a, b: tuple((rank(ti, ci, di, a), rank(ti, ci, di, b))
                                            for ti in range(t) for ci in range(cp)
                                            for di in range(dp)),
                   nbytes=act * local_tokens * h / p2p_split, cpu_s=cpu_call, p=p)

    # ------------------------------------------------------------------ buckets
    reduce_op = "reduce_scatter" if opts.distributed_optimizer else "all_reduce"
    size = bucket_size(opts.bucket_size, opts.overlap_grad_reduce, dp * cp)
    buckets = {st: assign_buckets(st, p, vp, chunks, layer_params, emb_params, head_params,
                                  size) for st in range(p)}
    launch_after: dict[int, list[Op]] = {}   # id(op) -> ops the host issues right after it
    insert_before: dict[int, list[Op]] = {}  # id(op) -> ops the host issues right before it
    empty = StageBuckets()
    stage_buckets = {st: empty for st in range(p)}
    for st in range(p) if dp * cp > 1 else ():
        forwards = [u for u in schedule("1f1b" if vp > 1 else opts.pipeline_schedule, p, st,
                                        mb_count, vp) if u[0] == "F"]
        stage_buckets[st] = bucket_ops(st, p, vp, mb_count, buckets[st], forwards, BucketComms(
            groups=instance_groups(dp_groups(st), k_inst)[0], reduce_op=reduce_op,
            inter_groups=instance_groups(dp_groups(st), k_inst)[1],
            grad_bytes=grad_bytes, param_bytes=act,
            overlap_grad_reduce=opts.overlap_grad_reduce,
            overlap_param_gather=opts.distributed_optimizer and opts.overlap_param_gather,
            align_param_gather=align_gather,
            gather_with_optimizer=opts.overlap_param_gather_with_optimizer_step,
            part_op=lambda k, v, mb, part: units[(k, v, mb)].part_op[part],
            first_op=lambda k, v, mb: units[(k, v, mb)].first,  # type: ignore[arg-type,return-value]
            key=lambda st=st: new_key(f"dp/{st}"), cpu_s=cpu_call,  # type: ignore[misc]
            launch_after=launch_after, insert_before=insert_before))

    def optimizer_s(st: int) -> float:
        # Grad unscale/norm (read 4 B), Adam over the fp32 shard (28 B), copy the updated
        # shard into 16-bit parameters (6 B), zero the gradient buffers.
        n = stage_params(st)
        local = n / shard
        return (cm.adamw_time(local, True, 8 * stage_layer_count[st] + 4)
                + cm.membound_time(4 * local) + cm.membound_time(6 * local)
                + cm.membound_time(grad_bytes * n))

    def chunk0_share(st: int) -> float:
        return sum(b.params for b in buckets[st] if b.v < p) / stage_params(st)

    rotated = opts.overlap_param_gather_with_optimizer_step and dp * cp > 1
    kind_sched = opts.pipeline_schedule if vp == 1 else "1f1b"
    last_bwd: dict[int, Op] = {}
    for st, cls in enumerate(classes):
        last_on_stream: dict[str, Op] = {}

        def run_unit(u: tuple[str, int, int], st: int = st, cls: RankClass = cls,
                     last_on_stream: dict[str, Op] = last_on_stream
                     ) -> tuple[Op | None, Op | None]:
            kind, chunk, mb = u
            unit = units[(kind, chunk * p + st, mb)]
            for op in unit.ops:
                for o in (*insert_before.get(id(op), []), op, *launch_after.get(id(op), [])):
                    program.add(cls, o)
                    last_on_stream[o.stream] = o
            if kind == "B":
                last_bwd[st] = unit.last  # type: ignore[assignment]
            return unit.first, unit.last

        for g in stage_buckets[st].prologue:    # aligned: before the first receive
            program.add(cls, g)
            last_on_stream[g.stream] = g
        if rotated:
            # Steady state of ChainedOptimizer._step (chunk 0, its gathers, the others): the
            # step opens at that dispatch and ends with chunk 0's optimizer step.
            last_on_stream["compute"] = program.add(cls, compute(
                "optimizer step chunks 1+ (previous step)",
                optimizer_s(st) * (1.0 - chunk0_share(st)), phase="optimizer",
                category="optimizer"))
        steps = pipeline_steps(kind_sched, p, st, mb_count, vp, overlap=overlap_p2p,
                               sync=batch_p2p)
        add_stage(program, cls, st, steps, run_unit, link, last_on_stream)

    # ------------------------------------------------------------------ gradients, optimizer
    for st, cls in enumerate(classes):
        n = stage_params(st)
        groups = instance_groups(dp_groups(st), k_inst)[0]
        deps_done = [last_bwd[st]] + stage_buckets[st].grads
        if not opts.overlap_grad_reduce:
            for g in stage_buckets[st].grads:   # finalize_model_grads: every chunk's one bucket
                g.deps = g.deps or [last_bwd[st]]
                program.add(cls, g)
        if m.tied_embeddings and p > 1 and st in (0, p - 1):
            pairs = tuple((rank(ti, ci, di, 0), rank(ti, ci, di, p - 1)) for ti in range(t)
                          for ci in range(cp) for di in range(dp))
            tie = program.add(cls, Op(
                name="tied embedding all-reduce", kind="collective", stream="dp",
                phase="comm", deps=list(deps_done), collective="all_reduce",
                group=pairs[0], groups=pairs, nbytes=grad_bytes * vocab_local * h,
                key="embedding-group", category="all_reduce"))
            deps_done.append(tie)
        dur = optimizer_s(st)
        if rotated:
            dur *= chunk0_share(st)     # the other chunks' steps open the step (see above)
        opt = program.add(cls, compute("optimizer step", dur, phase="optimizer",
                                       category="optimizer", deps=deps_done))
        if opts.distributed_optimizer and dp * cp > 1 and not stage_buckets[st].gathers:
            # Without overlap_param_gather the optimizer gathers every bucket right away.
            for b in buckets[st]:
                program.add(cls, Op(
                    name=f"param all_gather bucket v{b.v} {b.parts[-1]}", kind="collective",
                    stream="dp", phase="comm", deps=[opt], collective="all_gather",
                    group=groups[0], groups=groups, nbytes=act * b.params,
                    key=new_key(f"dp/{st}"), category="all_gather"))
    return program


def _cat(phase: str) -> str:
    return {"fwd": "forward", "bwd": "backward", "recompute": "recompute"}.get(phase, phase)
