"""The exact advance of a steady phase (:mod:`sim.engine.splice`, issue 13 item 3).

Independent truth: the full simulation of the same step. A spliced run (a shorter program
simulated, its steady period played again) must report exactly what the full run reports:
the summary, every op's ready/start/end, every rate change, every memory change, every
collective's choice, to the last bit. Each case also checks that the splice happened (a
test that passes because nothing was spliced could not fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sim.api as api
from sim.api import RunResult, simulate
from sim.config.load import load_scenario
from sim.engine import splice as splice_module

TINY = Path(__file__).resolve().parent / "golden" / "scenarios" / "tiny.yaml"
MOE = ["framework.name=megatron", "model.experts=8", "model.experts_per_token=2",
       "model.moe_ffn_hidden=1024"]

CASES = {
    # Megatron-Core 1F1B, pp 4: 64 micro-batches a stage.
    "megatron-1f1b": ["framework.name=megatron", "parallelism.pp=4", "parallelism.tp=2",
                      "training.global_batch_size=64"],
    # The interleaved schedule (pp 2 x vp 2): a period of pp micro-batches.
    "megatron-interleaved": ["framework.name=megatron", "parallelism.pp=2", "parallelism.vp=2",
                             "parallelism.tp=2", "parallelism.sequence_parallel=true",
                             "training.global_batch_size=128"],
    # The interleaved schedule with Megatron's overlaps (tp comm overlap, distributed optimizer,
    # overlapped gradient reduce and parameter gather): the host gains on the GPU for some
    # periods after the pipeline fills, so the timing settles later than the ops' pattern
    # (a cut there would copy reports no period repeats).
    "megatron-interleaved-overlaps": [
        "framework.name=megatron", "parallelism.pp=2", "parallelism.vp=2", "parallelism.tp=4",
        "parallelism.sequence_parallel=true", "framework.tp_comm_overlap=true",
        "framework.overlap_grad_reduce=true", "framework.overlap_param_gather=true",
        "framework.distributed_optimizer=true", "training.global_batch_size=128"],
    # Gradient accumulation, no pipeline: DDP and FSDP2 with 32 micro-batches a replica.
    "ddp-accumulation": ["training.global_batch_size=256"],
    "fsdp2-accumulation": ["framework.name=fsdp2", "training.global_batch_size=256"],
    # 128 GPUs: groups of more than 64 ranks, which a program's signatures hold by identity
    # (the long and the short program must still be found alike, by value).
    "ddp-accumulation-128-gpus": ["cluster.nodes=32", "training.global_batch_size=4096"],
    # FP8 (Transformer Engine, current scaling): each micro-batch pays its share of the
    # step's weight casts, a share the short program must keep at the long step's
    # (JobContext.cast_micro_batches), or no op of it is alike the long one's.
    "megatron-fp8-interleaved": ["framework.name=megatron", "parallelism.pp=2",
                                 "parallelism.vp=2", "parallelism.tp=2",
                                 "parallelism.sequence_parallel=true",
                                 "framework.fp8_recipe=tensorwise", "training.precision=fp8",
                                 "training.global_batch_size=128"],
    # Experts: all-to-alls on the fabric beside a pp 2 pipeline.
    "megatron-moe-ep4-pp2": [*MOE, "parallelism.pp=2", "parallelism.ep=4",
                             "training.global_batch_size=128"],
}


def _spied(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What each call of ``run_spliced`` returned."""
    seen: list[Any] = []
    real = api.run_spliced

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        seen.append(got)
        return got

    monkeypatch.setattr(api, "run_spliced", spy)
    return seen


def _without_wall(summary: dict[str, Any]) -> dict[str, Any]:
    out = dict(summary)
    out.pop("wall_s", None)
    out["sim"] = {k: v for k, v in out["sim"].items() if k != "wall_s"}
    return out


def _full(scenario: Any, keep_link_series: bool = False) -> RunResult:
    from sim.frameworks import JobContext, build_program
    ctx = JobContext.from_scenario(scenario)
    return api.run_program(ctx, build_program(ctx), steady_splice=False,
                           keep_link_series=keep_link_series)


def _assert_same_reports(a: RunResult, b: RunResult) -> None:
    assert _without_wall(dict(a.summary)) == _without_wall(dict(b.summary))
    ra, rb = a.recorder, b.recorder
    assert [(r.cls, r.op.index, r.ready, r.start, r.end, r.step, r.held) for r in ra.ops] == \
        [(r.cls, r.op.index, r.ready, r.start, r.end, r.step, r.held) for r in rb.ops]
    assert len(ra.rate_series) == len(rb.rate_series)
    for (ta, xa), (tb, xb) in zip(ra.rate_series, rb.rate_series, strict=True):
        assert ta == tb and np.array_equal(xa, xb)
    assert ra.memory.keys() == rb.memory.keys()
    for c in ra.memory:
        assert ra.memory[c].series == rb.memory[c].series
        assert ra.memory[c].reserved_series == rb.memory[c].reserved_series
        assert ra.memory[c].peak == rb.memory[c].peak
    assert ra.collective_choices == rb.collective_choices
    assert (ra.transfers_finished, ra.transfer_bytes) == (rb.transfers_finished,
                                                          rb.transfer_bytes)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_spliced_step_reports_what_the_full_step_does_to_the_bit(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = load_scenario(str(TINY), CASES[case])
    seen = _spied(monkeypatch)
    spliced = simulate(scenario)
    assert len(seen) == 1 and seen[0] is not None, "the step was not spliced"
    assert seen[0].ops == len(spliced.program.ops)
    _assert_same_reports(spliced, _full(scenario))


@pytest.mark.parametrize("case", ["megatron-moe-ep4-pp2", "megatron-interleaved-overlaps"])
def test_a_spliced_step_records_the_full_steps_link_rates(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-link series (links.png) is kept as changes; each repeat of the period is played
    # from the rates at its start, so it is the full run's change for change.
    scenario = load_scenario(str(TINY), CASES[case])
    seen = _spied(monkeypatch)
    spliced = simulate(scenario, keep_link_series=True)
    assert len(seen) == 1 and seen[0] is not None, "the step was not spliced"
    full = _full(scenario, keep_link_series=True)
    a, b = spliced.recorder.link_series, full.recorder.link_series
    assert len(a) == len(b) > 0
    for (ta, ia, ra), (tb, ib, rb) in zip(a, b, strict=True):
        assert ta == tb and np.array_equal(ia, ib) and np.array_equal(ra, rb)
    end = spliced.summary["step_time_s"]
    assert np.array_equal(spliced.recorder.link_bytes(end), full.recorder.link_bytes(end))


def test_the_short_run_simulates_fewer_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = load_scenario(str(TINY), CASES["megatron-1f1b"])
    asked: list[int] = []
    real = api._with_micro_batches

    def shorter(ctx: Any, micro_batches: int, origin: str) -> Any:
        asked.append(micro_batches)
        return real(ctx, micro_batches, origin)

    monkeypatch.setattr(api, "_with_micro_batches", shorter)
    simulate(scenario)
    # 64 micro-batches; the short program keeps SHORT_MICRO_BATCHES steady ones and the pipeline's
    # warm-up and cool-down (pp - 1 = 3 each side at most).
    assert asked and asked[0] <= splice_module.SHORT_MICRO_BATCHES + 2 * 3 + 2 < 64


def test_a_cut_is_refused_where_the_run_does_not_repeat() -> None:
    # The reports of a run whose one op ends a quantum late in every other period: no two
    # cuts a period apart see the same state, so no cut is returned.
    from sim.frameworks import JobContext, build_program
    scenario = load_scenario(str(TINY), CASES["megatron-1f1b"])
    ctx = JobContext.from_scenario(scenario)
    program = build_program(ctx)
    period = splice_module.steady_period(program)
    assert period is not None
    tap = splice_module.LogTap()
    engine = api.Engine(api.build_fabric(api.fabric_spec(scenario)), ctx.gpu.arch, tap,
                        gpu=ctx.gpu)
    tap.attach(engine)
    engine.run_step(program)
    short = splice_module.ShortRun(program)
    lengths = {cid: cp.length for cid, cp in period.classes.items()}
    cls0 = program.classes[0].id
    cp = period.classes[cls0]
    anchor = (cls0, cp.start + (period.periods // 2) * cp.length)
    assert splice_module.find_cut(tap.entries, short, lengths, anchor) is not None
    entries = list(tap.entries)
    order = short.order[cls0]
    for k in range(cp.start, cp.start + cp.periods * cp.length, 2 * cp.length):
        i = next(j for j, e in enumerate(entries) if e[0] == splice_module.OP
                 and e[3] is order[k])
        kind, t, cid, op, what, solves = entries[i]
        entries[i] = (kind, t + 2 ** -36, cid, op, what, solves)
    assert splice_module.find_cut(entries, short, lengths, anchor) is None
