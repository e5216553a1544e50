"""Each EP-load rank class's memory at its own load under skewed routing (issue 14 items 4
and 6): Megatron (:mod:`sim.frameworks.megatron.moe_rank_memory`) and torchtitan
(:func:`sim.frameworks.common.moe_ranks.patch_expert_memory`).

Independent truths: the routing's per-expert token counts (:mod:`sim.workload.routing`,
seeded: every one of the ``ep`` sources routes its tokens x top-2 over the Zipf shares), so
the rows an EP rank's experts receive are the sum of its local experts' counts; what the
grouped GEMMs save is linear in those rows (every saved tensor is ``rows x width``), so a
light rank's expert activations are the busiest's times the ratio of their rows; the
``alltoall`` dispatcher's receive buffer is ``rows x hidden`` bf16 tokens plus ``rows`` fp32
probs (``MoEAlltoAllTokenDispatcher``: ``output_splits`` from the gathered counts); what a
step allocates it frees (conservation, per category); the busiest class runs the one-class
program's ops, so its memory, the job's peak and the step are those of before.
"""

from __future__ import annotations

import re

import pytest
from conftest import make_scenario
from helpers import megatron_scenario, program

import sim.frameworks.common.moe_ranks as moe_ranks
import sim.frameworks.megatron.build as mbuild
from sim.api import simulate
from sim.config.training import Routing
from sim.frameworks import JobContext
from sim.frameworks.megatron.moe_rank_memory import MEMORY_FIELDS, own_memory
from sim.frameworks.megatron.shape import megatron_shape
from sim.program.ir import Op, Program, RankClass
from sim.scenario import Scenario
from sim.workload.routing import expert_loads, routing_matrix, routing_shares

# test_megatron_moe_routing.py's small model: 4 layers, 8 experts of width 1024, top-2.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048
H = 1024
ZIPF = {"distribution": "zipf", "s": 1.0}


def _with(s: Scenario, routing: dict | None) -> Scenario:
    if routing is None:
        return s
    return s.model_copy(update={"training": s.training.model_copy(
        update={"routing": Routing(**routing)})})


def _mega(ep: int, pp: int, routing: dict | None = ZIPF, ac: str = "none",
          framework: dict | None = None) -> Scenario:
    return _with(megatron_scenario({"tp": 1, "ep": ep, "pp": pp}, 8, model=TINY, seq=SEQ,
                                   ac=ac, framework=framework), routing)


def _rows(s: Scenario, ep: int) -> list[int]:
    """Rows each EP rank's experts receive per layer and micro-batch, from the routing."""
    loads = expert_loads(SEQ * ep, 2, routing_shares(8, "zipf", 1.0, None, s.seed))
    local = 8 // ep
    return [sum(loads[j * local:(j + 1) * local]) for j in range(ep)]


def _ops(c: RankClass) -> list[Op]:
    return [op for ops in c.streams.values() for op in ops]


def _entry(c: RankClass, name: str, field: str, cat: str) -> float:
    """The ``cat`` bytes op ``name`` of class ``c`` allocates or frees."""
    (op,) = [o for o in _ops(c) if o.name == name]
    return sum(b for k, b in getattr(op, field) if k == cat)


def _ep(c: RankClass, ep: int) -> int:
    # Megatron's expert mesh tp-cp-ep-dp-pp with expert TP 1: the EP index is rank % ep.
    (j,) = {r % ep for r in c.members}
    return j


def _stages(p: Program, pp: int) -> dict[int, list[RankClass]]:
    out: dict[int, list[RankClass]] = {}
    for c in p.classes:
        out.setdefault(int(re.match(r"pipeline stage (\d+)", c.label)[1]), []).append(c)
    assert len(out) == pp
    return out


@pytest.mark.parametrize(("ep", "pp"), [(8, 1), (4, 2)])
def test_a_light_class_holds_its_own_rows(ep: int, pp: int) -> None:
    s = _mega(ep, pp)
    rows = _rows(s, ep)
    assert len(set(rows)) == ep                  # Zipf s = 1: every EP rank differs
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.moe is not None and sh.moe.pace is not None
    busiest_saved = sh.moe.pace.experts.saved_bytes
    p = program(s)
    assert len(p.classes) == ep * pp
    for st, classes in _stages(p, pp).items():
        layer = 4 // pp * st                     # the stage's first layer (all MoE)
        hold = {_ep(c, ep): _entry(c, f"fwd attn L{layer} mb0", "alloc", "activations")
                for c in classes}
        router = {_ep(c, ep): _entry(c, f"fwd moe L{layer} mb0 router", "alloc",
                                     "moe_dispatch") for c in classes}
        experts = {_ep(c, ep): _entry(c, f"fwd moe L{layer} mb0 experts", "alloc",
                                      "moe_dispatch") for c in classes}
        b = max(range(ep), key=lambda j: rows[j])
        for j in range(ep):
            # The layer holds from its forward to its backward what the busiest holds less
            # the expert tensors of the rows it does not get: its expert activations are the
            # busiest's times the ratio of rows.
            own = busiest_saved - (hold[b] - hold[j])
            assert own / busiest_saved == pytest.approx(rows[j] / rows[b], rel=1e-12)
            # The experts' output (the combine's send buffer): rows x hidden bf16.
            assert experts[b] - experts[j] == pytest.approx((rows[b] - rows[j]) * H * 2,
                                                            rel=1e-12)
            # The dispatch's receive buffer, tokens and probs: in the dispatcher's buffers
            # with 2 local experts; with one it is the grouped GEMM's saved input itself.
            recv = (rows[b] - rows[j]) * (H * 2 + 4) if ep == 4 else 0.0
            assert router[b] - router[j] == pytest.approx(recv, rel=1e-12, abs=1e-6)


MEGA = {"name": "megatron"}


@pytest.mark.parametrize(("ac", "framework", "par"), [
    ("none", None, {}), ("full", None, {}),
    ("selective", dict(MEGA, recompute_modules=["core_attn", "moe_act"]), {}),
    ("selective", dict(MEGA, recompute_modules=["moe"]), {}),
    ("none", dict(MEGA, moe_token_dispatcher_type="allgather"), {}),
    ("none", dict(MEGA, moe_a2a_overlap=True), {"pp": 1, "ep": 8}),
    ("none", None, {"tp": 2, "sequence_parallel": True, "pp": 1}),
    ("none", None, {"vp": 2}),
])
def test_every_class_frees_what_it_allocates(ac: str, framework: dict | None,
                                             par: dict) -> None:
    s = _with(megatron_scenario({"tp": 1, "ep": 4, "pp": 2, **par}, 16, model=TINY, seq=SEQ,
                                ac=ac, framework=framework), ZIPF)
    p = program(s)
    assert len(p.classes) == p.pipeline_stages * par.get("ep", 4)   # a class per load
    held = set()
    for c in p.classes:
        for cat in ("activations", "moe_dispatch"):
            a = sum(b for op in _ops(c) for k, b in op.alloc if k == cat)
            f = sum(b for op in _ops(c) for k, b in op.free if k == cat)
            assert a == pytest.approx(f, rel=1e-12)
        held.add(sum(b for op in _ops(c) for k, b in op.alloc if k == "activations"))
    assert len(held) == len(p.classes)          # and each class its own


def _peaks(s: Scenario) -> tuple[dict, dict[str, float]]:
    out = simulate(s).summary
    return out, {r["label"]: r["peak_gib"] for r in out["memory_by_rank_class"]}


def test_the_busiest_class_the_peak_and_the_step_do_not_move(monkeypatch) -> None:
    s = _mega(4, 2)
    after, peaks = _peaks(s)
    monkeypatch.setattr(mbuild, "own_memory", lambda *a: 0)   # every class the busiest's
    before, was = _peaks(s)
    rows = _rows(s, 4)
    busiest = f"({max(rows)} expert rows)"
    for label, peak in peaks.items():
        if label.endswith(busiest):
            assert peak == was[label]
        else:
            assert peak < was[label]
    assert after["peak_memory_gib"] == before["peak_memory_gib"] == max(peaks.values())
    assert after["step_time_s"] == before["step_time_s"]


def test_balanced_and_one_class_programs_are_untouched(monkeypatch) -> None:
    def boom(*a: object) -> int:
        raise AssertionError("own_memory called")
    monkeypatch.setattr(mbuild, "own_memory", boom)
    assert len(program(_mega(4, 2, routing=None)).classes) == 2
    assert len(program(_mega(4, 2, routing={"distribution": "zipf", "s": 0.0})).classes) == 2
    # Beyond the class limit the one-class program keeps the busiest rank's memory.
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 2)
    assert len(program(_mega(4, 2)).classes) == 2


def test_nothing_to_do_when_balanced() -> None:
    s = _mega(4, 2, routing=None)
    ctx = JobContext.from_scenario(s)
    p = program(s)
    before = [[getattr(o, f) for f in MEMORY_FIELDS] for c in p.classes for o in _ops(c)]
    assert own_memory(p, megatron_shape(ctx), ctx.compute, 34e-6, {}, list(p.classes)) == 0
    assert before == [[getattr(o, f) for f in MEMORY_FIELDS] for c in p.classes
                      for o in _ops(c)]


# ------------------------------------------------------------------ torchtitan
def _titan(ep: int) -> Scenario:
    s = make_scenario(model=TINY, cluster__nodes=2, cluster__gpus_per_node=8,
                      cluster__nics_per_node=8, framework={"name": "fsdp2"},
                      parallelism={"ep": ep}, **{"training.seq_len": SEQ,
                                                 "training.micro_batch_size": 1,
                                                 "training.global_batch_size": 32})
    return _with(s, ZIPF)


def test_torchtitan_experts_save_their_own_rows() -> None:
    s = _titan(8)
    rows = _rows(s, 8)
    p = program(s)
    assert len(p.classes) == 8
    saved, work = {}, {}
    for c in p.classes:
        (j,) = {r % 8 for r in c.members}        # torchtitan's sparse mesh: ep innermost
        ops = [o for o in _ops(c) if moe_ranks.is_expert_gemm(o)]
        fwd = {sum(b for k, b in o.alloc if k == "activations") for o in ops
               if o.phase == "fwd"}
        bwd = {sum(b for k, b in o.free if k == "activations") for o in ops
               if o.phase == "bwd"}
        assert len(fwd) == 1 and fwd == bwd      # what the forward saves the backward frees
        saved[j] = fwd.pop()
        work[j] = {o.transient for o in ops if o.phase == "fwd"}.pop()
    b = max(range(8), key=lambda j: rows[j])
    for j in range(8):
        assert saved[j] / saved[b] == pytest.approx(rows[j] / rows[b], rel=1e-12)
        assert work[j] <= work[b]


def test_moe_act_recomputation_time_survives_the_split(monkeypatch) -> None:
    # recompute_modules moe_act re-runs the activation inside the experts' backward (its
    # time added to that op): the busiest class keeps exactly the one-class op, a light one
    # its own GEMMs plus that recomputation (the busiest's rows: an upper bound).
    s = _mega(4, 2, ac="selective",
              framework={"name": "megatron", "recompute_modules": ["core_attn", "moe_act"]})
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.moe is not None and sh.moe.pace is not None
    rows = _rows(s, 4)

    def bwd(p: Program) -> dict[str, float]:
        return {c.label: o.duration for c in p.classes for o in _ops(c)
                if o.name == "bwd moe L0 mb0 experts"}
    split = bwd(program(s))
    monkeypatch.setattr(moe_ranks, "MAX_CLASSES", 1)
    (one,) = bwd(program(s)).values()
    act = one - sh.moe.pace.experts.bwd_gpu_s
    assert act > 0
    for label, d in split.items():
        j = int(re.search(r"EP rank (\d+)", label)[1])
        if rows[j] == max(rows):
            assert d == one
        else:
            own = sh.moe.ranks[j].cost.bwd_gpu_s
            assert d == pytest.approx(own + act, rel=1e-12) and d < one


def test_flex_receive_buffer_follows_the_class_tokens() -> None:
    # DeepEP's dispatch returns each token once per rank holding one of its experts
    # (recv_x), so a rank's buffer is the tokens with an expert among its own, recounted
    # here from the routing matrix itself (every source's tokens drawn in one matrix, as
    # flex_skew draws them): the router's allocation is those tokens x the dispatch record.
    ep = 4
    s = _mega(ep, 2, framework={"name": "megatron", "moe_token_dispatcher_type": "flex"})
    shares = routing_shares(8, "zipf", 1.0, None, s.seed)
    idx = routing_matrix(shares, 2, SEQ * ep, s.seed)
    local = 8 // ep
    got = [int((idx // local == j).any(axis=1).sum()) for j in range(ep)]
    p = program(s)
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.moe is not None and sh.moe.flex is not None and sh.moe.pace is not None
    record = sh.moe.flex.record_bytes("dispatch_fwd")
    pace = sh.moe.pace.rank
    for st, classes in _stages(p, 2).items():
        layer = 2 * st
        for c in classes:
            j = _ep(c, ep)
            alloc = _entry(c, f"fwd moe L{layer} mb0 router", "alloc", "moe_dispatch")
            # The pace-setting class keeps the one-class buffer: the busiest receiver's.
            want = max(got) if j == pace else got[j]
            assert alloc == pytest.approx(want * record, rel=1e-12)
