"""ZeRO-3's ``PartitionedParameterCoordinator`` replayed: fetch, prefetch, wait and release of
each submodule's parameters, coalesced all-gathers (qwZ, hpZ, parameter offload), and the
caching allocator's flushes.

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

from sim.frameworks.deepspeed.constants import (
    FP32_SCALE,
    INT8,
    MAX_ONGOING_FETCH_EVENTS,
    QWZ_TARGET_GROUP,
    W16,
)
from sim.frameworks.deepspeed.host_costs import (
    CUDA_API_CPU_S,
    FREE_PARAM_CPU_S,
    HOOK_PY_CPU_S,
    RECORD_STREAM_CPU_S,
    TORCH_CALL_CPU_S,
    WAIT_CPU_S,
    _fetch_call_cpu,
    _release_call_cpu,
)
from sim.frameworks.deepspeed.stage3_state import _Gather, _Stage3State
from sim.hardware.compute import VIEW_CPU_S
from sim.program.ir import Op, Phase


class _Coordinator(_Stage3State):
    """The coordinator's fetch/prefetch/release decisions and the gathers they issue."""

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
                          alloc=((cat, out * elem),), micro_batch=self.mb,
                          dtype="i8" if quant else None)   # qwZ: int8 weights
        assert ag is not None
        ags = [ag]
        self.gathers.append((ag, "fwd" if forward else "bwd", secondary))
        scale_bytes = FP32_SCALE * scale_groups * world
        if quant:
            sc = e.collective(f"all-gather qwZ scales mb{self.mb}", "all_gather", scale_bytes,
                              stream, groups, cpu_s=0.0, alloc=(("buffers", scale_bytes),),
                              micro_batch=self.mb, dtype="f32")
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
