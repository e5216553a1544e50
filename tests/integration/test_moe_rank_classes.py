"""Per-EP-load rank classes under skewed routing (issue 14 item 4), torchtitan's FSDP2 + EP:
:mod:`sim.frameworks.common.moe_ranks` (shared with Megatron, whose own checks are in
test_megatron_moe_routing.py and test_megatron_flex_skew.py), and why DeepSpeed-MoE needs none.

Independent truths: the routing's per-expert token counts (:mod:`sim.workload.routing`, seeded);
torchtitan's sparse mesh puts ``ep`` innermost (``[pp, dp_replicate, efsdp, ep, etp]``
row-major, etp 1), so a rank's EP index is ``rank % ep``; grouped-GEMM FLOPs are linear in the
rows, so the expert FLOPs summed over every rank are the balanced total whatever the skew;
the slowest EP rank paces every combine all-to-all (the engine's rendezvous), so the step is
the one-class step; DeepSpeed's experts run over the capacity-padded ``[e, c, h]`` buffer,
the same rows on every rank (``sharded_moe.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import make_scenario
from helpers import program

import sim.frameworks.common.moe_ranks as moe_ranks
import sim.frameworks.fsdp2.moe as titan
from sim.api import simulate
from sim.config.training import Routing
from sim.frameworks import JobContext
from sim.program.ir import Program
from sim.scenario import Scenario
from sim.workload.block_pricing import price_block
from sim.workload.moe_ops import STYLE, MoELayout, moe_layer_ops
from sim.workload.routing import expert_loads, routing_shares

# test_titan_moe.py's small model: 4 layers, 8 experts of width 1024, top-2; 2048 tokens.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048
ZIPF = {"distribution": "zipf", "s": 1.0}


def _scn(ep: int, routing: dict | None = ZIPF, pp: int = 1, **training) -> Scenario:
    tr = {"training.seq_len": SEQ, "training.micro_batch_size": 1,
          "training.global_batch_size": 32}
    tr.update({f"training.{k}": v for k, v in training.items()})
    s = make_scenario(model=TINY, cluster__nodes=2, cluster__gpus_per_node=8,
                      cluster__nics_per_node=8, framework={"name": "fsdp2"},
                      parallelism={"ep": ep, "pp": pp}, **tr)
    if routing is None:
        return s
    return s.model_copy(update={"training": s.training.model_copy(
        update={"routing": Routing(**routing)})})


def _experts(p: Program):
    """(class, its expert GEMM ops) for every class."""
    return [(c, [op for ops in c.streams.values() for op in ops
                 if moe_ranks.is_expert_gemm(op)]) for c in p.classes]


def _rank_loads(s: Scenario, ep: int) -> list[tuple[int, ...]]:
    """Each EP rank's per-expert rows, from the routing itself: every one of the ``ep``
    sources routes its 2,048 tokens x top-2 over the Zipf shares (seed: the scenario's)."""
    shares = routing_shares(8, "zipf", 1.0, None, s.seed)
    loads = expert_loads(SEQ * ep, 2, shares)
    local = 8 // ep
    return [tuple(loads[j * local:(j + 1) * local]) for j in range(ep)]


@pytest.mark.parametrize(("ep", "pp"), [(8, 1), (4, 2)])
def test_each_ep_load_its_own_class_with_its_own_priced_gemms(ep: int, pp: int) -> None:
    s = _scn(ep, pp=pp)
    ctx = JobContext.from_scenario(s)
    p = program(s)
    loads = _rank_loads(s, ep)
    assert len(set(loads)) == ep                      # Zipf s = 1: every EP rank differs
    assert len(p.classes) == pp * ep
    assert p.meta["moe_rank_classes"] == "one per stage and expert load"
    # torchtitan's layer: its router unfused, no aux loss, torch._grouped_mm experts.
    lay = MoELayout(ep=ep, router_fusion=False, aux_loss=False, z_loss=False,
                    torch_grouped_mm=True)
    for c, ops in _experts(p):
        eps = {r % ep for r in c.members}
        assert len(eps) == 1                           # one load per class
        counts = loads[eps.pop()]
        assert f"({sum(counts)} expert rows)" in c.label
        cost = price_block(moe_layer_ops(ctx.model, lay, SEQ, tokens_per_expert=counts)
                           .experts, STYLE, ctx.compute)
        # 4 MoE layers over pp stages (torchtitan's split: 2 + 2 with pp 2), forward and
        # backward of every micro-batch
        assert len(ops) == 4 // pp * p.micro_batches * 2
        for op in ops:
            bwd = op.phase == "bwd"
            assert op.duration == pytest.approx(cost.bwd_s if bwd else cost.fwd_s, rel=1e-12)
            assert op.flops == pytest.approx(cost.flops_bwd if bwd else cost.flops_fwd,
                                             rel=1e-12)


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_expert_flops_over_the_ranks_are_the_balanced_total(ckpt: str, monkeypatch) -> None:
    # GEMM FLOPs are linear in rows and every source still routes 2,048 x 2 copies: summed
    # over the 16 ranks, the skewed classes' expert FLOPs (model and hardware, recomputation
    # included) are the balanced program's (8 x 4,096 rows per expert there: no alignment
    # padding, 4,096 is a multiple of 8).
    def total(p: Program, attr: str) -> float:
        return sum(len(c.members) * getattr(op, attr) for c, ops in _experts(p) for op in ops)
    skew, bal = program(_scn(8, activation_checkpointing=ckpt)), \
        program(_scn(8, None, activation_checkpointing=ckpt))
    assert len(skew.classes) == 8 and len(bal.classes) == 1
    for attr in ("flops", "hw_flops"):
        assert total(skew, attr) == pytest.approx(total(bal, attr), rel=1e-12)
    # ... while the one-class form counts the busiest rank's rows on every rank.
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 1)
    one = program(_scn(8, activation_checkpointing=ckpt))
    assert len(one.classes) == 1
    assert total(one, "flops") > 2 * total(skew, "flops")


def test_the_step_is_the_one_class_step(monkeypatch) -> None:
    """The busiest EP rank paces every combine all-to-all in both programs, and its class runs
    exactly the one-class ops. What is left is physical: an FSDP reduce-scatter shared by all
    classes runs beside each class's compute and is capped by the most memory-bound of them
    (sim.engine.hbm_share); a light rank's smaller expert GEMMs are more memory-bound.
    Giving them the busiest GEMM's matrix share (own times, FLOPs scaled) makes the two
    steps identical; with their own FLOPs the step moves by 0.14% here."""
    s = _scn(8)
    split = simulate(s)
    with monkeypatch.context() as m:
        m.setattr(moe_ranks, "MAX_CLASSES", 1)
        one = simulate(s)
    assert len(one.program.classes) == 1 and len(split.program.classes) == 8
    busy_op = max((op for _, ops in _experts(split.program) for op in ops),
                  key=lambda o: o.duration)
    assert busy_op.duration == max(op.duration for _, ops in _experts(one.program)
                                   for op in ops)
    t1, ts = one.summary["step_time_s"], split.summary["step_time_s"]
    assert ts == pytest.approx(t1, rel=3e-3)
    # The same transfers (no expert TP here): bytes equal up to the summation order.
    assert split.summary["bytes"] == pytest.approx(one.summary["bytes"], rel=1e-12)

    real = moe_ranks.patch_experts
    ranks: tuple[moe_ranks.RankExperts, ...] = ()

    def same_share(cls, load, gpu_time, is_experts=moe_ranks.is_expert_gemm):
        top = max(ranks, key=lambda r: r.cost.fwd_s).cost
        f, b = load.cost.fwd_s / top.fwd_s, load.cost.bwd_s / top.bwd_s
        c = replace(load.cost, flops_fwd=top.flops_fwd * f, flops_bwd=top.flops_bwd * b)
        real(cls, replace(load, cost=c), gpu_time, is_experts)

    real_split = titan.split_by_load

    def spy(program, ep_of, rk, patch, limit=None):
        nonlocal ranks
        ranks = rk
        return real_split(program, ep_of, rk, patch, limit)

    monkeypatch.setattr(titan, "split_by_load", spy)
    monkeypatch.setattr(titan, "patch_experts", same_share)
    assert simulate(s).summary["step_time_s"] == t1


def test_above_the_class_limit_one_class_per_stage_at_the_busiest_load(monkeypatch) -> None:
    # pp 2 x ep 4: 8 classes would be needed; with a limit of 7 each stage keeps one class
    # and every expert GEMM is the busiest EP rank's.
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 7)
    s = _scn(4, pp=2)
    p = program(s)
    assert len(p.classes) == 2
    assert p.meta["moe_rank_classes"] == "one per stage (busiest EP rank)"
    ctx = JobContext.from_scenario(s)
    lay = MoELayout(ep=4, router_fusion=False, aux_loss=False, z_loss=False,
                    torch_grouped_mm=True)
    costs = [price_block(moe_layer_ops(ctx.model, lay, SEQ, tokens_per_expert=c).experts,
                         STYLE, ctx.compute) for c in _rank_loads(s, 4)]
    top = max(costs, key=lambda c: c.fwd_s + c.bwd_s)
    for _, ops in _experts(p):
        fwd = [op.duration for op in ops if op.phase == "fwd"]
        assert fwd == pytest.approx([top.fwd_s] * len(fwd), rel=1e-12)
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 8)
    assert len(program(s).classes) == 8


def test_deepspeed_moe_needs_no_split() -> None:
    # DeepSpeed-MoE without drop_tokens: the busiest expert's load sets the capacity c of
    # every expert on every rank (all-reduce MAX over the EP group), and Experts.forward runs
    # each local expert over ep x c rows: the same GEMMs on every rank, one class.
    s = make_scenario({
        "name": "ds-moe", "model": dict(TINY, mlp="swiglu"),
        "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8, "nics_per_node": 0},
        "framework": {"name": "deepspeed", "zero_stage": 2, "moe": {"drop_tokens": False}},
        "parallelism": {"ep": 8},
        "training": {"seq_len": SEQ, "micro_batch_size": 1, "global_batch_size": 8,
                     "precision": "bf16", "routing": ZIPF}})
    p = program(s)
    assert len(p.classes) == 1 and "moe_rank_classes" not in p.meta
    shares = routing_shares(8, "zipf", 1.0, None, s.seed)
    assert p.meta["capacity"] == max(expert_loads(SEQ, 2, shares))
