"""torch's context-parallel ring attention under torchtitan (sim/frameworks/fsdp2/cp.py)
against closed forms from ``torch/distributed/tensor/experimental/_attention.py``:
the attention calls of each step and their shapes, the work balance of load balancing, the
bytes each exchange moves, and where the exchanges are waited for."""

from __future__ import annotations

import pytest
from conftest import SMALL_MODEL, make_scenario

from sim import catalog
from sim.frameworks import JobContext, build_program
from sim.frameworks.fsdp2.cp import (
    FULL_Q,
    HALF_Q,
    ring_step_segments,
    ring_steps,
    titan_repeats_kv,
)
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import Style, kernel_time
from sim.workload.model import ModelSpec

SMALL = SMALL_MODEL
SEQ = 4096


def scenario(cp: int, framework: dict | None = None, **training):
    return make_scenario(framework={"name": "fsdp2", **(framework or {})},
                         parallelism={"cp": cp}, training__seq_len=SEQ,
                         **{f"training.{k}": v for k, v in training.items()})


def layer_ops(p, layer: int = 1):
    return [op for op in p.ops if op.layer == layer]


# --------------------------------------------------------------------------- step shapes
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balancing_gives_every_rank_the_same_share_of_the_causal_triangle(cp) -> None:
    # Whole sequence: cp^2 blocks of (seq/cp)^2, half of them under the causal mask = cp^2/2
    # block units; split evenly, cp/2 per rank.
    for rank in range(cp):
        steps = ring_steps(cp, rank)
        assert len(steps) == cp and all(s is not None for s in steps)
        assert sum(s.work for s in steps if s) == pytest.approx(cp / 2)
    # Without it rank r computes its causal diagonal block and r full blocks, skips the rest.
    for rank in range(cp):
        steps = ring_steps(cp, rank, load_balance=False)
        assert sum(s.work for s in steps if s) == pytest.approx(0.5 + rank)
        assert sum(s is None for s in steps) == cp - 1 - rank


def test_each_step_is_the_shape_the_source_calls() -> None:
    # _templated_ring_attention: step 0 causal on the local chunks; step i <= rank all
    # queries against the first half of the keys; i > rank the second half of the queries
    # against all keys, merged into the second half only.
    steps = ring_steps(4, 2)
    first = steps[0]
    assert first is not None
    assert (first.q, first.kv, first.causal) == (1.0, 1.0, True)
    assert steps[1] == steps[2] == FULL_Q
    assert steps[3] == HALF_Q and HALF_Q.partial and not FULL_Q.partial


def test_ring_segments_issue_cp_attention_calls_whose_flops_are_the_rank_share() -> None:
    m = ModelSpec.from_ref(scenario(2).model, SEQ)
    cm = ComputeModel(catalog.gpu("h100-sxm"), "bf16")
    cp, local = 4, SEQ // 4
    segs = ring_step_segments(m, Style("bf16"), cm, 1, local, cp, m.q_dim)
    fwd = [k for i in range(cp) for k in segs[f"attn_ring{i}"].forward
           if k.klass == "attention"]
    bwd = [k for i in range(cp) for k in segs[f"attn_ring{i}_bwd"].backward
           if k.klass == "attention"]
    assert len(fwd) == len(bwd) == cp
    # Step 0 causal (no block), later steps one non-causal rectangle of half the local keys
    # or half the local queries.
    assert fwd[0].attn_block is None and fwd[0].attn is not None and fwd[0].attn[2] == local
    assert all(k.attn_block in ((local, local // 2), (local // 2, local)) for k in fwd[1:])
    # FLOPs per rank: 1/cp of the causal attention of the whole sequence,
    # 4 S^2 D H / 2 / cp forward, 2.5x that backward.
    whole = 4 * SEQ**2 * m.q_dim / 2
    assert sum(k.flops for k in fwd) == pytest.approx(whole / cp)
    assert sum(k.flops for k in bwd) == pytest.approx(2.5 * whole / cp)
    # The rectangle kernels are priced as such: a (S/cp x S/2cp) block, not a causal square.
    rect = fwd[1]
    assert rect.attn_block is not None
    q_len, kv_len = rect.attn_block
    assert kernel_time(cm, rect) == pytest.approx(
        cm.attention_time(1, m.heads, q_len, m.head_dim, "fwd", kv_seq=kv_len, causal=False))


# --------------------------------------------------------------------------- exchanges
@pytest.mark.parametrize("torch_version,width", [("2.8", "q_dim"), ("2.11", "kv_dim")])
def test_exchange_bytes_per_step(torch_version, width) -> None:
    cp = 4
    s = scenario(cp, torch_version=torch_version)
    p = build_program(JobContext.from_scenario(s))
    m = ModelSpec.from_ref(scenario(2).model, SEQ)
    # torchtitan before 2026 repeats K/V heads before SDPA: the ring carries heads-wide K/V.
    kvw = getattr(m, width)
    local_kv = 2 * (SEQ // cp) * kvw * 2                      # bf16 K and V of one rank
    ops = [op for op in layer_ops(p) if op.stream == "cp"]
    gathers = [op for op in ops if op.collective == "all_gather"]
    shifts = [op for op in ops if op.kind == "send"]
    # All-gather rotater: one gather of every rank's K/V per pass (forward, backward).
    assert [op.nbytes for op in gathers] == [cp * local_kv] * 2
    # Backward: the fp32 dK/dV accumulators shifted to the next rank after every step.
    assert [op.nbytes for op in shifts] == [2 * local_kv] * cp
    assert titan_repeats_kv(torch_version) == (width == "q_dim")


def test_alltoall_rotater_shifts_kv_before_every_step_but_the_last() -> None:
    cp = 4
    p = build_program(JobContext.from_scenario(scenario(cp, {"cp_rotate_method": "alltoall"})))
    fwd = [op for op in layer_ops(p) if op.kind == "send" and op.name.startswith("cp shift K/V")
           and "(bwd)" not in op.name]
    assert len(fwd) == cp - 1


def test_dead_kv_concatenations_run_eager_only() -> None:
    # With the all-gather rotater every step i < cp-1 still concatenates K and V; only the
    # first feeds the gather. Eager runs them all, inductor drops the dead ones.
    cp = 4

    def cats(compile_: bool) -> int:
        p = build_program(JobContext.from_scenario(scenario(cp, {"compile": compile_})))
        return sum(1 for op in layer_ops(p) if op.name.startswith("cp cat K/V"))

    assert cats(False) == 2 * (1 + (cp - 2))        # forward and backward passes
    assert cats(True) == 2


def test_compiled_ring_waits_for_each_exchange_where_it_is_issued() -> None:
    cp = 4

    def ring(compile_: bool):
        p = build_program(JobContext.from_scenario(scenario(cp, {"compile": compile_})))
        ops = layer_ops(p)
        first = next(op for op in ops if op.name.startswith("fwd attn_ring0"))
        gather = next(op for op in ops if op.collective == "all_gather"
                      and "(bwd)" not in op.name and op.stream == "cp")
        bwd1 = next(op for op in ops if op.name.startswith("bwd attn_ring1_bwd"))
        shift0 = next(op for op in ops if op.name.startswith("cp shift dK/dV 0"))
        return gather in first.deps, shift0 in bwd1.deps

    # Eager: step 0 overlaps the gather; a dK/dV shift overlaps the next step's backward.
    assert ring(False) == (False, False)
    # Compiled: wait_tensor right after each traced collective (_maybe_wrap_tensor).
    assert ring(True) == (True, True)


@pytest.mark.parametrize("rotate,held", [("allgather", 4), ("alltoall", 2)])
def test_ring_steps_hold_the_rotaters_key_value_buffer(rotate, held) -> None:
    # _AllGatherRotater keeps its all-gather output (every rank's K and V, cp local copies)
    # from the first step to the ring's end; the all-to-all rotater holds the received buffer
    # and the concatenation it sends on. Each ring step holds it on top of its own working
    # set, forward and backward (the backward ring gathers again).
    cp = 4

    def steps(method: str | None) -> dict[str, float]:
        fw = {"cp_rotate_method": method} if method else {}
        p = build_program(JobContext.from_scenario(scenario(cp, fw)))
        return {op.name: op.transient for op in layer_ops(p) if "attn_ring" in op.name
                and op.kind == "compute"}

    m = ModelSpec.from_ref(scenario(2).model, SEQ)
    local_kv = 2 * (SEQ // cp) * m.q_dim * 2          # heads-wide bf16 K and V (repeat_kv)
    with_buffer = steps(rotate)
    # The same ring priced without the buffer: the block's own transient (the ring's
    # accumulators in backward), independent of the rotate method.
    from sim.frameworks.fsdp2.tp_pass import TitanPass
    original = TitanPass._rotater_bytes
    try:
        TitanPass._rotater_bytes = lambda self: 0.0      # type: ignore[method-assign]
        without = steps(rotate)
    finally:
        TitanPass._rotater_bytes = original              # type: ignore[method-assign]
    assert with_buffer.keys() == without.keys() and with_buffer
    for name, t in with_buffer.items():
        assert t - without[name] == pytest.approx(held * local_kv), name
