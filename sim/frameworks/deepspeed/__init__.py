"""Microsoft DeepSpeed ZeRO stages 0-3, ZeRO++ and ZeRO-Offload/Infinity (pure data parallelism).

Every behaviour below is read from DeepSpeed's sources at commit 38327e07 (``deepspeed/runtime/
engine.py``, ``bf16_optimizer.py``, ``fp16/fused_optimizer.py``, ``zero/stage_1_and_2.py``,
``zero/stage3.py``, ``zero/partitioned_param_coordinator.py``, ``zero/partition_parameters.py``,
``zero/parameter_offload.py``, ``comm/coalesced_collectives.py``, ``zero/config.py``,
``zero/offload_config.py``, ``ops/adam/cpu_adam.py``, ``runtime/utils.py``). The model is a
Hugging Face Llama/GPT module tree (its submodules are what ZeRO-3 hooks) run eagerly in
16-bit: DeepSpeed casts the module to bf16/fp16, no autocast. Its kernels are priced with
:mod:`sim.layer_ops` style ``bf16`` (16-bit weights and activations), whose fused RMSNorm and
complex-multiply RoPE stand in for Hugging Face's unfused fp32 RMSNorm and rotate_half RoPE;
no KV cache is built.

Communication dtype is the model dtype (``engine.communication_data_type``), and with ZeRO the
gradient accumulation dtype is the model dtype too (``engine.get_data_types``); all collectives
of gradients move 2 bytes per element. Param groups: one (the client passes
``model.parameters()``), so "one collective per param group" is one collective.

Stage 0 (no ZeRO; ``engine.allreduce_gradients`` -> ``buffered_allreduce_fallback``)
    bf16 runs ``BF16_Optimizer``: fp32 gradient accumulation buffers of the whole model (4 B),
    16-bit ``.grad`` cleared at the start of each backward, added into the fp32 buffer after it
    (``update_hp_grads``); at the accumulation boundary the flat fp32 buffer is cast to bf16,
    all-reduced in one call on the compute stream, scaled and copied back; the fp32 master and
    Adam states are partitioned over the ranks, the step updates the local partition, copies
    it into the 16-bit weights and all-gathers them (``update_lp_params``). fp16 runs
    ``FP16_Optimizer``: fp16 ``.grad`` accumulate in place, bucketed all-reduce (5e8 elements,
    ``MEMORY_OPT_ALLREDUCE_SIZE``) at the boundary, full fp32 master and Adam on every rank,
    a host-synchronising overflow check and norm per tensor.
Stages 1 and 2 (``DeepSpeedZeroOptimizer``)
    Gradients are **all-reduced** bucket by bucket (``average_tensor`` -> ``allreduce_and_scatter``
    -> ``allreduce_bucket``: ``use_multi_rank_bucket_allreduce``), each rank keeping its slice;
    never a reduce-scatter. A bucket holds ``reduce_bucket_size`` elements copied by the
    AccumulateGrad hooks into a contiguous ``ipg_buffer`` (two with ``overlap_comm``); it is
    reduced when the next gradient does not fit. Stage 2 hooks reduce every micro-step; stage 1
    has hooks only with ``overlap_comm`` and then reduces only at the boundary, otherwise
    ``reduce_gradients`` walks the parameters after the last backward. With ``overlap_comm``
    the reduction stream waits for the compute stream and the compute stream for the
    reduction stream at each launch, so one bucket reduces beside compute; the epilogue
    synchronises the device. After the step one ``all_gather_into_tensor`` of the 16-bit flat
    buffer (``all_gather_dp_groups``), on the compute stream, before the next forward.
Stage 3 (``DeepSpeedZeroOptimizer_Stage3`` + ``PartitionedParameterCoordinator``)
    Hooks on every submodule fetch the parameters a module owns directly; the coordinator's
    decisions are replayed here exactly on the module trace (recorded in iteration 1, so this
    is the steady state): a module's missing parameters are all-gathered in one coalesced call,
    then up to ``stage3_prefetch_bucket_size`` more elements of upcoming parameters (bounded by
    ``stage3_max_live_parameters`` gathered at once), at every module's fetch; the host waits
    for the all-gather of the third-latest waited parameter (``__max_ongoing_fetch_events=2``);
    parameters are released after use unless persistent (``<= stage3_param_persistence_
    threshold`` elements: gathered once after every step), reused within
    ``stage3_max_reuse_distance`` (default 1e9 elements), or their reuse was already
    scanned by the prefetcher. Backward gathers again with prefetch. Gradients go through one
    ``reduce_bucket_size`` bucket on ``reduce_and_partition_stream`` with one coalesced
    reduce-scatter per bucket (``reduce_scatter_coalesced``: interleaving ``torch.cat`` copy,
    pre-divide, reduce-scatter), at most two reductions outstanding before the host waits
    (``max_param_reduce_events``), accumulated into a persistent gradient-partition buffer.
    The step loops over sub-groups (``sub_group_size``, default 1e9 elements).
ZeRO++ (stage 3)
    qwZ: int8 block-quantised all-gathers (``CUDAQuantizer``, groups of at most 8000 elements,
    one fp32 scale each, all-gathered separately), quantise before and dequantise after.
    hpZ: a secondary copy of each parameter sharded over ``hpz_partition_size`` ranks (one
    node by default) is made at its first release in a step (with a device synchronisation,
    ``_partition_param_sec``) and later gathers of the step use that node-local group.
    qgZ (more than one node): per tensor, int4 swizzled quantisation, all-to-all inside the
    node, dequantise-reduce-requantise, all-to-all across nodes, dequantise and sum
    (``all_to_all_quant_reduce``); 1-D tensors and sizes not divisible by 2 x world fall back
    to a reduce-scatter.
Offload
    ``offload_optimizer`` (stages 1-3): fp32 master and Adam states in host memory, the step
    on the CPU (``DeepSpeedCPUAdam``, :func:`sim.host.cpu_adam_s`; synchronous inside
    ``step()``), gradients copied to the host and parameters back as the code does. Stages
    1-2 (``copy_grads_in_partition``): the fp32 gradient partition to the host (4 B per
    element; under accumulation the 16-bit gradients make a round trip every micro-step),
    the updated fp32 partition back (4 B) and cast on the GPU, then the usual all-gather.
    Stage 3 (``partition_grads``): the 16-bit gradient partition to host memory and back to
    the GPU (2 + 2 B), at the boundary fp32 to the optimizer (4 B, blocking); parameters come
    back as 16-bit (``copy_`` converts on the CPU: 2 B). ``nvme`` on stage 3 swaps the fp32
    parameters and Adam states (and the fp32 gradients) with the node's NVMe around each
    sub-group's step; stages 1-2 treat ``nvme`` as ``cpu`` (``stage_1_and_2.py`` sets
    ``cpu_offload`` for any device other than none). ``offload_param`` (stage 3): 16-bit
    partitions in host memory, copied to the GPU (blocking ``.to``) before every gather;
    partitions beyond ``max_in_cpu`` (1e9 elements) per rank are read from NVMe first.

Host time. Model kernels are issued eagerly (:mod:`sim.compute`'s per-op costs as
``Op.cpu_s``, the GPU time as the duration), so a step can be bound by the host. Stage 3 adds
its Python: every submodule's four hooks (forward pre/post, and the autograd functions that
trigger the backward pre/post hooks), each waited parameter, each gather issued and split,
each parameter freed and each gradient hook. No measured figure was found for these; the
constants below are derived from the calls the code makes (about 90 us for a prefetched
``nn.Linear``'s forward fetch, wait and release, 55 us for a container module), and are an
estimate. Host waits the code makes (event and stream synchronisations, ``.item()``, blocking
copies, hpZ's ``synchronize``) are ops with ``host_sync``.

Memory pressure. Stage 3's throttles (fetch events, ``max_live_parameters``) are host-side:
when compute is the bottleneck the host issues gathers (and allocates their buffers) far
ahead of the GPU, and released blocks wait for the compute stream (``record_stream``). What
stops the growth is PyTorch's caching allocator: once the device is full, ``cudaMalloc`` fails
and it synchronises on the pending events before retrying (``release_cached_blocks`` ->
``synchronize_and_free_events``; ``stage3.py`` warns of these "allocator cache flushes"). The
builder makes the host wait for the compute stream when the gathered bytes it holds and has
released would exceed what the GPU has left beside the resident states and one micro-batch's
activations. This lives in the builder, not the engine: it needs the host-side order of
allocations and releases (what the caching allocator sees), which only the builder knows;
the engine books memory when ops run on the GPU. The engine's launch queue does not bound
this alone: without the flush, Llama 3 70B ZeRO-3 on 64 H100 (the shipped scenario) would
hold 99.5 GiB of gathered parameters at its peak, with it 49.6 GiB after 5 flushes per step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sim.compute import EAGER_BWD_OP_CPU_S, EAGER_FWD_OP_CPU_S, ComputeModel
from sim.frameworks.accounting import block_grad_params, block_model_flops
from sim.frameworks.base import JobContext, register
from sim.frameworks.steps import PassOps, micro_batch_ops
from sim.host import HostSpec, cpu_adam_s, cpu_pass_s
from sim.layer_ops import FP32, Kernel, Style, kernel_time, model_blocks
from sim.model import ModelSpec
from sim.program import CollectiveOp, HostTransfer, Op, Phase, Program, RankClass
from sim.scenario import DeepSpeedOptions

# --------------------------------------------------------------------------- constants
W16 = 2
"""Bytes of the model dtype (bf16/fp16) and of the communication dtype."""
FP64 = 8
INT8 = 1

ENGINE_ALLREDUCE_ELEMENTS = 500_000_000
"""engine.py MEMORY_OPT_ALLREDUCE_SIZE: bucket of buffered_allreduce_fallback (stage 0)."""
NCCL_START_ALIGNMENT_FACTOR = 2
"""stage_1_and_2.py / bf16_optimizer.py: flat buffers padded to 2 x world elements."""
MAX_ONGOING_FETCH_EVENTS = 2
"""partitioned_param_coordinator.py __max_ongoing_fetch_events."""
MAX_PARAM_REDUCE_EVENTS = 2
"""stage3.py max_param_reduce_events."""
QWZ_TARGET_GROUP = 8000
"""partition_parameters.py CUDAQuantizer.target_group_size (int8, one fp32 scale a group)."""
OFFLOAD_PARAM_MAX_IN_CPU = 1_000_000_000
"""offload_config.py max_in_cpu: partition elements kept in host memory under NVMe offload."""
INT4_BYTES = 0.5
FP32_SCALE = 4

# Host (CPU) cost of DeepSpeed's Python around the kernels. No published per-hook measurement
# was found (PR #6694 only reports that coalescing halves fetch/release CPU time); these are
# derived from the work the code does, counting its calls:
TORCH_CALL_CPU_S = EAGER_FWD_OP_CPU_S
"""A torch call through the dispatcher (torch.empty, cat, copy_, all_gather_into_tensor,
autograd.Function.apply): the project's eager per-op cost (sim.compute)."""
CUDA_API_CPU_S = 3e-6
"""A stream or event call from Python (torch.cuda.Event(), record, query, wait_stream,
entering or leaving a stream context): a CUDA runtime call of one to a few microseconds plus
the binding; an estimate, not a measurement."""
RECORD_STREAM_CPU_S = 1.5e-6
"""Tensor.record_stream: the caching allocator notes the stream under its mutex; no CUDA
call; an estimate."""
VIEW_CPU_S = 1.5e-6
"""A view (narrow, view): dispatcher plus a TensorImpl, no kernel; an estimate."""
HOOK_PY_CPU_S = 15e-6
"""Pure-Python bookkeeping of one coordinator entry point (frozenset of the module's
parameters, dict/deque/set work, nested calls behind logger guards); an estimate."""


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class _Zero:
    """The scenario's options resolved to DeepSpeed's effective settings."""

    stage: int
    overlap: bool
    contiguous: bool
    bucket: int
    prefetch: int
    persistence: int
    max_live: int
    offload_opt: str
    offload_param: str
    qwz: bool
    hpz: int
    qgz: bool
    fp16: bool
    max_reuse: int = 1_000_000_000
    sub_group: int = 1_000_000_000


def _resolve(ctx: JobContext) -> _Zero:
    """Check the options against what DeepSpeed accepts and resolve the defaults."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, DeepSpeedOptions)
    ctx.require_data_parallel_only("deepspeed")
    stage = opts.zero_stage
    zpp = opts.zeropp
    ctx.require(opts.offload_param == "none" or stage == 3, "framework.offload_param",
                f"parameter offload needs zero_stage 3 (got {stage})")
    ctx.require(opts.offload_optimizer == "none" or stage >= 1, "framework.offload_optimizer",
                "optimizer offload needs zero_stage 1, 2 or 3 (ZeRO-Offload)")
    ctx.require(not (zpp.qwz or zpp.hpz or zpp.qgz) or stage == 3, "framework.zeropp",
                f"ZeRO++ (qwz, hpz, qgz) needs zero_stage 3 (got {stage})")
    ctx.require(zpp.hpz_partition_size is None or zpp.hpz, "framework.zeropp.hpz_partition_size",
                "is set but zeropp.hpz is false")
    n = ctx.n_ranks
    hpz = 1
    if zpp.hpz:
        hpz = zpp.hpz_partition_size or s.cluster.gpus_per_node
        # groups._create_zero_param_parallel_group: min(size, world), world divisible by it.
        hpz = min(hpz, n)
        ctx.require(n % hpz == 0, "framework.zeropp.hpz_partition_size",
                    f"{hpz} does not divide the {n} data-parallel ranks")
    overlap = opts.overlap_comm if opts.overlap_comm is not None else stage == 3
    return _Zero(stage=stage, overlap=overlap, contiguous=opts.contiguous_gradients,
                 bucket=opts.reduce_bucket_size, prefetch=opts.stage3_prefetch_bucket_size,
                 persistence=opts.stage3_param_persistence_threshold,
                 max_live=opts.stage3_max_live_parameters,
                 offload_opt=opts.offload_optimizer, offload_param=opts.offload_param,
                 qwz=zpp.qwz, hpz=hpz, qgz=zpp.qgz,
                 fp16=s.training.precision == "fp16",
                 max_reuse=opts.stage3_max_reuse_distance, sub_group=opts.sub_group_size)


# --------------------------------------------------------------------------- emitter
class _Emitter:
    """Adds ops to the one rank class of a pure data-parallel job, keeping per-stream state:
    the last op of each stream, dependencies owed to the next op of a stream
    (``wait_stream``), and host time owed to the next op issued."""

    def __init__(self, program: Program, cls: RankClass, cm: ComputeModel) -> None:
        self.program = program
        self.cls = cls
        self.cm = cm
        self.last: dict[str, Op] = {}
        self.owed_deps: dict[str, list[Op]] = {}
        self.owed_cpu = 0.0
        self._keys = 0
        self.group = cls.members

    def add(self, op: Op) -> Op:
        """Append ``op`` with the dependencies and host time owed to it."""
        extra = self.owed_deps.pop(op.stream, [])
        for d in extra:
            if all(d is not x for x in op.deps):
                op.deps = list(op.deps) + [d]
        op.cpu_s += self.owed_cpu
        self.owed_cpu = 0.0
        self.program.add(self.cls, op)
        self.last[op.stream] = op
        return op

    def owe(self, stream: str, dep: Op | None) -> None:
        """The next op on ``stream`` waits for ``dep`` (``stream.wait_stream``)."""
        if dep is not None:
            self.owed_deps.setdefault(stream, []).append(dep)

    def kernels(self, name: str, stream: str, phase: Phase, nbytes: float, kernels: int = 1,
                category: str = "copy", cpu_per_kernel: float = TORCH_CALL_CPU_S,
                **kw: object) -> Op:
        """Memory-bound kernels moving ``nbytes`` in all (read plus written)."""
        dur = self.cm.membound_time(nbytes) + max(0, kernels - 1) * self.cm.kernel_min_s
        return self.add(Op(name=name, kind="compute", stream=stream, phase=phase,
                           duration=dur, cpu_s=kernels * cpu_per_kernel, category=category,
                           kernels=kernels, **kw))  # type: ignore[arg-type]

    def collective(self, name: str, coll: CollectiveOp, nbytes: float, stream: str,
                   groups: tuple[tuple[int, ...], ...] | None = None,
                   cpu_s: float = TORCH_CALL_CPU_S, **kw: object) -> Op | None:
        """A collective over ``groups`` (default: every rank); none on a single rank."""
        groups = groups or (self.group,)
        if len(groups[0]) <= 1:
            return None
        self._keys += 1
        return self.add(Op(name=name, kind="collective", stream=stream, phase="comm",
                           collective=coll, group=groups[0],
                           groups=groups if len(groups) > 1 else (), nbytes=nbytes,
                           key=f"deepspeed/{self._keys}", category=coll, cpu_s=cpu_s,
                           **kw))  # type: ignore[arg-type]

    def transfer(self, name: str, kind: HostTransfer, nbytes: float, stream: str,
                 phase: Phase, **kw: object) -> Op:
        """Bytes per rank between GPU and host memory, or host memory and NVMe."""
        return self.add(Op(name=name, kind="copy", stream=stream, phase=phase,
                           host_transfer=kind, nbytes=nbytes, category="copy",
                           cpu_s=TORCH_CALL_CPU_S, **kw))  # type: ignore[arg-type]

    def cpu_work(self, name: str, seconds: float, phase: Phase, deps: list[Op],
                 category: str = "optimizer") -> Op:
        """Work of the host thread itself (it blocks until done)."""
        return self.add(Op(name=name, kind="compute", stream="cpu", phase=phase,
                           duration=seconds, deps=deps, host_sync=True, category=category))

    def host_wait(self, name: str, deps: Sequence[Op | None], phase: Phase = "comm") -> Op:
        """The host blocks until ``deps`` are done (event/stream/device synchronize)."""
        return self.add(Op(name=name, kind="compute", stream="host", phase=phase,
                           deps=[d for d in deps if d is not None], host_sync=True,
                           category="sync"))


def _kernels_gpu_cpu(cm: ComputeModel, kernels: Iterable[Kernel], backward: bool
                     ) -> tuple[float, float, float]:
    """GPU seconds, host seconds to issue (eager PyTorch) and FLOPs of a kernel sequence."""
    gpu = cpu = flops = 0.0
    per = EAGER_BWD_OP_CPU_S if backward else EAGER_FWD_OP_CPU_S
    for k in kernels:
        gpu += kernel_time(cm, k)
        flops += k.flops
        if k.klass == "attention":
            cpu += cm.attention_cpu_s("bwd" if backward else "fwd")
        else:
            cpu += per
    return gpu, cpu, flops


def _pad(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def _grad_ready(m: ModelSpec) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Parameter tensors (name, numel) whose gradient is complete after each block's backward,
    in the order their AccumulateGrad hooks fire. A tied embedding is one leaf used twice: its
    hook fires after the embedding's backward, the last use."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name, numel, block, layer in reversed(m.parameter_tensors()):
        out.setdefault((block, layer), []).append((name, numel))
    return out


@register("deepspeed")
def build_deepspeed(ctx: JobContext) -> Program:
    """The program of one steady-state DeepSpeed training step (see the module docstring);
    with tensor or pipeline parallelism, Megatron-DeepSpeed's 3D step
    (:mod:`sim.frameworks.deepspeed.pipe`)."""
    par = ctx.scenario.parallelism
    if par.tp > 1 or par.pp > 1:
        from sim.frameworks.deepspeed.pipe import build_deepspeed_pipe
        return build_deepspeed_pipe(ctx)
    z = _resolve(ctx)
    if z.stage == 3:
        return _Stage3(ctx, z).build()
    return _Stage012(ctx, z).build()


# --------------------------------------------------------------------------- host helpers
def _host_pass_s(host: HostSpec, nbytes: float) -> float:
    """A memory-bound pass of DeepSpeed's CPU optimizer threads over ``nbytes`` of host
    memory (:func:`sim.host.cpu_pass_s`)."""
    return cpu_pass_s(host, nbytes, "deepspeed")


# --------------------------------------------------------------------------- stages 0-2
class _Stage012:
    """Stages 0-2: the engine's all-reduce (stage 0) or ``DeepSpeedZeroOptimizer`` (1-2)."""

    def __init__(self, ctx: JobContext, z: _Zero) -> None:
        self.ctx, self.z = ctx, z
        m = ctx.model
        self.m = m
        self.n = ctx.n_ranks
        self.cm = ctx.compute
        self.style = Style("bf16")
        self.costs = ctx.block_costs(self.style, kv_cache=False)
        self.psi = m.total_params
        # Flat 16-bit buffer padded to nccl_start_alignment_factor x world elements; each rank
        # owns an equal partition of it (get_data_parallel_partitions).
        self.padded = _pad(self.psi, NCCL_START_ALIGNMENT_FACTOR * self.n)
        self.part = self.padded // self.n
        self.tensors = m.parameter_tensors()
        self.ready = _grad_ready(m)
        self.offload = z.stage >= 1 and z.offload_opt != "none"
        self.host = HostSpec.from_scenario(ctx.scenario) if self.offload else None
        self.red = "reduce" if z.overlap else "compute"
        # Parameters whose 16-bit gradient each block's backward materialises (a tied
        # matrix's gradient first appears in the LM head's backward).
        self.grad_params = block_grad_params(m, self.costs)
        # ipg bucket state
        self.elems = 0
        self.bucket_extra: list[int] = []
        self.bucket_count = 0
        self.partition_grads_live = False
        self.averaged_exists = False
        self.ipg_live = 0.0

    # ------------------------------------------------------------------ program
    def build(self) -> Program:
        ctx, z = self.ctx, self.z
        n = self.n
        cls = RankClass(0, tuple(range(n)), label="all ranks (identical ZeRO partitions)")
        psi, padded, part = self.psi, self.padded, self.part
        if z.stage == 0 and not z.fp16:
            # BF16_Optimizer: flat bf16 weights, flat fp32 gradient accumulators of the whole
            # model, fp32 master + Adam of the partition; the bf16 .grad of the last backward
            # stays until the next backward clears it.
            cls.initial_memory = {"parameters": W16 * padded,
                                  "gradients": FP32 * padded + W16 * psi,
                                  "optimizer": 3 * FP32 * part}
        elif z.stage == 0:
            # FP16_Optimizer: flat fp16 weights, full fp32 master and Adam on every rank.
            cls.initial_memory = {"parameters": W16 * psi, "optimizer": 3 * FP32 * psi}
        elif self.offload:
            largest = max(numel for _, numel, _, _ in self.tensors)
            cls.initial_memory = {"parameters": W16 * padded,
                                  # temp_grad_buffer_for_gpu_offload (largest parameter)
                                  "buffers": W16 * largest}
        else:
            cls.initial_memory = {"parameters": W16 * padded, "optimizer": 3 * FP32 * part}
        flops = ctx.model_flops_per_step()
        program = Program([cls], n, ctx.tokens_per_step, flops,
                          flops + ctx.layer_recompute_flops(self.costs))
        program.meta.update(framework="deepspeed", zero_stage=z.stage,
                            micro_batches=ctx.micro_batches, style=self.style.name,
                            overlap_comm=z.overlap,
                            optimizer=("BF16_Optimizer" if z.stage == 0 and not z.fp16 else
                                       "FP16_Optimizer" if z.stage == 0 else
                                       "DeepSpeedZeroOptimizer"),
                            offload_optimizer="cpu" if self.offload else "none")
        self.e = _Emitter(program, cls, self.cm)
        self.model_flops = block_model_flops(self.m, self.costs, ctx.micro_batch, ctx.seq)
        for mb in range(ctx.micro_batches):
            self.micro_batch(mb)
        self.step()
        return program

    def micro_batch(self, mb: int) -> None:
        z, e, cm = self.z, self.e, self.cm
        m = self.m
        first, last = mb == 0, mb == self.ctx.micro_batches - 1
        fresh = (z.stage == 2 or (z.stage == 0 and not z.fp16) or first)
        grad_alloc = {b: W16 * p for b, p in self.grad_params.items()} if fresh else {}
        # AccumulateGrad adds a new 16-bit gradient into .grad (stage 0 fp16, stage 1).
        extra = {} if fresh else {b: cm.membound_time(3 * W16 * p)
                                  for b, p in self.grad_params.items()}
        ops = micro_batch_ops(self.costs, m.layers, mb, self.ctx.recompute, False, grad_alloc,
                              extra, self.model_flops)
        if not fresh:
            for op in ops.backward:
                op.transient += W16 * self.grad_params[op.name.split()[1]]
        for op in ops.forward:
            e.add(op)
        if z.stage == 0 and not z.fp16:
            # BF16_Optimizer.backward: clear_lp_grads() sets every .grad to None first.
            e.add(Op(name=f"clear_lp_grads mb{mb}", kind="compute", stream="compute",
                     phase="bwd", free=(("gradients", W16 * self.psi),), micro_batch=mb,
                     cpu_s=len(self.tensors) * 0.5e-6, category="backward"))
        if z.stage >= 1 and z.contiguous and not self.ipg_live:
            # DeepSpeedZeroOptimizer.backward: ipg_buffer (two with overlap_comm), every
            # micro-step; released by the epilogue.
            self.ipg_live = W16 * z.bucket * (2 if z.overlap else 1)
            e.add(Op(name=f"allocate ipg buffers mb{mb}", kind="compute", stream="compute",
                     phase="bwd", alloc=(("buffers", self.ipg_live),), micro_batch=mb,
                     cpu_s=TORCH_CALL_CPU_S, category="backward"))
        hooks = z.stage == 2 or (z.stage == 1 and z.overlap and last)
        key_of = {id(op): key for key, op in ops.bwd_of.items()}
        for op in ops.backward:
            e.add(op)
            if hooks:
                self.hook_params(self.ready.get(key_of[id(op)], []), mb)
        if z.stage == 0:
            if not z.fp16:
                self.update_hp_grads(mb)
            if last:
                self.engine_allreduce(mb)
            return
        if z.stage == 1 and not last:
            return
        if z.stage == 1 and not z.overlap:
            # reduce_gradients: after backward, every parameter in group (model) order.
            self.hook_params([(name, numel) for name, numel, _, _ in self.tensors], mb)
        self.epilogue(mb)

    # ------------------------------------------------------------------ stage 0
    def update_hp_grads(self, mb: int) -> None:
        # BF16_Optimizer._update_hp_grad per tensor: hp.add_(lp.grad.to(fp32)).
        self.e.kernels(f"update_hp_grads mb{mb}", "compute", "bwd",
                       (W16 + FP32 + 3 * FP32) * self.psi, kernels=2 * len(self.tensors),
                       category="backward", micro_batch=mb)

    def engine_allreduce(self, mb: int) -> None:
        """engine.allreduce_gradients -> buffered_allreduce_fallback -> allreduce_bucket, on
        the compute stream (no overlap)."""
        e, z = self.e, self.z
        if not z.fp16:
            # One flat fp32 tensor (BF16_Optimizer.get_grads_for_reduction): flatten is a
            # view; cast to the bf16 communication dtype, all-reduce, scale by 1/dp, copy back.
            p = self.padded
            e.kernels("cast fp32 grads to bf16", "compute", "bwd", (FP32 + W16) * p,
                      alloc=(("buffers", W16 * p),), micro_batch=mb)
            e.collective("all-reduce grads (engine)", "all_reduce", W16 * p, "compute",
                         micro_batch=mb)
            e.kernels("scale 1/dp + copy back to fp32", "compute", "bwd",
                      2 * W16 * p + (W16 + FP32) * p, kernels=2, free=(("buffers", W16 * p),),
                      micro_batch=mb)
            return
        # fp16 .grad tensors in named_parameters() order, buckets closed once past 5e8
        # elements (allreduce_no_retain): flatten copy, all-reduce, scale, unflatten copy.
        bucket: list[int] = []
        sizes = [numel for _, numel, _, _ in self.tensors]
        for i, numel in enumerate(sizes):
            bucket.append(numel)
            if sum(bucket) > ENGINE_ALLREDUCE_ELEMENTS or i == len(sizes) - 1:
                el = sum(bucket)
                e.kernels("flatten grad bucket", "compute", "bwd", 2 * W16 * el,
                          kernels=1, alloc=(("buffers", W16 * el),), micro_batch=mb)
                e.collective("all-reduce grad bucket (engine)", "all_reduce", W16 * el,
                             "compute", micro_batch=mb)
                e.kernels("scale 1/dp + unflatten copy", "compute", "bwd", 4 * W16 * el,
                          kernels=1 + len(bucket), free=(("buffers", W16 * el),),
                          micro_batch=mb)
                bucket = []

    # ------------------------------------------------------------------ stage 1/2 buckets
    def hook_params(self, params: list[tuple[str, int]], mb: int) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads for each gradient in hook order."""
        z = self.z
        run: list[int] = []
        for _name, numel in params:
            if self.elems + numel > z.bucket and self.elems > 0:
                self.copy_into_bucket(run, mb)
                run = []
                self.reduce_bucket(mb)
            if numel > z.bucket or not z.contiguous:
                self.bucket_extra.append(numel)   # reduced from its own .grad
            else:
                run.append(numel)
            self.elems += numel
        self.copy_into_bucket(run, mb)

    def copy_into_bucket(self, run: list[int], mb: int) -> None:
        if not run:
            return
        # new_grad_tensor.copy_(grad) into the ipg buffer on the compute stream; the .grad
        # then views the buffer, so the autograd gradient is freed.
        el = sum(run)
        self.e.kernels(f"copy grads into ipg bucket mb{mb}", "compute", "bwd", 2 * W16 * el,
                       kernels=len(run), category="backward",
                       cpu_per_kernel=TORCH_CALL_CPU_S + 2 * VIEW_CPU_S + HOOK_PY_CPU_S,
                       free=(("gradients", W16 * el),), micro_batch=mb)

    def reduce_bucket(self, mb: int) -> None:
        """reduce_ipg_grads: average_tensor (all-reduce of the bucket) then
        copy_grads_in_partition on the reduction stream (the compute stream without
        overlap_comm)."""
        z, e, n = self.z, self.e, self.n
        el = self.elems
        if el == 0:
            return
        s = self.red
        k = self.bucket_count
        self.bucket_count += 1
        deps: list[Op] = []
        if z.overlap:
            # average_tensor: stream.wait_stream(current); current.wait_stream(stream).
            compute_last = e.last.get("compute")
            if compute_last is not None:
                deps.append(compute_last)
            e.owe("compute", e.last.get(s))
            if not z.contiguous:
                # allreduce_and_copy (non-contiguous path) synchronises the device first.
                e.host_wait(f"synchronize before bucket {k}", list(e.last.values()))
        extra = sum(self.bucket_extra)
        # pre-divide (tensor.div_) and flatten of the per-rank slices (torch.cat)
        e.kernels(f"pre-divide + flatten bucket {k} mb{mb}", s, "bwd", 4 * W16 * el,
                  kernels=2, deps=deps, alloc=(("buffers", W16 * el),), micro_batch=mb)
        e.collective(f"all-reduce grad bucket {k} mb{mb}", "all_reduce", W16 * el, s,
                     micro_batch=mb)
        frees: list[tuple[str, float]] = [("buffers", W16 * el)]
        if extra:
            frees.append(("gradients", W16 * extra))
        mine = el / n
        if self.offload:
            # allreduce_and_copy_with_multiple_ranks copies back this rank's slices
            e.kernels(f"copy back my slice (bucket {k}) mb{mb}", s, "bwd", 2 * W16 * mine,
                      micro_batch=mb)
            self.offload_partition_grads(mine, mb, s, frees)
        else:
            alloc: tuple[tuple[str, float], ...] = ()
            if not self.partition_grads_live:
                # grads_in_partition: one buffer of the partition's parameters per micro-step
                alloc = (("gradients", W16 * self.part),)
                self.partition_grads_live = True
            copies = 2 if z.contiguous else 1
            e.kernels(f"copy back my slice + into partition (bucket {k}) mb{mb}", s, "bwd",
                      copies * 2 * W16 * mine, kernels=1 + copies, alloc=alloc,
                      free=tuple(frees), micro_batch=mb)
        self.elems = 0
        self.bucket_extra = []

    def offload_partition_grads(self, mine: float, mb: int, s: str,
                                frees: list[tuple[str, float]]) -> None:
        """copy_grads_in_partition with cpu_offload: async_accumulate_grad_in_cpu_via_gpu
        under accumulation, and at the boundary the per-parameter norm, the overflow check
        (a host sync per parameter: ``if self._has_inf_or_nan(...)``) and the fp32 copy to
        the host (async_inplace_copy_grad_to_fp32_buffer_from_gpu)."""
        e = self.e
        gas = self.ctx.micro_batches
        first = mb == 0 if self.z.stage == 2 else False
        boundary = mb == gas - 1
        tensors_here = max(1, round(len(self.tensors) * mine / max(1, self.part)))
        if gas > 1:
            if first:
                e.transfer(f"grads to host (accumulate) mb{mb}", "d2h", W16 * mine, s, "bwd",
                           micro_batch=mb)
            else:
                e.transfer(f"accumulated grads to GPU mb{mb}", "h2d", W16 * mine, s, "bwd",
                           micro_batch=mb)
                e.kernels(f"add accumulated grads mb{mb}", s, "bwd", 3 * W16 * mine,
                          kernels=tensors_here, micro_batch=mb)
        if boundary:
            op = e.kernels(f"grad norm + overflow check (per parameter) mb{mb}", s, "bwd",
                           (W16 + FP64 + FP64) * mine + 20 * mine, kernels=8 * tensors_here,
                           micro_batch=mb, alloc=(("buffers", FP32 * mine),))
            op.host_sync = True
            e.kernels(f"grads .float() mb{mb}", s, "bwd", (W16 + FP32) * mine,
                      micro_batch=mb)
            e.transfer(f"fp32 grads to host mb{mb}", "d2h", FP32 * mine, s, "bwd",
                       micro_batch=mb)
            frees.append(("buffers", FP32 * mine))
        e.add(Op(name=f"bucket done mb{mb}", kind="compute", stream=s, phase="bwd",
                 free=tuple(frees), micro_batch=mb, category="copy"))

    def epilogue(self, mb: int) -> None:
        """independent_gradient_partition_epilogue."""
        z, e = self.z, self.e
        self.reduce_bucket(mb)
        if z.overlap:
            e.host_wait(f"device synchronize (epilogue) mb{mb}", list(e.last.values()),
                        phase="bwd")
        if not self.offload:
            if self.averaged_exists:
                # averaged_gradients += this micro-step's partition, then the new buffer goes.
                e.kernels(f"accumulate averaged_gradients mb{mb}", "compute", "bwd",
                          3 * W16 * self.part, kernels=len(self.tensors) // self.n + 1,
                          free=(("gradients", W16 * self.part),), micro_batch=mb)
            self.averaged_exists = True
        self.partition_grads_live = False
        if self.ipg_live:
            e.add(Op(name=f"release ipg buffers mb{mb}", kind="compute", stream="compute",
                     phase="bwd", free=(("buffers", self.ipg_live),), micro_batch=mb,
                     category="backward"))
            self.ipg_live = 0.0

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        z, e, cm = self.z, self.e, self.cm
        psi, part, padded = self.psi, self.part, self.padded
        ph: Phase = "optimizer"
        if z.stage == 0 and z.fp16:
            self.fp16_optimizer_step()
            return
        if z.stage == 0:
            # BF16_Optimizer.step: norm of every fp32 gradient, host reads it (assert > 0),
            # Adam on the partition, copy into bf16, all-gather, zero the fp32 buffer.
            op = e.kernels("grad norm (fp32, all tensors)", "compute", ph, FP32 * psi,
                           kernels=len(self.tensors) + 2, category="optimizer")
            op.host_sync = True
            e.add(Op(name="FusedAdam (partition)", kind="compute", stream="compute",
                     phase=ph, duration=cm.adamw_time(part, True, 1), category="optimizer",
                     cpu_s=TORCH_CALL_CPU_S))
            e.kernels("copy fp32 partition into bf16 weights", "compute", ph,
                      (FP32 + W16) * part, category="optimizer")
            e.collective("all-gather updated weights", "all_gather", W16 * padded, "compute")
            e.kernels("clear_hp_grads (zero fp32 grads)", "compute", ph, FP32 * padded,
                      category="optimizer")
            return
        tensors_mine = max(1, len(self.tensors) // self.n)
        if z.fp16 and not self.offload:
            # has_overflow_partitioned_grads_serial + all_reduce + .item()
            e.kernels("overflow check (partition)", "compute", ph, 20 * part,
                      kernels=6 * tensors_mine, category="optimizer")
            e.collective("all-reduce overflow flag", "all_reduce", 1, "compute")
            e.host_wait("overflow .item()", [e.last.get("compute")], phase=ph)
        if self.offload:
            assert self.host is not None
            # complete_grad_norm_calculation_for_cpu_offload: .item() of every parameter's
            # norm, then one all-reduce and .item().
            e.host_wait("per-parameter norm .item()", [e.last.get("compute"),
                                                       e.last.get(self.red)], phase=ph)
            e.owed_cpu += tensors_mine * CUDA_API_CPU_S
            e.collective("all-reduce grad norm", "all_reduce", FP32, "compute")
            sync = e.host_wait("norm .item()", [e.last.get("compute")], phase=ph)
            unscale = e.cpu_work("unscale fp32 grads (CPU)", _host_pass_s(self.host, 8 * part),
                                 ph, [sync])
            adam = e.cpu_work("DeepSpeedCPUAdam (partition)",
                              cpu_adam_s(self.host, part, "deepspeed"), ph, [unscale])
            # bit16_partitions[...].copy_(fp32_partition.to(device)): fp32 over PCIe, cast on GPU.
            h2d = e.transfer("fp32 partition to GPU", "h2d", FP32 * part, "compute", ph,
                             deps=[adam], alloc=(("buffers", FP32 * part),))
            h2d.host_sync = True
            e.kernels("cast into 16-bit partition", "compute", ph, (FP32 + W16) * part,
                      free=(("buffers", FP32 * part),), category="optimizer")
        else:
            # scaled_global_norm -> get_grad_norm_direct: fp64 norm per partition tensor, one
            # all-reduce of the sum.
            e.kernels("grad norm (fp64 per tensor)", "compute", ph,
                      (W16 + 2 * FP64) * part, kernels=2 * tensors_mine + 4,
                      category="optimizer")
            e.collective("all-reduce grad norm", "all_reduce", FP32, "compute")
            # flatten(averaged_gradients).to(fp32); averaged freed; unscale; Adam; copy back.
            e.kernels("flatten + cast grads to fp32", "compute", ph,
                      2 * W16 * part + (W16 + FP32) * part, kernels=2,
                      alloc=(("gradients", FP32 * part),), transient=W16 * part,
                      free=(("gradients", W16 * part),), category="optimizer")
            e.kernels("unscale_and_clip_grads", "compute", ph, 2 * FP32 * part,
                      category="optimizer")
            e.add(Op(name="FusedAdam (partition)", kind="compute", stream="compute",
                     phase=ph, duration=cm.adamw_time(part, True, 1), category="optimizer",
                     cpu_s=TORCH_CALL_CPU_S, free=(("gradients", FP32 * part),)))
            e.kernels("copy fp32 partition into 16-bit weights", "compute", ph,
                      (FP32 + W16) * part, category="optimizer")
        # all_gather_dp_groups -> all_gather_into_tensor of the flat buffer (one param group)
        e.collective("all-gather updated weights", "all_gather", W16 * padded, "compute")
        self.averaged_exists = False

    def fp16_optimizer_step(self) -> None:
        """FP16_Optimizer.step (fused): per-tensor overflow check and norm with .item(), flat
        fp32 gradients, unscale, Adam over the whole model, copy back into fp16."""
        e, cm = self.e, self.cm
        psi = self.psi
        k = len(self.tensors)
        ph: Phase = "optimizer"
        op = e.kernels("overflow check (float().sum() per tensor)", "compute", ph,
                       (W16 + 2 * FP32) * psi, kernels=2 * k, category="optimizer",
                       cpu_per_kernel=TORCH_CALL_CPU_S + CUDA_API_CPU_S)
        op.host_sync = True
        e.kernels("grads to fp32 + flatten", "compute", ph, (W16 + FP32) * psi + 2 * FP32 * psi,
                  kernels=k + 1, alloc=(("gradients", FP32 * psi),), transient=FP32 * psi,
                  free=(("gradients", W16 * psi),), category="optimizer")
        op = e.kernels("grad norm + .item()", "compute", ph, FP32 * psi, kernels=2,
                       category="optimizer")
        op.host_sync = True
        e.kernels("unscale_and_clip_grads", "compute", ph, 2 * FP32 * psi,
                  category="optimizer")
        e.add(Op(name="FusedAdam (whole model)", kind="compute", stream="compute", phase=ph,
                 duration=cm.adamw_time(psi, True, 1), category="optimizer",
                 cpu_s=TORCH_CALL_CPU_S, free=(("gradients", FP32 * psi),)))
        e.kernels("copy fp32 master into fp16 weights", "compute", ph, (FP32 + W16) * psi,
                  kernels=k, category="optimizer")


# --------------------------------------------------------------------------- stage 3: model
@dataclass(frozen=True)
class _Param:
    """One ZeRO-3 parameter (``ds_id`` = pid, in module-construction order)."""

    pid: int
    name: str
    shape: tuple[int, ...]
    persist: bool
    aligned: int
    """Elements padded to a multiple of the world size (partition_parameters._aligned_size)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Seg:
    """Kernels run between two hook events: one compute op."""

    module: str
    kernels: list[Kernel]
    backward: bool
    phase: Phase
    unit: tuple[str, int, str]
    """(block, layer, fwd|bwd): the block op of :func:`micro_batch_ops` whose memory effects
    and model FLOPs this segment shares."""
    grads: tuple[int, ...] = ()
    """Parameters whose 16-bit gradient this segment materialises."""
    ready: tuple[int, ...] = ()
    """Parameters whose AccumulateGrad hook fires after it."""


# Event: ("pre", module, forward) | ("post", module) | ("run", _Seg)
_Event = tuple


def _tree(m: ModelSpec, world: int, persistence: int
          ) -> tuple[list[_Param], dict[str, tuple[int, ...]]]:
    """The parameters of a Hugging Face Llama/GPT causal LM in construction order, and the
    parameters each submodule owns directly (``named_parameters(recurse=False)``)."""
    params: list[_Param] = []
    modules: dict[str, tuple[int, ...]] = {}

    def param(name: str, *shape: int) -> int:
        numel = math.prod(shape)
        pid = len(params)
        # parameter_offload.mark_persistent_parameters: ds_numel <= threshold
        params.append(_Param(pid, name, shape, numel <= persistence, _pad(numel, world)))
        return pid

    def linear(key: str, out_f: int, in_f: int) -> None:
        ids = [param(f"{key}.weight", out_f, in_f)]
        if m.bias:
            ids.append(param(f"{key}.bias", out_f))
        modules[key] = tuple(ids)

    def norm(key: str) -> None:
        ids = [param(f"{key}.weight", m.hidden)]
        if m.norm == "layernorm" and m.bias:
            ids.append(param(f"{key}.bias", m.hidden))
        modules[key] = tuple(ids)

    h = m.hidden
    for c in ("root", "model", "rotary"):
        modules[c] = ()
    modules["embed"] = (param("embed_tokens.weight", m.vocab, h),)
    if m.position == "learned":
        modules["wpe"] = (param("wpe.weight", m.max_positions, h),)
    for layer in range(m.layers):
        pre = f"L{layer}."
        for c in ("layer", "attn", "mlp", "act"):
            modules[pre + c] = ()
        for name, o, i in m.linear_shapes():
            linear(pre + name, o, i)
        norm(pre + "ln1")
        norm(pre + "ln2")
    norm("norm")
    if m.tied_embeddings:
        modules["lm_head"] = modules["embed"]
    else:
        linear("lm_head", m.vocab, h)
    return params, modules


_LAYER_ROUTES = {"norm": "ln", "norm_out": "ln", "resid": "layer", "resid_in": "layer",
                 "silu": "act", "g_silu": "act", "gelu": "act", "g_gelu": "act"}


def _route(block: str, kernel: str) -> str:
    """The module whose forward/backward a kernel of :mod:`sim.layer_ops` belongs to."""
    head = kernel.split(".")[0]
    if block == "embed":
        return "wpe" if head in ("add_pos", "g_pos_sum") else "embed"
    if block == "head":
        return head if head in ("norm", "lm_head") else "root"
    if head in ("q", "k", "v", "o", "gate", "up", "down"):
        return head
    r = _LAYER_ROUTES.get(head, "attn" if block == "attn" else "mlp")
    return ("ln1" if block == "attn" else "ln2") if r == "ln" else r


def _scripts(m: ModelSpec) -> dict[str, list[tuple[str, str]]]:
    """Hook and kernel order per block and pass, as HF's module nesting fires them: pre and
    post forward hooks around each submodule's forward; pre-backward hooks when the
    gradient of a module's output arrives (reverse order), post-backward when its inputs'
    gradients are done."""
    def wrap(key: str) -> list[tuple[str, str]]:
        return [("pre", key), ("run", key), ("post", key)]

    swiglu = m.mlp == "swiglu"
    attn_f = ([("pre", "layer")] + wrap("ln1") + [("pre", "attn")] + wrap("q") + wrap("k")
              + wrap("v") + [("run", "attn")] + wrap("o") + [("post", "attn"), ("run", "layer")])
    mlp_inner_f = (wrap("gate") + wrap("act") + wrap("up") + [("run", "mlp")] + wrap("down")
                   if swiglu else wrap("up") + wrap("act") + wrap("down"))
    mlp_f = (wrap("ln2") + [("pre", "mlp")] + mlp_inner_f
             + [("post", "mlp"), ("run", "layer"), ("post", "layer")])
    mlp_inner_b = (wrap("down") + [("run", "mlp")] + wrap("up") + wrap("act") + wrap("gate")
                   if swiglu else wrap("down") + wrap("act") + wrap("up"))
    mlp_b = ([("pre", "layer"), ("pre", "mlp")] + mlp_inner_b
             + [("post", "mlp")] + wrap("ln2") + [("run", "layer")])
    attn_b = ([("pre", "attn")] + wrap("o") + [("run", "attn")] + wrap("v") + wrap("k")
              + wrap("q") + [("post", "attn")] + wrap("ln1")
              + [("run", "layer"), ("post", "layer")])
    embed_f = [("pre", "root"), ("pre", "model")] + wrap("embed")
    if m.position == "learned":
        embed_f += wrap("wpe")
    else:
        embed_f += [("pre", "rotary"), ("post", "rotary")]
    head_f = (wrap("norm") + [("post", "model")] + wrap("lm_head")
              + [("run", "root"), ("post", "root")])
    head_b = ([("pre", "root"), ("run", "root")] + wrap("lm_head")
              + [("pre", "model")] + wrap("norm"))
    embed_b = (wrap("wpe") if m.position == "learned" else []) + wrap("embed")
    return {"embed/fwd": embed_f, "attn/fwd": attn_f, "mlp/fwd": mlp_f, "head/fwd": head_f,
            "head/bwd": head_b, "mlp/bwd": mlp_b, "attn/bwd": attn_b, "embed/bwd": embed_b}


@dataclass
class _Gather:
    """One ``all_gather_coalesced`` call and its handle."""

    pids: list[int]
    ag: list[Op]
    single: bool
    quant: bool
    out_elems: int
    scale_bytes: float
    remaining: set[int]
    complete: bool = False
    done: Op | None = None
    buffer_bytes: float = 0.0
    """Flat buffers the handle keeps referenced until its last parameter is waited for."""


# Host seconds of the coordinator's entry points (see the constants above for the units).
def _fetch_call_cpu(forward: bool) -> float:
    # fetch_sub_module: iter_params/frozenset, trace bookkeeping, wait_stream (record + wait);
    # forward: _post_backward_module_hook applies PostBackwardFunctionModule to the inputs.
    return HOOK_PY_CPU_S + 2 * CUDA_API_CPU_S + (TORCH_CALL_CPU_S if forward else 0.0)


WAIT_CPU_S = TORCH_CALL_CPU_S + 5 * CUDA_API_CPU_S
"""Per waited parameter: stream context enter/exit, events query, handle.wait (work.wait),
Event() + record."""


def _release_call_cpu(forward: bool) -> float:
    # release_sub_module (+ _pre_backward_module_hook applying PreBackwardFunctionForModule to
    # the outputs in forward).
    return HOOK_PY_CPU_S + (TORCH_CALL_CPU_S if forward else 0.0)


FREE_PARAM_CPU_S = TORCH_CALL_CPU_S + RECORD_STREAM_CPU_S
"""free_param: record_stream + torch.empty(0)."""
GRAD_HOOK_CPU_S = (HOOK_PY_CPU_S + 4 * CUDA_API_CPU_S + RECORD_STREAM_CPU_S + 2 * VIEW_CPU_S
                   + TORCH_CALL_CPU_S)
"""reduce_partition_and_remove_grads -> __add_grad_to_ipg_bucket: wait_stream, stream context,
narrow/view_as, copy_, record_stream."""


class _Stage3:
    """ZeRO-3: the coordinator's fetch/prefetch/release decisions replayed on the module trace,
    gradient buckets, the sub-group step, ZeRO++ and offload."""

    def __init__(self, ctx: JobContext, z: _Zero) -> None:
        self.ctx, self.z = ctx, z
        m = ctx.model
        self.m = m
        self.W = ctx.n_ranks
        self.cm = ctx.compute
        s = ctx.scenario
        self.gpn = min(s.cluster.gpus_per_node, self.W)
        self.nodes = max(1, self.W // self.gpn)
        self.style = Style("bf16")
        self.costs = ctx.block_costs(self.style, kv_cache=False)
        self.blocks = dict(zip(("embed", "attn", "mlp", "head"),
                               model_blocks(m, self.style, ctx.micro_batch, ctx.seq, False),
                               strict=True))
        self.params, self.modules = _tree(m, self.W, z.persistence)
        self.P = {p.pid: p for p in self.params}
        self.part_total = sum(p.aligned // self.W for p in self.params)
        self.ag_side = "ag" if z.overlap else "compute"
        self.rs = "rs" if z.overlap else "compute"
        ranks = range(self.W)
        self.hpz_groups = tuple(tuple(ranks[i:i + z.hpz]) for i in range(0, self.W, z.hpz))
        self.local_groups = tuple(tuple(ranks[i:i + self.gpn])
                                  for i in range(0, self.W, self.gpn))
        self.global_groups = tuple(tuple(range(j, self.W, self.gpn)) for j in range(self.gpn))
        self.qgz_active = z.qgz and self.nodes > 1
        self.host = (HostSpec.from_scenario(s)
                     if z.offload_opt != "none" or z.offload_param != "none" else None)
        # offload_param nvme: partitions beyond max_in_cpu elements stay on NVMe.
        self.param_nvme_share = (max(0, self.part_total - OFFLOAD_PARAM_MAX_IN_CPU)
                                 / self.part_total if z.offload_param == "nvme" else 0.0)
        # coordinator state
        self.status = {p.pid: ("AV" if p.persist else "NA") for p in self.params}
        self.registry: dict[int, _Gather] = {}
        self.n_available = 0
        self.fetch_events: deque[Op] = deque()
        self.reduce_events: deque[Op] = deque()
        self.secondary: set[int] = set()
        self.active: dict[int, set[str]] = {p.pid: set() for p in self.params}
        self.held: dict[int, tuple[float, Op | None]] = {}
        """GPU bytes of each gathered parameter and the op that produced them."""
        self.step_id = 0
        self.most_recent: dict[int, int] = {}
        self.queue: deque[tuple[int, int]] = deque()
        self._release_cache: dict[tuple[str, int], frozenset[int]] = {}
        # gradient bucket state
        self.bucket: list[int] = []
        self.bucket_elems = 0
        self.bucket_kept: list[int] = []
        self.micro_step = 0
        self.n_buckets = 0
        self.gathers: list[tuple[Op, str, bool]] = []
        """(all-gather op, phase, hpZ) of every parameter gather, for tests and reports."""
        # CUDA caching allocator under memory pressure (see issue_gather)
        self.budget: float | None = None
        self.live = 0.0
        """Gathered bytes the host still holds (gathered or in flight, not yet released)."""
        self.pending = 0.0
        """Bytes the host released whose blocks the GPU may still be using (record_stream)."""
        self.allocator_syncs = 0

    # ------------------------------------------------------------------ events
    def events(self) -> list[_Event]:
        """Hook and compute events of one micro-batch (forward then backward)."""
        m = self.m
        scripts = _scripts(m)
        out: list[_Event] = []

        def emit(block: str, layer: int, pass_: str, unit_pass: str, phase: Phase) -> None:
            blk = self.blocks[block]
            backward = pass_ == "bwd"
            kernels = blk.backward if backward else blk.forward
            by_module: dict[str, list[Kernel]] = {}
            for k in kernels:
                by_module.setdefault(_route(block, k.name), []).append(k)
            prefix = f"L{layer}." if block in ("attn", "mlp") else ""
            for kind, key in scripts[f"{block}/{pass_}"]:
                name = prefix + key
                if kind == "pre":
                    out.append(("pre", name, not backward))
                elif kind == "post":
                    out.append(("post", name, not backward))
                else:
                    ks = by_module.get(key, [])
                    if not ks:
                        continue
                    # a recomputed forward belongs to the MLP backward op that holds it
                    unit = ("mlp", layer, "bwd") if unit_pass == "bwd_mlp" else \
                        (block, layer, unit_pass)
                    seg = _Seg(name, ks, backward, phase, unit)
                    if backward:
                        self._attach_grads(seg, name)
                    out.append(("run", seg))

        emit("embed", -1, "fwd", "fwd", "fwd")
        for layer in range(m.layers):
            emit("attn", layer, "fwd", "fwd", "fwd")
            emit("mlp", layer, "fwd", "fwd", "fwd")
        emit("head", -1, "fwd", "fwd", "fwd")
        emit("head", -1, "bwd", "bwd", "bwd")
        for layer in reversed(range(m.layers)):
            if self.ctx.recompute:
                # Checkpointed layer: its forward runs again (hooks and all) first.
                emit("attn", layer, "fwd", "bwd_mlp", "recompute")
                emit("mlp", layer, "fwd", "bwd_mlp", "recompute")
            emit("mlp", layer, "bwd", "bwd", "bwd")
            emit("attn", layer, "bwd", "bwd", "bwd")
        emit("embed", -1, "bwd", "bwd", "bwd")
        return out

    def _attach_grads(self, seg: _Seg, module: str) -> None:
        pids = self.modules.get(module, ())
        if not pids:
            return
        if module == "lm_head" and self.m.tied_embeddings:
            seg.grads = pids             # the tied gradient first appears here
        elif module == "embed" and self.m.tied_embeddings:
            seg.ready = pids             # one AccumulateGrad, after its last use
        else:
            seg.grads = pids
            seg.ready = pids

    # ------------------------------------------------------------------ build
    def build(self) -> Program:
        ctx, z = self.ctx, self.z
        W = self.W
        cls = RankClass(0, tuple(range(W)), label="all ranks (identical ZeRO-3 partitions)")
        part = self.part_total
        persist_full = sum(W16 * p.aligned for p in self.params if p.persist)
        persist_part = sum(W16 * p.aligned // W for p in self.params if p.persist)
        on_gpu_part = persist_part if z.offload_param != "none" else W16 * part
        cls.initial_memory = {"parameters": on_gpu_part + persist_full}
        if z.offload_opt == "none":
            cls.initial_memory["gradients"] = W16 * part     # grad_partitions_flat_buffer
            cls.initial_memory["optimizer"] = 3 * FP32 * part
        if z.contiguous:
            cls.initial_memory["buffers"] = W16 * z.bucket    # __ipg_bucket_flat_buffer
        flops = ctx.model_flops_per_step()
        program = Program([cls], W, ctx.tokens_per_step, flops,
                          flops + ctx.layer_recompute_flops(self.costs))
        program.meta.update(framework="deepspeed", zero_stage=3,
                            micro_batches=ctx.micro_batches, style=self.style.name,
                            overlap_comm=z.overlap,
                            persistent_params=sum(p.persist for p in self.params),
                            zeropp={"qwz": z.qwz, "hpz": z.hpz, "qgz": self.qgz_active},
                            offload_optimizer=z.offload_opt, offload_param=z.offload_param)
        self.e = _Emitter(program, cls, self.cm)
        self.program = program
        evs = self.events()
        self.order = [ev[1] for ev in evs if ev[0] == "pre"]
        self.param_order: list[tuple[int, int]] = []
        for step, key in enumerate(self.order):
            for pid in sorted(set(self.modules[key])):
                self.param_order.append((pid, step))
        model_flops = block_model_flops(self.m, self.costs, ctx.micro_batch, ctx.seq)
        for mb in range(ctx.micro_batches):
            ops = micro_batch_ops(self.costs, self.m.layers, mb, ctx.recompute, False, {}, {},
                                  model_flops)
            if mb == 0:
                # Room for gathered parameters: the GPU less the resident states, one
                # micro-batch's activations, the hpZ secondary partitions, a reduce-scatter's
                # interleaved copy and the largest gradient awaiting its bucket.
                largest = max(p.aligned for p in self.params)
                secondary = (sum(W16 * p.aligned // z.hpz for p in self.params
                                 if not p.persist) if z.hpz > 1 else 0.0)
                room = (ctx.gpu.usable_memory_bytes - sum(cls.initial_memory.values())
                        - _activation_peak(ops) - secondary
                        - W16 * min(z.bucket, sum(p.aligned for p in self.params))
                        - W16 * largest)
                self.budget = room if room > 0 else None
            self.micro_batch(mb, evs, ops)
        self.step()
        program.meta["param_gathers"] = len(self.gathers)
        program.meta["allocator_syncs"] = self.allocator_syncs
        return program

    # ------------------------------------------------------------------ micro-batch
    def micro_batch(self, mb: int, evs: list[_Event], ops: PassOps) -> None:
        e = self.e
        self.mb = mb
        self.reset_step()
        units: dict[tuple[str, int, str], Op] = {}
        for (block, layer), op in ops.fwd_of.items():
            units[(block, layer, "fwd")] = op
        for (block, layer), op in ops.bwd_of.items():
            units[(block, layer, "bwd")] = op
        unit_segs: dict[int, list[Op]] = {}
        kernel_flops: dict[int, float] = {}
        for ev in evs:
            if ev[0] == "pre":
                self.fetch(ev[1], ev[2])
            elif ev[0] == "post":
                self.release(ev[1], ev[2])
            else:
                seg: _Seg = ev[1]
                block_op = units[seg.unit]
                gpu, cpu, fl = _kernels_gpu_cpu(self.cm, seg.kernels, seg.backward)
                op = e.add(Op(
                    name=f"{'bwd' if seg.backward else 'fwd'} {seg.module} mb{mb}"
                    + (" (recompute)" if seg.phase == "recompute" else ""),
                    kind="compute", stream="compute", phase=seg.phase, duration=gpu,
                    cpu_s=cpu, micro_batch=mb, layer=seg.unit[1] if seg.unit[1] >= 0 else None,
                    transient=block_op.transient, category=block_op.category,
                    hw_flops=fl))
                unit_segs.setdefault(id(block_op), []).append(op)
                kernel_flops[id(op)] = fl
                if seg.grads:
                    op.alloc = op.alloc + (("gradients", W16 * sum(self.P[p].numel
                                                                 for p in seg.grads)),)
                for pid in seg.ready:
                    self.grad_hook(pid)
        # Memory effects and model FLOPs of each block op go to its segments.
        block_ops = list(ops.forward) + list(ops.backward)
        for bop in block_ops:
            segs = unit_segs.get(id(bop), [])
            if not segs:
                continue
            segs[0].alloc = bop.alloc + segs[0].alloc
            segs[-1].free = segs[-1].free + bop.free
            total = sum(kernel_flops[id(s)] for s in segs) or 1.0
            for sop in segs:
                sop.flops = bop.flops * kernel_flops[id(sop)] / total
        self.epilogue()

    # ------------------------------------------------------------------ coordinator
    def reset_step(self) -> None:
        """reset_step at the root's forward pre-hook: drain in-flight gathers, rewind the
        prefetch queue to the recorded parameter trace."""
        for pid in list(self.registry):
            if pid in self.registry:
                self.wait(pid)
                self.release_param(pid)
        self.queue = deque(self.param_order)
        self.most_recent = {}
        self.step_id = 0

    def fetch(self, key: str, forward: bool) -> None:
        """fetch_sub_module: gather what is missing, wait, prefetch."""
        e, z = self.e, self.z
        e.owed_cpu += _fetch_call_cpu(forward)
        pids = self.modules[key]
        missing = [p for p in pids if self.status[p] == "NA"]
        if missing:
            self.all_gather_params(missing, forward, demand=True)
        for pid in pids:
            self.active[pid].add(key)
            if pid in self.registry:
                self.wait(pid)
        if self.ag_side != "compute":
            e.owe("compute", e.last.get(self.ag_side))    # current_stream().wait_stream
        # The trace is complete (steady state): pop this module's parameters off the queue.
        not_fetched = {p for p in set(pids) if self.most_recent.get(p, -10**10) < self.step_id}
        discarded: set[int] = set()
        while self.queue and len(discarded) < len(not_fetched):
            pid, step = self.queue.popleft()
            self.most_recent[pid] = step
            discarded.add(pid)
        assert discarded == not_fetched, (key, discarded, not_fetched)
        if z.prefetch > 0:
            budget = min(z.max_live - self.n_available, z.prefetch)
            chosen: list[int] = []
            numel = 0
            while self.queue and numel < budget:
                pid, step = self.queue.popleft()
                do = self.status[pid] == "NA" and pid not in chosen
                self.most_recent[pid] = max(self.most_recent.get(pid, -10**10), step)
                if do:
                    chosen.append(pid)
                    numel += self.P[pid].numel
            if chosen:
                self.all_gather_params(chosen, forward, demand=False)
        self.step_id += 1

    def params_to_release(self, key: str, step_id: int) -> frozenset[int]:
        """__params_to_release (lru_cached on module and step in DeepSpeed as here)."""
        cached = self._release_cache.get((key, step_id))
        if cached is not None:
            return cached
        pids = self.modules[key]
        rel = {p for p in pids if not self.P[p].persist}
        for p in pids:
            if self.most_recent.get(p, -10**10) > step_id:
                rel.discard(p)
        traversed = 0
        for mod in self.order[step_id:]:
            if traversed >= self.z.max_reuse or not rel:
                break
            for p in self.modules[mod]:
                rel.discard(p)
                traversed += self.P[p].numel
        out = frozenset(rel)
        self._release_cache[(key, step_id)] = out
        return out

    def release(self, key: str, forward: bool) -> None:
        self.e.owed_cpu += _release_call_cpu(forward)
        rel = self.params_to_release(key, self.step_id)
        for pid in self.modules[key]:
            self.active[pid].discard(key)
            if pid in rel:
                self.release_param(pid)

    def release_param(self, pid: int) -> None:
        """__release_param -> param.partition(): hpZ secondary copy at the first release of a
        step, then free the gathered tensor (record_stream: once the compute stream is past
        its last use)."""
        if self.status[pid] != "AV" or self.active[pid]:
            return
        e, z = self.e, self.z
        p = self.P[pid]
        if z.hpz > 1 and pid not in self.secondary and not p.persist:
            sec = p.aligned // z.hpz
            if z.offload_param != "none":
                op = e.transfer(f"hpZ secondary of {p.name} to host", "d2h", W16 * sec,
                                "compute", "comm", micro_batch=self.mb)
            else:
                op = e.kernels(f"hpZ secondary copy {p.name}", "compute", "comm",
                               2 * W16 * sec, alloc=(("parameters", W16 * sec),),
                               micro_batch=self.mb)
            # _partition_param_sec: current_stream().synchronize() after the copy
            op.host_sync = True
            self.pending = 0.0
            self.secondary.add(pid)
        nbytes, producer = self.held.pop(pid, (0.0, None))
        if nbytes:
            target = e.last.get("compute")
            if target is None or (producer is not None and producer.index > target.index):
                target = producer
            assert target is not None
            target.free = target.free + (("parameters", nbytes),)
        e.owed_cpu += FREE_PARAM_CPU_S
        self.status[pid] = "NA"
        self.n_available -= p.numel
        self.live -= W16 * p.aligned
        self.pending += W16 * p.aligned

    def all_gather_params(self, pids: list[int], forward: bool, demand: bool) -> None:
        """__all_gather_params_: one coalesced gather per kind (with / without an hpZ
        secondary partition)."""
        todo = [p for p in pids if self.status[p] == "NA"]
        if not todo:
            return
        self.n_available += sum(self.P[p].numel for p in todo)
        with_sec = [p for p in todo if p in self.secondary]
        without = [p for p in todo if p not in self.secondary]
        for grp in (with_sec, without):
            if grp:
                self.issue_gather(sorted(grp), forward, demand, secondary=bool(grp is with_sec))

    def issue_gather(self, pids: list[int], forward: bool, demand: bool,
                     secondary: bool) -> None:
        """all_gather_coalesced on the allgather stream (``ag``; the compute stream without
        overlap_comm); the NCCL all-gather runs on its communicator's stream."""
        e, z, W = self.e, self.z, self.W
        side = self.ag_side
        phase: Phase = "comm"
        world = z.hpz if secondary else W
        psz = sum(self.P[p].aligned // world for p in pids)
        out = psz * world
        single = len(pids) == 1
        quant = z.qwz
        what = ("prefetch " if not demand else "") + ",".join(self.P[p].name for p in pids[:2]) \
            + ("..." if len(pids) > 2 else "")
        e.owed_cpu += (HOOK_PY_CPU_S + 2 * CUDA_API_CPU_S + 2 * TORCH_CALL_CPU_S
                       + (0.0 if single else TORCH_CALL_CPU_S + world * VIEW_CPU_S)
                       + (3 * TORCH_CALL_CPU_S if quant else 0.0))
        for p in pids:
            self.status[p] = "INF"
        # a coalesced gather holds its flat buffer and the split parameters; qwZ adds the int8
        need = W16 * out * (1 if single else 2) + (INT8 * out if quant else 0.0)
        if (self.budget is not None and self.pending > 0
                and self.live + self.pending + need > self.budget):
            # The host allocates gathered buffers as it issues them, far ahead of the GPU when
            # compute is the bottleneck (the fetch events only bound it against the gathers).
            # Released blocks wait for the compute stream (record_stream); once the device
            # is full, cudaMalloc fails and the caching allocator synchronises on those events
            # and retries (c10/cuda/CUDACachingAllocator.cpp release_cached_blocks ->
            # synchronize_and_free_events; stage3.py warns of these "allocator cache flushes").
            e.host_wait(f"allocator cache flush before gather mb{self.mb}",
                        [e.last.get("compute")])
            self.pending = 0.0
            self.allocator_syncs += 1
        self.live += sum(W16 * self.P[p].aligned for p in pids)
        if W == 1:
            g = _Gather(pids, [], single, quant, out, 0.0, set(pids))
            for p in pids:
                self.registry[p] = g
            return
        if z.offload_param != "none":
            # ds_tensor.to(device) from (pageable) host memory: a blocking copy.
            if self.param_nvme_share:
                rd = e.transfer(f"NVMe -> host {what}", "nvme_read",
                                W16 * psz * self.param_nvme_share, side, phase,
                                micro_batch=self.mb)
                rd.host_sync = True
            h2d = e.transfer(f"partition to GPU {what}", "h2d", W16 * psz, side, phase,
                             micro_batch=self.mb)
            h2d.host_sync = True
        scale_groups = _qwz_groups(psz) if quant else 0
        if not single:
            e.kernels(f"cat partitions {what}", side, phase, 2 * W16 * psz,
                      micro_batch=self.mb)
        if quant:
            e.kernels(f"qwZ quantize {what}", side, phase,
                      W16 * psz + INT8 * psz + FP32_SCALE * scale_groups, micro_batch=self.mb)
        stream = "nccl-hpz" if secondary else "nccl-ag"
        groups = self.hpz_groups if secondary else None
        elem = INT8 if quant else W16
        cat = "parameters" if single and not quant else "buffers"
        dep = e.last.get(side)
        ag = e.collective(f"all-gather ({'fwd' if forward else 'bwd'}) {what} mb{self.mb}",
                          "all_gather", out * elem, stream,
                          groups, cpu_s=0.0, deps=[dep] if dep is not None else [],
                          alloc=((cat, out * elem),), micro_batch=self.mb)
        assert ag is not None
        ags = [ag]
        self.gathers.append((ag, "fwd" if forward else "bwd", secondary))
        scale_bytes = FP32_SCALE * scale_groups * world
        if quant:
            sc = e.collective(f"all-gather qwZ scales mb{self.mb}", "all_gather", scale_bytes,
                              stream, groups, cpu_s=0.0, alloc=(("buffers", scale_bytes),),
                              micro_batch=self.mb)
            assert sc is not None
            ags.append(sc)
        g = _Gather(pids, ags, single, quant, out, scale_bytes, set(pids))
        for p in pids:
            self.registry[p] = g

    def wait(self, pid: int) -> None:
        """registry.pop(param).wait() on the allgather stream, with the host waiting for the
        fetch event recorded three waits ago (``__max_ongoing_fetch_events``)."""
        e = self.e
        side = self.ag_side
        g = self.registry.pop(pid)
        e.owed_cpu += WAIT_CPU_S
        if len(self.fetch_events) > MAX_ONGOING_FETCH_EVENTS:
            old = self.fetch_events.popleft()
            e.host_wait(f"fetch event sync mb{self.mb}", [old])
        if not g.complete:
            g.complete = True
            numel = sum(self.P[p].numel for p in g.pids)
            names = self.P[g.pids[0]].name
            if g.ag:
                deps = list(g.ag)
                if g.quant:
                    cat = "parameters" if g.single else "buffers"
                    g.done = e.kernels(f"qwZ dequantize {names}", side, "comm",
                                       INT8 * g.out_elems + g.scale_bytes + W16 * g.out_elems,
                                       deps=deps, alloc=((cat, W16 * g.out_elems),),
                                       free=(("buffers", INT8 * g.out_elems + g.scale_bytes),),
                                       micro_batch=self.mb)
                    deps = [g.done]
                    if not g.single:
                        g.buffer_bytes = W16 * g.out_elems
                elif not g.single:
                    g.buffer_bytes = W16 * g.out_elems
                if not g.single:
                    # AllGatherCoalescedHandle.wait: torch.cat of each parameter's partitions
                    e.owed_cpu += len(g.pids) * (TORCH_CALL_CPU_S
                                                 + self.W * (VIEW_CPU_S + RECORD_STREAM_CPU_S))
                    g.done = e.kernels(f"split gathered {names}", side, "comm", 2 * W16 * numel,
                                       kernels=len(g.pids), deps=deps,
                                       alloc=(("parameters", W16 * numel),),
                                       micro_batch=self.mb)
                elif not g.quant:
                    g.done = e.add(Op(name=f"wait all-gather {names}", kind="compute",
                                      stream=side, phase="comm", deps=deps,
                                      micro_batch=self.mb, category="copy"))
            for p in g.pids:
                self.status[p] = "AV"
                held = W16 * (self.P[p].aligned if g.single else self.P[p].numel)
                self.held[p] = (held if g.ag else 0.0, g.done)
        g.remaining.discard(pid)
        if not g.remaining and g.buffer_bytes:
            last = e.last.get(side)
            assert last is not None
            last.free = last.free + (("buffers", g.buffer_bytes),)
        ev = e.last.get(side)
        if ev is not None:
            self.fetch_events.append(ev)

    # ------------------------------------------------------------------ gradients
    def grad_hook(self, pid: int) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads."""
        e, z = self.e, self.z
        numel = self.P[pid].numel
        e.owed_cpu += GRAD_HOOK_CPU_S
        if self.bucket_elems + numel > z.bucket and self.bucket_elems > 0:
            self.reduce_bucket()
        # __add_grad_to_ipg_bucket: the reduction stream waits for the compute stream.
        if self.rs != "compute":
            e.owe(self.rs, e.last.get("compute"))
        if z.contiguous and self.bucket_elems + numel <= z.bucket:
            e.kernels(f"copy grad {self.P[pid].name} into ipg bucket", self.rs, "bwd",
                      2 * W16 * numel, free=(("gradients", W16 * numel),),
                      micro_batch=self.mb, cpu_per_kernel=0.0)
        else:
            self.bucket_kept.append(pid)
        self.bucket.append(pid)
        self.bucket_elems += numel

    def reduce_bucket(self) -> None:
        """__reduce_and_partition_ipg_grads on reduce_and_partition_stream."""
        if not self.bucket:
            return
        e, W = self.e, self.W
        rs = self.rs
        k = self.n_buckets
        self.n_buckets += 1
        if len(self.reduce_events) > MAX_PARAM_REDUCE_EVENTS:
            e.host_wait(f"reduce event sync (bucket {k})", [self.reduce_events.popleft()])
        pids = sorted(self.bucket)
        e.owed_cpu += HOOK_PY_CPU_S + len(pids) * (W * VIEW_CPU_S + 2 * TORCH_CALL_CPU_S)
        transient = 0.0
        if self.qgz_active:
            out_elems = sum(self.qgz_reduce(pid) for pid in pids)
        else:
            out_elems, transient = self.coalesced_reduce_scatter(pids, f"bucket {k}")
        frees: list[tuple[str, float]] = []
        if transient:
            frees.append(("buffers", transient))
        kept = sum(self.P[p].numel for p in self.bucket_kept)
        if kept:
            frees.append(("gradients", W16 * kept))
        self.partition_grads(out_elems, len(pids), frees, k)
        self.reduce_events.append(e.last[rs])
        self.bucket, self.bucket_kept, self.bucket_elems = [], [], 0

    def coalesced_reduce_scatter(self, pids: list[int], label: str,
                                 groups: tuple[tuple[int, ...], ...] | None = None
                                 ) -> tuple[int, float]:
        """reduce_scatter_coalesced: interleaving torch.cat (unless one tensor divisible by the
        world), pre-divide, one reduce-scatter. Returns (output elements, cat buffer bytes)."""
        e, W = self.e, self.W
        rs = self.rs
        total = W * sum(-(-self.P[p].numel // W) for p in pids)
        buf = 0.0
        if not (len(pids) == 1 and self.P[pids[0]].numel % W == 0):
            buf = W16 * total
            e.kernels(f"interleave grads (cat) {label}", rs, "bwd", 2 * W16 * total,
                      alloc=(("buffers", buf),), micro_batch=self.mb)
        e.kernels(f"pre-divide {label}", rs, "bwd", 2 * W16 * total, micro_batch=self.mb)
        e.collective(f"reduce-scatter {label} mb{self.mb}", "reduce_scatter", W16 * total, rs,
                     groups, cpu_s=0.0, micro_batch=self.mb)
        return total // W, buf

    def qgz_reduce(self, pid: int) -> int:
        """all_to_all_quant_reduce for one gradient; returns its output elements."""
        p = self.P[pid]
        W, L, N = self.W, self.gpn, self.nodes
        n = p.numel
        if len(p.shape) == 1 or n % (2 * W) != 0:
            out, buf = self.coalesced_reduce_scatter([pid], f"{p.name} (qgZ fallback)")
            if buf:
                self.e.last[self.rs].free = self.e.last[self.rs].free + (("buffers", buf),)
            return out
        e, rs, mb = self.e, self.rs, self.mb
        intra = max(p.shape[0], p.shape[1], W)     # intra_quant_group
        inter = intra // L
        q_intra = n * INT4_BYTES
        q_inter = n * INT4_BYTES / L
        e.kernels(f"qgZ swizzle_quant {p.name}", rs, "bwd",
                  W16 * n + q_intra + FP32_SCALE * intra,
                  alloc=(("buffers", 2 * (q_intra + FP32_SCALE * intra)),), micro_batch=mb)
        e.collective(f"qgZ intra-node all-to-all {p.name}", "all_to_all", q_intra, rs,
                     self.local_groups, micro_batch=mb)
        e.collective(f"qgZ intra-node all-to-all scales {p.name}", "all_to_all",
                     FP32_SCALE * intra, rs, self.local_groups, micro_batch=mb)
        e.kernels(f"qgZ quantized_reduction {p.name}", rs, "bwd",
                  q_intra + FP32_SCALE * intra + q_inter + FP32_SCALE * inter,
                  alloc=(("buffers", 2 * (q_inter + FP32_SCALE * inter)),), micro_batch=mb)
        e.collective(f"qgZ inter-node all-to-all {p.name}", "all_to_all", q_inter, rs,
                     self.global_groups, micro_batch=mb)
        e.collective(f"qgZ inter-node all-to-all scales {p.name}", "all_to_all",
                     FP32_SCALE * inter, rs, self.global_groups, micro_batch=mb)
        e.kernels(f"qgZ dequantize + sum over nodes {p.name}", rs, "bwd",
                  q_inter + W16 * n / L + W16 * n / L + W16 * n / W, kernels=1 + N,
                  free=(("buffers", 2 * (q_intra + FP32_SCALE * intra)
                         + 2 * (q_inter + FP32_SCALE * inter)),), micro_batch=mb)
        return n // W

    def partition_grads(self, elems: int, tensors: int, frees: list[tuple[str, float]],
                        k: int) -> None:
        """partition_grads: copy (first micro-step) or add into the gradient partition buffer;
        with optimizer offload through host memory as the code does."""
        e, z, mb = self.e, self.z, self.mb
        rs = self.rs
        first = self.micro_step == 0
        boundary = mb == self.ctx.micro_batches - 1
        if z.offload_opt == "none":
            e.kernels(f"{'copy' if first else 'accumulate'} grad partitions (bucket {k})", rs,
                      "bwd", (2 if first else 3) * W16 * elems, kernels=tensors,
                      free=tuple(frees), micro_batch=mb, cpu_per_kernel=0.0)
            return
        # The partition buffer lives in host memory: first micro-step copy out and back to
        # the GPU; later ones bring it in, add, and copy it out again.
        if first:
            e.transfer(f"grad partitions to host (bucket {k})", "d2h", W16 * elems, rs, "bwd",
                       micro_batch=mb)
            e.transfer(f"grad partitions back to GPU (bucket {k})", "h2d", W16 * elems, rs,
                       "bwd", micro_batch=mb, alloc=(("buffers", W16 * elems),))
        else:
            e.transfer(f"grad partitions to GPU (bucket {k})", "h2d", W16 * elems, rs, "bwd",
                       micro_batch=mb, alloc=(("buffers", W16 * elems),))
            e.kernels(f"accumulate grad partitions (bucket {k})", rs, "bwd", 3 * W16 * elems,
                      kernels=tensors, micro_batch=mb)
            e.transfer(f"grad partitions to host (bucket {k})", "d2h", W16 * elems, rs, "bwd",
                       micro_batch=mb)
        if boundary:
            # _constant_buffered_norm2 on the GPU copy, then fp32 to the optimizer: a blocking
            # copy_ into host memory (or, swapped to NVMe, through the gradient swapper).
            e.kernels(f"grad norm (fp64) (bucket {k})", rs, "bwd", (W16 + 2 * FP64) * elems,
                      kernels=3 * tensors, micro_batch=mb)
            e.kernels(f"grads .float() (bucket {k})", rs, "bwd", (W16 + FP32) * elems,
                      kernels=tensors, micro_batch=mb, alloc=(("buffers", FP32 * elems),))
            d2h = e.transfer(f"fp32 grads to host (bucket {k})", "d2h", FP32 * elems, rs, "bwd",
                             micro_batch=mb, free=(("buffers", FP32 * elems),))
            d2h.host_sync = z.offload_opt == "cpu"
            if z.offload_opt == "nvme":
                e.transfer(f"fp32 grads to NVMe (bucket {k})", "nvme_write", FP32 * elems, rs,
                           "bwd", micro_batch=mb)
        e.add(Op(name=f"release grad partition buffers (bucket {k})", kind="compute",
                 stream=rs, phase="bwd", free=tuple(frees) + (("buffers", W16 * elems),),
                 micro_batch=mb, category="copy"))

    def epilogue(self) -> None:
        """independent_gradient_partition_epilogue: last bucket, then the host waits for the
        reduction stream."""
        e = self.e
        self.reduce_bucket()
        e.host_wait(f"reduce_and_partition_stream.synchronize() mb{self.mb}",
                    [e.last.get(self.rs)], phase="bwd")
        self.micro_step += 1

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        e, z, cm = self.e, self.z, self.cm
        ph: Phase = "optimizer"
        part = self.part_total
        # _partition_all_parameters -> release_and_reset_all (persistent ones too)
        for pid in list(self.registry):
            if pid in self.registry:
                self.wait(pid)
        for p in self.params:
            self.active[p.pid].clear()
            if self.status[p.pid] == "AV":
                nbytes, _ = self.held.pop(p.pid, (0.0, None))
                if p.persist:
                    nbytes = W16 * p.aligned
                if nbytes:
                    e.last["compute"].free = e.last["compute"].free + (("parameters", nbytes),)
                self.status[p.pid] = "NA"
        self.n_available = 0
        self.live = self.pending = 0.0
        n_tensors = len(self.params)
        if z.fp16:
            # has_overflow: isinf/isnan over the gradient partitions, all-reduce, .item()
            e.kernels("overflow check (grad partitions)", self.rs, ph, 2 * W16 * part + 2,
                      kernels=6, category="optimizer")
            e.owe("compute", e.last[self.rs])
            e.collective("all-reduce overflow flag", "all_reduce", 1, "compute")
            e.host_wait("overflow .item()", [e.last.get("compute")], phase=ph)
        # _create_fp16_sub_groups: parameters in order, a sub-group closed once its partition
        # elements reach sub_group_size.
        sub_groups: list[int] = []
        acc = 0
        for p in self.params:
            acc += p.aligned // self.W
            if acc >= self.z.sub_group or p is self.params[-1]:
                sub_groups.append(acc)
                acc = 0
        if z.offload_opt == "none":
            # _get_norm_groups -> get_grad_norm_direct: g.double().norm(2) per parameter
            e.kernels("grad norm (fp64 per tensor)", "compute", ph, (W16 + 2 * FP64) * part,
                      kernels=2 * n_tensors + 3, category="optimizer")
            e.collective("all-reduce grad norm", "all_reduce", FP64, "compute")
            for i, sg in enumerate(sub_groups):
                e.kernels(f"flatten + fp32 grads (sub-group {i})", "compute", ph,
                          2 * W16 * sg + (W16 + FP32) * sg, kernels=2,
                          alloc=(("gradients", FP32 * sg),), transient=W16 * sg,
                          category="optimizer")
                e.kernels(f"unscale_and_clip_grads (sub-group {i})", "compute", ph,
                          2 * FP32 * sg, category="optimizer")
                e.add(Op(name=f"FusedAdam (sub-group {i})", kind="compute", stream="compute",
                         phase=ph, duration=cm.adamw_time(sg, True, 1), category="optimizer",
                         cpu_s=TORCH_CALL_CPU_S))
                e.kernels(f"fp32 -> 16-bit partition (sub-group {i})", "compute", ph,
                          (FP32 + W16) * sg, free=(("gradients", FP32 * sg),),
                          category="optimizer")
        else:
            self.offloaded_step(sub_groups, n_tensors)
        self.post_step()

    def offloaded_step(self, sub_groups: list[int], n_tensors: int) -> None:
        """The step with the optimizer in host memory (ZeRO-Offload / ZeRO-Infinity)."""
        e, z = self.e, self.z
        host = self.host
        assert host is not None
        ph: Phase = "optimizer"
        # complete_grad_norm_calculation_for_cpu_offload: a GPU scalar per parameter summed,
        # float() (host sync), one all-reduce, .cpu() (host sync).
        e.kernels("sum per-parameter grad norms", "compute", ph, 16.0 * n_tensors,
                  kernels=2 * n_tensors, category="optimizer")
        e.host_wait("norm float()", [e.last.get("compute"), e.last.get(self.rs)], phase=ph)
        e.collective("all-reduce grad norm", "all_reduce", FP32, "compute")
        prev = e.host_wait("norm .cpu()", [e.last.get("compute")], phase=ph)
        for i, sg in enumerate(sub_groups):
            deps: list[Op] = [prev]
            if z.offload_opt == "nvme":
                # swap_in_optimizer_state: fp32 param, exp_avg, exp_avg_sq and the swapped
                # gradients read from NVMe into pinned buffers (aio wait: blocking).
                rd = e.transfer(f"NVMe -> host optimizer states (sub-group {i})", "nvme_read",
                                (3 * FP32 + FP32) * sg, "nvme", ph, deps=deps)
                rd.host_sync = True
                deps = [rd]
            unscale = e.cpu_work(f"unscale fp32 grads (CPU, sub-group {i})",
                                 _host_pass_s(host, 2 * FP32 * sg), ph, deps)
            adam = e.cpu_work(f"DeepSpeedCPUAdam (sub-group {i})",
                              cpu_adam_s(host, sg, "deepspeed"), ph, [unscale])
            # _reassign_or_swap_out_partitioned_parameters: fp16 flat .copy_(fp32): blocking;
            # the dtype conversion happens on the CPU, 16-bit bytes cross PCIe (unless the
            # 16-bit partitions themselves live in host memory).
            conv = e.cpu_work(f"fp32 -> 16-bit on CPU (sub-group {i})",
                              _host_pass_s(host, (FP32 + W16) * sg), ph, [adam])
            last = conv
            if z.offload_param == "none":
                last = e.transfer(f"16-bit partition to GPU (sub-group {i})", "h2d", W16 * sg,
                                  "compute", ph, deps=[conv])
                last.host_sync = True
            if z.offload_opt == "nvme":
                wr = e.transfer(f"host -> NVMe optimizer states (sub-group {i})", "nvme_write",
                                3 * FP32 * sg, "nvme", ph, deps=[adam])
                wr.host_sync = True
                last = wr
            prev = last

    def post_step(self) -> None:
        """_post_step: all-gather the persistent parameters (one call each, then a device
        synchronize) and drop the hpZ secondary partitions."""
        e, z = self.e, self.z
        persist = [p for p in self.params if p.persist]
        dep = e.last.get("compute")
        last: list[Op | None] = [dep]
        for p in persist:
            op = e.collective(f"all-gather persistent {p.name}", "all_gather", W16 * p.aligned,
                              "nccl-ag", deps=[dep] if dep is not None else [],
                              alloc=(("parameters", W16 * p.aligned),))
            if op is None:
                e.last["compute"].alloc = e.last["compute"].alloc + (
                    ("parameters", W16 * p.aligned),)
            last.append(op)
        sync = e.host_wait("device synchronize (persistent params)", last, phase="optimizer")
        if self.secondary and z.offload_param == "none":
            sync.free = (("parameters", W16 * sum(self.P[p].aligned // z.hpz
                                                  for p in self.secondary)),)
        self.secondary.clear()
        for p in persist:
            self.status[p.pid] = "AV"


def _activation_peak(ops: PassOps) -> float:
    """Most activation and scratch bytes one micro-batch holds at once (its block ops'
    allocations and frees in order, plus the largest transient)."""
    held = peak = 0.0
    for op in ops.forward + ops.backward:
        held += sum(b for c, b in op.alloc if c != "gradients")
        peak = max(peak, held + op.transient)
        held -= sum(b for c, b in op.free if c != "gradients")
    return peak


def _qwz_groups(numel: int) -> int:
    """CUDAQuantizer.quantize's group count for a tensor of ``numel`` elements: the smallest
    count >= numel / 8000 with groups of a multiple of 8 elements, doubled while groups stay
    above 8000 elements (partition_parameters.py)."""
    if numel <= 0:
        return 0
    groups = math.ceil(numel / QWZ_TARGET_GROUP)
    while groups < numel:
        if numel % (8 * groups) == 0:
            break
        groups += 1
    while numel % (8 * groups * 2) == 0 and numel / groups > QWZ_TARGET_GROUP:
        groups *= 2
    return groups
