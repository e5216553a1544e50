"""PyTorch FSDP2 (``fully_shard``) as torchtitan applies it to a Llama model, with HSDP, CPU
offload, and torchtitan's tensor, pipeline and context parallelism around it.

Units (torchtitan ``apply_fsdp``, ``torchtitan/models/llama3/infra/parallelize.py``; now
``torchtitan/distributed/fsdp.py``, ``apply_fsdp_to_decoder``): the token embedding, each
transformer block, and the final norm with the output projection; the root wraps them and owns
no parameters of its own here. Resharding after forward follows torchtitan's
``fsdp_reshard_after_forward`` policy (``get_fsdp_reshard_after_forward_policy``): with
``reshard_after_forward`` left unset it is ``"default"``: the embedding and the blocks reshard
without pipeline parallelism and do not with it ("to avoid per-microbatch all-gathers"); set
explicitly, it applies to them either way. Norm + output are never resharded after forward
(backward needs them right away); torchtitan's ``"always"``, which reshards them too, is not
offered by the boolean.

What each step does (``torch/distributed/fsdp/_fully_shard/``):

* Parameters live sharded in fp32 (1/n per rank, n = the FSDP world size) with fp32 gradients
  and AdamW states of the shard. Mixed precision: gathered parameters in bf16 (``param_dtype``),
  gradients reduced in fp32 (``reduce_dtype``) by default; compute in bf16
  (:mod:`sim.layer_ops` style ``bf16``).
* Forward: each unit all-gathers its parameters on the all-gather stream (the copy-in cast to
  bf16 is folded into it), then the compute stream copies them out of the flat buffer and runs
  the unit. Prefetch is implicit: the CPU runs ahead, so unit u+1's all-gather is issued while
  unit u computes; it may start once the all-gather of unit u-1 has been copied out (the
  two-deep ``AllGatherState``, ``FSDPParamGroup.wait_for_unshard``). With
  ``reshard_after_forward`` a unit frees its gathered parameters after its forward.
* Backward: unit u's backward waits for its all-gather (issued again if resharded); when it
  starts, the all-gather of the unit before it is prefetched (``_backward_prefetch``, one unit
  ahead). After the unit's backward (``post_backward``) its gradients are copied into a
  reduce_dtype buffer on the compute stream (``foreach_reduce_scatter_copy_in``) and
  reduce-scattered on the reduce-scatter stream; that copy-in waits until the previous
  reduce-scatter has finished (one ``ReduceScatterState``). The optimizer waits for every
  reduce, then AdamW steps the local shard. Gradient accumulation (torchtitan's train loop)
  reduce-scatters every micro-batch.
* HSDP (``hsdp_shard_size`` = s): a 2-D mesh (dp/s replicas x s shards, consecutive ranks
  shard together). All-gathers and reduce-scatters stay inside the shard group; right after
  each reduce-scatter ``foreach_reduce`` all-reduces the reduced shard across the replicas on
  its own ``all_reduce_stream`` (which waits for the reduce-scatter stream; "run the HSDP
  all-reduces concurrently with all-gather/reduce-scatter since collectives use different
  network resources", ``FSDPCommContext.lazy_init``). The next micro-batch's post-backward of
  the same unit, and the optimizer, wait for that all-reduce (``_wait_for_post_backward``).
  States shard by s (x cp), not by dp.
* CPU offload (``CPUOffloadPolicy``): sharded fp32 parameters, gradients and optimizer
  states stay in pinned host memory. Each all-gather's input is first copied to the GPU
  (``FSDPParam.all_gather_inputs``: ``.to(device, non_blocking=True)``, then cast to
  param_dtype) on the all-gather copy-in stream; after each reduce the fp32 reduced shard is
  copied to the host on the post-reduce stream (``foreach_reduce``: non-blocking into pinned
  memory for the first gradient, blocking and added on the CPU when accumulating). The
  backward ends by waiting for those copies (``finalize_backward``) and ``torch.optim.AdamW``
  steps the CPU tensors (:func:`sim.host.cpu_adam_s`, one thread per rank under torchrun).
* Pipeline parallelism (``torch/distributed/pipelining``): each stage's model chunks are
  separate FSDP roots. ``_PipelineStageBase.backward_maybe_with_nosync`` runs every backward
  with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``:
  gradients accumulate unsharded (cast to reduce_dtype on the first micro-batch,
  ``FSDPParam.to_accumulated_grad_if_needed``, then added, ``accumulate_unsharded_grad_if_needed``)
  and parameters stay gathered; after the chunk's last backward (``_add_reduce_grad`` /
  ``perform_reduce_grad`` -> ``_post_backward``) ``post_backward`` runs for every unit in
  module order: one reduce-scatter per unit per step. Schedules come from
  :func:`sim.frameworks.megatron.schedule` (the same orders as torch's ``Schedule1F1B``,
  ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B``, whose warm-up is
  ``(vp - 1) * pp + 2 * (pp - 1 - rank)``); Schedule1F1B batches each forward's send with the
  next backward's receive and waits for both, and each backward's send with the next
  forward's receive.
* Tensor and context parallelism: :mod:`sim.frameworks.torchtitan_parallel`. The FSDP unit of
  a tensor-parallel rank holds its 1/tp of the block (DTensor local shards), sharded again over
  the FSDP mesh (dp_shard x cp). The sequence-parallel norms' weights are replicated and their
  gradients come out Partial: post_backward all-reduces each over the tensor-parallel group
  before the copy-in (``FSDPParam._get_grad_inner_tensor`` redistributes to Replicate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sim.frameworks.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.frameworks.base import JobContext, register
from sim.frameworks.megatron import schedule as pipeline_order
from sim.frameworks.steps import micro_batch_ops
from sim.frameworks.torchtitan_cp import titan_repeats_kv
from sim.frameworks.torchtitan_parallel import (
    Comms,
    Mesh,
    TitanBlocks,
    TitanPass,
    stage_layers,
    titan_blocks,
)
from sim.host import HostSpec, cpu_adam_s, cpu_pass_s
from sim.layer_ops import (
    BF16,
    FP32,
    BlockCost,
    SacCost,
    Style,
    head_block,
    model_blocks,
    op_sac_costs,
    price_block,
)
from sim.program import Op, Phase, Program, RankClass
from sim.scenario import Fsdp2Options

AG, RS = "all-gather", "reduce-scatter"


@dataclass
class _Unit:
    """One ``fully_shard`` unit of one pipeline model chunk."""

    name: str
    numel: int
    """Parameters on this tensor-parallel rank, unsharded."""
    keys: list[tuple[str, int]]
    """(block, layer) it covers, in forward order."""
    reshard_after_forward: bool
    grad_bytes: float
    """bf16 gradients its backward produces (autograd's unsharded .grad)."""
    partial_grads: int = 0
    """Tensor parallelism: replicated (SequenceParallel norm) weights whose gradients come out
    Partial and are all-reduced over the tensor-parallel group before the reduce
    (``FSDPParam._get_grad_inner_tensor`` redistributes them to the parameter's Replicate)."""


def _reshard_blocks(opts: Fsdp2Options, pp: int) -> bool:
    """Whether the embedding and blocks reshard after forward: the scenario's boolean when
    given, else torchtitan's "default" policy (not with pipeline parallelism)."""
    if "reshard_after_forward" in opts.model_fields_set:
        return opts.reshard_after_forward
    return pp == 1


def _check(ctx: JobContext, opts: Fsdp2Options) -> None:
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
    mbs = ctx.micro_batches
    if pp > 1:
        if vp > 1:
            ctx.require(mbs % pp == 0, "training.global_batch_size",
                        f"Interleaved1F1B here needs the micro-batch count ({mbs}) to be a "
                        f"multiple of pp={pp}")
        elif opts.pipeline_schedule == "1f1b":
            ctx.require(mbs >= pp, "training.global_batch_size",
                        f"Schedule1F1B needs at least pp={pp} micro-batches (got {mbs})")
    try:
        stage_layers(m.layers, pp * vp, opts.pipeline_first_stage_less_layers,
                     opts.pipeline_last_stage_less_layers)
    except ValueError as exc:
        ctx.fail("parallelism.pp", str(exc))


BlockOps = Callable[[tuple[str, int]], list[Op]]


@dataclass
class _Job:
    """What every pipeline stage of the step shares."""

    ctx: JobContext
    opts: Fsdp2Options
    mesh: Mesh
    style: Style
    n_mb: int
    n_shard: int
    """FSDP world size: dp_shard x cp."""
    pbytes: int
    rbytes: int
    costs: dict[str, BlockCost]
    titan: TitanBlocks | None
    chunk_units: list[list[_Unit]]
    ugrad: dict[str, float]
    model_flops: dict[str, tuple[float, float]]
    p2p_bytes: float
    stage_params: list[int]
    host: HostSpec | None
    sac: dict[str, SacCost] | None = None
    """torchtitan's op-level selective checkpointing of each layer (``selective``)."""
    sends: dict[tuple[str, int, int], Op] = field(default_factory=dict)
    first_compute: dict[tuple[str, int, int], Op] = field(default_factory=dict)
    """The first compute-stream op of each (F|B, virtual stage, micro-batch)."""

    @property
    def pp(self) -> int:
        return self.mesh.pp

    def param_bytes(self, u: _Unit) -> float:
        """Bytes of a unit's unsharded parameters as gathered: with FSDP2's float8 all-gather
        (torchao ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``) a transformer
        block's shards are cast to E4M3 before the gather, 1 byte per parameter (its norm
        weights, a few thousandths of it, counted alike); embedding and output stay 16-bit."""
        if self.style.float8_weights and u.name.startswith("L"):
            return float(u.numel)
        return float(self.pbytes * u.numel)

    @property
    def vp(self) -> int:
        return self.ctx.scenario.parallelism.vp

    @property
    def n_virtual(self) -> int:
        return self.pp * self.vp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved 1f1b" if self.vp > 1 else self.opts.pipeline_schedule


@register("fsdp2")
def build_fsdp2(ctx: JobContext) -> Program:
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, Fsdp2Options)
    _check(ctx, opts)
    par = s.parallelism
    m = ctx.model
    t, pp, cp, vp = par.tp, par.pp, par.cp, par.vp
    dp = ctx.dp
    shard = opts.hsdp_shard_size or dp
    mesh = Mesh(pp, dp // shard, shard, cp, t)
    # training.precision fp8: torchtitan's float8 converter (torchao Float8Linear, dynamic
    # tensorwise scaling) on every linear but the output layer; parameters stay bf16.
    fp8 = s.training.precision == "fp8"
    ctx.require(not opts.float8_all_gather or fp8, "framework.float8_all_gather",
                "needs training.precision fp8 (the float8 converter)")
    hf = opts.model_code == "huggingface"
    if hf:
        # Hugging Face LlamaForCausalLM wrapped per decoder layer: bf16 parameters from the
        # MixedPrecisionPolicy, the model's eager code (sim.hf_ops). torchtitan's tensor,
        # context and pipeline plans, its float8 converter and op-level SAC are torchtitan's.
        ctx.require(t == 1 and cp == 1 and pp == 1, "framework.model_code",
                    "huggingface is modelled with FSDP (and HSDP) only: tp, cp and pp must be 1")
        ctx.require(not fp8, "framework.model_code",
                    "huggingface is modelled with bf16 or fp16 precision, not torchao float8")
        ctx.require(s.training.activation_checkpointing != "selective",
                    "framework.model_code", "selective (op-level SAC) is torchtitan's")
    ctx.require(hf or not opts.checkpoint_use_reentrant, "framework.checkpoint_use_reentrant",
                "torchtitan's checkpoint_wrapper is non-reentrant; reentrant checkpointing "
                "is Hugging Face's option (model_code: huggingface)")
    style = Style("hf_bf16" if hf else "bf16", compile=opts.compile, float8=fp8,
                  float8_weights=fp8 and opts.float8_all_gather)
    n_virtual = pp * vp
    chunk_layers = stage_layers(m.layers, n_virtual, opts.pipeline_first_stage_less_layers,
                                opts.pipeline_last_stage_less_layers)

    # HF's use_cache defaults on and LlamaModel builds a DynamicCache in training too;
    # GradientCheckpointingLayer drops it under checkpointing (transformers modeling_layers.py).
    kv_cache = hf and not ctx.recompute
    costs = ctx.block_costs(style, kv_cache=kv_cache)
    # torchtitan's apply_compile compiles the transformer blocks; the loss is compiled apart
    # (loss.py) or, before that existed, not at all: then norm, output and cross-entropy run
    # eagerly (fp32 logits, log_softmax and their gradients materialised).
    ctx.require(opts.compile or not opts.compile_loss, "framework.compile_loss",
                "true needs framework.compile true (torchtitan compiles the loss only when "
                "compiling)")
    eager_head = opts.compile and opts.compile_loss is False
    if eager_head:
        eager = replace(style, compile=False)
        costs["head"] = price_block(head_block(m, eager, ctx.micro_batch, ctx.seq), eager,
                                    ctx.compute)
    selective = s.training.activation_checkpointing == "selective"
    tb = titan_blocks(m, style, ctx.compute, ctx.micro_batch, ctx.seq, t, cp,
                      opts.cp_rotate_method, sac=selective, eager_head=eager_head,
                      repeat_kv=titan_repeats_kv(s.training.torch_version)
                      ) if t > 1 or cp > 1 else None
    if tb is not None:
        numel = dict(tb.params)
        ugrad = {b: float(BF16 * n) for b, n in numel.items()}
    else:
        numel = {"embed": m.embedding_params, "attn": costs["attn"].params,
                 "mlp": costs["mlp"].params, "head": m.norm_params + m.lm_head_params}
        # Unsharded bf16 gradients, produced by each block's backward, freed by the copy-in
        # (a tied matrix gets its gradient from the output layer and the embedding).
        ugrad = {b: BF16 * p for b, p in block_grad_params(m, costs).items()}
    layer_raf = _reshard_blocks(opts, pp)

    def units_of(v: int) -> list[_Unit]:
        out: list[_Unit] = []
        if v == 0:
            out.append(_Unit("embed", numel["embed"], [("embed", -1)], layer_raf,
                             ugrad["embed"]))
        for layer in chunk_layers[v]:
            out.append(_Unit(f"L{layer}", numel["attn"] + numel["mlp"],
                             [("attn", layer), ("mlp", layer)], layer_raf,
                             ugrad["attn"] + ugrad["mlp"], partial_grads=2 if t > 1 else 0))
        if v == n_virtual - 1:
            # torchtitan does not reshard norm + output after forward: backward needs them
            # right away.
            out.append(_Unit("head", numel["head"], [("head", -1)], False,
                             ugrad["head"], partial_grads=1 if t > 1 else 0))
        return out

    chunk_units = [units_of(v) for v in range(n_virtual)]
    tokens_mb = ctx.micro_batch * ctx.seq
    job = _Job(
        ctx=ctx, opts=opts, mesh=mesh, style=style, n_mb=ctx.micro_batches,
        n_shard=shard * cp, pbytes=BF16 if opts.param_dtype == "bf16" else FP32,
        rbytes=BF16 if opts.reduce_dtype == "bf16" else FP32, costs=costs, titan=tb,
        chunk_units=chunk_units, ugrad=ugrad,
        model_flops=block_model_flops(m, costs, ctx.micro_batch, ctx.seq),
        # Activations sent between stages: the last block's output, this rank's share.
        p2p_bytes=float(BF16 * (tb.local_tokens if tb is not None else tokens_mb) * m.hidden),
        stage_params=[sum(u.numel for v in range(st, n_virtual, pp) for u in chunk_units[v])
                      for st in range(pp)],
        host=HostSpec.from_scenario(s) if opts.cpu_offload else None,
        sac=(op_sac_costs(model_blocks(m, style, ctx.micro_batch, ctx.seq, False)[1:3],
                          style, ctx.compute)
             if selective and tb is None else None))

    classes = [RankClass(st, mesh.members(st),
                         label=(f"pipeline stage {st}" if pp > 1
                                else "all ranks (identical FSDP shards)"))
               for st in range(pp)]
    for st, cls in enumerate(classes):
        shard_params = job.stage_params[st] / job.n_shard
        # fp32 sharded parameters, gradients and the two AdamW moments: 16 B per parameter
        # over the FSDP world size; in host memory with CPU offload.
        cls.initial_memory = {} if opts.cpu_offload else {
            "parameters": FP32 * shard_params, "optimizer": 2 * FP32 * shard_params,
            "gradients": FP32 * shard_params}
    if tb is not None and tb.sac is not None:
        # Every rank re-runs its own shard's share of each layer (local widths, seq/cp).
        hw = ctx.model_flops_per_step() + m.layers * ctx.micro_batches * dp * cp * t * sum(
            c.recompute_flops for c in tb.sac.values())
    elif job.sac is not None:
        hw = ctx.model_flops_per_step() + m.layers * ctx.micro_batches * dp * cp * sum(
            c.recompute_flops for c in job.sac.values())
    else:
        hw = ctx.model_flops_per_step() + ctx.layer_recompute_flops(costs)
    program = Program(classes, ctx.n_ranks, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      hw)
    program.meta.update(framework="fsdp2", micro_batches=job.n_mb, style=style.name,
                        pipeline_stages=pp, schedule=job.schedule, hsdp_replicas=dp // shard,
                        fsdp_shards=job.n_shard)
    for st, cls in enumerate(classes):
        _Stage(job, program, cls, st).build()
    # A stage's forward (backward) waits for the activation (gradient) its neighbour sent.
    for (kind, v, mb), first in job.first_compute.items():
        sender = job.sends.get((kind, v - 1 if kind == "F" else v + 1, mb))
        if sender is not None:
            first.deps = list(first.deps) + [sender]
    return program


class _Stage:
    """One pipeline stage's step (the whole job without pipeline parallelism)."""

    def __init__(self, job: _Job, program: Program, cls: RankClass, st: int) -> None:
        self.job = job
        self.program = program
        self.cls = cls
        self.st = st
        mesh = job.mesh
        self.shard_groups = mesh.shard_groups(st)
        self.rep_groups = mesh.replicate_groups(st)
        # Built once per stage: every tensor- and context-parallel op names these groups.
        self.tp_groups = mesh.tp_groups(st)
        self.cp_groups = mesh.cp_groups(st)
        self.cp_ring_pairs = mesh.cp_ring_pairs(st)
        self._keys = 0
        self.gathered: dict[str, bool] = {}
        self.last_rs: Op | None = None          # ReduceScatterState: one input buffer
        self.rs_held = 0.0                      # ... its bytes, until the state is dropped
        self.last_ar: dict[str, Op] = {}        # each unit's _all_reduce_state
        self.reduces: list[Op] = []
        self.offloads: list[Op] = []
        self.accumulated: dict[str, float] = {}
        self.sent: list[Op] = []
        self.fwd_sent: list[Op] = []
        self.per_mb: dict[int, tuple[BlockOps, BlockOps]] = {}
        tb = job.titan
        self.titan = TitanPass(tb, Comms(self._tp_op, self._cp_gather, self._cp_shift),
                               job.ctx.recompute) if tb is not None else None

    # ------------------------------------------------------------------ helpers
    def key(self, prefix: str) -> str:
        self._keys += 1
        return f"fsdp2/{self.st}/{prefix}#{self._keys}"

    def add(self, op: Op) -> Op:
        return self.program.add(self.cls, op)

    def _tp_op(self, kind: str, nbytes: float, name: str, mb: int, layer: int | None) -> Op:
        groups = self.tp_groups
        return Op(name=name, kind="collective", stream="compute", phase="comm",
                  collective=kind, group=groups[0], groups=groups, nbytes=nbytes,  # type: ignore[arg-type]
                  key=self.key("tp"), category=kind, micro_batch=mb, layer=layer)

    def _cp_gather(self, nbytes: float, name: str, mb: int, layer: int | None) -> Op:
        groups = self.cp_groups
        return Op(name=name, kind="collective", stream="cp", phase="comm",
                  collective="all_gather", group=groups[0], groups=groups, nbytes=nbytes,
                  key=self.key("cp"), category="all_gather", micro_batch=mb, layer=layer)

    def _cp_shift(self, nbytes: float, name: str, mb: int, layer: int | None) -> Op:
        return Op(name=name, kind="send", stream="cp", phase="comm",
                  pairs=self.cp_ring_pairs, nbytes=nbytes,
                  key=self.key("cp-shift"), category="send_recv", micro_batch=mb, layer=layer)

    def block_ops(self, mb: int) -> tuple[BlockOps, BlockOps]:
        """Forward and backward ops of each (block, layer) of micro-batch ``mb``."""
        if mb in self.per_mb:
            return self.per_mb[mb]
        job, m, cm = self.job, self.job.ctx.model, self.job.ctx.compute
        ops_f: BlockOps
        ops_b: BlockOps
        if self.titan is not None:
            tp = self.titan

            def ops_f(k: tuple[str, int]) -> list[Op]:
                return tp.forward(k[0], k[1], mb)

            def ops_b(k: tuple[str, int]) -> list[Op]:
                ops = tp.backward(k[0], k[1], mb)
                # The block's bf16 weight gradients exist once its backward is done.
                done = next(x for x in reversed(ops) if x.kind == "compute")
                done.alloc = done.alloc + (("gradients", job.ugrad[k[0]]),)
                return ops
        else:
            extra = {"embed": tied_grad_sum_s(cm, m, BF16)}
            pops = micro_batch_ops(job.costs, m.layers, mb, job.ctx.recompute,
                                   job.style.autocast, job.ugrad, extra, job.model_flops,
                                   sac=job.sac, reentrant=job.opts.checkpoint_use_reentrant)

            def ops_f(k: tuple[str, int]) -> list[Op]:
                return [pops.fwd_of[k]]

            def ops_b(k: tuple[str, int]) -> list[Op]:
                return [pops.bwd_of[k]]
        self.per_mb[mb] = (ops_f, ops_b)
        return ops_f, ops_b

    # ------------------------------------------------------------------ FSDP collectives
    def gather(self, u: _Unit, deps: list[Op], mb: int, phase: str) -> Op:
        """unshard(): the copy-in and all-gather of a unit (the copy-in alone when the FSDP
        world size is 1)."""
        job = self.job
        if job.host is not None:
            # CPU offload: the fp32 shard is copied to the GPU on the all-gather copy-in
            # stream before it is cast and gathered.
            nbytes = FP32 * u.numel / job.n_shard
            deps = deps + [self.add(Op(
                name=f"H2D params {u.name} ({phase}) mb{mb}", kind="copy",
                stream="ag-copy-in", phase="comm", deps=list(deps), host_transfer="h2d",
                nbytes=nbytes, category="copy", micro_batch=mb,
                transient=nbytes))]
        nbytes = job.param_bytes(u)
        if job.n_shard == 1:
            return self.copy_in(u, deps, mb, phase)
        deps = [self.copy_in(u, deps, mb, phase)]
        return self.add(Op(
            name=f"{AG} {u.name} ({phase}) mb{mb}", kind="collective", stream="ag",
            phase="comm", deps=deps, collective="all_gather", group=self.shard_groups[0],
            groups=self.shard_groups, nbytes=nbytes, key=self.key(f"ag/{u.name}/{phase}/{mb}"),
            category="all_gather", micro_batch=mb, alloc=(("buffers", nbytes),)))

    def copy_in(self, u: _Unit, deps: list[Op], mb: int, phase: str) -> Op:
        """foreach_all_gather's copy-in (``torch/distributed/fsdp/_fully_shard/
        _fsdp_collectives.py``), on the all-gather copy-in stream: ``_get_param_all_gather_
        inputs`` casts this rank's fp32 shards into one flat param_dtype buffer
        (``torch._foreach_copy_``) and ``all_gather_copy_in`` copies that into this rank's
        slice of the all-gather output, which NCCL then gathers in place. There is no
        shortcut for an FSDP world size of 1: both copies run on the whole unit and the
        one-rank all-gather moves nothing, so this op stands for the gather."""
        job, cm = self.job, self.job.ctx.compute
        local = job.param_bytes(u) / job.n_shard
        cast = cm.membound_time(FP32 * u.numel / job.n_shard + local)
        alloc: tuple[tuple[str, float], ...] = (
            (("buffers", job.param_bytes(u)),) if job.n_shard == 1 else ())
        return self.add(Op(
            name=f"all-gather copy-in {u.name} ({phase}) mb{mb}", kind="compute",
            stream="ag-copy-in", phase="comm", deps=deps, category="copy", micro_batch=mb,
            duration=cast + cm.membound_time(2 * local), transient=local, alloc=alloc))

    def copy_out(self, u: _Unit, ag: Op, mb: int, phase: str) -> Op:
        """wait_for_unshard(): split_with_sizes_copy out of the all-gather buffer into the
        unsharded parameters (the buffer is released once copied), after the all-gather or,
        with an FSDP world size of 1, after the copy-in that stands for it."""
        job, cm = self.job, self.job.ctx.compute
        nbytes = job.param_bytes(u)
        ph: Phase = "fwd" if phase == "fwd" else "bwd"
        return self.add(Op(
            name=f"copy-out {u.name} ({phase}) mb{mb}", kind="compute", stream="compute",
            phase=ph, deps=[ag], duration=cm.membound_time(2 * nbytes), category="copy",
            alloc=(("parameters", nbytes),), free=(("buffers", nbytes),), micro_batch=mb))

    def reduce(self, u: _Unit, grads: float, mb: int, deps: list[Op], free_params: bool,
               first_grad: bool) -> None:
        """post_backward -> foreach_reduce: copy-in, reduce-scatter, HSDP all-reduce,
        offload of the reduced shard."""
        job, cm = self.job, self.job.ctx.compute
        rb = job.rbytes
        deps = list(deps)
        if self.last_rs is not None:
            deps.append(self.last_rs)
        if u.name in self.last_ar:
            deps.append(self.last_ar[u.name])
        for i in range(u.partial_grads):
            # Each replicated norm weight's gradient, in the dtype it is held in.
            held = BF16 if job.pp == 1 else rb
            self.add(self._tp_op("all_reduce", float(held * job.ctx.model.hidden),
                                 f"tp all_reduce norm grad {i} {u.name} mb{mb}", mb, None))
        frees: tuple[tuple[str, float], ...] = (("gradients", grads),)
        if free_params:
            frees += (("parameters", job.param_bytes(u)),)
        deps += self.drop_reduce_scatter_state(mb)
        copy_in = self.add(Op(
            name=f"copy-in grads {u.name} mb{mb}", kind="compute", stream="compute",
            phase="bwd", deps=deps, duration=cm.membound_time(grads + rb * u.numel),
            category="copy", alloc=(("buffers", rb * u.numel),), free=frees,
            micro_batch=mb))
        if job.n_shard > 1:
            rs = self.add(Op(
                name=f"{RS} {u.name} mb{mb}", kind="collective", stream="rs", phase="comm",
                deps=[copy_in], collective="reduce_scatter", group=self.shard_groups[0],
                groups=self.shard_groups, nbytes=rb * u.numel,
                key=self.key(f"rs/{u.name}/{mb}"), category="reduce_scatter",
                micro_batch=mb))
        else:
            # World size 1: the reduce-scatter is a copy (foreach_reduce).
            rs = self.add(Op(name=f"reduce copy {u.name} mb{mb}", kind="compute",
                             stream="rs", phase="bwd", deps=[copy_in], category="copy",
                             duration=cm.membound_time(2 * rb * u.numel), micro_batch=mb))
        self.last_rs = rs
        self.rs_held = rb * u.numel
        self.reduces.append(rs)
        post = rs
        if job.mesh.replicate > 1:
            post = self.add(Op(
                name=f"all-reduce {u.name} mb{mb}", kind="collective", stream="ar",
                phase="comm", deps=[rs], collective="all_reduce", group=self.rep_groups[0],
                groups=self.rep_groups, nbytes=rb * u.numel / job.n_shard,
                key=self.key(f"ar/{u.name}/{mb}"), category="all_reduce", micro_batch=mb))
            self.last_ar[u.name] = post
            self.reduces.append(post)
        if job.host is not None:
            self.offload_grad(u, post, mb, first_grad)

    def drop_reduce_scatter_state(self, mb: int) -> list[Op]:
        """The compute stream waits for the last reduce-scatter and drops its
        ``ReduceScatterState``, releasing the reduce-scatter input (``foreach_reduce``
        allocates it on the compute stream and returns it, so it is not freed when the
        collective ends): at the next unit's ``post_backward`` or in ``finalize_backward``
        at the end of each backward (``_fsdp_param_group.py``, ``_fsdp_state.py``)."""
        if not self.rs_held or self.last_rs is None:
            return []
        op = self.add(Op(name=f"wait reduce-scatter (drop state) mb{mb}", kind="compute",
                         stream="compute", phase="bwd", deps=[self.last_rs],
                         free=(("buffers", self.rs_held),), category="copy", micro_batch=mb))
        self.rs_held = 0.0
        return [op]

    def offload_grad(self, u: _Unit, post: Op, mb: int, first_grad: bool) -> None:
        """The reduced shard, cast to fp32, is copied to pinned host memory on the
        post-reduce stream: non-blocking for a step's first gradient; when accumulating onto
        the host gradient the copy blocks the host, which then adds on the CPU."""
        job = self.job
        host = job.host
        assert host is not None
        nbytes = FP32 * u.numel / job.n_shard
        d2h = self.add(Op(
            name=f"D2H grads {u.name} mb{mb}", kind="copy", stream=post.stream, phase="comm",
            deps=[post], host_transfer="d2h", nbytes=nbytes, category="copy", micro_batch=mb,
            host_sync=not first_grad))
        self.offloads.append(d2h)
        if not first_grad:
            # grad += new on CPU tensors: read both, write one (12 B per parameter), one
            # thread under torchrun.
            self.offloads.append(self.add(Op(
                name=f"CPU grad += {u.name} mb{mb}", kind="compute", stream="cpu",
                phase="bwd", deps=[d2h], category="copy", micro_batch=mb, host_sync=True,
                duration=cpu_pass_s(host, 3 * nbytes, "torch"))))

    def accumulate(self, u: _Unit, mb: int, first: bool) -> None:
        """No gradient sync (pipeline parallelism): the unsharded gradient is kept in
        reduce_dtype (FSDPParam.to_accumulated_grad_if_needed on the first backward,
        accumulate_unsharded_grad_if_needed after)."""
        job, cm = self.job, self.job.ctx.compute
        if first:
            if job.rbytes != BF16:
                self.add(Op(name=f"grad to reduce dtype {u.name} mb{mb}", kind="compute",
                            stream="compute", phase="bwd", category="copy", micro_batch=mb,
                            duration=cm.membound_time(u.grad_bytes + job.rbytes * u.numel),
                            alloc=(("gradients", job.rbytes * u.numel),),
                            free=(("gradients", u.grad_bytes),)))
                self.accumulated[u.name] = job.rbytes * u.numel
            else:
                self.accumulated[u.name] = u.grad_bytes
            return
        held = self.accumulated[u.name]
        self.add(Op(name=f"accumulate grad {u.name} mb{mb}", kind="compute", stream="compute",
                    phase="bwd", category="copy", micro_batch=mb,
                    duration=cm.membound_time(u.grad_bytes + 2 * held),
                    free=(("gradients", u.grad_bytes),)))

    def send(self, kind: str, v: int, mb: int, after: Op) -> None:
        job = self.job
        nxt = v + 1 if kind == "F" else v - 1
        if not 0 <= nxt < job.n_virtual:
            return
        op = self.add(Op(
            name=f"send {'act' if kind == 'F' else 'grad'} v{v}->v{nxt} mb{mb}", kind="send",
            stream=f"pp-{'fwd' if kind == 'F' else 'bwd'}", phase="comm", deps=[after],
            pairs=job.mesh.stage_pairs(self.st, nxt % job.pp), nbytes=job.p2p_bytes,
            key=f"pp/{kind}/{v}/{mb}", category="send_recv", micro_batch=mb))
        job.sends[(kind, v, mb)] = op
        self.sent.append(op)
        if kind == "F":
            self.fwd_sent.append(op)

    # ------------------------------------------------------------------ passes
    def forward(self, v: int, mb: int) -> None:
        job = self.job
        fwd_ops, _ = self.block_ops(mb)
        copied: list[Op] = []
        last: Op | None = None
        for u in job.chunk_units[v]:
            if not self.gathered.get(u.name):
                # Implicit prefetch: this all-gather waits for the copy-out two gathers back
                # (the AllGatherState the previous unit's wait_for_unshard released).
                ag = self.gather(u, copied[-2:-1], mb, "fwd")
                copied.append(self.copy_out(u, ag, mb, "fwd"))
                self.gathered[u.name] = True
            for k in u.keys:
                for op in fwd_ops(k):
                    last = self.add(op)
            assert last is not None
            if u.reshard_after_forward:
                last.free = last.free + (("parameters", job.param_bytes(u)),)
                self.gathered[u.name] = False
        assert last is not None
        self.send("F", v, mb, last)

    def backward(self, v: int, mb: int, first_of_step: bool) -> None:
        job = self.job
        _, bwd_ops = self.block_ops(mb)
        units = list(reversed(job.chunk_units[v]))
        pending: dict[str, Op] = {}
        if not self.gathered.get(units[0].name):
            pending[units[0].name] = self.gather(units[0], [], mb, "bwd")
        last: Op | None = None
        for i, u in enumerate(units):
            copied = None
            if u.name in pending:
                copied = self.copy_out(u, pending.pop(u.name), mb, "bwd")
                self.gathered[u.name] = True
            if i + 1 < len(units) and not self.gathered.get(units[i + 1].name):
                # Backward prefetch: the previous unit's all-gather is issued as this unit's
                # backward begins.
                nxt = units[i + 1]
                pending[nxt.name] = self.gather(nxt, [copied] if copied else [], mb, "bwd")
            for k in reversed(u.keys):
                for op in bwd_ops(k):
                    last = self.add(op)
            assert last is not None
            if job.pp == 1:
                # Reshard after backward, then reduce (every micro-batch).
                last.free = last.free + (("parameters", job.param_bytes(u)),)
                self.gathered[u.name] = False
                self.reduce(u, u.grad_bytes, mb, [], free_params=False, first_grad=mb == 0)
            else:
                self.accumulate(u, mb, first_of_step)
        assert last is not None
        if job.pp == 1:
            self.drop_reduce_scatter_state(mb)      # finalize_backward
        self.send("B", v, mb, last)

    def reduce_grad(self, v: int, mb: int, wait: list[Op]) -> None:
        """Pipeline REDUCE_GRAD (stage ``_post_backward``): post_backward of every unit of the
        chunk in module order: reshard, reduce-scatter the accumulated gradient."""
        for u in self.job.chunk_units[v]:
            self.reduce(u, self.accumulated.pop(u.name), mb, wait, free_params=True,
                        first_grad=True)
            self.gathered[u.name] = False
            wait = []
        self.drop_reduce_scatter_state(mb)          # finalize_backward

    # ------------------------------------------------------------------ the step
    def build(self) -> None:
        job = self.job
        pp, st = job.pp, self.st
        sched = job.schedule
        if pp == 1:
            order = [(k, 0, mb) for mb in range(job.n_mb) for k in ("F", "B")]
        else:
            order = pipeline_order("1f1b" if job.vp > 1 else job.opts.pipeline_schedule,
                                   pp, st, job.n_mb, job.vp)
        backwards: dict[int, int] = {}
        for kind, chunk, mb in order:
            v = chunk * pp + st
            start = len(self.program.ops)
            waits: list[Op] = []
            if sched == "1f1b" and self.sent:
                # Schedule1F1B batches the previous unit's send with this unit's receive and
                # waits for both before computing.
                waits.append(self.sent[-1])
            if sched == "gpipe" and kind == "B" and backwards.get(v, 0) == 0:
                waits += self.fwd_sent        # all forward sends are waited for first
            if kind == "F":
                self.forward(v, mb)
            else:
                self.backward(v, mb, first_of_step=backwards.get(v, 0) == 0)
                backwards[v] = backwards.get(v, 0) + 1
                if pp > 1 and backwards[v] == job.n_mb:
                    # Single-stage schedules reduce once they have waited for their backward
                    # sends (Schedule1F1B the last, ScheduleGPipe all); the interleaved
                    # runtime right after the chunk's last backward (_add_reduce_grad).
                    bwd_sent = [o for o in self.sent if o not in self.fwd_sent]
                    self.reduce_grad(v, mb, bwd_sent[-1:] if sched == "1f1b"
                                     else bwd_sent if sched == "gpipe" else [])
            first = next((o for o in self.program.ops[start:] if o.stream == "compute"), None)
            if first is not None:
                job.first_compute[(kind, v, mb)] = first
                if waits:
                    first.deps = list(first.deps) + waits
        self.optimizer()

    def optimizer(self) -> None:
        job = self.job
        m = job.ctx.model
        local = job.stage_params[self.st] / job.n_shard
        last = [o for o in (self.last_rs, *self.last_ar.values()) if o is not None]
        if job.host is not None:
            # finalize_backward: the host waits for every gradient copy, then
            # torch.optim.AdamW steps the fp32 shard in host memory.
            sync = self.add(Op(name="wait gradient offload", kind="compute", stream="compute",
                               phase="optimizer", deps=last + self.offloads, host_sync=True,
                               category="optimizer"))
            self.add(Op(name="optimizer step (AdamW on CPU, local shard)", kind="compute",
                        stream="cpu", phase="optimizer", deps=[sync],
                        duration=cpu_adam_s(job.host, local, "torch"), category="optimizer"))
            return
        fused = job.ctx.scenario.training.optimizer == "adamw_fused"
        # torch.optim.adamw._multi_tensor_adamw (foreach; torchtitan 9dec370's default,
        # foreach = not fused) allocates exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs):
        # one fp32 tensor per parameter shard, all at once; the fused kernel allocates none.
        self.add(Op(name="optimizer step (AdamW, local shard)", kind="compute",
                    stream="compute", phase="optimizer", deps=last,
                    duration=job.ctx.compute.adamw_time(local, fused, len(m.parameter_tensors())),
                    transient=0.0 if fused else FP32 * local, category="optimizer"))
