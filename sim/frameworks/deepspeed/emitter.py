"""The op emitter shared by the ZeRO builders: per-stream state (last op, ``wait_stream``
dependencies and host time owed to the next op) and helpers for kernels, collectives, host
transfers, host work and host waits."""

from __future__ import annotations

from collections.abc import Sequence

from sim.frameworks.deepspeed.host_costs import TORCH_CALL_CPU_S
from sim.hardware.compute import ComputeModel
from sim.program.ir import (
    CPU_STREAM,
    HOST_WAIT_STREAM,
    CollectiveOp,
    HostTransfer,
    NcclType,
    Op,
    Phase,
    Program,
    RankClass,
)


class _Emitter:
    """Adds ops to the one rank class of a pure data-parallel job, keeping per-stream state:
    the last op of each stream, dependencies owed to the next op of a stream
    (``wait_stream``), and host time owed to the next op issued."""

    def __init__(self, program: Program, cls: RankClass, cm: ComputeModel,
                 w16: NcclType = "bf16") -> None:
        self.program = program
        self.w16 = w16
        """NCCL type of the 16-bit model dtype (bf16, or f16 with fp16 training)."""
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
                   cpu_s: float = TORCH_CALL_CPU_S, dtype: NcclType | None = None,
                   **kw: object) -> Op | None:
        """A collective over ``groups`` (default: every rank); none on a single rank. Its
        tensor is of the 16-bit model dtype unless ``dtype`` says otherwise."""
        groups = groups or (self.group,)
        if len(groups[0]) <= 1:
            return None
        self._keys += 1
        return self.add(Op(name=name, kind="collective", stream=stream, phase="comm",
                           collective=coll, group=groups[0],
                           groups=groups if len(groups) > 1 else (), nbytes=nbytes,
                           dtype=dtype or self.w16,
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
        return self.add(Op(name=name, kind="host", stream=CPU_STREAM, phase=phase,
                           duration=seconds, deps=deps, host_sync=True, category=category))

    def host_wait(self, name: str, deps: Sequence[Op | None], phase: Phase = "comm") -> Op:
        """The host blocks until ``deps`` are done (event/stream/device synchronize)."""
        return self.add(Op(name=name, kind="compute", stream=HOST_WAIT_STREAM, phase=phase,
                           deps=[d for d in deps if d is not None], host_sync=True,
                           category="sync"))
