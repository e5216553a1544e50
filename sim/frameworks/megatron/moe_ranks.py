"""Each EP rank its own expert load under skewed routing: one rank class per load.

Megatron's builder makes one rank class per pipeline stage (:mod:`.build`), so a skewed
routing first prices every rank at the busiest EP rank's experts
(:mod:`sim.frameworks.common.moe_pace`): the step's pace is right (every MoE layer's combine
waits for the slowest rank), but a lightly loaded rank shows the busiest's GEMM time and,
with expert-TP > 1, its expert-TP all-gather and reduce-scatter carry the busiest rank's
tokens (NVLink bytes overcounted by up to the imbalance factor).

:func:`split_expert_ranks` lifts that after the program is built, in the program layer
alone: each stage's class is split (:func:`sim.program.split.split_ranks`) into one class
per distinct expert load (ranks whose EP index holds the same per-expert token counts run
identical ops), and in each class

* the grouped expert GEMMs take that EP rank's priced time and FLOPs (:class:`RankExperts`;
  over the ranks the FLOPs add up to the balanced total: GEMM FLOPs are linear in rows);
* the expert-TP all-gather and reduce-scatter run over that class's own expert-TP groups
  (each group lies inside one EP rank: ``RankGenerator`` ``tp-ep`` with expert-TP fastest)
  with that rank's tokens, under their own key.

The all-to-alls keep their shared key and per-peer matrix, so the engine's rendezvous makes
every class wait for the slowest at each dispatch and combine, as NCCL and DeepEP do.

Cost: a class per distinct load per stage. Up to :data:`MAX_CLASSES` classes in all the
split is made; beyond it (EP 64 over 16 stages would be 1,024 classes, each simulated) the
program keeps one class per stage priced at the busiest EP rank (``program.meta
["moe_rank_classes"]`` says which). The saved activations stay the busiest rank's on every
rank (the layer builder attaches them per layer): the peak is right, a light rank's memory is
over-counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import Pace
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op, Program, RankClass
from sim.program.mesh import RankMesh
from sim.program.split import split_ranks
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.moe_ops import STYLE, MoELayout, moe_layer_ops

MAX_CLASSES = 16
"""Most rank classes the split may leave in the program. Engine time grows about linearly with
the classes while the step time does not move (the slowest rank paces every all-to-all):
Mixtral 8x7B at pp 4 x ep 8 under Zipf s = 1 simulates in 3.3 s with 4 classes, 12.5 s with
32 (step 6.071 vs 6.068 s); GPT-OSS-120B at pp 4 x ep 16, 21 s with 4, 162 s with 64."""
_EXPERTS = re.compile(r"^(fwd|bwd|recompute) moe L\d+ mb\d+ experts$")
_ETP = re.compile(r"^(fwd|bwd|recompute) moe L\d+ mb\d+ etp (all_gather|reduce_scatter)$")


@dataclass(frozen=True)
class RankExperts:
    """One EP rank's expert load and what it costs."""

    counts: tuple[int, ...]
    """Token copies each of its local experts receives (its GEMMs' rows)."""
    cost: BlockCost
    """Its grouped expert GEMMs, priced."""
    etp_gather_bytes: float
    """Bytes it adds to the expert-TP all-gather (its tokens, one expert-TP shard)."""


def rank_experts(ctx: JobContext, lay: MoELayout, tokens: int, cm: ComputeModel,
                 pace: Pace | None) -> tuple[RankExperts, ...]:
    """Every EP rank's load and priced experts under ``pace``'s routing (``()`` when
    balanced: every rank is alike)."""
    if pace is None:
        return ()
    local = len(pace.loads) // lay.ep
    peers = pace.peer_tokens
    out: list[RankExperts] = []
    seen: dict[tuple[int, ...], RankExperts] = {}
    for j in range(lay.ep):
        counts = tuple(pace.loads[j * local:(j + 1) * local])
        if counts not in seen:
            ops = moe_layer_ops(ctx.model, lay, tokens, tokens_per_expert=counts,
                                send_tokens=peers[j] if peers else None,
                                recv_tokens=[row[j] for row in peers] if peers else None,
                                ep_rank=j)
            seen[counts] = RankExperts(counts, price_block(ops.experts, STYLE, cm),
                                       ops.etp_gather_bytes)
        out.append(seen[counts])
    return tuple(out)


def split_expert_ranks(program: Program, mesh: RankMesh, ranks: tuple[RankExperts, ...],
                       etp: int, limit: int | None = None) -> bool:
    """Split every stage's class by its members' expert load (see the module docstring);
    returns whether it did (False: balanced, one load, or more than ``limit`` classes,
    default :data:`MAX_CLASSES`)."""
    limit = MAX_CLASSES if limit is None else limit
    if len({r.counts for r in ranks}) <= 1:
        return False
    ep_of = {r: mesh.coords(r).get("ep", 0) for c in program.classes for r in c.members}
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
            _patch(c, load, etp, k)
    program.meta["moe_rank_classes"] = "one per stage and expert load"
    return True


def _patch(cls: RankClass, load: RankExperts, etp: int, k: int) -> None:
    """Give ``cls``'s expert GEMMs and expert-TP exchanges its own load."""
    mine = set(cls.members)
    own: dict[int, tuple[tuple[int, ...], ...]] = {}
    for ops in cls.streams.values():
        for op in ops:
            if op.kind == "compute" and _EXPERTS.match(op.name):
                bwd = op.phase == "bwd"
                op.duration = load.cost.bwd_gpu_s if bwd else load.cost.fwd_gpu_s
                if op.flops:        # its own rows' FLOPs (the ranks' sum: the balanced total)
                    op.flops = load.cost.flops_bwd if bwd else load.cost.flops_fwd
            elif op.kind == "collective" and _ETP.match(op.name):
                _own_groups(op, mine, own)
                op.nbytes = load.etp_gather_bytes * etp
                op.key = f"{op.key}|load{k}"


def _own_groups(op: Op, mine: set[int], memo: dict[int, tuple[tuple[int, ...], ...]]) -> None:
    """Keep the groups of ``op`` inside the class (one tuple object per source tuple: the
    engine caches a collective's classes by its groups' identity)."""
    src = op.all_groups
    hit = memo.get(id(src))
    if hit is None:
        hit = tuple(g for g in src if g[0] in mine)
        memo[id(src)] = hit
    op.groups = hit
    op.group = hit[0]
