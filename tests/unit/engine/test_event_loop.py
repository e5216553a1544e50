"""``run_until`` runs events exactly as ``simpy.Environment.run(until=event)`` does (issue 13;
:mod:`sim.engine.event_loop`): the same order of same-time events, the same state after a
stop (the stopping event's other callbacks run when the next run resumes), the same value,
and a failed event crashes the run."""

from __future__ import annotations

import pytest
import simpy

from sim.engine.event_loop import run_until


def _world(log: list) -> tuple[simpy.Environment, list[simpy.Process]]:
    # Three workers with colliding wake-up times and a shared event each waits on: the order
    # of same-time events is simpy's (time, priority, schedule order).
    env = simpy.Environment()
    gate = env.event()

    def worker(i: int):
        for k in range(4):
            yield env.timeout((i * k) % 3 * 0.5)
            log.append((env.now, i, k))
            if i == 1 and k == 1 and not gate.triggered:
                gate.succeed(k)
        got = yield gate
        log.append((env.now, i, "gate", got))
        return i

    procs = [env.process(worker(i)) for i in range(3)]

    def watcher():
        # Waits on the first worker after a run stops at it: its callback comes after the
        # stop's, so it runs only when the next run resumes.
        yield env.timeout(0.1)
        got = yield procs[0]
        log.append((env.now, "watched", got))

    env.process(watcher())
    return env, procs


def _two_runs(run) -> list:
    log: list = []
    env, procs = _world(log)
    first = run(env, procs[0])
    log.append(("first", first, env.now))
    second = run(env, simpy.AllOf(env, procs))
    log.append(("all", sorted(second.todict().values()), env.now))
    return log


def test_the_same_events_in_the_same_order_as_simpy() -> None:
    assert _two_runs(run_until) == _two_runs(lambda env, ev: env.run(until=ev))


def test_a_processed_event_returns_its_value_and_a_failure_crashes() -> None:
    env = simpy.Environment()
    done = env.timeout(1.0, value="v")
    assert run_until(env, done) == "v"
    assert run_until(env, done) == "v"   # already processed: nothing runs

    def fails():
        yield env.timeout(1.0)
        raise ValueError("boom")

    proc = env.process(fails())
    with pytest.raises(ValueError, match="boom"):
        run_until(env, proc)
    with pytest.raises(RuntimeError, match="No scheduled events left"):
        run_until(simpy.Environment(), simpy.Environment().event())
