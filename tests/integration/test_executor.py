"""The shared executor (sim/apps/executor.py): one home for "simulate many scenarios, keep each
failure as a record with its one-line error", used by compare, sweep and plan.

The oracles are closed forms: the exact error text each app has always written (the golden
test pins the numbers), the order and count of records, and the worker-death bookkeeping of
:func:`sim.apps.executor.run_tasks` driven by a scripted backend (no processes, so every branch is
reached deterministically)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import make_scenario

import sim.api
from sim.apps import compare, executor, plan, sweep
from sim.apps.executor import (
    Lost,
    Outcome,
    Pool,
    Task,
    attempt,
    one_line,
    run_batch,
    run_tasks,
    simulate_task,
    type_and_message,
)
from sim.scenario import ScenarioError

# Two nodes of two GPUs, ddp: dp = 4 replicas, global batch 8 (as tests/integration/test_sweep.py).
TINY = {
    "name": "tiny-executor",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "ddp",
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8},
}


def _tiny(**training: Any) -> Any:
    return make_scenario(TINY, **{f"training.{k}": v for k, v in training.items()})


def _no_wall(summary: dict[str, Any]) -> dict[str, Any]:
    return {**summary, "sim": {k: v for k, v in summary["sim"].items() if k != "wall_s"}}


# --------------------------------------------------------------------------- wording
@pytest.mark.parametrize(("exc", "line", "typed"), [
    (ValueError("a\n   b\tc"), "ValueError: a b c", "ValueError: a b c"),
    # An empty message: a sweep row drops the dangling separator, the planner keeps it.
    (RuntimeError(), "RuntimeError", "RuntimeError: "),
    (KeyError("k"), "KeyError: 'k'", "KeyError: 'k'"),
])
def test_error_wording(exc: BaseException, line: str, typed: str) -> None:
    assert one_line(exc) == line
    assert type_and_message(exc) == typed


def test_attempt_turns_an_exception_into_a_record() -> None:
    def boom() -> dict[str, Any]:
        raise ZeroDivisionError("float division by zero")

    out = attempt(7, boom)
    assert (out.index, out.summary, out.error) == (7, None,
                                                   "ZeroDivisionError: float division by zero")
    assert out.wall_s >= 0.0
    ok = attempt(3, lambda: {"step_time_s": 1.5}, type_and_message)
    assert (ok.index, ok.summary, ok.error) == (3, {"step_time_s": 1.5}, None)

    def interrupted() -> dict[str, Any]:
        raise KeyboardInterrupt

    # Not an Exception (Ctrl-C, SystemExit): not a variant's failure, so it propagates.
    with pytest.raises(KeyboardInterrupt):
        attempt(0, interrupted)


# --------------------------------------------------------------------------- simulations
def test_run_batch_keeps_order_and_a_refused_variant_as_a_row() -> None:
    # micro-batch 4 on dp = 4 is 16 sequences for a global batch of 8: the ddp builder
    # refuses it (ScenarioError); the other two simulate exactly as sim.api.simulate does.
    good, refused = _tiny(), _tiny(micro_batch_size=4)
    tasks = [Task(0, good, {}), Task(1, refused, {}), Task(2, good, {})]
    outs = run_batch(tasks, 1, "tiny.yaml")
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[1].summary is None
    assert outs[1].error == ("ScenarioError: tiny.yaml: training.global_batch_size: 8 is not a "
                             "multiple of micro_batch_size x dp = 4 x 4")
    direct = _no_wall(sim.api.simulate(good, 1, origin="tiny.yaml").summary)
    for o in (outs[0], outs[2]):
        assert o.error is None and o.summary is not None
        assert _no_wall(o.summary) == direct


def test_before_variant_failure_is_that_variants_error() -> None:
    def refuse_second(values: dict[str, Any]) -> None:
        if values["i"] == 1:
            raise RuntimeError("injected")

    tasks = [Task(i, _tiny(), {"i": i}) for i in range(2)]
    outs = run_batch(tasks, 1, "x", before_variant=refuse_second)
    assert [o.error for o in outs] == [None, "RuntimeError: injected"]


@pytest.mark.parametrize(("exc", "compared", "swept", "planned"), [
    (RuntimeError("boom\n  here"), "internal error: RuntimeError: boom\n  here",
     "RuntimeError: boom here", "RuntimeError: boom here"),
    (RuntimeError(), "internal error: RuntimeError: ", "RuntimeError", "RuntimeError: "),
    (ScenarioError("x.yaml: parallelism.tp: refused"), "x.yaml: parallelism.tp: refused",
     "ScenarioError: x.yaml: parallelism.tp: refused",
     "ScenarioError: x.yaml: parallelism.tp: refused"),
])
def test_the_three_apps_word_one_failure_as_they_always_did(
        monkeypatch: pytest.MonkeyPatch, exc: BaseException, compared: str, swept: str,
        planned: str) -> None:
    # Every app reaches sim.api.simulate through the executor; one failure there is kept as
    # a record by each, in its own wording (compare's table and exit status, sweep's rows and
    # plan's candidates read them as before).
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(sim.api, "simulate", failing)
    base = _tiny()
    variants = [compare.Variant("a", base, "tiny.yaml"), compare.Variant("b", base, "t.yaml")]
    compare.simulate_variants(variants)
    assert [(v.summary, v.error) for v in variants] == [(None, compared)] * 2
    assert sweep.run_batch([Task(0, base, {})], 1, "x")[0].error == swept
    layout = plan.Layout("ddp", 1, 1, 4, 1, 1, 1, "none")
    got = plan.simulate_layout(base, layout)
    assert (got.summary, got.error) == (None, planned)


def test_compare_records_a_success_and_a_refusal() -> None:
    variants = [compare.Variant("ok", _tiny(), "tiny.yaml"),
                compare.Variant("mbs4", _tiny(micro_batch_size=4), "tiny.yaml")]
    compare.simulate_variants(variants)
    assert variants[0].error is None and variants[0].summary is not None
    assert variants[1].summary is None
    # A ScenarioError is the user's to fix: its own line, with no type in front.
    assert variants[1].error == ("tiny.yaml: training.global_batch_size: 8 is not a multiple "
                                 "of micro_batch_size x dp = 4 x 4")
    assert simulate_task(Task(0, _tiny(), {}), 1, "tiny.yaml").error is None


# --------------------------------------------------------------------------- the pool
def test_inline_pool_surfaces_exceptions_through_the_future() -> None:
    pool = Pool(1)
    assert pool.submit(divmod, 7, 2).result() == (3, 1)
    with pytest.raises(ZeroDivisionError):
        pool.submit(divmod, 1, 0).result()
    # fn(first, chunk, *rest) over chunks, results in order (one chunk with one worker).
    assert pool.map_chunks(lambda k, chunk: [k * x for x in chunk], [1, 2, 3], 10) == \
        [10, 20, 30]
    assert pool.map_chunks(lambda k, chunk: chunk, [], 10) == []


# --------------------------------------------------------------------------- worker deaths
class ScriptedBackend(executor.Backend):
    """Runs tasks in this process, except that any batch holding ``killer`` loses its
    worker: in a shared batch the backend cannot tell who was running (``started`` None),
    alone the death is the variant's own."""

    name = "scripted"

    def __init__(self, killer: int, own_when_alone: bool = True) -> None:
        self.killer = killer
        self.own_when_alone = own_when_alone
        self.rounds: list[tuple[bool, list[list[int]]]] = []

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        self.rounds.append((isolated, [[t.index for t in b] for b in batches]))
        for b in batches:
            if any(t.index == self.killer for t in b):
                yield b, Lost("signal 9", None, own=self.own_when_alone and len(b) == 1)
            else:
                yield b, [Outcome(t.index, {"i": t.index}, None, 0.0) for t in b]


def test_a_dead_worker_costs_only_the_variant_that_killed_it() -> None:
    tasks = [Task(i, None, {}) for i in range(5)]  # type: ignore[arg-type]
    be = ScriptedBackend(killer=2)
    outs = sorted(run_tasks(be, tasks, size=2), key=lambda o: o.index)
    assert [o.index for o in outs] == [0, 1, 2, 3, 4]
    assert outs[2].error == "WorkerDied: signal 9 while simulating this variant"
    assert all(o.summary == {"i": o.index} for o in outs if o.index != 2)
    # First round: batches of two; then the lost batch's variants alone.
    assert be.rounds == [(False, [[0, 1], [2, 3], [4]]), (True, [[2], [3]])]


def test_a_variant_that_never_proves_the_culprit_gives_up_after_max_losses() -> None:
    # Deaths never pinned on the variant (the worker died outside it): MAX_WORKER_LOSSES
    # tries, then an error row rather than an endless retry.
    be = ScriptedBackend(killer=0, own_when_alone=False)
    outs = list(run_tasks(be, [Task(0, None, {})], size=1))  # type: ignore[arg-type]
    assert [o.error for o in outs] == ["WorkerDied: signal 9 while simulating this variant"]
    assert len(be.rounds) == executor.MAX_WORKER_LOSSES


def test_the_apps_share_the_one_backend_layer() -> None:
    # Names stay importable where they were (the CLI builds plan's Ray/Dask hook from sweep).
    assert sweep.make_backend is executor.make_backend
    assert sweep.run_tasks is executor.run_tasks and sweep.Task is executor.Task
    assert sweep.one_line is executor.one_line and sweep.BACKENDS is executor.BACKENDS
    assert plan.BACKENDS is executor.BACKENDS


class InlineBackend(executor.Backend):
    """The executor's backend contract, run in this process (what a Ray or Dask worker
    would run: :func:`sim.apps.executor.run_batch`), finishing batches last to first."""

    name = "inline"

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        for b in reversed(batches):
            yield b, run_batch(b, 1, self.origin)


def test_planner_backend_hook_matches_local_simulations_in_order() -> None:
    # The hook `fabricsim plan --backend ray|dask` uses: the same summaries and errors as the
    # planner's local simulate_layout, in the layouts' order whatever the finishing order.
    base = _tiny()
    layouts = [plan.Layout("ddp", 1, 1, 4, 1, 1, 4, "none"),   # 16 sequences > 8: refused
               plan.Layout("ddp", 1, 1, 4, 1, 1, 1, "none"),
               plan.Layout("ddp", 1, 1, 4, 1, 1, 2, "none")]
    remote = plan.backend_simulations(InlineBackend(plan.PLAN_ORIGIN))(base, layouts)
    local = [plan.simulate_layout(base, x) for x in layouts]
    assert [r.error for r in remote] == [x.error for x in local]
    assert remote[0].error is not None and "not a multiple of micro_batch_size x dp = 4 x 4" \
        in remote[0].error
    for r, x in zip(remote, local, strict=True):
        assert (r.summary is None) == (x.summary is None)
        if r.summary is not None and x.summary is not None:
            assert _no_wall(r.summary) == _no_wall(x.summary)
