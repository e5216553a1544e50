"""Megatron's job shape (:mod:`sim.frameworks.megatron.shape`): the rank layout against
Megatron-Core's own worked example, and the groups partitioning every pipeline stage."""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim.frameworks import JobContext
from sim.frameworks.megatron.shape import MegatronShape, megatron_shape

# 4 layers (pp up to 4), 16 heads (tp up to 16) on 8-GPU H100 nodes with 8 NICs each.
SHAPED = {
    "model": {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4,
              "ffn_hidden": 2816, "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 8, "nics_per_node": 8},
    "framework": {"name": "megatron"},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 64}}


def shape(tp: int, pp: int, cp: int = 1, gpus: int = 16) -> MegatronShape:
    # 4 layers (pp up to 4), 16 heads (tp up to 16); the cluster sets dp = gpus / (tp pp cp).
    return megatron_shape(JobContext.from_scenario(make_scenario(
        SHAPED, cluster__nodes=gpus // 8, parallelism={"tp": tp, "pp": pp, "cp": cp})))


def test_rank_groups_match_megatron_cores_worked_example() -> None:
    # megatron/core/parallel_state.py, initialize_model_parallel's docstring: 16 GPUs, tp=2,
    # pp=4 (so dp=2) give the tensor groups [g0, g1], [g2, g3], ..., the data-parallel groups
    # [g0, g2], [g1, g3], [g4, g6], ... and the pipeline groups [g0, g4, g8, g12], ...
    s = shape(tp=2, pp=4)
    assert s.dp == 2
    tp = {g for st in range(4) for g in s.tp_groups(st)}
    assert tp == {(2 * i, 2 * i + 1) for i in range(8)}
    dp = {g for st in range(4) for g in s.dp_groups(st)}
    assert dp == {(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)}
    nxt = [dict(s.stage_pairs(st, st + 1)) for st in range(3)]
    chains = [[r] for r in s.members(0)]
    for chain in chains:
        for st in range(3):
            chain.append(nxt[st][chain[-1]])
    assert chains == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert [s.members(st) for st in range(4)] == [tuple(range(4 * st, 4 * st + 4))
                                                  for st in range(4)]


@pytest.mark.parametrize(("tp", "pp", "cp"), [(2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 4, 1)])
def test_groups_partition_each_stage(tp: int, pp: int, cp: int) -> None:
    # Every rank of a stage is in exactly one tensor group and one data-and-context group
    # (gradients are reduced over dp x cp ranks), and sends to exactly one ring neighbour.
    s = shape(tp=tp, pp=pp, cp=cp)
    for st in range(pp):
        members = sorted(s.members(st))
        assert len(members) == 16 // pp
        for groups, size in ((s.tp_groups(st), tp), (s.dp_groups(st), s.dp * cp)):
            assert sorted(r for g in groups for r in g) == members
            assert {len(g) for g in groups} == {size}
        ring = s.cp_ring_pairs(st)
        assert sorted(a for a, _ in ring) == members == sorted(b for _, b in ring)
        # A ring step stays inside the rank's tensor and data coordinates: only the context
        # coordinate (stride tp in the tp-cp-ep-dp-pp order) moves, by one mod cp.
        assert all(b - a in (tp, -(cp - 1) * tp) for a, b in ring)
        pairs = s.stage_pairs(st, (st + 1) % pp)
        assert all(b - a == ((st + 1) % pp - st) * 16 // pp for a, b in pairs)
