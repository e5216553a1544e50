"""The host clock: when a rank class's host thread issues each of its ops.

One rule, used by the engine (:meth:`sim.engine.core.Engine.run_step` runs it against simulated
ends) and by the planner's lower bound (:func:`sim.apps.plan.bound._earliest_schedule` runs it
against
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
from collections.abc import Iterable, Iterator

from sim.engine.time_grid import on_grid
from sim.program.ir import Op, RankClass

# Pending kernel launches a CUDA stream queues before a launch blocks the host thread: about
# 1,000 per stream, measured by launching 10,000 short kernels (Stack Overflow question
# 53970187, "CUDA stream is blocked when launching many kernels (>1000)", and the same report
# on the NVIDIA developer forum; with 3 streams each took 1,000). It bounds how far the host
# can run ahead of the GPU, and so how many prefetched all-gathers a framework without its
# own limit (FairScale, DeepSpeed ZeRO-3) can have in flight. We take 1,024.
LAUNCH_QUEUE_KERNELS = 1024


HostIssue = tuple[Op, Op | None, tuple[Op, ...]]
"""What the host waits for before it issues an op: ``(op, sync, launches)``.

``sync`` is the ``host_sync`` op issued just before ``op`` (None if the previous op does not
synchronise): the host waits for its end before it spends ``op.cpu_s``. ``launches`` are ops
of ``op``'s stream, oldest first, whose ends free the launch-queue room ``op`` needs: the
host waits for them after spending ``op.cpu_s`` (empty when there is room). A plain tuple:
the engine and the planner make one per op, and a dataclass made the planner's bound about a
tenth slower."""


def issue_order(cls: RankClass) -> list[Op]:
    """The ops of rank class ``cls`` in the order its host issues them: program order."""
    return sorted((o for ops in cls.streams.values() for o in ops), key=lambda o: o.index)


def host_issues(order: Iterable[Op]) -> Iterator[HostIssue]:
    """What the host waits for before issuing each op of ``order`` (one rank class's ops in
    program order, :func:`issue_order`), in that order.

    A generator: the engine and the planner use each entry once, and entries that die at
    once spare the garbage collector (kept in a list, they slowed the planner's bound on a
    58,000-op program by a third)."""
    queues: dict[str, deque[Op]] = {}
    pending: dict[str, int] = {}
    sync: Op | None = None
    for op in order:
        launches: tuple[Op, ...] = ()
        stream = op.stream
        k = 0 if op.kind == "host" else op.kernels   # host work launches no kernel
        if k:
            queue = queues.get(stream)
            if queue is None:
                queue = queues[stream] = deque()
            n = pending.get(stream, 0) + k
            while queue and n > LAUNCH_QUEUE_KERNELS:
                head = queue.popleft()
                launches += (head,)
                n -= head.kernels       # queued ops are never host work
            queue.append(op)
            pending[stream] = n
        yield op, sync, launches
        sync = op if op.host_sync else None


def issue_time(host_free: float, sync_end: float, cpu_s: float, launch_end: float) -> float:
    """When the host issues an op.

    Parameters
    ----------
    host_free
        When the host finished issuing the previous op (the step's start for the first).
    sync_end
        End of the op's ``sync`` (:data:`HostIssue`; ``-inf`` if none).
    cpu_s
        The op's CPU seconds (:attr:`sim.program.ir.Op.cpu_s`).
    launch_end
        The latest end of the op's ``launches`` (:data:`HostIssue`; ``-inf`` if none).
    """
    t = host_free if host_free >= sync_end else sync_end
    t += on_grid(cpu_s)
    return t if t >= launch_end else launch_end
