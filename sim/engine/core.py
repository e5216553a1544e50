"""The engine: runs a :class:`~sim.program.ir.Program` on a fabric with simpy.

One simpy process per (rank class, stream) walks that stream's ops in order. An op starts
when its stream reaches it and its dependencies have finished. Compute and copy ops take
their duration; a collective waits until every rank class of its group has reached it, then
runs as flows on the fabric (:mod:`sim.fabric.collectives`). The engine holds no framework logic and
does no measurement: it tells an :class:`EngineObserver` what happens.

A ``copy`` op with ``host_transfer`` set moves bytes between each member GPU and its host
memory (or between host memory and the node's NVMe) as flows on the fabric, so offloaded
parameters and gradients share PCIe with GPUDirect network traffic. Ops of kind ``host`` are
the CPU's own work (a CPU optimizer step): they run beside the GPU streams, launch no kernel
and take no share of the GPU.

Hooks for subclasses (keep the core small): :meth:`Engine.compute_duration` (how long a
compute op takes given what runs beside it). On Hopper and Blackwell a collective marked
``Op.launch_behind_compute`` that becomes ready beside running compute ops starts when they
end (:mod:`sim.engine.launch_wait`). A rank class's
:attr:`~sim.program.ir.RankClass.compute_factor` (a straggler GPU, ``faults.slow_gpus``)
multiplies its compute ops' time there; copies and host work keep theirs (a throttled GPU's
SM clocks fall, its copy engines' and PCIe's rates do not). :attr:`Engine.jitter`
(``faults.jitter``, :mod:`sim.engine.jitter`) multiplies them again by a factor per class and
step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import numpy as np
import simpy
from simpy.resources.resource import Request

from sim import catalog
from sim.catalog import GpuSpec
from sim.engine.event_loop import run_until
from sim.engine.gc_pause import paused_gc as paused_gc  # re-exported (sim.api)
from sim.engine.hbm_share import HbmShare
from sim.engine.host_clock import LAUNCH_QUEUE_KERNELS as LAUNCH_QUEUE_KERNELS  # re-exported
from sim.engine.host_clock import HostIssue, host_issues, issue_order, issue_time
from sim.engine.jitter import StepJitter
from sim.engine.launch_wait import BLOCKING_ARCHS, RunningCompute
from sim.engine.time_grid import GridEnvironment
from sim.engine.waits import AllDone, FirstOf
from sim.fabric.collectives import alltoall
from sim.fabric.collectives.runner import Choice, CollectiveRunner, NcclSettings, transport_capacity
from sim.fabric.network import FlowNetwork, NetworkObserver
from sim.fabric.topology import LINK_KINDS, Fabric
from sim.fabric.topology.storage import StorageTarget
from sim.hardware.interference import (
    NCCL_CHANNELS,
    CommLoad,
    alltoall_ctas,
    comm_load,
    slowdown,
)
from sim.hardware.power import sustained_gemm_flops
from sim.program.ir import Op, Program, RankClass

# Ops between two progress reports: often enough for a bar, rare enough to cost nothing.
PROGRESS_EVERY = 512


class EngineObserver(NetworkObserver):
    """What the engine reports; the recorder subclasses this."""

    def on_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
              step: int, held: float = 0.0) -> None:
        """An op finished: it was ready (reached and dependencies met) at ``ready``, ran from
        ``start`` (later than ready for a collective waiting for its peers) to ``end``;
        ``held`` is how long it waited for the host to issue it after its dependencies were
        met (``ready`` less that moment; 0 when the host had issued it already)."""

    def on_memory(self, cls: RankClass, t: float, category: str, delta: float,
                  op: Op | None = None) -> None:
        """``delta`` bytes of ``category`` allocated (positive) or freed (negative) by ``op``
        (None: held before the step)."""

    def on_background_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
                         step: int, held: float = 0.0) -> None:
        """An op of a background stream (:attr:`Program.background_streams`) finished; ``step``
        is the step that issued it (it may end during a later one)."""

    def on_collective(self, op: Op, choice: Choice | None) -> None:
        """A collective or point-to-point op (``op.key``) finished on the fabric, once for all
        its groups; ``choice`` is what NCCL ran (algorithm, protocol), None if nothing moved."""


@dataclass
class _GpuLoad:
    """What the running collectives of one rank class hold on each of its GPUs."""

    ctas: int = 0
    hbm_bytes_per_s: float = 0.0
    holders: int = 0
    """Collectives holding the GPU now (from their kernel's launch to their end)."""
    changed: simpy.Event | None = None
    """Succeeds (and is replaced) whenever ``ctas`` or the HBM traffic changes."""


# Categories of compute ops that are GEMM/attention work when an op carries no FLOP count.
_MATRIX_CATEGORIES = ("forward", "backward", "recompute", "recompute+backward")
# The GPU when the engine is built without a spec (unit tests).
_DEFAULT_GPU = "h100-sxm"


@dataclass
class _Rendezvous:
    needed: set[int]
    launched: simpy.Event
    arrived: set[int] = field(default_factory=set)
    start: float = 0.0
    reported: bool = False


class Engine:
    """Runs programs step after step on one fabric.

    Examples
    --------
    See :func:`sim.api.simulate`, which builds the program and the fabric and runs this.
    """

    def __init__(self, fabric: Fabric, arch: str, observer: EngineObserver | None = None,
                 nccl: NcclSettings | None = None, nic_transport: str = "infiniband",
                 sm_count: int = 132, gpu: GpuSpec | None = None) -> None:
        self.env = GridEnvironment()
        self.fabric = fabric
        self.observer = observer or EngineObserver()
        self.net = FlowNetwork(self.env, transport_capacity(fabric, arch, nic_transport),
                               fabric.kind, len(LINK_KINDS), self.observer)
        self.collectives = CollectiveRunner(self.env, self.net, fabric, arch, nccl)
        self.events_processed = 0
        self.progress: Callable[[int], None] | None = None
        """Called with the number of ops finished so far, every :data:`PROGRESS_EVERY` ops
        (for a progress bar on long simulations)."""
        self._step = 0
        self.arch = arch
        self.sm_count = gpu.sm_count if gpu is not None else sm_count
        spec = gpu if gpu is not None else catalog.gpu(_DEFAULT_GPU)
        self.hbm_bytes_per_s = spec.hbm_bytes_per_s
        self.matrix_flops = sustained_gemm_flops(spec)
        self._load: dict[int, _GpuLoad] = {}
        self._sm_turn: dict[int, simpy.Resource] = {}
        """Rank classes with side-stream kernels: the one turn on the SMs their compute ops
        take in order (:meth:`_take_sms`)."""
        # Collectives slowed by the memory-bound compute beside them (sim.engine.hbm_share).
        self.hbm_share = HbmShare(self.net, self.sm_count, self.hbm_bytes_per_s,
                                  self._held)
        self._wire_rate: dict[tuple[int, ...], tuple[float, int]] = {}
        self._load_cache: dict[tuple[str, tuple[int, ...], float], CommLoad] = {}
        self._p2p_load: dict[tuple[object, float], CommLoad] = {}
        self._needed: dict[tuple[str, int], tuple[object, frozenset[int]]] = {}
        self._host_routes: dict[tuple[int, str | None],
                                tuple[np.ndarray, np.ndarray, float]] = {}
        self.running_compute = RunningCompute(enabled=False)
        """The compute ops running now, which a collective launched beside them waits for on
        Hopper (:mod:`sim.engine.launch_wait`)."""
        self.jitter: StepJitter | None = None
        """Step-to-step compute variation (``faults.jitter``); None: every step alike."""
        self.host_cpu_factor = 1.0
        """Host CPU seconds per x86 second: every op's ``cpu_s`` (the frameworks' x86-era issue
        costs) times this (:attr:`sim.hardware.host.HostSpec.cpu_op_factor`; Grace 2.75)."""
        self.storage: StorageTarget | None = None
        """Where ``storage_write`` copies go (:mod:`sim.fabric.topology.storage`); None: the
        node's NVMe drives."""
        self._background: dict[tuple[int, str], simpy.Process] = {}
        self._step_factor: dict[int, float] = {}

    # ------------------------------------------------------------------ hooks
    def compute_duration(self, cls: RankClass, op: Op) -> float:
        """Seconds a compute or copy op would take if what runs beside it now ran to its end.

        Override to model interference differently. A collective running on the rank class
        holds SMs (one CTA per NCCL channel) and HBM bandwidth; the op is slowed by
        :func:`sim.hardware.interference.slowdown` from its matrix share. :meth:`_run_compute`
        re-applies this whenever a collective starts or ends during the op. A straggler class
        (``cls.compute_factor`` above 1) runs its compute kernels that many times longer.
        """
        if op.kind == "compute":
            return (op.duration * cls.compute_factor * self._step_factor.get(cls.id, 1.0)
                    * self._slowdown(cls, op))
        return op.duration * self._slowdown(cls, op)

    def _matrix_share(self, op: Op) -> float:
        """Share of the op's time in tensor-core math: its FLOPs at the sustained GEMM rate
        (the part's busy-node rate, ``sustained_gemm_flops``) over its duration (1 for
        forward/backward work that carries no FLOP count)."""
        flops = max(op.flops, op.hw_flops)
        if op.duration <= 0:
            return 0.0
        if flops <= 0:
            return 1.0 if op.kind == "compute" and op.category in _MATRIX_CATEGORIES else 0.0
        return min(1.0, flops / self.matrix_flops / op.duration)

    def _slowdown(self, cls: RankClass, op: Op) -> float:
        load = self._load.get(cls.id)
        if load is None or op.kind == "host" or (load.ctas == 0
                                                  and load.hbm_bytes_per_s <= 0):
            return 1.0
        return slowdown(self.sm_count, self.hbm_bytes_per_s, self._matrix_share(op),
                        load.ctas, load.hbm_bytes_per_s)

    def _take_sms(self, cls: RankClass, op: Op) -> Request | None:
        """The request for the SMs a compute op of a class with side-stream kernels runs on
        (:attr:`sim.program.ir.Op.side_kernel`); None when it needs no turn."""
        turns = self._sm_turn.get(cls.id)
        if turns is None or op.kind != "compute" or op.duration <= 0:
            return None
        return turns.request()

    def _held(self, cls_id: int) -> tuple[int, float]:
        load = self._load.get(cls_id)
        return (0, 0.0) if load is None else (load.ctas, load.hbm_bytes_per_s)

    def _run_compute(self, cls: RankClass, op: Op) -> Generator[simpy.Event, object, None]:
        """Run a compute or copy op whose rate follows the collectives beside it: the work
        left (in seconds at full speed) drains at 1/slowdown, re-evaluated at every change.
        While it runs, its memory-bound share slows the class's collectives
        (:mod:`sim.engine.hbm_share`)."""
        env = self.env
        load = self._load.get(cls.id)
        if load is None or op.kind == "host":
            yield env.timeout(self.compute_duration(cls, op))
            return
        memory = 1.0 - self._matrix_share(op) if op.duration > 0 else 0.0
        self.hbm_share.compute_started(cls.id, memory)
        self.running_compute.started(cls.id, op)
        try:
            yield from self._drain(cls, op, load)
        finally:
            self.running_compute.ended(cls.id, op)
            self.hbm_share.compute_ended(cls.id, memory)

    def _drain(self, cls: RankClass, op: Op, load: _GpuLoad
               ) -> Generator[simpy.Event, object, None]:
        env = self.env
        work = op.duration
        while work > 0:
            f = self.compute_duration(cls, op) / op.duration
            changed = load.changed
            assert changed is not None
            t0 = env.now
            done = env.timeout(work * f)
            yield FirstOf(env, done, changed)
            if done.callbacks is None:   # processed: the op ran to its end
                return
            work -= (env.now - t0) / f
            if work <= 1e-15:
                return

    def _change_load(self, cls_id: int, ctas: int, hbm: float, holders: int = 0) -> None:
        load = self._load[cls_id]
        load.ctas += ctas
        load.holders += holders
        # With no collective left the sum is exactly zero: adding and taking away GB/s-sized
        # floats leaves a residue (hundredths of a byte/s) that grew period by period, so a
        # steady phase never repeated bit for bit (sim.engine.splice).
        load.hbm_bytes_per_s = max(0.0, load.hbm_bytes_per_s + hbm) if load.holders else 0.0
        old = load.changed
        assert old is not None
        # Wake the compute ops draining under the old load; with none waiting (no callbacks)
        # the event stays as it is: triggering it would schedule an event that does nothing.
        if old.callbacks:
            load.changed = self.env.event()
            old.succeed()
        self.hbm_share.load_changed(cls_id)

    def _comm_load(self, op: Op) -> CommLoad:
        """SMs and HBM traffic this collective or send/recv holds on each member GPU: the
        channels and the predicted time of what NCCL would run (the runner's selection)."""
        if op.kind == "collective" and op.collective:
            group = tuple(op.all_groups[0]) if op.all_groups else ()
            # Uneven splits: the even all-to-all as heavy as its busiest rank.
            nbytes = alltoall.even_equivalent(op.peer_bytes) if op.peer_bytes else op.nbytes
            if len(group) <= 1 or nbytes <= 0:
                return CommLoad(0, 0.0)
            key = (op.collective, group, nbytes)
            hit = self._load_cache.get(key)
            if hit is None:
                plan, _, predicted = self.collectives.select(op.collective, group, nbytes)
                hit = comm_load(self.arch, op.collective, nbytes, nbytes * plan.volume,
                                predicted, plan.nccl_channels or plan.channels, plan.algorithm)
                if op.collective == "all_to_all":
                    # Grouped sends: the rounds' point-to-point channels, not a ring's.
                    gpn = self.fabric.spec.gpus_per_node
                    hit = CommLoad(alltoall_ctas(self.arch, [
                        (nbytes / len(group), r // gpn == group[0] // gpn)
                        for r in group[1:]]), hit.hbm_bytes_per_s)
                self._load_cache[key] = hit
            # A fused kernel's own SM count (Op.sm_ctas) replaces NCCL's channels.
            return CommLoad(op.sm_ctas, hit.hbm_bytes_per_s) if op.sm_ctas else hit
        pairs = tuple(op.pairs)
        if not pairs or op.nbytes <= 0:
            return CommLoad(0, 0.0)
        # A pure function of the first pair and the size (a frozen value): every micro-batch's
        # send between two stages asks the same.
        p2p_key = (pairs[0], op.nbytes)
        load = self._p2p_load.get(p2p_key)
        if load is not None:
            return load
        rate = self._wire_rate.get(pairs[0])
        if rate is None:
            spec = self.fabric.spec
            one_node = len({r // spec.gpus_per_node for r in pairs[0]}) <= 1
            nic = (spec.nic_gbps / 8e-9 * spec.nics_per_node / spec.gpus_per_node
                   if spec.nics_per_node else spec.pcie_gbytes_per_s * 1e9)
            nvlink = spec.nvlink_gbytes_per_s * 1e9
            # NCCL runs a send to an NVLink peer on every channel, to a network peer on 2
            # (sim.hardware.interference: ncclTopoGetNchannels).
            rate = self._wire_rate[pairs[0]] = (
                (nvlink, NCCL_CHANNELS.get(self.arch, 32)) if one_node
                else (min(nvlink, nic), 0))
        load = self._p2p_load[p2p_key] = comm_load(self.arch, "p2p", op.nbytes, op.nbytes,
                                                   op.nbytes / rate[0], rate[1] or None)
        return load

    # ------------------------------------------------------------------ state read back
    def issued_at(self, op: Op) -> float:
        """When the host issued ``op`` in the step running now (:mod:`sim.engine.host_clock`)."""
        return self._issue_time[op.index]

    def accumulators(self, cls_id: int) -> tuple[float, ...]:
        """The engine's running sums for rank class ``cls_id`` (the CTAs and HBM traffic its
        collectives hold, the memory-bound share of its compute, its collectives' rate share):
        floats added and taken away over the step, so an exact replay
        (:mod:`sim.engine.splice`) compares them rather than assume they come back alike."""
        load = self._load.get(cls_id)
        return ((load.ctas, load.hbm_bytes_per_s) if load is not None else (0, 0.0)) \
            + self.hbm_share.class_state(cls_id)

    # ------------------------------------------------------------------ running
    def run_step(self, program: Program) -> float:
        """Run one step of ``program``; returns its duration (all streams of all classes)."""
        env = self.env
        t0 = env.now
        if self._step == 0:
            for cls in program.classes:
                for cat, nbytes in cls.initial_memory.items():
                    if nbytes:
                        self.observer.on_memory(cls, t0, cat, nbytes)
        done: dict[int, simpy.Event] = {op.index: env.event() for op in program.ops}
        for cls in program.classes:
            if any(o.kind in ("collective", "send", "recv")
                   for ops in cls.streams.values() for o in ops):
                self._load[cls.id] = _GpuLoad(changed=env.event())
            else:
                self._load.pop(cls.id, None)
        # Classes with side-stream kernels (Op.side_kernel) run their compute ops one at a
        # time: one SM turn each, granted in the order the ops become ready.
        self._sm_turn = {cls.id: simpy.Resource(env, capacity=1) for cls in program.classes
                         if any(o.side_kernel for ops in cls.streams.values() for o in ops)}
        # Track running compute only where a marked collective will ask (Hopper).
        self.running_compute.enabled = self.arch in BLOCKING_ARCHS and any(
            o.launch_behind_compute for o in program.ops)
        class_of = program.class_of_rank()
        self._needed.clear()   # rank classes are the program's
        self._step_factor = {} if self.jitter is None else self.jitter.factors(
            self._step, ((c.id, len(c.members)) for c in program.classes))
        # The host issues each class's ops in program order without waiting for the GPU,
        # except where the host-clock rule (sim.engine.host_clock) makes it wait for an op to
        # finish: one host-clock process per class publishes each op's issue time.
        self._issue_time: dict[int, float] = {}
        self._issue_wait: dict[int, simpy.Event] = {}
        self._t0 = t0
        self._finished: dict[int, float] = {}
        rendezvous: dict[str, _Rendezvous] = {}
        bg = program.background_streams
        procs = [
            env.process(self._stream(program, cls, ops, done, class_of, rendezvous))
            for cls in program.classes
            for name, ops in cls.streams.items() if name not in bg
        ]
        for cls in program.classes:
            for name in sorted(bg):
                if cls.streams.get(name):
                    self._start_background(program, cls, name, done, class_of, rendezvous)
        for cls in program.classes:
            env.process(self._host_clock(host_issues(issue_order(cls)), done))
        with paused_gc():
            run_until(env, simpy.AllOf(env, procs))
        self._step += 1
        return env.now - t0

    def _start_background(self, program: Program, cls: RankClass, name: str,
                          done: dict[int, simpy.Event], class_of: dict[int, int],
                          rendezvous: dict[str, _Rendezvous]) -> None:
        """Run this step's ops of background stream ``name`` of ``cls`` after the ones earlier
        steps put there (a background thread's queue); the step does not wait for them."""
        key = (cls.id, name)
        previous = self._background.get(key)
        body = self._stream(program, cls, cls.streams[name], done, class_of, rendezvous,
                            background=(self._issue_time, self._issue_wait, self._finished,
                                        self._step))

        def queued() -> Generator[simpy.Event, object, None]:
            if previous is not None and previous.is_alive:
                yield previous
            yield from body
        self._background[key] = self.env.process(queued())

    def drain_background(self) -> float:
        """Run until every background stream has finished (the last asynchronous write of a
        run, after its last step); returns the time they end."""
        alive = [p for p in self._background.values() if p.is_alive]
        if alive:
            with paused_gc():
                self.env.run(until=simpy.AllOf(self.env, alive))
        return self.env.now

    def _stream(self, program: Program, cls: RankClass, ops: list[Op],
                done: dict[int, simpy.Event], class_of: dict[int, int],
                rendezvous: dict[str, _Rendezvous],
                background: tuple[dict[int, float], dict[int, simpy.Event], dict[int, float],
                                  int] | None = None
                ) -> Generator[simpy.Event, object, None]:
        """Run one stream's ops in order. ``background``: the issuing step's tables (issue
        times, their waits, ends) and index, for a background stream that may run on into
        later steps (:meth:`_start_background`)."""
        env = self.env
        obs = self.observer
        issue_times, issue_waits, finished, step = background or (
            self._issue_time, self._issue_wait, self._finished, self._step)
        for op in ops:
            pending = [ev for ev in (done[d.index] for d in op.deps)
                       if ev.callbacks is not None]   # not processed yet
            if pending:
                yield AllDone(env, pending)
            met = env.now          # its inputs are there; what follows waits for the host
            issued = issue_times.get(op.index)
            if issued is None:
                wait = issue_waits.setdefault(op.index, env.event())
                yield wait
                issued = issue_times[op.index]
            if issued > env.now:
                yield env.timeout(issued - env.now)
            ready = env.now
            if op.kind in ("collective", "send", "recv"):
                if op.launch_behind_compute:   # Hopper, Blackwell: SMs when the compute ends
                    beside = self.running_compute.beside(cls.id, op, env)
                    if beside:
                        yield AllDone(env, beside)
                start = yield from self._collective(cls, op, class_of, rendezvous)
            else:
                turn = self._take_sms(cls, op)
                if turn is not None:
                    yield turn
                start = env.now
                for cat, nbytes in op.alloc:
                    obs.on_memory(cls, start, cat, nbytes, op)
                if op.transient:
                    obs.on_memory(cls, start, "buffers", op.transient, op)
                if op.host_transfer is not None:
                    yield from self._host_transfer(cls, op)
                else:
                    yield from self._run_compute(cls, op)
                if turn is not None:
                    self._sm_turn[cls.id].release(turn)
            end = env.now
            if op.transient and op.kind in ("compute", "copy"):
                obs.on_memory(cls, end, "buffers", -op.transient, op)
            for cat, nbytes in op.free:
                obs.on_memory(cls, end, cat, -nbytes, op)
            if background is not None:
                obs.on_background_op(cls, op, ready, start, end, step, ready - met)
            else:
                obs.on_op(cls, op, ready, start, end, self._step, ready - met)
            self.events_processed += 1
            if self.progress is not None and self.events_processed % PROGRESS_EVERY == 0:
                self.progress(self.events_processed)
            finished[op.index] = end
            done[op.index].succeed()

    def _host_clock(self, issues: Iterator[HostIssue], done: dict[int, simpy.Event]
                    ) -> Generator[simpy.Event, object, None]:
        """The host thread of one rank class: issues its ops as :mod:`sim.engine.host_clock` says,
        waiting (in simulated time) for the ops ``issues`` names to finish. Runs ahead of
        simulated time and waits only when blocked."""
        t = self._t0
        finished = self._finished
        issue_wait = self._issue_wait
        issued = self._issue_time
        factor = self.host_cpu_factor
        for op, sync, launches in issues:
            sync_end = launch_end = -math.inf
            if sync is not None:
                if not done[sync.index].processed:
                    yield done[sync.index]
                sync_end = finished[sync.index]
            for head in launches:
                if not done[head.index].processed:
                    yield done[head.index]
                end = finished[head.index]
                if end > launch_end:
                    launch_end = end
            t = issue_time(t, sync_end, op.cpu_s * factor, launch_end)
            issued[op.index] = t
            wait = issue_wait.pop(op.index, None)
            if wait is not None:
                wait.succeed()

    def _host_transfer(self, cls: RankClass, op: Op) -> Generator[simpy.Event, object, None]:
        """Every member rank moves ``op.nbytes`` over its own route (GPU <-> host over PCIe,
        host <-> NVMe): one flow each, sharing the links max-min with all other traffic."""
        if op.nbytes <= 0:
            return
        key = (cls.id, op.host_transfer)
        plan = self._host_routes.get(key)
        fab = self.fabric
        if plan is None:
            routes: list[tuple[int, ...]] = []
            storage = self.storage
            for r in cls.members:
                if op.host_transfer in ("storage_write", "gpu_storage_write") \
                        and storage is not None:
                    routes.append(storage.route(r, op.host_transfer == "gpu_storage_write"))
                elif op.host_transfer == "gpu_storage_write":   # to the node's NVMe
                    node = r // fab.spec.gpus_per_node
                    routes.append(fab.route_to_host(r) + fab.route_nvme(node, "write"))
                elif op.host_transfer == "h2d":
                    routes.append(fab.route_from_host(r))
                elif op.host_transfer == "d2h":
                    routes.append(fab.route_to_host(r))
                else:
                    node = r // fab.spec.gpus_per_node
                    routes.append(fab.route_nvme(node, "read" if op.host_transfer == "nvme_read"
                                                 else "write"))
            flat = np.fromiter((i for rt in routes for i in rt), dtype=np.int64)
            lengths = np.array([len(rt) for rt in routes], dtype=np.int64)
            latency = max(fab.path_latency(rt) for rt in routes)
            plan = self._host_routes[key] = (flat, lengths, latency)
        flat, lengths, latency = plan
        n = len(lengths)
        cap = (self.storage.flow_cap if self.storage is not None
               and op.host_transfer in ("storage_write", "gpu_storage_write") else np.inf)
        yield self.env.timeout(latency)
        yield self.net.start_group(flat, lengths, np.full(n, float(op.nbytes)), np.ones(n),
                                   np.full(n, cap), tag=op)

    def _classes_needed(self, op: Op, class_of: dict[int, int]) -> frozenset[int]:
        """The rank classes that must reach ``op`` before it starts. Builders hand every
        micro-batch's collective the same group (or pairs) tuple, so the answer is kept per
        tuple object: at 16,384 GPUs a group is thousands of ranks, walked once."""
        members: object = op.pairs if op.kind in ("send", "recv") else (op.groups or op.group)
        cache_key = (op.kind, id(members))
        hit = self._needed.get(cache_key)
        if hit is not None and hit[0] is members:
            return hit[1]
        if op.kind == "collective":
            ranks = [r for g in op.all_groups for r in g]
        elif op.kind == "send":
            ranks = [s for s, _ in op.pairs]
        else:
            ranks = [r for p in op.pairs for r in p]
        needed = frozenset(class_of[r] for r in ranks)
        self._needed[cache_key] = (members, needed)
        return needed

    def _collective(self, cls: RankClass, op: Op, class_of: dict[int, int],
                    rendezvous: dict[str, _Rendezvous]) -> Generator[simpy.Event, object, float]:
        """Wait for every class of the group, then run the transfer once for all of them."""
        env = self.env
        rv = rendezvous.get(op.key)
        if rv is None:
            rv = _Rendezvous(needed=set(self._classes_needed(op, class_of)),
                             launched=env.event())
            rendezvous[op.key] = rv
        rv.arrived.add(cls.id)
        for cat, nbytes in op.alloc:
            self.observer.on_memory(cls, env.now, cat, nbytes, op)
        if rv.arrived >= rv.needed and not rv.launched.triggered:
            rv.start = env.now
            if op.kind == "collective":
                assert op.collective is not None
                # A fused kernel (Op.sm_ctas) copies with its own SMs, not NCCL's
                # channels (sim.fabric.collectives.fused_kernel).
                body = self.collectives.run_collective_groups(
                    op.collective, op.all_groups, op.nbytes, tag=op, peer_bytes=op.peer_bytes,
                    fused_sms=op.sm_ctas, fused_kernel=op.fused_kernel)
            else:
                body = self.collectives.run_p2p(op.pairs, op.nbytes, tag=op)
            self.hbm_share.collective_started(op.key, op, rv.needed)
            rv.launched.succeed(env.process(body))
        # The NCCL kernel holds its SMs from its launch on this GPU, waiting for the peers
        # included; it moves data (HBM traffic) once every member has arrived.
        need = self._comm_load(op)
        self._change_load(cls.id, need.ctas, 0.0, holders=1)
        proc = yield rv.launched
        assert isinstance(proc, simpy.Process)
        self._change_load(cls.id, 0, need.hbm_bytes_per_s)
        yield proc
        self._change_load(cls.id, -need.ctas, -need.hbm_bytes_per_s, holders=-1)
        if not rv.reported:
            rv.reported = True
            self.hbm_share.collective_ended(op.key)
            self.observer.on_collective(op, proc.value)
        return rv.start
