"""ZeRO-3's step builder (``DeepSpeedZeroOptimizer_Stage3``): the hook and kernel events of a
micro-batch, the program's resident memory and allocator budget, and each micro-batch's
compute segments between hooks, over the coordinator, gradient and step units."""

from __future__ import annotations

from collections.abc import Iterable

from sim.frameworks.common.accounting import block_model_flops
from sim.frameworks.common.steps import PassOps, micro_batch_ops
from sim.frameworks.deepspeed.constants import W16
from sim.frameworks.deepspeed.emitter import _Emitter
from sim.frameworks.deepspeed.stage3_grads import _Gradients
from sim.frameworks.deepspeed.stage3_step import _Step
from sim.frameworks.deepspeed.stage3_trace import _Event, _route, _scripts, _Seg
from sim.hardware.compute import EAGER_BWD_OP_CPU_S, EAGER_FWD_OP_CPU_S, ComputeModel
from sim.program.ir import Op, Phase, Program, RankClass
from sim.workload.layer_ops import FP32, Kernel, kernel_time


class _Stage3(_Step, _Gradients):
    """ZeRO-3: the coordinator's fetch/prefetch/release decisions replayed on the module trace,
    gradient buckets, the sub-group step, ZeRO++ and offload. The units are its bases:
    :class:`_Step` (over :class:`_Coordinator`) and :class:`_Gradients`, all over
    :class:`_Stage3State`; this class adds the events and the build."""

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
                          flops + ctx.layer_recompute_flops(self.costs),
                          micro_batches=ctx.micro_batches)
        program.meta.update(framework="deepspeed", zero_stage=3, style=self.style.name,
                            overlap_comm=z.overlap,
                            persistent_params=sum(p.persist for p in self.params),
                            zeropp={"qwz": z.qwz, "hpz": z.hpz, "qgz": self.qgz_active},
                            offload_optimizer=z.offload_opt, offload_param=z.offload_param)
        self.e = _Emitter(program, cls, self.cm, w16="f16" if z.fp16 else "bf16")
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


def _activation_peak(ops: PassOps) -> float:
    """Most activation and scratch bytes one micro-batch holds at once (its block ops'
    allocations and frees in order, plus the largest transient)."""
    held = peak = 0.0
    for op in ops.forward + ops.backward:
        held += sum(b for c, b in op.alloc if c != "gradients")
        peak = max(peak, held + op.transient)
        held -= sum(b for c, b in op.free if c != "gradients")
    return peak
