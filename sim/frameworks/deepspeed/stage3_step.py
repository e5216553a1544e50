"""ZeRO-3's optimizer step: release of every gathered parameter, the overflow check, the
sub-group loop (FusedAdam on the GPU, or DeepSpeedCPUAdam with ZeRO-Offload / NVMe swapping),
and the post-step gather of persistent parameters."""

from __future__ import annotations

from sim.frameworks.deepspeed.constants import FP64, W16
from sim.frameworks.deepspeed.host_costs import TORCH_CALL_CPU_S, _host_pass_s
from sim.frameworks.deepspeed.stage3_coordinator import _Coordinator
from sim.hardware.host import cpu_adam_s
from sim.program.ir import Op, Phase
from sim.workload.layer_ops import FP32


class _Step(_Coordinator):
    """The step after the last micro-batch (``DeepSpeedZeroOptimizer_Stage3.step``)."""

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
            e.collective("all-reduce overflow flag", "all_reduce", 1, "compute", dtype="u8")
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
            e.collective("all-reduce grad norm", "all_reduce", FP64, "compute", dtype="f64")
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
        e.collective("all-reduce grad norm", "all_reduce", FP32, "compute", dtype="f32")
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
