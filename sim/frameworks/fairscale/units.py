"""FairScale FSDP's ops: gathers, compute, post-backward reductions and the bucket.

:class:`FairscaleStep` adds a shaped job's ops (:class:`~sim.frameworks.fairscale.shape.
FairscaleShape`) to a program in the order FairScale's hooks issue them, one method per hook:
:meth:`~FairscaleStep.gather` (``_rebuild_full_params``), :meth:`~FairscaleStep.post_backward`
(``_post_backward_hook``), :meth:`~FairscaleStep.post_reduction` (``_post_reduction_hook``),
:meth:`~FairscaleStep.flush` (``ReduceScatterBucketer``'s ``Bucket.flush``) and
:meth:`~FairscaleStep.micro_batch` (one forward and backward, then
``_wait_for_post_backward``). Its only mutable state is the bucket (:class:`Bucket`). What
waits for what is in :mod:`sim.frameworks.fairscale.build`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.frameworks.common.steps import PassOps, micro_batch_ops
from sim.frameworks.fairscale.shape import FairscaleShape, FsdpUnit, shard_numel
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op, Phase, Program, RankClass
from sim.workload.layer_ops import FP32


@dataclass
class Bucket:
    """The bucketer's one bucket for the reduce-scatter dtype: units waiting in it."""

    members: list[FsdpUnit] = field(default_factory=list)
    offset: int = 0
    """Elements per rank already filled."""
    allocated: bool = False
    """Buffers set up (``Bucket.setup`` on first use in backward, torn down at its end)."""


class FairscaleStep:
    """Adds one FairScale job's ops to ``program`` for rank class ``cls`` (every rank)."""

    def __init__(self, shape: FairscaleShape, cm: ComputeModel, program: Program,
                 cls: RankClass) -> None:
        self.s = shape
        self.cm = cm
        self.program = program
        self.cls = cls
        self.bucket = Bucket()

    def add(self, op: Op) -> Op:
        return self.program.add(self.cls, op)

    # ------------------------------------------------------------------ gathers
    def gather(self, unit: FsdpUnit, mb: int, phase: Phase, wait: list[Op]) -> Op | None:
        """_rebuild_full_params: cast the fp32 shard (fp32_to_fp16 stream), then all-gather
        (all_gather stream, waiting for the cast). Returns the op the compute waits for."""
        s, n, hook = self.s, self.s.n, self.s.hook_cpu_s
        chunk = shard_numel(unit.numel, n)
        full = s.pbytes * chunk * n
        tag = f"{unit.name} ({phase}) mb{mb}"
        cast: Op | None = None
        if s.mixed:
            cast = self.add(Op(
                name=f"cast fp32->16-bit shard {tag}", kind="compute", stream="fp32_to_fp16",
                phase=phase, deps=wait, duration=self.cm.membound_time((FP32 + s.pbytes) * chunk),
                category="copy", micro_batch=mb, cpu_s=hook,
                alloc=(("buffers" if n > 1 else "parameters", s.pbytes * chunk),)))
        if n == 1:
            # Not sharded (world size 1): the 16-bit shard is the full parameter.
            return cast
        return self.add(Op(
            name=f"all-gather {tag}", kind="collective", stream="all_gather", phase="comm",
            deps=[cast] if cast is not None else wait, collective="all_gather", group=s.group,
            nbytes=full, dtype=s.param_dtype, key=f"fairscale/ag/{unit.name}/{phase}/{mb}",
            category="all_gather",
            micro_batch=mb, cpu_s=hook, alloc=(("parameters", full),),
            free=(("buffers", s.pbytes * chunk),) if s.mixed else ()))

    # ------------------------------------------------------------------ reductions
    def post_reduction(self, units: list[FsdpUnit], mb: int, label: str,
                       extra_free: float) -> Op:
        """_post_reduction_hook of each unit reduced together: post-divide, cast the reduced
        shard to fp32, add it into the fp32 gradient shard."""
        s, cm = self.s, self.cm
        t = 0.0
        cast = 0.0
        kernels = 0
        for u in units:
            e = shard_numel(u.numel, s.n)
            if s.post_div > 1:
                t += cm.membound_time(2 * s.rbytes * e)
                kernels += 1
            if s.rbytes != FP32:
                t += cm.membound_time((s.rbytes + FP32) * e)
                cast += FP32 * e
                kernels += 1
            t += cm.membound_time(3 * FP32 * e)
            kernels += 1
        return self.add(Op(
            name=f"post-reduction {label} mb{mb}", kind="compute", stream="post_backward",
            phase="bwd", duration=t, category="copy", micro_batch=mb,
            cpu_s=s.hook_cpu_s * kernels, transient=cast,
            free=(("buffers", extra_free),) if extra_free else ()))

    def flush(self, mb: int, wait: list[Op]) -> None:
        """Bucket.flush: one reduce-scatter of the filled part, then the callbacks, then
        the used part zeroed and a fresh output shard allocated."""
        s, cm, bucket, hook = self.s, self.cm, self.bucket, self.s.hook_cpu_s
        if not bucket.members:
            return
        used = bucket.offset
        full = s.rbytes * used * s.n
        # data[:, :offset].contiguous() copies unless the bucket is exactly full.
        copy = used < s.bucket_capacity
        names = "+".join(u.name for u in bucket.members)
        prep = self.add(Op(
            name=f"bucket contiguous {names} mb{mb}", kind="compute", stream="post_backward",
            phase="bwd", deps=wait, duration=cm.membound_time(2 * full) if copy else 0.0,
            category="copy", micro_batch=mb, cpu_s=hook if copy else 0.0,
            alloc=(("buffers", full),) if copy else ()))
        self.add(Op(
            name=f"reduce-scatter bucket {names} mb{mb}", kind="collective",
            stream="post_backward", phase="comm", deps=[prep], collective="reduce_scatter",
            group=s.group, nbytes=full, dtype=s.reduce_dtype,
            key=f"fairscale/rs/bucket/{names}/{mb}",
            category="reduce_scatter", micro_batch=mb, cpu_s=hook,
            free=(("buffers", full),) if copy else ()))
        done = self.post_reduction(bucket.members, mb, f"bucket {names}", 0.0)
        done.duration += (cm.membound_time(s.rbytes * used * s.n)
                          + cm.membound_time(s.rbytes * s.bucket_capacity))
        done.cpu_s += 2 * hook
        bucket.members = []
        bucket.offset = 0

    def post_backward(self, unit: FsdpUnit, last_bwd: Op, mb: int) -> None:
        """_post_backward_hook: the post_backward stream waits for the compute stream, then
        reduces the unit's flat gradient (directly, or through the bucket)."""
        s, cm = self.s, self.cm
        numel = unit.numel
        prep_t = 0.0
        prep_kernels = 0
        cast32 = 0.0
        if s.mixed and s.opts.fp32_reduce_scatter:
            prep_t += cm.membound_time((s.gbytes + FP32) * numel)     # grad.to(fp32)
            cast32 = FP32 * numel
            prep_kernels += 1
        if s.pre_div > 1:
            prep_t += cm.membound_time(2 * s.rbytes * numel)         # div_ in place
            prep_kernels += 1
        if s.n == 1:
            # Not sharded: _post_reduction_hook runs on the gradient itself.
            op = self.post_reduction([unit], mb, unit.name, 0.0)
            op.deps = [last_bwd]
            op.duration += prep_t
            op.cpu_s += prep_kernels * s.hook_cpu_s
            op.transient += cast32
            op.free = (("gradients", s.gbytes * numel),)
        elif shard_numel(numel, s.n) > s.bucket_capacity:
            self._reduce_scatter_direct(unit, last_bwd, mb, prep_t, prep_kernels, cast32)
        else:
            self._copy_into_bucket(unit, last_bwd, mb, prep_t, prep_kernels, cast32)

    def _reduce_scatter_direct(self, unit: FsdpUnit, last_bwd: Op, mb: int, prep_t: float,
                               prep_kernels: int, cast32: float) -> None:
        """Too big for the bucket: torch.cat of the chunks, a zeroed output shard, and
        _reduce_scatter_base right away (the bucket is not flushed)."""
        s, cm, hook = self.s, self.cm, self.s.hook_cpu_s
        chunk = shard_numel(unit.numel, s.n)
        padded = s.rbytes * chunk * s.n
        temps = cast32 + padded + s.rbytes * chunk
        prep = self.add(Op(
            name=f"prepare grads {unit.name} mb{mb}", kind="compute",
            stream="post_backward", phase="bwd", deps=[last_bwd],
            duration=prep_t + cm.membound_time(2 * padded)
            + cm.membound_time(s.rbytes * chunk),
            category="copy", micro_batch=mb, cpu_s=hook * (prep_kernels + 2),
            alloc=(("buffers", temps),)))
        self.add(Op(
            name=f"reduce-scatter {unit.name} mb{mb}", kind="collective",
            stream="post_backward", phase="comm", deps=[prep],
            collective="reduce_scatter", group=s.group, nbytes=padded, dtype=s.reduce_dtype,
            key=f"fairscale/rs/{unit.name}/{mb}", category="reduce_scatter",
            micro_batch=mb, cpu_s=hook))
        # The unsharded gradient (record_stream on post_backward) and the temporaries
        # die once the hook's work on the post_backward stream is done.
        done = self.post_reduction([unit], mb, unit.name, temps)
        done.free = done.free + (("gradients", s.gbytes * unit.numel),)

    def _copy_into_bucket(self, unit: FsdpUnit, last_bwd: Op, mb: int, prep_t: float,
                          prep_kernels: int, cast32: float) -> None:
        """Bucketed: cast and pre-divide, flush the bucket first if the chunk does not fit
        in what is left, then torch.stack the chunks and copy them into the bucket."""
        s, bucket, hook = self.s, self.bucket, self.s.hook_cpu_s
        chunk = shard_numel(unit.numel, s.n)
        padded = s.rbytes * chunk * s.n
        if prep_t:
            self.add(Op(name=f"prepare grads {unit.name} mb{mb}", kind="compute",
                        stream="post_backward", phase="bwd", deps=[last_bwd], duration=prep_t,
                        category="copy", micro_batch=mb, cpu_s=hook * prep_kernels,
                        alloc=(("buffers", cast32),) if cast32 else ()))
        if chunk > s.bucket_capacity - bucket.offset:
            self.flush(mb, [last_bwd])
        alloc: tuple[tuple[str, float], ...] = ()
        if not bucket.allocated:
            alloc = (("buffers", s.bucket_bytes),)    # Bucket.setup on first use in backward
            bucket.allocated = True
        free: tuple[tuple[str, float], ...] = (("gradients", s.gbytes * unit.numel),)
        if cast32:
            free += (("buffers", cast32),)
        self.add(Op(
            name=f"copy grads into bucket {unit.name} mb{mb}", kind="compute",
            stream="post_backward", phase="bwd", deps=[last_bwd],
            duration=2 * self.cm.membound_time(2 * padded), category="copy", micro_batch=mb,
            cpu_s=hook * 2, alloc=alloc, transient=padded, free=free))
        bucket.members.append(unit)
        bucket.offset += chunk

    # ------------------------------------------------------------------ micro-batches
    def compute_ops(self, mb: int, recompute: bool) -> PassOps:
        """One micro-batch's compute ops (not yet added), with the host time eager PyTorch
        takes to issue them and the per-weight gradients freed after the flat gradient's cat."""
        s, cm = self.s, self.cm
        ops = micro_batch_ops(s.costs, s.model.layers, mb, recompute, s.style.autocast,
                              s.grad_alloc, s.extra_bwd_s, s.model_flops)
        for (block, _layer), op in ops.fwd_of.items():
            op.cpu_s = s.block_cpu(cm, block, "fwd")
        for (block, _layer), op in ops.bwd_of.items():
            op.cpu_s = s.block_cpu(cm, block, "bwd")
            if op.phase == "recompute":
                op.cpu_s += s.block_cpu(cm, "attn", "fwd") + s.block_cpu(cm, "mlp", "fwd")
            if block in s.pieces_freed:
                op.free = op.free + (("gradients", s.pieces_freed[block]),)
        return ops

    def micro_batch(self, mb: int, recompute: bool, prev_compute: Op | None) -> Op:
        """One micro-batch's forward and backward with their hooks, then
        ``_wait_for_post_backward``; returns its last compute-stream op."""
        ops = self.compute_ops(mb, recompute)
        self._forward(ops, mb, prev_compute)
        self._backward(ops, mb)
        # ---------------- _wait_for_post_backward: flush, compute waits, teardown.
        self.flush(mb, [])
        side = self.cls.streams.get("post_backward", [])
        teardown = (("buffers", self.s.bucket_bytes),) if self.bucket.allocated else ()
        self.bucket.allocated = False
        return self.add(Op(
            name=f"wait for post-backward mb{mb}", kind="compute", stream="compute",
            phase="bwd", deps=[side[-1]] if side else [], category="backward",
            micro_batch=mb, free=teardown))

    def _forward(self, ops: PassOps, mb: int, prev_compute: Op | None) -> None:
        """The root gathers after the previous compute; each unit's compute waits for its
        gather; resharded units free their parameters after it."""
        s = self.s
        root_ag = self.gather(s.root, mb, "fwd", [prev_compute] if prev_compute is not None
                              else [])
        embed = ops.fwd_of[("embed", -1)]
        embed.deps = [root_ag] if root_ag is not None else []
        self.add(embed)
        for unit in s.layers:
            ag = self.gather(unit, mb, "fwd", [])
            first = ops.fwd_of[unit.blocks[0]]
            first.deps = [ag] if ag is not None else []
            for key in unit.blocks:
                self.add(ops.fwd_of[key])
            if unit.resharded:
                last = ops.fwd_of[unit.blocks[-1]]
                last.free = last.free + (("parameters", s.held(unit)),)
        self.add(ops.fwd_of[("head", -1)])

    def _backward(self, ops: PassOps, mb: int) -> None:
        """The root's parameters are still gathered; each layer's pre-backward hook gathers
        again if resharded; its post-backward hook frees them and reduce-scatters its
        gradient."""
        s = self.s
        self.add(ops.bwd_of[("head", -1)])
        for unit in reversed(s.layers):
            first = ops.bwd_of[unit.blocks[-1]]
            if unit.resharded:
                ag = self.gather(unit, mb, "bwd", [])
                first.deps = [ag] if ag is not None else []
            for key in reversed(unit.blocks):
                self.add(ops.bwd_of[key])
            last = ops.bwd_of[unit.blocks[0]]
            last.free = last.free + (("parameters", s.held(unit)),)
            self.post_backward(unit, last, mb)
        embed_bwd = self.add(ops.bwd_of[("embed", -1)])
        embed_bwd.free = embed_bwd.free + (("parameters", s.held(s.root)),)
        self.post_backward(s.root, embed_bwd, mb)
