"""ZeRO-3's gradients: the ipg bucket filled by the AccumulateGrad hooks, its coalesced
reduce-scatter (or ZeRO++ qgZ all-to-all) on ``reduce_and_partition_stream``, and the
gradient partition buffer (on the GPU, or through host memory under optimizer offload)."""

from __future__ import annotations

from sim.frameworks.deepspeed.constants import (
    FP32_SCALE,
    FP64,
    INT4_BYTES,
    MAX_PARAM_REDUCE_EVENTS,
    W16,
)
from sim.frameworks.deepspeed.host_costs import (
    GRAD_HOOK_CPU_S,
    HOOK_PY_CPU_S,
    TORCH_CALL_CPU_S,
)
from sim.frameworks.deepspeed.stage3_state import _Stage3State
from sim.hardware.compute import VIEW_CPU_S
from sim.program.ir import Op
from sim.workload.layer_ops import FP32


class _Gradients(_Stage3State):
    """Gradient hooks, bucket reductions and the micro-step epilogue."""

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
        # int4 values packed two to an int8 tensor, fp32 scales (all_to_all_quant_reduce).
        e.collective(f"qgZ intra-node all-to-all {p.name}", "all_to_all", q_intra, rs,
                     self.local_groups, micro_batch=mb, dtype="i8")
        e.collective(f"qgZ intra-node all-to-all scales {p.name}", "all_to_all",
                     FP32_SCALE * intra, rs, self.local_groups, micro_batch=mb, dtype="f32")
        e.kernels(f"qgZ quantized_reduction {p.name}", rs, "bwd",
                  q_intra + FP32_SCALE * intra + q_inter + FP32_SCALE * inter,
                  alloc=(("buffers", 2 * (q_inter + FP32_SCALE * inter)),), micro_batch=mb)
        e.collective(f"qgZ inter-node all-to-all {p.name}", "all_to_all", q_inter, rs,
                     self.global_groups, micro_batch=mb, dtype="i8")
        e.collective(f"qgZ inter-node all-to-all scales {p.name}", "all_to_all",
                     FP32_SCALE * inter, rs, self.global_groups, micro_batch=mb, dtype="f32")
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
