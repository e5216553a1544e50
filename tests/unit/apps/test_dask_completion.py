"""Dask futures gathered as they finish even where ``as_completed`` misses one
(sim/apps/dask_completion.py).

The hang this guards against: distributed's ``as_completed(with_results=True)`` never queues a
future whose result fetch raised inside its tracking callback, and the scheduler's ``erred``
report can be the last word on a task whose worker died. The fakes below stand for exactly
those two states (an iterator that drops a future; a future the client still sees pending while
the scheduler holds it as erred), so each test fails if :func:`completed` trusts the iterator
alone: it would wait forever, which the fake clock turns into a failure after
:data:`MAX_POLLS` polls.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from sim.apps import dask_completion
from sim.apps.dask_completion import TaskFailed, completed


class FakeFuture:
    def __init__(self, key: str, status: str = "pending", value: Any = None) -> None:
        self.key, self.status, self.value = key, status, value

    def done(self) -> bool:
        return self.status in ("finished", "error")

    def result(self, timeout: float | None = None) -> Any:
        if self.status == "error":
            raise self.value
        return self.value

    def exception(self, timeout: float | None = None) -> BaseException:
        return self.value


class DroppingAsCompleted:
    """``as_completed`` that yields the futures it was given except those in ``drop``
    (whose tracking callback raised), each once, already finished."""

    drop: set[str] = set()

    def __init__(self, futures: list[FakeFuture], **_: Any) -> None:
        self.queue = [f for f in futures if f.key not in self.drop and f.done()]

    def next_batch(self, block: bool = True) -> list[tuple[FakeFuture, Any]]:
        out = [(f, f.value if f.status != "error" else (type(f.value), f.value, None))
               for f in self.queue]
        self.queue = []
        return out


class FakeClient:
    def __init__(self, scheduler: dict[str, tuple[str, str]]) -> None:
        self.scheduler = scheduler

    def run_on_scheduler(self, fn: Any, keys: list[str]) -> dict[str, tuple[str, str]]:
        fake = types.SimpleNamespace(tasks={
            k: types.SimpleNamespace(state=s, exception_text=t)
            for k, (s, t) in self.scheduler.items()})
        return fn(fake, keys)


MAX_POLLS = 2000
"""Polls after which a test calls the wait endless (each poll sleeps 0.1 ms)."""


class FakeClock:
    """``time`` for the module under test: real monotonic time, a sleep that counts its
    polls, fails past :data:`MAX_POLLS` and may run ``on_poll`` (work finishing meanwhile)."""

    def __init__(self) -> None:
        self.polls = 0
        self.on_poll: Callable[[int], None] | None = None
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll(self.polls)
        assert self.polls < MAX_POLLS, "completed() waits forever on a finished task"
        time.sleep(1e-4)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    mod = types.ModuleType("distributed")
    mod.as_completed = DroppingAsCompleted  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "distributed", mod)
    DroppingAsCompleted.drop = set()
    c = FakeClock()
    monkeypatch.setattr(dask_completion, "time", c)
    return c


def _drain(client: Any, futures: list[FakeFuture]) -> dict[str, tuple[bool, Any]]:
    out = {}
    for fut, ok, value in completed(client, futures, resync_s=0.01):
        assert fut.key not in out              # each future once
        out[fut.key] = (ok, value)
    return out


def test_a_finished_future_the_iterator_dropped_is_still_yielded(clock):
    DroppingAsCompleted.drop = {"b", "c"}
    dead = RuntimeError("KilledWorker: the worker died")
    futures = [FakeFuture("a", "finished", 1), FakeFuture("b", "finished", 2),
               FakeFuture("c", "error", dead)]
    out = _drain(FakeClient({}), futures)
    assert out == {"a": (True, 1), "b": (True, 2), "c": (False, dead)}


def test_a_task_erred_on_the_scheduler_but_pending_here_is_reported_failed(clock):
    # The client never heard: its future is still pending; the scheduler holds it erred.
    futures = [FakeFuture("a", "finished", 1), FakeFuture("b")]
    client = FakeClient({"a": ("memory", ""), "b": ("erred", "KilledWorker: died twice")})
    out = _drain(client, futures)
    assert out["a"] == (True, 1)
    ok, exc = out["b"]
    assert not ok and isinstance(exc, TaskFailed) and "KilledWorker" in str(exc)


def test_pending_work_is_waited_for_not_failed(clock):
    # A task still running (or not yet known to the scheduler) is neither yielded nor failed
    # at a resync: it comes out once it finishes.
    fut = FakeFuture("a")

    def finish(polls: int) -> None:
        if polls == 50:
            fut.status, fut.value = "finished", 7

    clock.on_poll = finish
    out = [(f.key, ok, v) for f, ok, v in completed(FakeClient({}), [fut], resync_s=0.0)]
    assert out == [("a", True, 7)]
    assert clock.polls >= 50
