"""ZeRO stages 0-2: the engine's all-reduce with ``BF16_Optimizer`` / ``FP16_Optimizer``
(stage 0) or ``DeepSpeedZeroOptimizer``'s ipg buckets, partitioned gradients, optimizer step
and weight all-gather (stages 1-2), with ZeRO-Offload of the optimizer (see
:mod:`sim.frameworks.deepspeed`)."""

from __future__ import annotations

from sim.frameworks.common.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.frameworks.common.base import JobContext
from sim.frameworks.common.steps import PassOps, micro_batch_ops
from sim.frameworks.deepspeed.constants import (
    ENGINE_ALLREDUCE_ELEMENTS,
    FP64,
    W16,
)
from sim.frameworks.deepspeed.emitter import _Emitter
from sim.frameworks.deepspeed.host_costs import (
    CUDA_API_CPU_S,
    HOOK_PY_CPU_S,
    TORCH_CALL_CPU_S,
    _host_pass_s,
)
from sim.frameworks.deepspeed.moe import Tensors, _group, moe_plan
from sim.frameworks.deepspeed.resolve import _Zero, kernel_style
from sim.hardware.compute import VIEW_CPU_S
from sim.hardware.host import HostSpec, cpu_adam_s
from sim.program.ir import Op, Phase, Program, RankClass
from sim.workload.layer_ops import FP32


def _grad_ready(tensors: Tensors) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Parameter tensors (name, numel) whose gradient is complete after each block's backward,
    in the order their AccumulateGrad hooks fire. A tied embedding is one leaf used twice: its
    hook fires after the embedding's backward, the last use."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name, numel, block, layer in reversed(tensors):
        out.setdefault((block, layer), []).append((name, numel))
    return out


# --------------------------------------------------------------------------- stages 0-2
class _Stage012:
    """Stages 0-2: the engine's all-reduce (stage 0) or ``DeepSpeedZeroOptimizer`` (1-2)."""

    def __init__(self, ctx: JobContext, z: _Zero) -> None:
        self.ctx, self.z = ctx, z
        m = ctx.model
        self.m = m
        self.n = ctx.n_ranks
        self.cm = ctx.compute
        self.style = kernel_style(m)
        self.costs = ctx.block_costs(self.style, kv_cache=False)
        # DeepSpeed-MoE: expert parameters in their own groups over the expert-DP group.
        self.moe = moe_plan(ctx, z) if m.moe is not None else None
        self.tensors = self.moe.tensors if self.moe else m.parameter_tensors()
        world = (tuple(range(self.n)),)
        # Each group's flat 16-bit buffer padded to nccl_start_alignment_factor x its group's
        # size; each rank owns an equal partition of it (get_data_parallel_partitions).
        self.param_groups = (self.moe.param_groups if self.moe else
                             [_group(m.total_params, self.n, world, False)])
        self.psi = sum(g.numel for g in self.param_groups)
        self.padded = sum(g.padded for g in self.param_groups)
        self.part = sum(g.part for g in self.param_groups)
        self.ready = _grad_ready(self.tensors)
        self.offload = z.stage >= 1 and z.offload_opt != "none"
        self.host = HostSpec.from_scenario(ctx.scenario) if self.offload else None
        self.red = "reduce" if z.overlap else "compute"
        # Parameters whose 16-bit gradient each block's backward materialises (a tied
        # matrix's gradient first appears in the LM head's backward).
        self.grad_params = block_grad_params(m, self.costs)
        # ipg bucket state
        self.elems = 0
        self.elems_expert = 0
        self.expert_first = False
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
                          flops + self.recompute_flops(),
                          micro_batches=ctx.micro_batches)
        if self.moe is not None:
            program.meta.update(moe="deepspeed-moe", ep=self.moe.ep, expert_dp=self.moe.edp,
                                capacity=self.moe.lay.capacity)
        program.meta.update(framework="deepspeed", zero_stage=z.stage, style=self.style.name,
                            overlap_comm=z.overlap,
                            optimizer=("BF16_Optimizer" if z.stage == 0 and not z.fp16 else
                                       "FP16_Optimizer" if z.stage == 0 else
                                       "DeepSpeedZeroOptimizer"),
                            offload_optimizer="cpu" if self.offload else "none")
        self.e = _Emitter(program, cls, self.cm, w16="f16" if z.fp16 else "bf16")
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
        if m.tied_embeddings:
            # Autograd adds the tied matrix's two gradients (LM head, embedding) before its
            # AccumulateGrad hook fires, as DDP, FSDP2 and FairScale are charged.
            extra["embed"] = extra.get("embed", 0.0) + tied_grad_sum_s(cm, m, W16)
        ops = micro_batch_ops(self.costs, m.layers, mb, self.ctx.recompute, False, grad_alloc,
                              extra, self.model_flops)
        if not fresh:
            for op in ops.backward:
                op.transient += W16 * self.grad_params[op.name.split()[1]]
        moe_fwd, moe_bwd = self.moe_ops(ops)
        for op in ops.forward:
            if id(op) in moe_fwd:
                assert self.moe is not None
                self.moe.forward(e, mb, moe_fwd[id(op)],
                                 "ckpt" if self.ctx.recompute else "fwd")
            else:
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
            if id(op) in moe_bwd:
                assert self.moe is not None
                def hook(key: tuple[str, int]) -> None:
                    if hooks:
                        self.hook_params(self.ready.get(key, []), mb)

                self.moe.backward(e, mb, moe_bwd[id(op)], fresh, hook,
                                  self.costs["attn"] if self.ctx.recompute else None)
                continue
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
            # reduce_gradients: after backward, every parameter in group order (the dense
            # group in model order, then the MoE groups').
            experts = self.moe.expert_names if self.moe else set()
            self.hook_params(sorted(((name, numel) for name, numel, _, _ in self.tensors),
                                    key=lambda t: t[0] in experts), mb)
        self.epilogue(mb)

    def recompute_flops(self) -> float:
        """Hardware FLOPs activation checkpointing adds to the step (MoE layers re-run
        their own blocks)."""
        ctx = self.ctx
        if self.moe is None or not ctx.recompute:
            return ctx.layer_recompute_flops(self.costs)
        a, mlp = self.costs["attn"], self.costs["mlp"]
        per_mb = sum(self.moe.recompute_flops(a) if self.moe.is_moe(la)
                     else a.flops_fwd + mlp.flops_fwd for la in range(self.m.layers))
        return per_mb * ctx.micro_batches * ctx.dp

    def moe_ops(self, ops: PassOps) -> tuple[dict[int, int], dict[int, int]]:
        """The MLP ops of MoE layers (by id) the DeepSpeed-MoE layer's ops replace, with
        their layer: forward, backward."""
        if self.moe is None:
            return {}, {}
        layers = [la for la in range(self.m.layers) if self.moe.is_moe(la)]
        return ({id(ops.fwd_of[("mlp", la)]): la for la in layers},
                {id(ops.bwd_of[("mlp", la)]): la for la in layers})

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
        experts = self.moe.expert_names if self.moe else set()
        for name, numel in params:
            if self.elems + numel > z.bucket and self.elems > 0:
                self.copy_into_bucket(run, mb)
                run = []
                self.reduce_bucket(mb)
            if numel > z.bucket or not z.contiguous:
                self.bucket_extra.append(numel)   # reduced from its own .grad
            else:
                run.append(numel)
            if name in experts:
                self.expert_first = self.expert_first or self.elems == 0
                self.elems_expert += numel
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
        z, e = self.z, self.e
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
        # average_tensor: one all-reduce per process group, in the order the bucket's
        # slices first name it (dense over the world, experts over the expert-DP group).
        parts = [(el - self.elems_expert, self.param_groups[0].groups, "")]
        if self.elems_expert:
            assert self.moe is not None
            exp = (self.elems_expert, self.moe.edp_groups, " (experts)")
            parts = [exp] + parts if self.expert_first else parts + [exp]
        mine = 0.0
        for count, groups, what in parts:
            if count:
                e.collective(f"all-reduce grad bucket {k}{what} mb{mb}", "all_reduce",
                             W16 * count, s, groups=groups, micro_batch=mb)
                mine += count / len(groups[0])
        frees: list[tuple[str, float]] = [("buffers", W16 * el)]
        if extra:
            frees.append(("gradients", W16 * extra))
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
        self.elems_expert = 0
        self.expert_first = False
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
            e.collective("all-reduce overflow flag", "all_reduce", 1, "compute", dtype="u8")
            e.host_wait("overflow .item()", [e.last.get("compute")], phase=ph)
        if self.offload:
            assert self.host is not None
            # complete_grad_norm_calculation_for_cpu_offload: .item() of every parameter's
            # norm, then one all-reduce and .item().
            e.host_wait("per-parameter norm .item()", [e.last.get("compute"),
                                                       e.last.get(self.red)], phase=ph)
            e.owed_cpu += tensors_mine * CUDA_API_CPU_S
            e.collective("all-reduce grad norm", "all_reduce", FP32, "compute", dtype="f32")
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
            e.collective("all-reduce grad norm", "all_reduce", FP32, "compute", dtype="f32")
            for i, g in enumerate(self.param_groups[1:], 1):
                # Each further group's norm over the world, a MoE group's again over its
                # expert-DP group (_average_expert_grad_norms).
                e.collective(f"all-reduce grad norm (group {i})", "all_reduce", FP32,
                             "compute", dtype="f32")
                if g.expert:
                    e.collective(f"all-reduce expert grad norm (group {i})", "all_reduce",
                                 FP32, "compute", groups=g.groups, dtype="f32")
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
        # all_gather_dp_groups -> all_gather_into_tensor of each group's flat buffer over
        # its own data-parallel group (one group for a dense model)
        for i, g in enumerate(self.param_groups):
            e.collective("all-gather updated weights" + (f" (group {i})" if i else ""),
                         "all_gather", W16 * g.padded, "compute", groups=g.groups)
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
