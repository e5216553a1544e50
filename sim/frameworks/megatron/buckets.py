"""Megatron-Core's gradient and parameter buckets (``megatron/core/distributed``).

* ``DistributedDataParallel._allocate_buffers_for_parameters`` (``distributed_data_parallel.py``)
  turns bucketing off (one bucket for the whole model chunk) on every pipeline stage but the
  first (``if pp_rank > 0: self.bucket_size = None``: "data-parallel communication on these
  stages is not on the critical path") and when ``disable_bucketing`` is set, which
  ``megatron/training/training.py`` ``get_model`` does for every model chunk after the first
  (``disable_bucketing=(model_chunk_idx > 0)``). Without ``overlap_grad_reduce`` the bucket size
  is None too (one bucket). The default size is ``max(40M, 1M x dp x cp)`` parameters.
* ``_ParamAndGradBuffer.__init__`` (``param_and_grad_buffer.py``) walks the parameters in
  reverse registration order (about the order backward produces their gradients) and closes a
  bucket once it holds at least ``bucket_size`` elements. Here the unit is a block: the output
  layer (with the final norm), each transformer layer, the embedding.
* With ``overlap_grad_reduce`` a bucket's reduce is launched by the backward hook of its last
  gradient in the last micro-batch (``register_grad_ready``), else all after the schedule
  (``finalize_model_grads``).
* With the distributed optimizer and ``overlap_param_gather`` the updated parameters are
  all-gathered per bucket in the next step's forward pre-hooks (``_make_forward_pre_hook`` ->
  ``finish_param_sync``: dispatch the bucket's gather if not yet dispatched, wait for it, then
  dispatch the next bucket's), not after the optimizer. With ``align_param_gather``
  (``training.py`` sets ``config.param_sync_func``, and ``_finish_param_sync_for_bucket_group``
  then skips dispatching the next bucket) the interleaved schedule dispatches every bucket of
  model chunks 0 and 1 on every stage before its first receive ("we launch asynchronous
  communication at the same time across the pipeline-parallel group") and chunk c >= 2 at the
  forward of virtual micro-batch ``k`` with ``k + pp_rank`` the first of chunk c - 1
  (``schedules.py``, ``param_sync_func``). Megatron-LM's ``--no-align-param-gather`` defaults
  it on, but ``validate_args`` turns it off without virtual stages, and the non-interleaved
  schedules never call ``param_sync_func``; Megatron-Bridge's ``CommOverlapConfig`` turns it
  on with pp > 1 and vp > 1 (``comm_overlap.py`` ``_get_optimizer_overlap_cfgs``).
* ``overlap_param_gather_with_optimizer_step`` (interleaved only, ``validate_args``):
  ``get_megatron_optimizer`` gives model chunk 0 its own optimizer, and
  ``ChainedOptimizer._step`` dispatches chunk 0's gathers (``start_param_sync(force_dispatch
  =True)``) right after stepping it, beside the other chunks' optimizer steps; the schedule's
  own dispatch of chunk 0 is then skipped (``DistributedDataParallel.start_param_sync``).
* ``num_distributed_optimizer_instances`` k > 1 (partial distributed optimizer,
  ``parallel_state.py`` ``initialize_model_parallel``): the dp-cp group splits into k
  contiguous intra-instance groups; ``_ParamAndGradBucketGroup.start_grad_sync``
  reduce-scatters each bucket in its intra-instance group, then all-reduces the local shard
  across the instances (ranks at the same place in each), both on the communication stream;
  parameters are all-gathered in the intra-instance group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.pipeline import Placement
from sim.program.ir import NcclType, Op
from sim.scenario import MegatronOptions

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape

DEFAULT_BUCKET_PARAMS = 40_000_000   # max(40M, 1M x dp x cp): training.py get_model


@dataclass
class Bucket:
    """One bucket of one model chunk; ``parts`` in backward order: ``head``, layer numbers,
    ``embed``."""

    v: int
    params: float
    parts: list[int | str] = field(default_factory=list)


def data_parallel_modes(ctx: JobContext, opts: MegatronOptions, vp: int, dp_cp: int
                        ) -> tuple[bool, int]:
    """Effective ``align_param_gather`` and the optimizer instance count, refusing what
    Megatron-LM refuses. Megatron-LM's ``--no-align-param-gather`` defaults it on;
    ``validate_args`` turns it off without virtual stages (the non-interleaved schedules
    never call ``param_sync_func``) and allows ``overlap_param_gather_with_optimizer_step``
    only with interleaving, the distributed optimizer and ``overlap_param_gather``."""
    ctx.require(not opts.overlap_param_gather_with_optimizer_step
                or (vp > 1 and opts.distributed_optimizer and opts.overlap_param_gather),
                "framework.overlap_param_gather_with_optimizer_step",
                "needs the interleaved schedule (parallelism.vp > 1), distributed_optimizer and "
                "overlap_param_gather (Megatron-LM validate_args)")
    k = opts.num_distributed_optimizer_instances
    ctx.require(k == 1 or (opts.distributed_optimizer and dp_cp % k == 0),
                "framework.num_distributed_optimizer_instances",
                f"{k} optimizer instances need the distributed optimizer and must divide "
                f"dp x cp = {dp_cp} (parallel_state.py)")
    return vp > 1 and opts.align_param_gather is not False, k


def instance_groups(groups: tuple[tuple[int, ...], ...], k: int
                    ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(intra-instance, inter-instance) groups of dp-cp ``groups`` with k optimizer instances.

    >>> instance_groups(((0, 1, 2, 3),), 2)
    (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    """
    size = len(groups[0]) // k
    intra = tuple(g[i * size:(i + 1) * size] for g in groups for i in range(k))
    inter = tuple(g[j::size] for g in groups for j in range(size)) if k > 1 else ()
    return intra, inter


def bucket_size(size: int | None, overlap_grad_reduce: bool, dp_cp: int) -> int | None:
    """The DDP config's bucket size in parameters (None: one bucket)."""
    if not overlap_grad_reduce:
        return None
    return size or max(DEFAULT_BUCKET_PARAMS, 1_000_000 * dp_cp)


def assign_buckets(st: int, p: int, vp: int, chunks: list[list[int]], layer_params: float,
                   emb_params: float, head_params: float, size: int | None,
                   place: Placement | None = None) -> list[Bucket]:
    """Buckets of stage ``st``, every model chunk, as Megatron-Core assigns them.
    ``place``: which virtual stages are the stage's chunks, and which take the input or end
    a pipeline (default Megatron-Core's loop).

    Examples
    --------
    Two stages, two chunks each, 4 layers of 30M parameters per chunk, 40M buckets: only the
    first stage's first chunk is split.

    >>> ch = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    >>> [(b.v, b.parts) for b in assign_buckets(0, 2, 2, ch, 30e6, 10e6, 10e6, 40_000_000)]
    [(0, [3, 2]), (0, [1, 0]), (0, ['embed']), (2, [11, 10, 9, 8])]
    >>> [len(assign_buckets(1, 2, 2, ch, 30e6, 10e6, 10e6, 40_000_000))]
    [2]
    """
    pl = place if place is not None else Placement(p, vp)
    out: list[Bucket] = []
    for c in range(vp):
        v = pl.virtual(st, c)
        parts: list[tuple[int | str, float]] = []
        if pl.is_last(v):
            parts.append(("head", head_params))
        parts += [(layer, layer_params) for layer in reversed(chunks[v])]
        if pl.is_first(v):
            parts.append(("embed", emb_params))
        limit = size if (st == 0 and c == 0) else None
        cur = Bucket(v, 0.0)
        for name, k in parts:
            cur.parts.append(name)
            cur.params += k
            if limit is not None and cur.params >= limit:
                out.append(cur)
                cur = Bucket(v, 0.0)
        if cur.parts:
            out.append(cur)
    return out


@dataclass
class StageBuckets:
    """What one stage's buckets add to the program."""

    grads: list[Op] = field(default_factory=list)
    """Each bucket's gradient reduce."""
    gathers: list[Op] = field(default_factory=list)
    """With ``overlap_param_gather``: each bucket's parameter all-gather in the forward."""
    prologue: list[Op] = field(default_factory=list)
    """Gathers the schedule dispatches before anything else (``align_param_gather``)."""


@dataclass
class BucketComms:
    """How a stage's bucket collectives are built and where they hook into its units."""

    groups: tuple[tuple[int, ...], ...]
    reduce_op: str
    grad_bytes: float
    inter_groups: tuple[tuple[int, ...], ...]
    """With k > 1 distributed-optimizer instances: the groups that all-reduce each shard."""
    param_bytes: float
    grad_dtype: NcclType
    """NCCL types of the gradient reduces and parameter gathers (of ``grad_bytes`` and
    ``param_bytes`` per element)."""
    param_dtype: NcclType
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    align_param_gather: bool
    """Effective (interleaved schedule only)."""
    gather_with_optimizer: bool
    """``overlap_param_gather_with_optimizer_step`` (interleaved schedule only)."""
    part_op: Callable[[str, int, int, int | str], Op]
    """(F|B, virtual stage, micro-batch, part) -> the forward's first op of the part (its
    pre-hook) or the backward's last op of the part (its gradients are ready)."""
    first_op: Callable[[str, int, int], Op]
    key: Callable[[], str]
    cpu_s: float
    launch_after: dict[int, list[Op]]
    """id(op) -> ops the host issues right after it (filled in)."""
    insert_before: dict[int, list[Op]]
    """id(op) -> ops the host issues right before it (filled in)."""


def bucket_ops(st: int, p: int, vp: int, m: int, buckets: list[Bucket],
               forwards: list[tuple[str, int, int]], c: BucketComms) -> StageBuckets:
    """The gradient reduces and (``overlap_param_gather``) parameter gathers of stage
    ``st``'s buckets, hooked where Megatron-Core issues and waits for them; ``forwards``:
    the stage's forward units in schedule order."""
    out = StageBuckets()
    hooks: list[Op] = []
    for b in buckets:
        g = Op(name=f"grad {c.reduce_op} bucket v{b.v} {b.parts[-1]}", kind="collective",
               stream="dp", phase="comm", collective=c.reduce_op,  # type: ignore[arg-type]
               group=c.groups[0], groups=c.groups, nbytes=c.grad_bytes * b.params,
               dtype=c.grad_dtype,
               key=c.key(), category=c.reduce_op, cpu_s=c.cpu_s)
        out.grads.append(g)
        chain = [g]
        if c.inter_groups:
            chain.append(Op(name=f"grad all_reduce instances bucket v{b.v} {b.parts[-1]}",
                            kind="collective", stream="dp", phase="comm", deps=[g],
                            collective="all_reduce", group=c.inter_groups[0],
                            groups=c.inter_groups,
                            nbytes=c.grad_bytes * b.params / len(c.groups[0]), key=c.key(),
                            dtype=c.grad_dtype,
                            category="all_reduce", cpu_s=c.cpu_s))
            out.grads.append(chain[-1])
        if c.overlap_grad_reduce:
            done = c.part_op("B", b.v, m - 1, b.parts[-1])
            g.deps = [done]
            c.launch_after.setdefault(id(done), []).extend(chain)
        if not c.overlap_param_gather:
            continue
        gather = Op(name=f"param all_gather bucket v{b.v} {b.parts[-1]}", kind="collective",
                    stream="dp", phase="comm", collective="all_gather", group=c.groups[0],
                    groups=c.groups, nbytes=c.param_bytes * b.params, key=c.key(),
                    dtype=c.param_dtype,
                    category="all_gather", cpu_s=c.cpu_s)
        out.gathers.append(gather)
        # The pre-hook of the bucket's first part in forward (its last in backward order),
        # in the chunk's first micro-batch, waits for the gather.
        hook = c.part_op("F", b.v, 0, b.parts[-1])
        hook.deps = list(hook.deps) + [gather]
        hooks.append(hook)
    by_chunk: dict[int, list[tuple[Op, Op]]] = {}
    for b, gather, hook in zip(buckets, out.gathers, hooks, strict=False):
        by_chunk.setdefault(b.v // p, []).insert(0, (gather, hook))   # forward order
    for chunk, pairs in by_chunk.items():
        if c.gather_with_optimizer and chunk == 0:
            # Dispatched after chunk 0's optimizer step; the builder starts the step there.
            out.prologue[:0] = [g for g, _ in pairs]
        elif not c.align_param_gather:
            # Lazy: the first bucket at its own pre-hook, each next one when the forward
            # reaches the bucket before it (finish_param_sync dispatches the next).
            for i, (gather, hook) in enumerate(pairs):
                at = c.insert_before.setdefault(id(hook), [])
                if i == 0:
                    at.append(gather)
                if i + 1 < len(pairs):
                    at.append(pairs[i + 1][0])
        elif chunk < 2:
            out.prologue.extend(g for g, _ in pairs)     # before the stage's first receive
        else:
            _, fc, fmb = forwards[(chunk - 1) * p - st]
            first = c.first_op("F", fc * p + st, fmb)
            c.insert_before.setdefault(id(first), []).extend(g for g, _ in pairs)
    return out


def expert_groups(s: MegatronShape, st: int) -> tuple[tuple[int, ...], ...] | None:
    """Stage ``st``'s expert-data-parallel groups; None when there is nothing to reduce (no
    experts on the stage, or expert-dp 1)."""
    if s.moe is None or s.moe.edp == 1 or not s.stage_expert_params(st):
        return None
    return s.moe.edp_groups(st)


def expert_buckets(s: MegatronShape, st: int, size: int | None) -> list[Bucket]:
    """The routed experts' buckets of stage ``st``: Megatron-Core's DDP packs the expert
    parameters into their own buffers with the same bucket size and the same rule (split only
    on the first stage's first chunk), in backward order of their layers."""
    if s.moe is None:
        return []
    moe = s.moe
    chunks = [[la for la in ch if moe.is_moe(la)] for ch in s.chunks]
    if s.mtp is not None:   # the modules' layers, after the last chunk's (each's)
        for v, ch in enumerate(chunks):
            if s.place.is_last(v):
                ch += [la for la in s.mtp.layers if moe.is_moe(la)]
    out = []
    for b in assign_buckets(st, s.p, s.vp, chunks, moe.expert_params, 0.0, 0.0, size,
                            s.place):
        b.parts = [x for x in b.parts if isinstance(x, int)]
        if b.parts:
            out.append(b)
    return out
