"""The host clock: when a rank class's host thread issues each of its ops.

One rule, used by the engine (:meth:`sim.engine.Engine.run_step` runs it against simulated
ends) and by the planner's lower bound (:func:`sim.plan._earliest_schedule` runs it against
the earliest schedule's ends), so a change here changes both.

A framework's Python thread issues a rank class's ops one after another in program order,
spending each op's ``cpu_s`` on the way; CUDA launches are asynchronous, so it does not wait
for the GPU (CUDA C++ Programming Guide, "Asynchronous Concurrent Execution"), except

- after an op marked ``host_sync`` (``torch.cuda.synchronize``, a blocking ``.item()``):
  nothing after it is issued before it has finished;
- when a stream's launch queue is full: a launch that would leave more than
  :data:`LAUNCH_QUEUE_KERNELS` kernels issued and unfinished on its stream blocks until
  enough of that stream's oldest ops have finished (a stream runs its work in order).

Which ops the host waits for depends only on the program (its order, kernel counts and
``host_sync`` flags), never on timings: :func:`host_issues` lists them once, and
:func:`issue_time` is the clock's arithmetic given their ends. The module holds no simpy
state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from sim.program import Op, RankClass

# Pending kernel launches a CUDA stream queues before a launch blocks the host thread: about
# 1,000 per stream, measured by launching 10,000 short kernels (Stack Overflow question
# 53970187, "CUDA stream is blocked when launching many kernels (>1000)", and the same report
# on the NVIDIA developer forum; with 3 streams each took 1,000). It bounds how far the host
# can run ahead of the GPU, and so how many prefetched all-gathers a framework without its
# own limit (FairScale, DeepSpeed ZeRO-3) can have in flight. We take 1,024.
LAUNCH_QUEUE_KERNELS = 1024

# Stream of host work (a CPU optimizer step): it runs on the CPU and launches no kernel.
CPU_STREAM = "cpu"


@dataclass(frozen=True, slots=True)
class HostIssue:
    """What the host waits for before it issues ``op``."""

    op: Op
    sync: Op | None
    """The ``host_sync`` op issued just before ``op``: the host waits for its end before it
    spends ``op.cpu_s``. None when the previous op does not synchronise."""
    launches: tuple[Op, ...]
    """Ops of ``op``'s stream, oldest first, whose ends free the launch-queue room ``op``
    needs: the host waits for them after spending ``op.cpu_s``. Empty when there is room."""


def issue_order(cls: RankClass) -> list[Op]:
    """The ops of rank class ``cls`` in the order its host issues them: program order."""
    return sorted((o for ops in cls.streams.values() for o in ops), key=lambda o: o.index)


def launched_kernels(op: Op) -> int:
    """CUDA kernels issuing ``op`` puts on its stream's launch queue (none for host work)."""
    return 0 if op.stream == CPU_STREAM else op.kernels


def host_issues(order: Iterable[Op]) -> list[HostIssue]:
    """What the host waits for before issuing each op of ``order`` (one rank class's ops in
    program order, :func:`issue_order`), in that order."""
    queues: dict[str, deque[Op]] = {}
    pending: dict[str, int] = {}
    out: list[HostIssue] = []
    sync: Op | None = None
    for op in order:
        launches: tuple[Op, ...] = ()
        k = launched_kernels(op)
        if k:
            stream = op.stream
            queue = queues.get(stream)
            if queue is None:
                queue = queues[stream] = deque()
            n = pending.get(stream, 0) + k
            if n > LAUNCH_QUEUE_KERNELS and queue:
                freed: list[Op] = []
                while queue and n > LAUNCH_QUEUE_KERNELS:
                    head = queue.popleft()
                    freed.append(head)
                    n -= launched_kernels(head)
                launches = tuple(freed)
            queue.append(op)
            pending[stream] = n
        out.append(HostIssue(op, sync, launches))
        sync = op if op.host_sync else None
    return out


def issue_time(host_free: float, sync_end: float, cpu_s: float, launch_end: float) -> float:
    """When the host issues an op.

    Parameters
    ----------
    host_free
        When the host finished issuing the previous op (the step's start for the first).
    sync_end
        End of :attr:`HostIssue.sync` (``-inf`` if none).
    cpu_s
        The op's CPU seconds (:attr:`sim.program.Op.cpu_s`).
    launch_end
        The latest end of :attr:`HostIssue.launches` (``-inf`` if none).
    """
    t = host_free if host_free >= sync_end else sync_end
    t += cpu_s
    return t if t >= launch_end else launch_end
