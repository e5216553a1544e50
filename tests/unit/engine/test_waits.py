"""``AllDone`` and ``FirstOf`` (sim.engine.waits) run a simulation exactly as simpy's ``AllOf``
and ``|`` do: the same resumptions in the same order at the same times, the same events
scheduled (the heap counter), the same outcome of "which came first"."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.waits import AllDone, FirstOf

# A world of workers: each waits on a random subset of earlier workers' "done" events (all
# of them) and, between steps, races a timer against a shared "changed" event that others
# fire, as the engine's draining compute ops do. Delays are small multiples of 0.5 so that
# many events fall at the same time and only schedule order separates them.
_worker = st.tuples(
    st.lists(st.integers(0, 30), max_size=4),          # whom it waits for (earlier indices)
    st.lists(st.integers(0, 3), min_size=1, max_size=4),  # its step lengths (x 0.5)
    st.integers(0, 3),                                  # fire "changed" after this step
)


def _run(workers: list, lean: bool) -> tuple[list, int]:
    env = simpy.Environment()
    log: list = []
    done = [env.event() for _ in workers]
    state = {"changed": env.event()}

    def worker(i: int, waits: list[int], steps: list[int], fire: int):
        pending = [done[j % i] for j in waits if i and not done[j % i].processed]
        if pending:
            yield AllDone(env, pending) if lean else simpy.AllOf(env, pending)
        log.append((env.now, i, "start"))
        for k, d in enumerate(steps):
            timer = env.timeout(d * 0.5)
            changed = state["changed"]
            if lean:
                yield FirstOf(env, timer, changed)
                first = timer.processed
            else:
                fired = yield timer | changed
                first = timer in fired
            log.append((env.now, i, k, first))
            now_changed = state["changed"]   # as Engine._change_load: only when awaited
            if k == fire and now_changed.callbacks:
                state["changed"] = env.event()
                now_changed.succeed()
        done[i].succeed()

    for i, (waits, steps, fire) in enumerate(workers):
        env.process(worker(i, waits, steps, fire))
    env.run()
    return log, next(env._eid)


@settings(max_examples=150, deadline=None)
@given(st.lists(_worker, min_size=1, max_size=25))
def test_lean_waits_run_as_simpy_conditions(workers: list) -> None:
    assert _run(workers, lean=True) == _run(workers, lean=False)


def test_a_failed_event_fails_the_wait() -> None:
    env = simpy.Environment()
    a, b = env.event(), env.event()
    both = AllDone(env, [a, b])
    first = FirstOf(env, env.event(), b)
    b.fail(ValueError("x"))
    with pytest.raises(ValueError):   # as a Condition: b's failure passes to the wait,
        env.run()                     # and nobody defuses the wait's
    assert not both.ok and isinstance(both.value, ValueError)
    assert not first.ok and isinstance(first.value, ValueError)
