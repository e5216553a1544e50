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
  (:func:`sim.frameworks.megatron.overlap.column_linear_backward`). With
  ``tp_comm_overlap`` (sequence parallelism required, as Megatron-LM's ``validate_args``
  asks) Transformer Engine's userbuffers overlap each exchange with the GEMM beside it:
  ring-exchange all-gathers under the consuming GEMM's chunks, pipelined reduce-scatters
  under the producing GEMM's (:mod:`sim.frameworks.megatron.overlap`); each exchange still
  waits for its input and its consumer for it.
* Pipeline parallelism: the schedule of ``pipeline_parallel/schedules.py`` — 1F1B with
  min(p - s - 1, m) warm-up forwards on stage s, interleaved 1F1B with ``vp`` model chunks per
  stage ((p - s - 1) * 2 + (vp - 1) * p warm-up units), or GPipe (all forwards, then all
  backwards). Activations go to the next stage and gradients back as point-to-point
  transfers, each a rendezvous of both stages, issued and waited for where Megatron-Core's
  schedules do (:mod:`sim.frameworks.megatron.pipeline`), so bubbles and stalls come out of
  the simulation.
  The embedding sits on the first stage and the output layer with the loss on the last.
  DeepSeek's DualPipe and DualPipeV (``pipeline_schedule: dualpipe | dualpipev``) run their own
  order and placement (:mod:`sim.frameworks.megatron.dualpipe`).
* Context parallelism: each rank holds seq/cp tokens (two load-balanced chunks); attention
  runs as Transformer Engine's ring, cp steps each beside the exchange of the next K/V chunk
  (:func:`sim.frameworks.megatron.overlap.cp_ring`).
* Data parallelism: fp32 (bf16 training) or 16-bit (fp16) gradient buffers reduced per
  bucket (:mod:`sim.frameworks.megatron.buckets`: split only on the first stage's first model
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
* Mixture-of-experts layers (:mod:`sim.frameworks.megatron.moe`): the router, the
  ``alltoall`` dispatcher's all-to-alls over the EP groups, the grouped expert GEMMs, on the
  compute stream; the experts laid out by MoE parallel folding (etp x ep x expert-dp x pp),
  their gradients in their own buckets over the expert-data-parallel group.
* Multi-token prediction modules (:mod:`sim.frameworks.megatron.mtp`): on the last virtual
  stage, after its layers and before the output layer, each depth's embedding lookup,
  projection, transformer layer and head; their parameters in the head's bucket part.
* Memory per parameter (``docs/.../dist_optimizer.md``): 16-bit parameters, gradient
  buffers, and the optimizer's fp32 master weights and Adam moments (12 bytes; 16 when the
  gradients are fp16), the latter sharded over data-parallel ranks by the distributed
  optimizer. Activations per micro-batch in flight, from :mod:`sim.workload.megatron_ops`.

Where each part lives: :mod:`sim.frameworks.megatron.shape` (rank layout and groups,
per-stage sizes and memory; its option checks in :mod:`sim.frameworks.megatron.checks`),
:mod:`sim.frameworks.megatron.layer` (op prices and each unit's ops: embedding, layers,
output layer), :mod:`sim.frameworks.megatron.overlap`
(overlapped tensor-parallel and context-parallel forms), :mod:`sim.frameworks.megatron.pipeline`
(schedules and transfers), :mod:`sim.frameworks.megatron.buckets` (data-parallel buckets,
the experts' too);
this module assembles them into the step.
"""

from __future__ import annotations

from collections import deque
from functools import partial

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.a2a_overlap import (
    check_a2a_overlap,
    combined_warmup,
    issue_pair,
    pair_steps,
)
from sim.frameworks.megatron.activation_offload import check_activation_offload
from sim.frameworks.megatron.buckets import (
    Bucket,
    BucketComms,
    StageBuckets,
    assign_buckets,
    bucket_ops,
    bucket_size,
    expert_buckets,
    expert_groups,
    instance_groups,
)
from sim.frameworks.megatron.cuda_graphs import apply_cuda_graphs, check_cuda_graphs
from sim.frameworks.megatron.delay_wgrad import (
    LayerWgrad,
    WgradSplit,
    check_delay_wgrad,
    resplit_expert_classes,
)
from sim.frameworks.megatron.dualpipe import deepseek_order, deepseek_steps
from sim.frameworks.megatron.fsdp import fsdp_ops
from sim.frameworks.megatron.layer import (
    KeySeq,
    UnitBuilder,
    UnitKey,
    UnitOps,
    compute,
    layer_costs,
)
from sim.frameworks.megatron.layer_offload import add_layer_offload, check_layer_offload
from sim.frameworks.megatron.moe_rank_memory import own_memory
from sim.frameworks.megatron.moe_ranks import split_expert_ranks
from sim.frameworks.megatron.optimizer_precision import gpu_step_s, offload_ops
from sim.frameworks.megatron.optimizer_state_offload import (
    add_state_offloads,
    add_state_reload,
    check_state_offload,
)
from sim.frameworks.megatron.pipeline import (  # noqa: F401 - chunk_layers re-exported
    P2PLink,
    Step,
    Unit,
    add_stage,
    chunk_layers,
    pipeline_steps,
    schedule,
)
from sim.frameworks.megatron.schedule_nodes import node_host
from sim.frameworks.megatron.shape import MegatronShape, megatron_shape
from sim.frameworks.megatron.tp_grads import stage_replicated_params
from sim.hardware.attention_cost import release_or_newest
from sim.hardware.host import HostSpec, te_module_call_cpu_s
from sim.program.ir import Op, Program, RankClass

# CPU seconds per Python-level torch op in Megatron's eager layers (see PYTHON_OPS). Fitted,
# not measured: the MAPE minimum over vTrain's single-node FIT half only (every 2nd of its 720
# rows; tools/fit_megatron_host.py, golden section: 33.8 us, kept at 34), validated on the
# other half (docs/calibration.md). Earlier it was fitted on rows that also validated it.
# Read at build time (tools/fit_megatron_host.py sets it while fitting).
MEGATRON_CPU_S_PER_OP = 34e-6
# With the local implementation (older Megatron, Megatron-DeepSpeed), the timers synchronise
# the device around every micro-batch's forward and backward (megatron/timers.py
# _Timer.start/stop call torch.cuda.synchronize in the versions without timing log levels),
# so the host cannot run ahead across micro-batches (UnitBuilder.build_unit). Megatron-Core's
# timers at the default log level do not.

Hooks = dict[int, list[Op]]
"""id(op) -> ops the host issues right after (or right before) it."""


def build_megatron(ctx: JobContext) -> Program:
    """Megatron-LM's training step (see the module docstring): check and shape the job,
    build every unit's ops, hook the data-parallel buckets into them, lay each stage's
    units out in its pipeline schedule, then reduce gradients and step the optimizer."""
    s = megatron_shape(ctx)
    graphs = check_cuda_graphs(ctx, s.opts)
    if s.opts.moe_a2a_overlap:
        check_a2a_overlap(ctx, s)
    if s.opts.delay_wgrad_compute:
        check_delay_wgrad(ctx, s)
    check_state_offload(ctx, s)
    check_activation_offload(ctx, s)
    check_layer_offload(ctx, s.opts)
    classes = []
    for st in range(s.p):
        classes.append(RankClass(st, s.members(st), label=f"pipeline stage {st}"))
        classes[-1].initial_memory = s.initial_memory(st)
    program = Program(classes, ctx.n_ranks, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      0.0, micro_batches=s.mb_count, pipeline_stages=s.p)
    program.meta.update(framework="megatron", style="megatron",
                        schedule=(s.opts.pipeline_schedule if s.vp == 1 or s.deepseek_schedule
                                  else "interleaved 1f1b"))
    program.hw_flops_per_step = ctx.model_flops_per_step() + s.recompute_flops()
    # A module call of Megatron-Core's Transformer Engine layers costs what a TE module call
    # of the job's release costs on its host (sim.hardware.host.te_module_call_cpu_s); the
    # local layers keep the cost fitted on vTrain's (MEGATRON_CPU_S_PER_OP).
    cpu_call = MEGATRON_CPU_S_PER_OP if s.legacy else te_module_call_cpu_s(
        HostSpec.from_scenario(ctx.scenario),
        release_or_newest(ctx.scenario.training.transformer_engine_version))
    keys = KeySeq()
    builder = UnitBuilder(s, layer_costs(s, ctx.compute, cpu_call), keys, ctx.compute)
    units = builder.build_units()
    # delay_wgrad_compute (and DualPipe(V)'s zero-bubble backwards): the weight gradients
    # leave the backward units before the buckets hook into them.
    split = WgradSplit(ctx, s, cpu_call) \
        if s.opts.delay_wgrad_compute or s.deepseek_schedule else None
    wgrad = split.units(units) if split is not None else {}
    if builder.offload is not None:   # activation offloading's reloads, once the units are final
        builder.offload.finish({k: u.ops for k, u in units.items()})
    built = list(classes)
    link = P2PLink(pairs=s.stage_pairs, nbytes=s.act * s.local_tokens * s.h / s.p2p_split,
                   cpu_s=cpu_call, p=s.p, dtype=s.act_dtype, place=s.place)
    add_state_offloads(s, program, classes)
    step = _Step(ctx, s, program, classes, units, keys, cpu_call)
    step.wgrad = wgrad
    step.add_buckets()
    if s.opts.cpu_offloading_num_layers:
        add_layer_offload(s, units, step.launch_after, step.insert_before)
    step.add_stages(link)
    step.add_gradients_and_optimizer()
    if s.moe is not None:        # skewed routing: a class per expert load (moe_ranks)
        if split_expert_ranks(program, s.moe.mesh, s.moe.ranks, s.moe.etp,
                              busiest=s.moe.experts_cost):
            if split is not None:
                # Light classes keep the busiest rank's memory here (an upper bound):
                # own_memory lays units out again without the delayed weight gradients.
                resplit_expert_classes(program, s, ctx.compute, split)
            else:
                own_memory(program, s, ctx.compute, cpu_call, units, built)
    if graphs is not None:       # captured regions: one replay's host time each
        apply_cuda_graphs(program, graphs, cpu_call, s.act * s.local_tokens * s.h, s.vp)
    return program


class _Step:
    """Adds a shaped job's units, data-parallel buckets and optimizer to ``program``, stage by
    stage (one rank class per pipeline stage)."""

    def __init__(self, ctx: JobContext, shape: MegatronShape, program: Program,
                 classes: list[RankClass], units: dict[UnitKey, UnitOps], keys: KeySeq,
                 cpu_call: float) -> None:
        s = shape
        self.cm = ctx.compute
        self.s = s
        self.program = program
        self.classes = classes
        self.units = units
        self.keys = keys
        self.cpu_call = cpu_call
        self.host = HostSpec.from_scenario(ctx.scenario) if s.optimizer.offload > 0 else None
        # overlap_param_gather_with_optimizer_step: chunk 0's optimizer step closes the step
        # and the other chunks' steps open the next (see add_stages).
        self.rotated = s.opts.overlap_param_gather_with_optimizer_step and s.dp * s.cp > 1
        size = bucket_size(s.opts.bucket_size, s.opts.overlap_grad_reduce, s.dp * s.cp)
        self.buckets = {st: assign_buckets(st, s.p, s.vp, s.chunks, s.layer_params,
                                           s.emb_params, s.head_params, size,
                                           s.place)
                        for st in range(s.p)}
        self.launch_after: Hooks = {}   # id(op) -> ops the host issues right after it
        self.insert_before: Hooks = {}  # id(op) -> ops the host issues right before it
        self.expert_buckets = {st: expert_buckets(self.s, st, size) for st in range(s.p)}
        empty = StageBuckets()
        self.stage_buckets = {st: empty for st in range(s.p)}
        self.expert_stage_buckets = {st: empty for st in range(s.p)}
        self.last_bwd: dict[int, Op] = {}
        self.wgrad: dict[UnitKey, dict[int, LayerWgrad]] = {}
        """``delay_wgrad_compute`` (or DualPipe): each backward unit's delayed weight
        gradients by layer."""
        self.zero_bubble: dict[int, set[Unit]] = {}
        """DualPipe(V): each stage's backward units whose weight gradients wait for a
        ``weight`` step."""
        self.deferred: dict[int, deque[list[Op]]] = {}
        """DualPipe(V): each stage's deferred weight gradients, first in, first out
        (``WeightGradStore``)."""

    # ------------------------------------------------------------------ buckets
    def add_buckets(self) -> None:
        """Each stage's gradient reduces and parameter gathers (:func:`bucket_ops`), hooked
        into its units where Megatron-Core issues them; the routed experts' buckets over the
        expert-data-parallel groups likewise (their own buffers: Megatron-Core's
        ``DistributedDataParallel`` ``expert_parallel_buffers`` over ``expt_dp``)."""
        s = self.s
        for st in range(s.p) if s.dp * s.cp > 1 else ():
            if s.opts.use_megatron_fsdp:   # Megatron-FSDP: per-unit gathers and reduces
                self.stage_buckets[st], self.expert_stage_buckets[st] = fsdp_ops(
                    s, self.units, s.dp_groups(st), partial(self.keys, f"dp/{st}"),
                    self.cpu_call, self.launch_after, self.insert_before,
                    expert_groups(self.s, st), partial(self.keys, f"edp/{st}"))
                continue
            self.stage_buckets[st] = self._bucket_ops(
                st, self.buckets[st], instance_groups(s.dp_groups(st), s.k_inst), "dp")
        for st in range(s.p) if not s.opts.use_megatron_fsdp else ():
            groups = expert_groups(self.s, st)
            if groups is not None:
                self.expert_stage_buckets[st] = self._bucket_ops(
                    st, self.expert_buckets[st], (groups, ()), "edp")

    def _bucket_ops(self, st: int, buckets: list[Bucket],
                    groups: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]],
                    prefix: str) -> StageBuckets:
        s = self.s
        reduce_op = "reduce_scatter" if s.opts.distributed_optimizer else "all_reduce"
        units = self.units
        forwards = [u for u in self.order(st) if u[0] == "F"]
        intra, inter = groups
        return bucket_ops(
            st, s.p, s.vp, s.chunk_micro_batches, buckets, forwards, BucketComms(
                groups=intra, reduce_op=reduce_op, inter_groups=inter,
                grad_bytes=s.grad_bytes, param_bytes=s.gather_bytes(st, prefix == "edp"),
                grad_dtype=s.grad_dtype, param_dtype=s.act_dtype,
                overlap_grad_reduce=s.opts.overlap_grad_reduce,
                overlap_param_gather=(s.opts.distributed_optimizer
                                      and s.opts.overlap_param_gather),
                align_param_gather=s.align_gather,
                gather_with_optimizer=s.opts.overlap_param_gather_with_optimizer_step,
                part_op=lambda k, v, mb, part: units[(k, v, mb)].part_op[part],
                first_op=lambda k, v, mb: units[(k, v, mb)].first,  # type: ignore[arg-type,return-value]
                key=lambda: self.keys(f"{prefix}/{st}"),
                cpu_s=self.cpu_call, launch_after=self.launch_after,
                insert_before=self.insert_before))

    def order(self, st: int) -> list[Unit]:
        """Stage ``st``'s units in the order its schedule runs them."""
        s = self.s
        if s.deepseek_schedule:
            return deepseek_order(s.schedule_kind, s.p, st, s.mb_count)
        return schedule(s.schedule_kind, s.p, st, s.mb_count, s.vp)

    def optimizer_s(self, st: int) -> float:
        """GPU seconds of stage ``st``'s optimizer step over its shard (dense over the
        data-parallel group, the local experts over the expert-data-parallel group):
        :func:`~sim.frameworks.megatron.optimizer_precision.gpu_step_s`."""
        s = self.s
        n = s.stage_params(st)
        local = self.local_params(st)
        n += s.stage_expert_params(st)
        return gpu_step_s(self.cm, s.optimizer, local, n, s.grad_bytes,
                          8 * s.stage_layer_count[st] + 4)

    def local_params(self, st: int) -> float:
        """Parameters of stage ``st``'s optimizer shard on one rank."""
        s = self.s
        local = s.stage_params(st) / s.shard
        e = s.stage_expert_params(st)
        if e:   # the local experts' shard over the expert-data-parallel group
            local += e / s.expert_shard
        return local

    def _step_bytes(self, st: int) -> float:
        """GPU bytes the optimizer allocates at the step: fp32 copies of 16-bit gradients
        (Megatron-Core's ``copy_group_grads``), held until the next step's ``zero_grad``."""
        plan = self.s.optimizer
        return plan.step_bytes * (1.0 - plan.offload) * self.local_params(st)

    def chunk0_share(self, st: int) -> float:
        """Share of stage ``st``'s parameters in its first model chunk."""
        return sum(b.params for b in self.buckets[st] if b.v < self.s.p) / \
            self.s.stage_params(st)

    # ------------------------------------------------------------------ pipeline
    def add_stages(self, link: P2PLink) -> None:
        """Each stage's units and transfers in its pipeline schedule (:func:`add_stage`)."""
        for st, cls in enumerate(self.classes):
            last_on_stream: dict[str, Op] = {}

            def run_unit(u: tuple[str, int, int], st: int = st, cls: RankClass = cls,
                         last_on_stream: dict[str, Op] = last_on_stream
                         ) -> tuple[Op | None, Op | None]:
                return self._run_unit(u, st, cls, last_on_stream)

            for g in (*self.stage_buckets[st].prologue,     # aligned: before the first receive
                      *self.expert_stage_buckets[st].prologue):
                self.program.add(cls, g)
                last_on_stream[g.stream] = g
            if self.rotated:
                # Steady state of ChainedOptimizer._step (chunk 0, its gathers, the others):
                # the step opens at that dispatch and ends with chunk 0's optimizer step.
                last_on_stream["compute"] = self.program.add(cls, compute(
                    "optimizer step chunks 1+ (previous step)",
                    self.optimizer_s(st) * (1.0 - self.chunk0_share(st)), phase="optimizer",
                    category="optimizer"))
            steps = self._stage_steps(st)

            def run_pair(f: tuple[str, int, int], b: tuple[str, int, int], st: int = st,
                         cls: RankClass = cls, last_on_stream: dict[str, Op] = last_on_stream
                         ) -> tuple[Op | None, Op | None]:
                return self._run_pair(f, b, st, cls, last_on_stream)

            def run_weight(st: int = st, cls: RankClass = cls,
                           last_on_stream: dict[str, Op] = last_on_stream
                           ) -> tuple[Op | None, Op | None]:
                return self._run_weight(st, cls, last_on_stream)

            add_stage(self.program, cls, st, steps, run_unit, link, last_on_stream, run_pair,
                      run_weight)

    def _stage_steps(self, st: int) -> list[Step]:
        """Stage ``st``'s schedule: units, transfers and waits (:func:`pipeline_steps`), or
        DualPipe's or DualPipeV's (:func:`~sim.frameworks.megatron.dualpipe.deepseek_steps`)."""
        s = self.s
        if s.deepseek_schedule:
            steps = deepseek_steps(s.schedule_kind, s.p, st, s.mb_count)
            self.zero_bubble[st] = {x.unit for x in steps if x.zero_bubble and x.unit}
            self.deferred[st] = deque()
            return steps
        # The combined 1F1B schedule (moe_a2a_overlap): one more warm-up forward, then
        # each steady forward and backward issued together (a2a_overlap).
        kind_sched = s.schedule_kind
        extra = int(s.opts.moe_a2a_overlap)
        steps = pipeline_steps(kind_sched, s.p, st, s.mb_count, s.vp,
                               overlap=s.overlap_p2p, sync=s.batch_p2p, extra_warmup=extra)
        if extra:
            steps = pair_steps(steps, schedule(kind_sched, s.p, st, s.mb_count, s.vp, extra),
                               combined_warmup(s.p, st, s.mb_count, s.vp))
        return steps

    def _run_unit(self, u: tuple[str, int, int], st: int, cls: RankClass,
                  last_on_stream: dict[str, Op]) -> tuple[Op | None, Op | None]:
        """Add one unit's ops, with the bucket ops hooked before and after them."""
        kind, chunk, mb = u
        if self.s.deepseek_schedule:
            return self._run_plain(u, st, cls, last_on_stream)
        if self.s.opts.moe_a2a_overlap:
            # Lone units go through the combined schedule's plan too (the warm-up forwards
            # and cool-down backwards: forward_backward_helper_wrapper with one of them).
            return self._run_pair(u if kind == "F" else None, u if kind == "B" else None,
                                  st, cls, last_on_stream)
        unit = self.units[(kind, self.s.place.virtual(st, chunk), mb)]
        for op in unit.ops:
            self._emit(op, cls, last_on_stream)
        if kind == "B":
            self.last_bwd[st] = unit.last  # type: ignore[assignment]
        return unit.first, unit.last

    def _run_plain(self, u: Unit, st: int, cls: RankClass, last_on_stream: dict[str, Op]
                   ) -> tuple[Op | None, Op | None]:
        """DualPipe's (or DualPipeV's) lone chunk: the module's plain forward or backward. A
        backward's weight gradients run right after it, or, for a zero-bubble one, wait in
        the stage's queue for a ``weight`` step."""
        key = (u[0], self.s.place.virtual(st, u[1]), u[2])
        unit = self.units[key]
        for op in unit.ops:
            self._emit(op, cls, last_on_stream)
        if u[0] == "F":
            return unit.first, unit.last
        dw = [op for w in self.wgrad.get(key, {}).values() for op in (*w.mlp, *w.pre)]
        if u in self.zero_bubble[st]:
            self.deferred[st].append(dw)
            dw = []
        for op in dw:
            self._emit(op, cls, last_on_stream)
        self.last_bwd[st] = dw[-1] if dw else unit.last  # type: ignore[assignment]
        return unit.first, self.last_bwd[st]

    def _run_weight(self, st: int, cls: RankClass, last_on_stream: dict[str, Op]
                    ) -> tuple[Op | None, Op | None]:
        """DualPipe's ``_weight_chunk``: the oldest deferred backward's weight gradients."""
        dw = self.deferred[st].popleft()
        for op in dw:
            self._emit(op, cls, last_on_stream)
        if not dw:
            return None, None
        self.last_bwd[st] = dw[-1]
        return dw[0], dw[-1]

    def _emit(self, op: Op, cls: RankClass, last_on_stream: dict[str, Op]) -> None:
        """Add one op with the bucket ops hooked before and after it."""
        for o in (*self.insert_before.get(id(op), []), op, *self.launch_after.get(id(op), [])):
            self.program.add(cls, o)
            last_on_stream[o.stream] = o

    def _run_pair(self, f: tuple[str, int, int] | None, b: tuple[str, int, int] | None,
                  st: int, cls: RankClass, last_on_stream: dict[str, Op]
                  ) -> tuple[Op | None, Op | None]:
        """A forward and a backward unit (or one of them) issued together, layer by layer
        (:func:`sim.frameworks.megatron.a2a_overlap.issue_pair`)."""
        place = self.s.place
        if self.s.deepseek_schedule and not self.s.opts.moe_a2a_overlap:
            # DualPipe without an overlapped_forward_backward: the forward, then the backward.
            assert f is not None and b is not None
            first, _ = self._run_plain(f, st, cls, last_on_stream)
            return first, self._run_plain(b, st, cls, last_on_stream)[1]
        fu = self.units[(f[0], place.virtual(st, f[1]), f[2])].ops if f else []
        bu = self.units[(b[0], place.virtual(st, b[1]), b[2])].ops if b else []
        label = " ".join(f"{u[0]}{place.virtual(st, u[1])}.{u[2]}" for u in (f, b) if u)
        first, last = issue_pair(fu, bu, lambda op: self._emit(op, cls, last_on_stream),
                                 label, self.wgrad.get((b[0], place.virtual(st, b[1]), b[2]))
                                 if b and self.wgrad else None,
                                 single_queue=self.s.opts.cuda_device_max_connections == 1,
                                 node_cpu=node_host(bool(self.s.lay.fp8)),
                                 full_recompute=self.s.ac == "full")
        if b is not None:
            self.last_bwd[st] = last
        return first, last

    # ------------------------------------------------------------------ gradients, optimizer
    def add_gradients_and_optimizer(self) -> None:
        """After the schedule: the gradient reduces not overlapped with backward
        (``finalize_model_grads``: every chunk's one bucket), the tied embedding's all-reduce
        between the first and last stage, the optimizer step and, without
        ``overlap_param_gather``, the distributed optimizer's parameter gathers."""
        s, program = self.s, self.program
        for st, cls in enumerate(self.classes):
            groups = instance_groups(s.dp_groups(st), s.k_inst)[0]
            grads = self.stage_buckets[st].grads + self.expert_stage_buckets[st].grads
            deps_done = [self.last_bwd[st]] + grads
            if not s.opts.overlap_grad_reduce:
                for g in grads:
                    g.deps = g.deps or [self.last_bwd[st]]
                    program.add(cls, g)
            # _allreduce_layernorm_grads: after finish_grad_sync, before the embeddings'.
            deps_done += self._tp_grad_all_reduce(st, cls, deps_done)
            # Tied, or copied for the multi-token prediction modules (_allreduce_word_
            # embedding_grads: share_embeddings_and_output_weights or mtp_num_layers).
            # (Under DualPipeV's V the embedding and the head are both on stage 0; DualPipe's
            # pair all-reduce sums every copy.)
            if (s.model.tied_embeddings or s.mtp is not None) and s.p > 1 \
                    and not s.place.folded and st in (0, s.p - 1):
                pairs = s.stage_pairs(0, s.p - 1)
                tie = program.add(cls, Op(
                    name=("tied" if s.model.tied_embeddings else "mtp") + " embedding all-reduce",
                    kind="collective", stream="dp",
                    phase="comm", deps=list(deps_done), collective="all_reduce",
                    group=pairs[0], groups=pairs, nbytes=s.grad_bytes * s.vocab_local * s.h,
                    dtype=s.grad_dtype,
                    key="embedding-group", category="all_reduce"))
                deps_done.append(tie)
            if s.place.bidirectional:
                deps_done.append(self._dualpipe_pair_all_reduce(st, cls, deps_done))
            deps_done += add_state_reload(s, program, cls, st, [self.last_bwd[st]])
            dur = self.optimizer_s(st)
            if self.rotated:
                dur *= self.chunk0_share(st)   # the other chunks' steps open the step
            opt = program.add(cls, compute("optimizer step", dur, phase="optimizer",
                                           category="optimizer", deps=deps_done,
                                           transient=self._step_bytes(st)))
            if self.host is not None:   # optimizer_cpu_offload: the CPU share's step
                for o in offload_ops(s.optimizer, self.host, self.local_params(st), opt,
                                     deps_done):
                    program.add(cls, o)
                opt = o
            if s.opts.distributed_optimizer and s.dp * s.cp > 1 \
                    and not self.stage_buckets[st].gathers:
                # Without overlap_param_gather the optimizer gathers every bucket right away.
                for b in self.buckets[st]:
                    program.add(cls, Op(
                        name=f"param all_gather bucket v{b.v} {b.parts[-1]}",
                        kind="collective", stream="dp", phase="comm", deps=[opt],
                        collective="all_gather", group=groups[0], groups=groups,
                        nbytes=s.gather_bytes(st, False) * b.params, dtype=s.act_dtype,
                        key=self.keys(f"dp/{st}"),
                        category="all_gather"))
            # Then the experts' buffers (DistributedDataParallel.start_param_sync walks the
            # dense bucket groups, then the expert-parallel ones).
            self._expert_gathers(st, cls, opt)

    def _dualpipe_pair_all_reduce(self, st: int, cls: RankClass, deps: list[Op]) -> Op:
        """DualPipe's two copies of each stage summed: stage ``st`` and stage ``p - 1 - st``
        hold the same two stages (each one's forward-direction copy and the other's reverse
        one), so each rank all-reduces its gradient shard (after the data-parallel reduce,
        the part its optimizer steps) with its peer's, keyed by the pair so both issue it."""
        s = self.s
        peer = s.p - 1 - st
        lo, hi = min(st, peer), max(st, peer)
        pairs = s.stage_pairs(lo, hi)
        return self.program.add(cls, Op(
            name="dualpipe copies grad all-reduce", kind="collective", stream="dp",
            phase="comm", deps=list(deps), collective="all_reduce", group=pairs[0],
            groups=pairs, nbytes=s.grad_bytes * self.local_params(st), dtype=s.grad_dtype,
            key=f"dualpipe-pair/{lo}", category="all_reduce", cpu_s=self.cpu_call))

    def _tp_grad_all_reduce(self, st: int, cls: RankClass, deps: list[Op]) -> list[Op]:
        """The replicated parameters' gradients of stage ``st`` summed over its
        tensor-parallel groups (:mod:`sim.frameworks.megatron.tp_grads`): flattened into one
        buffer (``_flatten_dense_tensors``: a copy kernel), one all-reduce on the compute
        stream's order, copied back (``buf.copy_(synced)``). Nothing with tp = 1."""
        s, n = self.s, stage_replicated_params(self.s, st)
        if not n:
            return []
        nbytes = s.grad_bytes * n
        groups = s.tp_groups(st)
        flat = self.program.add(cls, compute(
            "flatten replicated grads", self.cm.membound_time(2 * nbytes), phase="optimizer",
            category="copy", deps=list(deps), cpu_s=self.cpu_call))
        ar = self.program.add(cls, Op(
            name="tp all-reduce replicated grads", kind="collective", stream="compute",
            phase="comm", deps=[flat], collective="all_reduce", group=groups[0], groups=groups,
            nbytes=nbytes, dtype=s.grad_dtype, key=f"tp-grads/{st}", category="all_reduce",
            cpu_s=self.cpu_call))
        back = self.program.add(cls, compute(
            "unflatten replicated grads", self.cm.membound_time(2 * nbytes), phase="optimizer",
            category="copy", deps=[ar], cpu_s=self.cpu_call))
        return [back]

    # ------------------------------------------------------------------ experts
    def _expert_gathers(self, st: int, cls: RankClass, opt: Op) -> None:
        """Without ``overlap_param_gather``: the distributed optimizer's all-gathers of the
        updated expert parameters over the expert-data-parallel group, after its step."""
        s = self.s
        groups = expert_groups(self.s, st)
        if not s.opts.distributed_optimizer or self.expert_stage_buckets[st].gathers \
                or groups is None:
            return
        for b in self.expert_buckets[st]:
            self.program.add(cls, Op(
                name=f"expert param all_gather bucket v{b.v} {b.parts[-1]}",
                kind="collective", stream="dp", phase="comm", deps=[opt],
                collective="all_gather", group=groups[0], groups=groups,
                nbytes=s.gather_bytes(st, True) * b.params, dtype=s.act_dtype,
                key=self.keys(f"edp/{st}"), category="all_gather"))
