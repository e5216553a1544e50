"""Megatron's rank classes per expert load under skewed routing: its expert-TP exchanges.

The split by load, its labels, its class limit and the expert GEMMs' own time and FLOPs are
framework-neutral (:mod:`sim.frameworks.common.moe_ranks`, shared with torchtitan's FSDP2 +
EP). What is Megatron's alone: its expert-parallel index comes from its expert mesh
(``RankGenerator`` ``tp-ep-dp-pp``, :attr:`.moe.MoEPlan.mesh`), and with expert-TP > 1 the
one-class form makes every expert-TP all-gather and reduce-scatter carry the busiest EP
rank's tokens (NVLink bytes overcounted by up to the imbalance factor). In each class those
exchanges run over the class's own expert-TP groups (each group lies inside one EP rank:
``tp-ep`` with expert-TP fastest) with that rank's tokens, under their own key; the
all-to-alls keep their shared key, so every class waits for the slowest.
"""

from __future__ import annotations

import re
from functools import partial

from sim.frameworks.common.moe_ranks import (
    MAX_CLASSES,
    RankExperts,
    patch_experts,
    rank_experts,
    split_by_load,
)
from sim.program.ir import Op, Program, RankClass
from sim.program.mesh import RankMesh
from sim.workload.block_pricing import BlockCost

__all__ = ["MAX_CLASSES", "RankExperts", "rank_experts", "split_expert_ranks"]

_ETP = re.compile(r"^(fwd|bwd|recompute) moe L\d+ mb\d+ etp (all_gather|reduce_scatter)$")


def split_expert_ranks(program: Program, mesh: RankMesh, ranks: tuple[RankExperts, ...],
                       etp: int, limit: int | None = None,
                       busiest: BlockCost | None = None) -> bool:
    """Split every stage's class by its members' expert load (see the module docstring);
    returns whether it did (False: balanced, one load, or more than ``limit`` classes,
    default :data:`~sim.frameworks.common.moe_ranks.MAX_CLASSES`). ``busiest``: the expert
    block the program was priced at (the pace's), whose op time beyond the block
    (``moe_act``'s recomputation) each class keeps."""
    if len({r.counts for r in ranks}) <= 1:
        return False
    ep_of = {r: mesh.coords(r).get("ep", 0) for c in program.classes for r in c.members}
    return split_by_load(program, ep_of, ranks, partial(_patch, etp=etp, busiest=busiest),
                         limit)


def _patch(cls: RankClass, load: RankExperts, k: int, etp: int,
           busiest: BlockCost | None = None) -> None:
    """Give ``cls``'s expert GEMMs and expert-TP exchanges its own load."""
    patch_experts(cls, load, gpu_time=True, busiest=busiest)
    mine = set(cls.members)
    own: dict[int, tuple[tuple[int, ...], ...]] = {}
    for ops in cls.streams.values():
        for op in ops:
            if op.kind == "collective" and _ETP.match(op.name):
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
