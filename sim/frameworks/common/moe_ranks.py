"""Each EP rank its own expert load under skewed routing: one rank class per load.

The builders that price a skewed routing (``training.routing``) through
:func:`sim.frameworks.common.moe_pace.routing_pace` make one rank class per pipeline stage
priced at the busiest EP rank's experts: the step's pace is right (every MoE layer's combine
all-to-all waits for the slowest rank), but a lightly loaded rank shows the busiest's GEMM
time and FLOPs. :func:`split_by_load` lifts that after the program is built, in the program
layer alone: each stage's class is split (:func:`sim.program.split.split_ranks`) into one
class per distinct expert load (ranks whose EP index holds the same per-expert token counts
run identical ops), and :func:`patch_experts` gives each class's grouped expert GEMMs that EP
rank's priced time and FLOPs (:class:`RankExperts`; over the ranks the FLOPs add up to the
balanced total: GEMM FLOPs are linear in rows). A framework adds what else differs by load
(Megatron: its expert-TP exchanges, :mod:`sim.frameworks.megatron.moe_ranks`).

The all-to-alls keep their shared key and per-peer matrix, so the engine's rendezvous makes
every class wait for the slowest at each dispatch and combine, as NCCL does: the busiest
class runs exactly the ops of the one-class program, and the step does not move.

Used by Megatron-Core's builder and torchtitan's FSDP2 + EP (:mod:`sim.frameworks.fsdp2.moe`).
DeepSpeed-MoE needs none: its experts run over the capacity-padded ``[e, c, h]`` buffer, the
same rows on every EP rank whatever the routing (:mod:`sim.frameworks.deepspeed.moe`).

Cost: a class per distinct load per stage. Up to :data:`MAX_CLASSES` classes in all the
split is made; beyond it (EP 64 over 16 stages would be 1,024 classes, each simulated) the
program keeps one class per stage priced at the busiest EP rank (``program.meta
["moe_rank_classes"]`` says which), memory included.

Memory: what a rank's experts save for backward and the buffers that hold the tokens it
receives follow its own load in each class, as they do on the GPU (Megatron-Core's
``MoEAlltoAllTokenDispatcher`` sizes the received tokens by the counts it gathered; the
grouped GEMMs save their inputs and fc1 outputs at those rows). :func:`patch_expert_memory`
does it where the expert GEMMs' op carries them (torchtitan); Megatron re-lays its units'
memory per load (:mod:`sim.frameworks.megatron.moe_rank_memory`). The busiest class keeps
the one-class program's memory, so the peak of the job does not move.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import Pace, priced_ranks
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op, Program, RankClass
from sim.program.split import split_ranks
from sim.workload.block_pricing import BlockCost
from sim.workload.moe_ops import MoELayerOps, MoELayout

MAX_CLASSES = 16
"""Most rank classes the split may leave in the program. Engine time grows about linearly with
the classes while the step time does not move (the slowest rank paces every all-to-all):
Mixtral 8x7B at pp 4 x ep 8 under Zipf s = 1 simulates in 3.3 s with 4 classes, 12.5 s with
32 (step 6.071 vs 6.068 s); GPT-OSS-120B at pp 4 x ep 16, 21 s with 4, 162 s with 64."""


@dataclass(frozen=True)
class RankExperts:
    """One EP rank's expert load and what it costs."""

    counts: tuple[int, ...]
    """Token copies each of its local experts receives (its GEMMs' rows)."""
    cost: BlockCost
    """Its grouped expert GEMMs, priced."""
    etp_gather_bytes: float
    """Bytes it adds to the expert-TP all-gather (its tokens, one expert-TP shard)."""
    ops: MoELayerOps | None = None
    """Its MoE layer ops (its expert block's saved tensors, its all-to-alls' receive sizes)."""


def rank_experts(ctx: JobContext, lay: MoELayout, tokens: int, cm: ComputeModel,
                 pace: Pace | None) -> tuple[RankExperts, ...]:
    """Every EP rank's load and priced experts under ``pace``'s routing (``()`` when
    balanced: every rank is alike). Priced as :func:`~.moe_pace.routing_pace` prices them,
    so the busiest rank's cost is the pace's."""
    if pace is None:
        return ()
    local = len(pace.loads) // lay.ep
    priced = priced_ranks(ctx, lay, tokens, cm, pace.loads, pace.peer_tokens)
    return tuple(RankExperts(tuple(pace.loads[j * local:(j + 1) * local]), cost,
                             ops.etp_gather_bytes, ops)
                 for j, (ops, cost) in enumerate(priced))


def experts_op_name(phase: str, layer: int, mb: int) -> str:
    """The name both builders give one layer's grouped expert GEMMs for one micro-batch."""
    return f"{phase} moe L{layer} mb{mb} experts"


def is_expert_gemm(op: Op) -> bool:
    """Whether ``op`` is a layer's grouped expert GEMMs: a compute op whose name is
    :func:`experts_op_name` of its own phase, layer and micro-batch (the IR has no tag
    field, so the name is checked against the op's structured fields, not a pattern)."""
    return (op.kind == "compute" and op.layer is not None and op.micro_batch is not None
            and op.name == experts_op_name(op.phase, op.layer, op.micro_batch))


Patch = Callable[[RankClass, RankExperts, int], None]
"""Gives one class (the ``k``-th of its stage) its load: ``patch(cls, load, k)``."""


def split_by_load(program: Program, ep_of: Mapping[int, int],
                  ranks: tuple[RankExperts, ...], patch: Patch,
                  limit: int | None = None) -> bool:
    """Split every class by its members' expert load (``ranks[ep_of[rank]]``) and ``patch``
    each part; returns whether it did (False: balanced, one load, or more than ``limit``
    classes, default :data:`MAX_CLASSES`)."""
    limit = MAX_CLASSES if limit is None else limit
    if len({r.counts for r in ranks}) <= 1:
        return False
    parts: list[tuple[RankClass, list[list[int]]]] = []
    for cls in list(program.classes):
        by: dict[tuple[int, ...], list[int]] = {}
        for r in cls.members:
            by.setdefault(ranks[ep_of[r]].counts, []).append(r)
        parts.append((cls, list(by.values())))
    if sum(len(p) for _, p in parts) > limit:
        program.meta["moe_rank_classes"] = "one per stage (busiest EP rank)"
        return False
    for cls, groups in parts:
        label = cls.label
        out = [cls] + [split_ranks(program, tuple(g)) for g in groups[1:]]
        for k, c in enumerate(out):
            load = ranks[ep_of[c.members[0]]]
            eps = ",".join(str(e) for e in sorted({ep_of[r] for r in c.members}))
            c.label = f"{label}, EP rank {eps} ({sum(load.counts)} expert rows)"
            patch(c, load, k)
    program.meta["moe_rank_classes"] = "one per stage and expert load"
    return True


def patch_experts(cls: RankClass, load: RankExperts, gpu_time: bool,
                  is_experts: Callable[[Op], bool] = is_expert_gemm,
                  busiest: BlockCost | None = None) -> None:
    """Give ``cls``'s expert GEMMs its own load's time and FLOPs (model FLOPs where the op
    counts them, hardware FLOPs likewise: a recomputation keeps none of the first).
    ``gpu_time``: the kernels' GPU time alone (Megatron, whose ops carry the host's issue
    time apart) or bounded by the host's issue time too (:attr:`BlockCost.fwd_s`).
    ``busiest``: the expert block the ops were priced at; what the builder added to an op
    beyond it (Megatron's ``moe_act`` recomputation inside the experts' backward) is kept,
    and a class at that block's load keeps its ops' time as built."""
    c = load.cost
    for ops in cls.streams.values():
        for op in ops:
            if not is_experts(op):
                continue
            bwd = op.phase == "bwd"
            if gpu_time:
                own = c.bwd_gpu_s if bwd else c.fwd_gpu_s
                was = None if busiest is None else \
                    (busiest.bwd_gpu_s if bwd else busiest.fwd_gpu_s)
            else:
                own = c.bwd_s if bwd else c.fwd_s
                was = None if busiest is None else (busiest.bwd_s if bwd else busiest.fwd_s)
            if was is None or op.duration == was:
                op.duration = own
            elif own != was:
                # The recomputed activation's time stays the busiest rank's (an elementwise
                # kernel over its rows: at most that much over a light rank's).
                op.duration = own + (op.duration - was)
            if op.flops:        # its own rows' FLOPs (the ranks' sum: the balanced total)
                op.flops = c.flops_bwd if bwd else c.flops_fwd
            if op.hw_flops:
                op.hw_flops = c.flops_bwd if bwd else c.flops_fwd


def patch_expert_memory(cls: RankClass, load: RankExperts, busiest: BlockCost,
                        is_experts: Callable[[Op], bool] = is_expert_gemm) -> None:
    """Give ``cls``'s expert GEMMs its own load's memory where the op carries the expert
    block's (torchtitan: the forward allocates what the block saves, the backward frees it,
    each holds its working set while it runs): each ``activations`` entry of ``busiest``'s
    saved bytes becomes the load's, the transient working set likewise. Other entries (the
    expert gradients) do not follow the load."""
    own = load.cost
    for ops in cls.streams.values():
        for op in ops:
            if not is_experts(op):
                continue
            op.alloc = _swap(op.alloc, busiest.saved_bytes, own.saved_bytes)
            op.free = _swap(op.free, busiest.saved_bytes, own.saved_bytes)
            bwd = op.phase == "bwd"
            was = busiest.bwd_transient_bytes if bwd else busiest.fwd_transient_bytes
            if op.transient and op.transient == was:
                op.transient = own.bwd_transient_bytes if bwd else own.fwd_transient_bytes


def _swap(entries: tuple[tuple[str, float], ...], was: float, now: float
          ) -> tuple[tuple[str, float], ...]:
    return tuple((cat, now if cat == "activations" and b == was else b)
                 for cat, b in entries)
