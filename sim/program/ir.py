"""The program: what each rank does in one training step, as streams of ops.

The framework schedule builders (:mod:`sim.frameworks`) produce a :class:`Program`; the engine
(:mod:`sim.engine.core`) runs it. Nothing here knows about time or the fabric.

* An :class:`Op` runs on one stream of one rank class: the compute stream, a named
  communication stream, a copy engine, or the host's own (:data:`CPU_STREAM`: work of the CPU,
  kind ``host``; :data:`HOST_WAIT_STREAM`: the host waiting on the GPU). Ops of one stream run
  in order; ``deps`` add cross-stream dependencies (CUDA events).
* A rank class stands for every rank that runs exactly the same ops at the same times (the
  data-parallel replicas of a pure data-parallel job, for example). It is simulated once; its
  collectives still name their full group of global ranks, so every member's flows go on the
  fabric.
* A collective starts when every rank class with a member in its group has reached it, as
  NCCL's kernels do; matching ops carry the same ``key``. A ``send`` is posted by its source
  classes alone (Megatron's pipeline sends are batched with the receiver's early receive);
  the receiver's ops depend on the send op itself.
* Memory: bytes allocated by category when an op starts, freed when it ends, and a transient
  working set held only while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OpKind = Literal["compute", "host", "collective", "send", "recv", "copy"]
"""What an op is. ``compute``: GPU kernels (``duration`` at full speed, slowed by the
collectives beside them). ``host``: work of the host CPU itself (an optimizer step on CPU
tensors, gradient accumulation into host memory): ``duration`` of CPU time, no kernel launched,
no share of the GPU's SMs or HBM. ``collective``, ``send``, ``recv``: NCCL transfers on the
fabric. ``copy``: a copy engine (device, host or NVMe transfers)."""
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
HostTransfer = Literal["h2d", "d2h", "nvme_read", "nvme_write", "storage_write",
                       "gpu_storage_write"]
Phase = Literal["fwd", "bwd", "recompute", "optimizer", "comm", "loss"]
NcclType = Literal["i8", "u8", "i32", "u32", "i64", "u64", "f16", "f32", "f64", "bf16",
                   "f8e4m3", "f8e5m2"]
"""NCCL's element types by the names its kernels carry (NCCL src/device/generate.py,
``all_tys``; ``ncclDataType_t`` in nccl.h)."""

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")

CPU_STREAM = "cpu"
"""The stream of a rank class's ``host`` ops (the CPU's own work, in program order)."""
HOST_WAIT_STREAM = "host"
"""The stream builders put the host's waits on (``torch.cuda.synchronize``, an event wait:
``host_sync`` ops that do no work); a profiler shows them on the CPU, not as kernels."""


@dataclass(eq=False)
class Op:
    """One operation of one rank class."""

    name: str
    kind: OpKind
    stream: str
    phase: Phase
    duration: float = 0.0
    """Compute and copy ops: GPU seconds at full speed on this GPU."""
    cpu_s: float = 0.0
    """CPU seconds the framework's host code spends issuing this op. The host issues a rank
    class's ops one after another in program order without waiting for the GPU, so an op
    cannot start before the host has issued it: small kernels become bound by the host."""
    kernels: int = 1
    """CUDA kernel launches this op stands for: the host may have at most
    ``engine.LAUNCH_QUEUE_KERNELS`` of them issued and not yet finished on one stream."""
    host_sync: bool = False
    """The host waits for this op to finish on the GPU before issuing anything after it
    (``torch.cuda.synchronize``, a blocking ``.item()``)."""
    deps: list[Op] = field(default_factory=list)
    collective: CollectiveOp | None = None
    group: tuple[int, ...] = ()
    """Global ranks taking part in a collective."""
    groups: tuple[tuple[int, ...], ...] = ()
    """Several disjoint groups running the same collective at once (the tensor-parallel
    groups of every replica of a folded rank class); empty means just ``group``."""
    pairs: tuple[tuple[int, int], ...] = ()
    """Send/recv: (source, destination) global ranks of every member's transfer."""
    nbytes: float = 0.0
    """Collective message size as nccl-tests counts it (all-reduce buffer, all-gather output,
    reduce-scatter input); bytes of each send/recv transfer, or of a copy."""
    key: str = ""
    """Identifies the matching op in the other rank classes of a collective."""
    alloc: tuple[tuple[str, float], ...] = ()
    free: tuple[tuple[str, float], ...] = ()
    transient: float = 0.0
    transient_parts: tuple[float, ...] = ()
    """The tensors making up ``transient`` (adding up to it), each a request to the caching
    allocator; empty: one request of ``transient`` bytes."""
    alloc_parts: tuple[float, ...] = ()
    """The tensors of the op's ``activations`` allocation when it is the saved tensors of a
    block (adding up to it), each a request to the caching allocator."""
    layer: int | None = None
    micro_batch: int | None = None
    flops: float = 0.0
    """Model FLOPs this op performs (no recomputation)."""
    hw_flops: float = 0.0
    """FLOPs the hardware performs (recomputation included)."""
    category: str = ""
    """What the op is, for plots and breakdowns: forward, backward, recompute, optimizer,
    all_gather, reduce_scatter, all_reduce, send_recv, copy."""
    index: int = -1
    """Position in the program, set by :meth:`Program.add`."""
    host_transfer: HostTransfer | None = None
    """A ``copy`` op that moves ``nbytes`` per member rank between GPU and host memory
    (``h2d``, ``d2h``) or between host memory and the node's NVMe drives (``nvme_read``,
    ``nvme_write``): it runs as flows on the fabric's PCIe/NVMe links instead of taking
    ``duration``. ``storage_write``: host memory to the checkpoint storage (the node's NVMe
    drives, or over its NIC and the network to a storage endpoint: the engine's
    ``storage``); ``gpu_storage_write``: GPU memory to that storage through host memory,
    streamed (a synchronous checkpoint save, :mod:`sim.program.checkpoint_ops`)."""
    peer_bytes: tuple[tuple[float, ...], ...] = ()
    """An ``all_to_all`` with uneven splits (``ncclSend``/``ncclRecv`` per peer, as
    ``torch.distributed.all_to_all_single`` with split sizes issues it): row ``i``, column
    ``j`` is the bytes the group's ``i``-th member sends to its ``j``-th (the diagonal stays on
    the GPU), the same for every group of ``groups``. Empty: ``nbytes`` split evenly over the
    ``n`` members (``nbytes / n`` to each peer, nccl-tests' all-to-all)."""
    sm_ctas: int = 0
    """A collective run by a fused kernel that holds a fixed number of SMs for its whole run
    (DeepEP's dispatch and combine: ``Buffer.set_num_sms``) instead of NCCL's channels: the
    SMs the interference model takes from compute beside it. 0: NCCL's own CTAs."""
    fused_kernel: str = ""
    """Which fused kernel runs a collective with ``sm_ctas`` SMs: ``""`` DeepEP's normal
    kernels (:mod:`sim.fabric.collectives.fused_kernel`), ``"hybridep"`` Hybrid-EP's TMA
    kernels (:mod:`sim.fabric.collectives.hybridep_kernel`)."""
    side_kernel: bool = False
    """A compute op on a side stream whose kernels take the GPU's SMs in turn with the
    compute stream's rather than beside them (the elementwise kernels Megatron-Core's combined
    1F1B runs on its communication stream): the engine runs it and the rank class's other
    compute ops one at a time. A Hopper GEMM's CTAs fill an SM's register file (three warp
    groups of 384 threads at 168 registers: 64,512 of 65,536), so a kernel launched beside a
    running GEMM gets no SM until the GEMM's CTAs retire (CUDA C++ Programming Guide,
    "Hardware Multithreading": blocks are resident only while registers and shared memory
    allow)."""
    launch_behind_compute: bool = False
    """A collective launched on a second hardware queue beside the compute stream (Megatron-Core's
    combined 1F1B with ``CUDA_DEVICE_MAX_CONNECTIONS`` above 1): on Hopper its kernel gets SMs
    only when the compute running when it becomes ready ends (:mod:`sim.engine.launch_wait`)."""
    dtype: NcclType | None = None
    """Collectives and sends: the element type NCCL moves (``nbytes`` is whole elements of
    it). A label only (the HTA trace's kernel names): it never feeds timing. None: not
    set by the builder."""

    @property
    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups or ((self.group,) if self.group else ())


@dataclass
class RankClass:
    """Ranks that run identical ops at identical times."""

    id: int
    members: tuple[int, ...]
    streams: dict[str, list[Op]] = field(default_factory=dict)
    initial_memory: dict[str, float] = field(default_factory=dict)
    """Bytes held before the step starts, by category (sharded parameters, optimizer states)."""
    label: str = ""
    compute_factor: float = 1.0
    """The class's compute kernels take this many times their ``duration`` (a straggler GPU,
    ``faults.slow_gpus``; set by :func:`sim.program.split.split_rank`). 1: full speed."""


@dataclass
class Program:
    """Every rank class's streams for one training step.

    What the analysis and the outputs read back is a typed field; ``meta`` holds the
    builder's free-form labels (``framework``, ``style``, ``schedule``, ZeRO options, ...)
    for people and tests, and nothing in the simulator reads it.
    """

    classes: list[RankClass]
    n_ranks: int
    tokens_per_step: float
    model_flops_per_step: float
    hw_flops_per_step: float
    micro_batches: int = 1
    """Micro-batches each data-parallel rank runs per step (gradient accumulation steps)."""
    pipeline_stages: int = 1
    """Pipeline-parallel stages; above 1 the summary and the timeline count pipeline bubbles."""
    meta: dict[str, object] = field(default_factory=dict)
    """Free-form labels, read by nobody in the simulator."""
    background_streams: frozenset[str] = frozenset()
    """Streams that run beside the steps (a background thread's queue, as an asynchronous
    checkpoint's writer): a step ends without waiting for them, and each runs its ops after
    those the previous steps put on the same stream of the same rank class."""
    _ops: list[Op] = field(default_factory=list)

    def add(self, cls: RankClass, op: Op) -> Op:
        op.index = len(self._ops)
        self._ops.append(op)
        cls.streams.setdefault(op.stream, []).append(op)
        return op

    @property
    def ops(self) -> list[Op]:
        return self._ops

    def class_of_rank(self) -> dict[int, int]:
        return {r: c.id for c in self.classes for r in c.members}

    def validate(self) -> None:
        """Checks that catch builder mistakes early: every rank in exactly one class,
        dependencies inside the program, collective groups covered by classes."""
        seen: set[int] = set()
        for c in self.classes:
            overlap = seen.intersection(c.members)
            if overlap:
                raise ValueError(f"ranks {sorted(overlap)[:4]} in two rank classes")
            seen.update(c.members)
        if seen != set(range(self.n_ranks)):
            raise ValueError("rank classes do not cover every rank exactly once")
        ids = {id(op) for op in self._ops}
        for op in self._ops:
            for d in op.deps:
                if id(d) not in ids:
                    raise ValueError(f"{op.name} depends on an op outside the program")
            if op.kind == "collective" and (not op.all_groups or not op.key):
                raise ValueError(f"collective {op.name} needs a group and a key")
            if op.peer_bytes and (op.collective != "all_to_all" or any(
                    len(row) != len(op.all_groups[0]) for row in op.peer_bytes)
                    or len(op.peer_bytes) != len(op.all_groups[0])):
                raise ValueError(f"{op.name}: peer_bytes is an all-to-all's group-size "
                                 "square matrix")
            if (op.kind == "host") != (op.stream == CPU_STREAM):
                raise ValueError(f"{op.name}: host work runs on stream {CPU_STREAM!r}, and "
                                 "only host work does")
