"""Several jobs' programs as one: each job's ranks moved onto the nodes it is placed on, its
rank classes and collective keys kept apart, so one engine runs them all on one fabric.

What changes in each job's program (in place: build a fresh one per merge):

* ranks: job rank ``r`` becomes cluster rank ``nodes[r // gpus_per_node] * gpus_per_node +
  r % gpus_per_node`` in every class's members, collective group and send/recv pair. A tuple
  shared by several ops stays shared (the engine caches routes by a tuple's identity);
* rank classes: renumbered after the previous jobs' (ids stay unique: the engine keeps each
  class's GPU load by id), labels prefixed ``job/``;
* collective keys: prefixed ``job:``, so two jobs' identical collectives meet in two
  rendezvous, never one;
* op indices: the job's ops follow the previous jobs' in its own order (each class's host
  issues its ops in index order, so the order inside a job is unchanged);
* a start offset ``start_s`` > 0: a leading host op of that duration on each of the job's
  classes, first in its issue order, that the host waits for (``host_sync``): nothing of the
  job is issued before ``start_s``. It launches no kernel and holds no GPU share;
* several steps (``JobPart.more``: the same job built again, one program per further step):
  each step's ops join the first step's rank classes' streams, keys prefixed ``job:k:``, after
  a barrier on each class (a host op, ``host_sync``, that depends on the last op of every
  stream of the job's previous step): what :meth:`sim.engine.core.Engine.run_step` does
  between steps (the next starts when the last op of the previous has ended), for this job
  alone.

GPUs no job is placed on form one idle rank class with no ops (:meth:`Program.validate` wants
every rank covered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sim.program.ir import CPU_STREAM, Op, Program, RankClass

START_WAIT = "job-start-wait"
"""Name of the leading op that holds a job until its ``start_s``."""
STEP_BARRIER = "job-step-barrier"
"""Name of the op that holds a job's next step until its previous one has ended."""


@dataclass
class JobPart:
    """One job to merge: its program and where it runs."""

    name: str
    program: Program
    nodes: tuple[int, ...]
    """Cluster nodes of the job's nodes 0, 1, ... in order."""
    start_s: float = 0.0
    more: list[Program] = field(default_factory=list)
    """The job built again, once per further step (same classes in the same order)."""


@dataclass
class JobSlice:
    """Where one job sits in the merged program."""

    name: str
    classes: list[RankClass]
    ops: list[Op]
    """The job's own ops in merged index order (start waits left out)."""
    waits: list[Op] = field(default_factory=list)
    """The start-wait and step-barrier ops the merge added (not the job's own work)."""
    ranks: tuple[int, ...] = ()
    """The cluster ranks the job runs on."""
    start_s: float = 0.0
    program: Program | None = None
    """The job's program (relabelled: it shares its classes and ops with the merged one)."""
    steps: int = 1


def rank_map(nodes: Sequence[int], gpus_per_node: int) -> list[int]:
    """Cluster rank of each job rank.

    Examples
    --------
    >>> rank_map([3, 1], 2)
    [6, 7, 2, 3]
    """
    return [n * gpus_per_node + g for n in nodes for g in range(gpus_per_node)]


class _Relabel:
    """Maps rank tuples through one job's rank map, one new tuple per old tuple object."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self._seen: dict[int, tuple[object, tuple]] = {}

    def __call__(self, t: tuple) -> tuple:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        out: tuple
        if t and isinstance(t[0], tuple):
            out = tuple(self(x) for x in t)
        else:
            out = tuple(self.ranks[r] for r in t)
        self._seen[id(t)] = (t, out)
        return out


def _relabel_ops(p: Program, move: _Relabel, prefix: str) -> None:
    for op in p.ops:
        if op.group:
            op.group = move(op.group)
        if op.groups:
            op.groups = move(op.groups)
        if op.pairs:
            op.pairs = move(op.pairs)
        op.key = f"{prefix}:{op.key}"


def merge(parts: Sequence[JobPart], n_ranks: int, gpus_per_node: int
          ) -> tuple[Program, list[JobSlice]]:
    """One program running every job of ``parts`` on a cluster of ``n_ranks`` GPUs.

    The merged program's per-step totals (tokens, FLOPs) are the jobs' sums; its
    ``pipeline_stages`` and ``micro_batches`` the largest (read per job from the slices).
    Raises ValueError when two jobs share a GPU or a job's nodes do not hold its ranks."""
    merged = Program(classes=[], n_ranks=n_ranks, tokens_per_step=0.0,
                     model_flops_per_step=0.0, hw_flops_per_step=0.0)
    slices: list[JobSlice] = []
    taken: set[int] = set()
    for part in parts:
        p = part.program
        ranks = rank_map(part.nodes, gpus_per_node)
        if len(ranks) != p.n_ranks:
            raise ValueError(f"job {part.name}: {p.n_ranks} ranks on {len(part.nodes)} nodes "
                             f"of {gpus_per_node} GPUs")
        if taken.intersection(ranks) or max(ranks) >= n_ranks:
            raise ValueError(f"job {part.name}: its nodes overlap another job's or the cluster")
        taken.update(ranks)
        move = _Relabel(ranks)
        _relabel_ops(p, move, part.name)
        offset = len(merged.classes)
        for c in p.classes:
            c.id += offset
            c.members = move(c.members)
            c.label = f"{part.name}/{c.label}" if c.label else part.name
        waits = _start_waits(p.classes, part.start_s)
        order = [*waits, *p.ops]
        for k, q in enumerate(part.more, start=1):
            _relabel_ops(q, move, f"{part.name}:{k}")
            barriers = _append_step(p.classes, q)
            waits += barriers
            order += [*barriers, *q.ops]
        for op in order:
            op.index = len(merged.ops)
            merged.ops.append(op)
        merged.classes.extend(p.classes)
        merged.tokens_per_step += p.tokens_per_step
        merged.model_flops_per_step += p.model_flops_per_step
        merged.hw_flops_per_step += p.hw_flops_per_step
        merged.micro_batches = max(merged.micro_batches, p.micro_batches)
        merged.pipeline_stages = max(merged.pipeline_stages, p.pipeline_stages)
        own = [op for op in order if op.name not in (START_WAIT, STEP_BARRIER)]
        slices.append(JobSlice(part.name, list(p.classes), own, waits, tuple(ranks),
                               part.start_s, p, 1 + len(part.more)))
    idle = tuple(r for r in range(n_ranks) if r not in taken)
    if idle:
        merged.classes.append(RankClass(id=len(merged.classes), members=idle, label="idle"))
    merged.meta["jobs"] = [s.name for s in slices]
    merged.validate()
    return merged, slices


def _start_waits(classes: list[RankClass], start_s: float) -> list[Op]:
    """A leading host wait of ``start_s`` on each class (none at 0)."""
    if start_s <= 0:
        return []
    waits = []
    for c in classes:
        op = Op(START_WAIT, "host", CPU_STREAM, "comm", duration=start_s, host_sync=True,
                kernels=0, category="wait")
        c.streams[CPU_STREAM] = [op, *c.streams.get(CPU_STREAM, [])]
        waits.append(op)
    return waits


def _append_step(classes: list[RankClass], q: Program) -> list[Op]:
    """Append step program ``q``'s streams to ``classes`` (its classes, in the same order,
    with the same members), each class's behind a barrier on the last op of every stream of
    every class so far (the previous step's ends). Returns the barriers."""
    if len(q.classes) != len(classes) or any(
            len(c.members) != len(qc.members) for c, qc in zip(classes, q.classes, strict=True)):
        raise ValueError("a job's steps built different rank classes")
    ends = [ops[-1] for c in classes for ops in c.streams.values() if ops]
    barriers = []
    for c, qc in zip(classes, q.classes, strict=True):
        barrier = Op(STEP_BARRIER, "host", CPU_STREAM, "comm", host_sync=True, kernels=0,
                     category="wait", deps=list(ends))
        c.streams.setdefault(CPU_STREAM, []).append(barrier)
        for stream, ops in qc.streams.items():
            c.streams.setdefault(stream, []).extend(ops)
        barriers.append(barrier)
    return barriers
