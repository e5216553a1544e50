"""Megatron-DeepSpeed 3D: DeepSpeed's PipelineEngine over Megatron's tensor-parallel layers.

``framework.name: deepspeed`` with ``parallelism.tp`` or ``pp`` > 1 is how BLOOM-176B trained
(Megatron-DeepSpeed's ``GPTModelPipe``, a DeepSpeed ``PipelineModule``). Read from DeepSpeed
at commit 38327e07 (``runtime/pipe/engine.py``, ``schedule.py``, ``p2p.py``, ``module.py``,
``runtime/engine.py``, ``bf16_optimizer.py``, ``zero/stage_1_and_2.py``, ``runtime/utils.py``
``PartitionedTensor``):

* Layout (``PipeModelDataParallelTopology``, axes pipe, data, model; a
  :class:`~sim.program.mesh.RankMesh`): global rank
  ``t + tp * (d + dp * s)``; each pipeline stage is one rank class.
* Layers: Megatron's local (apex/fused-kernel) layers, priced by :mod:`sim.workload.megatron_ops`
  (column-parallel QKV and fc1, row-parallel projection and fc2; two blocking all-reduces in
  the tensor-parallel group in forward and two in backward per layer; no sequence
  parallelism). The tied word embedding sits on the first and last stage (``TiedLayerSpec``),
  split by ``partition_method``.
* Schedule: :func:`sim.frameworks.deepspeed.pipe_schedule.train_schedule`, every instruction
  in order on the compute stream. ``p2p.send``/``recv`` are ``torch.distributed.send``/
  ``recv`` (blocking; a large NCCL send completes only once the receiver has posted its
  receive), so each transfer is one rendezvous that both stages' streams wait for (an op of
  kind ``recv``, which the engine starts once both ends have reached it).
* ``pipe_partitioned``/``grad_partitioned`` (defaults on, effective with tp > 1): a stage
  sends a ``PartitionedTensor`` — a small meta tensor then its 1/tp slice, two blocking sends
  — and the receiver rebuilds the full tensor with an all-gather in the tensor-parallel group
  (``PartitionedTensor.full``): the input before the forward; in backward the stage's own
  output (its data was freed after the send) and the received gradient.
* Activation checkpointing (``--checkpoint-activations``, ``deepspeed.checkpointing``):
  every transformer layer keeps only its input and recomputes its forward, tensor-parallel
  all-reduces included, before its backward; with ``partition_activations`` each
  tensor-parallel rank keeps 1/tp of the input and all-gathers it before the recompute.
* Gradients and optimizer (``_exec_reduce_tied_grads``, ``_exec_reduce_grads``: only after
  the last micro-batch, nothing overlaps backward; all on the compute stream):

  - ``zero_stage: 0`` with bf16 — ``BF16_Optimizer`` (what BLOOM ran: "bf16 must use z0! it
    implements its own zero stage 1 equivalent"): each backward's bf16 gradients are added
    into fp32 accumulators (``update_hp_grads``); the tied embedding's fp32 gradient is
    all-reduced between the first and last stage; ``buffered_allreduce_fallback`` casts the
    flat fp32 gradients to bf16 and all-reduces them over data-parallel ranks; fp32 master
    weights and Adam states are sharded over data-parallel ranks, the step updates the shard
    and all-gathers the bf16 weights.
  - ``zero_stage: 0`` with fp16 — ``FP16_Optimizer`` (fused): 16-bit gradients accumulate
    in ``.grad``; ``buffered_allreduce_fallback`` all-reduces them in buckets of 5e8
    elements; every rank keeps the stage's full fp32 master and Adam states; overflow
    check and norm read by the host; no weight all-gather.
  - ``zero_stage: 1`` — ``DeepSpeedZeroOptimizer``: 16-bit gradients accumulate in ``.grad``;
    ``reduce_gradients(pipeline_parallel=True)`` all-reduces them bucket by bucket
    (``reduce_bucket_size``) through the ipg buffer, each rank keeping its slice; the step on
    the fp32 shard, then an all-gather of the 16-bit weights.

  The global gradient norm (gradient clipping) is all-reduced over the model-parallel group
  (every stage and tensor-parallel rank of a replica) before any stage steps.
* Memory: 16-bit parameters and gradients of the stage's 1/tp shard, fp32 accumulators
  (BF16_Optimizer), 12 bytes of fp32 master and Adam states per parameter sharded over
  data-parallel ranks; activations of every micro-batch in flight (at most
  ``num_pipe_buffers``).

Not modelled: the attention mask and micro-batch loading (``LoadMicroBatch`` copies a few
KB), the embedding LayerNorm BLOOM adds, ALiBi's bias (folded into the fused softmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.nccl_dtype import half
from sim.frameworks.deepspeed.pipe_schedule import train_schedule
from sim.frameworks.deepspeed.pipe_step import (
    FP32,
    TORCH_CALL_CPU_S,
    W16,
    optimizer_step,
    reduce_grads,
    reduce_tied,
)
from sim.frameworks.megatron.build import MEGATRON_CPU_S_PER_OP
from sim.program.ir import CollectiveOp, NcclType, Op, Phase, Program, RankClass
from sim.program.mesh import Groups, Pairs, RankMesh
from sim.scenario import DeepSpeedOptions
from sim.workload.layer_ops import BlockCost, price_block
from sim.workload.megatron_host_ops import CHECKPOINT_OPS, PYTHON_OPS
from sim.workload.megatron_ops import (
    STYLE,
    MegatronLayout,
    megatron_blocks,
    padded_vocab,
)

META_BYTES = 64
"""PartitionedTensor.to_meta: a LongTensor of the original shape, part count, rank and the
partition offsets (8 bytes each, about eight of them)."""


@dataclass(frozen=True)
class _Setup:
    """The scenario resolved to what DeepSpeed and Megatron-DeepSpeed run."""

    t: int
    p: int
    dp: int
    m: int
    bf16_optimizer: bool
    fp16_optimizer: bool
    partitioned_act: bool
    partitioned_grad: bool
    stage_layers: tuple[tuple[int, ...], ...]


def _stage_layers(ctx: JobContext, method: str) -> tuple[tuple[int, ...], ...]:
    """Transformer layers of each stage: PipelineModule's ``type:transformer`` balances the
    layers; ``type:transformer|embedding`` counts the embedding on the first and the tied
    embedding on the last stage as one layer each (BLOOM: 70 + 2 = 72 over 12 stages)."""
    layers, p = ctx.model.layers, ctx.scenario.parallelism.pp
    extra = 2 if method == "type:transformer|embedding" and p > 1 else 0
    ctx.require((layers + extra) % p == 0 and (layers + extra) // p > 1, "parallelism.pp",
                f"{layers} layers{' + 2 embeddings' if extra else ''} do not split into "
                f"pp={p} equal stages")
    per = (layers + extra) // p
    sizes = [per] * p
    if extra:
        sizes[0] -= 1
        sizes[-1] -= 1
    out, start = [], 0
    for k in sizes:
        out.append(tuple(range(start, start + k)))
        start += k
    return tuple(out)


def _resolve(ctx: JobContext) -> _Setup:
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, DeepSpeedOptions)
    par = s.parallelism
    m = ctx.model
    t = par.tp
    ctx.require(opts.zero_stage in (0, 1), "framework.zero_stage",
                "DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 (\"incompatible with "
                "pipeline parallelism\"); use zero_stage 0 or 1 with tp or pp > 1")
    ctx.require(opts.offload_optimizer == "none" and opts.offload_param == "none",
                "framework.offload_optimizer",
                "offload with tensor or pipeline parallelism is not modelled")
    ctx.require(not (opts.zeropp.qwz or opts.zeropp.hpz or opts.zeropp.qgz), "framework.zeropp",
                "ZeRO++ needs zero_stage 3, which the PipelineEngine refuses")
    ctx.require(par.cp == 1 and par.vp == 1 and not par.sequence_parallel, "parallelism",
                "Megatron-DeepSpeed 3D is modelled without context parallelism, interleaving "
                "(vp) or sequence parallelism")
    ctx.require(s.training.precision in ("bf16", "fp16"), "training.precision",
                "Megatron-DeepSpeed is modelled with bf16 or fp16")
    ctx.require(s.training.activation_checkpointing != "selective",
                "training.activation_checkpointing",
                "deepspeed.checkpointing recomputes whole layers: none or full")
    ctx.require(m.heads % t == 0 and m.kv_heads % t == 0, "parallelism.tp",
                f"{m.heads} attention heads do not split over tp={t}")
    ctx.require(m.ffn_hidden % t == 0, "parallelism.tp",
                f"ffn_hidden {m.ffn_hidden} does not split over tp={t}")
    layers = _stage_layers(ctx, opts.pipeline.partition_method)
    return _Setup(t=t, p=par.pp, dp=ctx.dp, m=ctx.micro_batches,
                  bf16_optimizer=opts.zero_stage == 0 and s.training.precision == "bf16",
                  fp16_optimizer=opts.zero_stage == 0 and s.training.precision == "fp16",
                  partitioned_act=opts.pipeline.pipe_partitioned and t > 1,
                  partitioned_grad=opts.pipeline.grad_partitioned and t > 1,
                  stage_layers=layers)


TOPOLOGY_AXES = ("pipe", "data", "model")
"""``PipeModelDataParallelTopology``'s axes, outermost first (``runtime/pipe/topology.py``;
``ProcessTopology`` lays them out row-major): global rank ``t + tp * (d + dp * s)``."""


def build_deepspeed_pipe(ctx: JobContext) -> Program:
    """The program of one DeepSpeed pipeline-engine step (see the module docstring)."""
    return _Pipe(ctx, _resolve(ctx)).build()


class _Pipe:
    """Emits every stage's instruction stream as ops."""

    def __init__(self, ctx: JobContext, su: _Setup) -> None:
        self.ctx, self.su = ctx, su
        self.grid = RankMesh(TOPOLOGY_AXES, (su.p, su.dp, su.t))
        s = ctx.scenario
        opts = s.framework
        assert isinstance(opts, DeepSpeedOptions)
        self.opts = opts
        m = ctx.model
        self.mdl = m
        self.cm = ctx.compute
        self.recompute = s.training.activation_checkpointing == "full"
        lay = MegatronLayout(tp=su.t, flash_attention=opts.pipeline.flash_attention,
                             dropout=opts.pipeline.dropout)
        self.blocks = megatron_blocks(m, lay, ctx.micro_batch, ctx.seq)
        self.cost: dict[str, BlockCost] = {k: price_block(b, STYLE, self.cm)
                                           for k, b in self.blocks.items()}
        c = self.cost
        self.tokens = ctx.micro_batch * ctx.seq
        self.act_bytes = float(W16 * self.tokens * m.hidden)     # one [s, b, h] tensor
        self.w16 = half(s.training.precision)   # NCCL type of the 16-bit tensors
        self.layer_params = sum(c[k].params for k in ("attn_pre", "attn_main", "mlp_pre",
                                                      "mlp_main"))
        self.vocab_local = padded_vocab(m, su.t) // su.t
        self.layer_saved = sum(c[k].saved_bytes for k in ("attn_pre", "attn_main", "mlp_pre",
                                                          "mlp_main"))
        # deepspeed.checkpointing keeps a checkpointed layer's input, 1/tp of it with
        # partition_activations (checkpointing.py partition_activations /
        # gather_partitioned_activations).
        self.partition_acts = opts.pipeline.partition_activations and self.recompute \
            and su.t > 1
        self.layer_hold = (self.act_bytes / (su.t if self.partition_acts else 1)
                           if self.recompute else self.layer_saved)
        self.cpu = {k: PYTHON_OPS[k][0] * MEGATRON_CPU_S_PER_OP for k in c}
        self.cpu_b = {k: PYTHON_OPS[k][1] * MEGATRON_CPU_S_PER_OP / 2 for k in c}
        self.blocking = opts.pipeline.cuda_launch_blocking
        self._keys = 0

    # ------------------------------------------------------------------ layout
    def rank(self, ti: int, di: int, st: int) -> int:
        return self.grid.rank(model=ti, data=di, pipe=st)

    def tp_groups(self, st: int) -> Groups:
        return self.grid.groups(["model"], pipe=st)

    def dp_groups(self, st: int) -> Groups:
        return self.grid.groups(["data"], pipe=st)

    def stage_pairs(self, src: int, dst: int) -> Pairs:
        """(rank on stage ``src``, its peer on ``dst``), tensor-parallel index outermost: a
        pipeline transfer's pairs, or the tied embedding's."""
        return self.grid.peer_pairs("pipe", src, dst, over=["model", "data"])

    def model_parallel_groups(self) -> Groups:
        """One per data-parallel index: every stage and tensor-parallel rank of a replica
        (``PipelineParallelGrid``'s ``ds_model_proc_group``, ranks ascending)."""
        return self.grid.groups(["pipe", "model"])

    def stage_params(self, st: int) -> int:
        """Parameters of stage ``st`` on one tensor-parallel rank (a tied embedding counted
        on both stages that hold it)."""
        m, p = self.mdl, self.su.p
        n = len(self.su.stage_layers[st]) * self.layer_params
        emb = self.vocab_local * m.hidden
        if st == 0:
            n += emb + (m.max_positions * m.hidden if m.position == "learned" else 0)
        if st == p - 1:
            n += m.norm_params + emb
        return n

    # ------------------------------------------------------------------ op makers
    def key(self, prefix: str) -> str:
        self._keys += 1
        return f"{prefix}#{self._keys}"

    def op(self, cls: RankClass, op: Op) -> Op:
        if self.blocking:
            op.host_sync = True
        return self.program.add(cls, op)

    def compute(self, cls: RankClass, name: str, dur: float, phase: Phase, mb: int = -1,
                **kw: object) -> Op:
        cat = {"fwd": "forward", "bwd": "backward", "recompute": "recompute"}.get(phase, phase)
        return self.op(cls, Op(name=name, kind="compute", stream="compute", phase=phase,
                               duration=dur, micro_batch=mb if mb >= 0 else None,
                               category=cat, **kw))  # type: ignore[arg-type]

    def membound(self, cls: RankClass, name: str, nbytes: float, phase: Phase,
                 kernels: int = 1, **kw: object) -> Op:
        dur = self.cm.membound_time(nbytes) + max(0, kernels - 1) * self.cm.kernel_min_s
        return self.compute(cls, name, dur, phase, kernels=kernels,
                            cpu_s=kernels * TORCH_CALL_CPU_S, **kw)  # type: ignore[arg-type]

    def collective(self, cls: RankClass, name: str, coll: CollectiveOp, nbytes: float,
                   groups: tuple[tuple[int, ...], ...], prefix: str, mb: int = -1,
                   layer: int | None = None, key: str | None = None,
                   dtype: NcclType | None = None) -> Op | None:
        """A collective on the compute stream; ``key`` names it across rank classes (a
        group inside one class gets a fresh one). Of 16-bit tensors unless ``dtype``."""
        if len(groups[0]) <= 1 or nbytes <= 0:
            return None
        return self.op(cls, Op(name=name, kind="collective", stream="compute", phase="comm",
                               collective=coll, group=groups[0], groups=groups,
                               nbytes=nbytes, dtype=dtype or self.w16,
                               key=key or self.key(prefix), category=coll,
                               micro_batch=mb if mb >= 0 else None, layer=layer,
                               cpu_s=TORCH_CALL_CPU_S))

    def tp(self, cls: RankClass, st: int, coll: CollectiveOp, name: str, mb: int,
           layer: int | None = None) -> None:
        self.collective(cls, name, coll, self.act_bytes, self.tp_groups(st), f"tp/{st}", mb,
                        layer)

    def p2p(self, cls: RankClass, what: str, src: int, dst: int, mb: int, sending: bool,
            partitioned: bool) -> None:
        """A blocking send (or receive) between neighbouring stages: one rendezvous per
        tensor, both ends' compute streams wait for it."""
        su = self.su
        pairs = self.stage_pairs(src, dst)
        # The partition's meta is int64 (send_obj_meta's LongTensor), the data 16-bit.
        tensors: list[tuple[str, float, NcclType]] = \
            [("meta", float(META_BYTES), "i64"), ("data", self.act_bytes / su.t, self.w16)] \
            if partitioned else [("data", self.act_bytes, self.w16)]
        verb = "send" if sending else "recv"
        for label, nbytes, dtype in tensors:
            self.op(cls, Op(name=f"{verb} {what} {label} s{src}->s{dst} mb{mb}", kind="recv",
                            stream="compute", phase="comm", pairs=pairs, nbytes=nbytes,
                            dtype=dtype,
                            key=f"p2p/{what}/{src}->{dst}/{mb}/{label}", category="send_recv",
                            micro_batch=mb, cpu_s=TORCH_CALL_CPU_S))

    # ------------------------------------------------------------------ passes
    def layer_fwd(self, cls: RankClass, st: int, mb: int, layer: int, phase: Phase) -> None:
        c, cpu = self.cost, self.cpu
        blocks = self.blocks
        recompute = phase == "recompute"
        extra_cpu = CHECKPOINT_OPS * MEGATRON_CPU_S_PER_OP if recompute else 0.0
        alloc = () if recompute else (("activations", self.layer_hold),)
        self.compute(cls, f"{phase} attn L{layer} mb{mb}",
                     c["attn_pre"].fwd_gpu_s + c["attn_main"].fwd_gpu_s, phase, mb,
                     layer=layer, alloc=alloc,
                     cpu_s=cpu["attn_pre"] + cpu["attn_main"] + extra_cpu,
                     flops=0.0 if recompute else blocks["attn_main"].flops_fwd)
        self.tp(cls, st, "all_reduce", f"all_reduce {phase} attn L{layer} mb{mb}", mb, layer)
        op = self.compute(cls, f"{phase} mlp L{layer} mb{mb}",
                          c["mlp_pre"].fwd_gpu_s + c["mlp_main"].fwd_gpu_s, phase, mb,
                          layer=layer, cpu_s=cpu["mlp_pre"] + cpu["mlp_main"],
                          flops=0.0 if recompute else blocks["mlp_main"].flops_fwd)
        self.tp(cls, st, "all_reduce", f"all_reduce {phase} mlp L{layer} mb{mb}", mb, layer)
        if recompute:
            # The recomputed layer's activations live until its backward ends.
            op.alloc = (("activations", self.layer_saved),)

    def layer_bwd(self, cls: RankClass, st: int, mb: int, layer: int) -> None:
        if self.recompute:
            if self.partition_acts:
                self.tp(cls, st, "all_gather", f"gather checkpointed input L{layer} mb{mb}", mb,
                        layer)
            self.layer_fwd(cls, st, mb, layer, "recompute")
        c, cpu = self.cost, self.cpu_b
        self.compute(cls, f"bwd mlp L{layer} mb{mb}",
                     c["mlp_pre"].bwd_gpu_s + c["mlp_main"].bwd_gpu_s, "bwd", mb, layer=layer,
                     cpu_s=cpu["mlp_pre"] + cpu["mlp_main"],
                     flops=self.blocks["mlp_main"].flops_bwd)
        self.tp(cls, st, "all_reduce", f"all_reduce bwd mlp L{layer} mb{mb}", mb, layer)
        free = self.layer_hold + (self.layer_saved if self.recompute else 0.0)
        self.compute(cls, f"bwd attn L{layer} mb{mb}",
                     c["attn_pre"].bwd_gpu_s + c["attn_main"].bwd_gpu_s, "bwd", mb, layer=layer,
                     cpu_s=cpu["attn_pre"] + cpu["attn_main"], free=(("activations", free),),
                     flops=self.blocks["attn_main"].flops_bwd)
        self.tp(cls, st, "all_reduce", f"all_reduce bwd attn L{layer} mb{mb}", mb, layer)

    def forward(self, cls: RankClass, st: int, mb: int) -> None:
        su, c = self.su, self.cost
        # _exec_forward_pass clones the received input (pipe_buffers['inputs'] keeps the
        # original until the gradient is sent back): one more [s, b, h] per micro-batch.
        held = (("activations", self.act_bytes),) if st > 0 else ()
        if st > 0 and su.partitioned_act:
            # PartitionedTensor.from_meta(...).full(): all-gather the received slices.
            self.tp(cls, st, "all_gather", f"gather input mb{mb}", mb)
        if st == 0:
            self.compute(cls, f"fwd embed mb{mb}", c["embed"].fwd_gpu_s, "fwd", mb,
                         cpu_s=self.cpu["embed"],
                         alloc=(("activations", c["embed"].saved_bytes),))
            self.tp(cls, st, "all_reduce", f"embed all_reduce mb{mb}", mb)
        else:
            self.compute(cls, f"clone input mb{mb}", self.cm.membound_time(2 * self.act_bytes),
                         "fwd", mb, cpu_s=TORCH_CALL_CPU_S, alloc=held)
        for layer in su.stage_layers[st]:
            self.layer_fwd(cls, st, mb, layer, "fwd")
        if st == su.p - 1:
            self.compute(cls, f"fwd head+loss mb{mb}", c["head"].fwd_gpu_s, "fwd", mb,
                         cpu_s=self.cpu["head"], alloc=(("activations", c["head"].saved_bytes),),
                         transient=c["head"].fwd_transient_bytes,
                         flops=self.blocks["head"].flops_fwd)

    def backward(self, cls: RankClass, st: int, mb: int) -> None:
        su, c = self.su, self.cost
        n = self.stage_params(st)
        if self.su.bf16_optimizer:
            # BF16_Optimizer.clear_lp_grads: the previous backward's bf16 .grad go.
            self.compute(cls, f"clear_lp_grads mb{mb}", 0.0, "bwd", mb,
                         free=(("gradients", W16 * n),), cpu_s=TORCH_CALL_CPU_S)
        if st < su.p - 1 and su.partitioned_grad:
            # Rebuild this stage's output (freed after it was sent) and the received gradient.
            self.tp(cls, st, "all_gather", f"gather output mb{mb}", mb)
            self.tp(cls, st, "all_gather", f"gather output grad mb{mb}", mb)
        grads = self._grad_alloc(mb, W16 * n)
        if st == su.p - 1:
            self.compute(cls, f"bwd head+loss mb{mb}", c["head"].bwd_gpu_s, "bwd", mb,
                         cpu_s=self.cpu_b["head"], free=(("activations", c["head"].saved_bytes),),
                         transient=c["head"].bwd_transient_bytes,
                         flops=self.blocks["head"].flops_bwd, alloc=grads)
            grads = ()
            # parallel_lm_logits: copy_to_tensor_model_parallel_region before the
            # vocab-parallel logits GEMM, an all-reduce of the input gradient in backward.
            self.tp(cls, st, "all_reduce", f"all_reduce bwd head mb{mb}", mb)
        for i, layer in enumerate(reversed(su.stage_layers[st])):
            before = len(self.program.ops)
            self.layer_bwd(cls, st, mb, layer)
            if grads and i == 0:
                op = self.program.ops[before]
                op.alloc = op.alloc + grads
        last = None
        if st == 0:
            last = self.compute(cls, f"bwd embed mb{mb}", c["embed"].bwd_gpu_s, "bwd", mb,
                                cpu_s=self.cpu_b["embed"],
                                free=(("activations", c["embed"].saved_bytes),))
        tensors = self.tensors(st)
        if self.su.bf16_optimizer:
            # update_hp_grads: hp.add_(lp.grad.float()) per tensor (cast, then add).
            last = self.membound(cls, f"update_hp_grads mb{mb}", (W16 + 4 * FP32) * n, "bwd",
                                 kernels=2 * tensors, mb=mb)
        elif mb > 0:
            # AccumulateGrad adds each new 16-bit gradient into .grad.
            last = self.membound(cls, f"accumulate .grad mb{mb}", 3 * W16 * n, "bwd",
                                 kernels=tensors, mb=mb)
        if st > 0:
            # The input buffer goes once its gradient is sent (_exec_send_grads).
            if last is None:
                last = self.compute(cls, f"release input mb{mb}", 0.0, "bwd", mb)
            last.free = last.free + (("activations", self.act_bytes),)

    def tensors(self, st: int) -> int:
        """Parameter tensors of stage ``st`` (Megatron's GPT layer: fused QKV, projection,
        fc1, fc2 with their biases, two norms with theirs)."""
        m = self.mdl
        per_layer = 4 * (2 if m.bias else 1) + 2 * (2 if m.norm == "layernorm" and m.bias
                                                    else 1)
        n = per_layer * len(self.su.stage_layers[st])
        return n + (1 if st == 0 else 0) + (3 if st == self.su.p - 1 else 0)

    def _grad_alloc(self, mb: int, nbytes: float) -> tuple[tuple[str, float], ...]:
        """16-bit gradients appear with the first backward (every backward under
        BF16_Optimizer, which clears them before each)."""
        return (("gradients", nbytes),) if (mb == 0 or self.su.bf16_optimizer) else ()

    # ------------------------------------------------------------------ program
    def build(self) -> Program:
        ctx, su = self.ctx, self.su
        classes = []
        for st in range(su.p):
            cls = RankClass(st, self.grid.members(pipe=st), label=f"pipeline stage {st}")
            n = self.stage_params(st)
            # fp32 master + Adam m, v: sharded over the replicas, except FP16_Optimizer's.
            shard = 1 if su.fp16_optimizer else su.dp
            cls.initial_memory = {"parameters": float(W16 * n),
                                  "optimizer": 3.0 * FP32 * n / shard}
            if su.bf16_optimizer:
                # fp32 accumulators, and the bf16 .grad the last backward left (cleared by
                # the first backward of the step).
                cls.initial_memory["gradients"] = float((FP32 + W16) * n)
            classes.append(cls)
        flops = ctx.model_flops_per_step()
        hw = flops
        if self.recompute:
            per_layer = self.blocks["attn_main"].flops_fwd + self.blocks["mlp_main"].flops_fwd
            hw += per_layer * self.mdl.layers * su.m * su.dp
        self.program = Program(classes, ctx.n_ranks, ctx.tokens_per_step, flops, hw,
                               micro_batches=su.m, pipeline_stages=su.p)
        self.program.meta.update(
            framework="deepspeed", zero_stage=self.opts.zero_stage, style="megatron",
            schedule="deepspeed TrainSchedule",
            optimizer="BF16_Optimizer" if su.bf16_optimizer else "FP16_Optimizer"
            if su.fp16_optimizer else "DeepSpeedZeroOptimizer")
        for st, cls in enumerate(classes):
            self.stage(cls, st)
        return self.program

    def stage(self, cls: RankClass, st: int) -> None:
        su = self.su
        handlers = {
            "fwd": lambda mb: self.forward(cls, st, mb),
            "bwd": lambda mb: self.backward(cls, st, mb),
            "send_act": lambda mb: self.p2p(cls, "act", st, st + 1, mb, True, su.partitioned_act),
            "recv_act": lambda mb: self.p2p(cls, "act", st - 1, st, mb, False,
                                            su.partitioned_act),
            "send_grad": lambda mb: self.p2p(cls, "grad", st, st - 1, mb, True,
                                             su.partitioned_grad),
            "recv_grad": lambda mb: self.p2p(cls, "grad", st + 1, st, mb, False,
                                             su.partitioned_grad),
            "reduce_tied": lambda mb: reduce_tied(self, cls, st),
            "reduce_grads": lambda mb: reduce_grads(self, cls, st),
            "optimizer": lambda mb: optimizer_step(self, cls, st),
        }
        for step in train_schedule(su.m, su.p, st):
            for ins in step:
                h = handlers.get(ins.kind)
                if h is not None:
                    h(ins.mb)


def stage_param_counts(ctx: JobContext) -> Sequence[int]:
    """Parameters each pipeline stage holds on one tensor-parallel rank (for tests/reports)."""
    pipe = _Pipe(ctx, _resolve(ctx))
    return [pipe.stage_params(st) for st in range(pipe.su.p)]
