"""Killing loky's executor on Ctrl-C leaves no traceback of its own teardown race.

Seen in the clean-clone suite under load (tests/integration/test_plan_interrupt.py): after a
killed shutdown, loky's ``ExecutorManagerThread`` raised ``KeyError`` on a work item the
shutdown had cancelled and the default thread hook printed a traceback after the command's
one-line interrupt message. :func:`sim.apps.loky_teardown.kill_loky_executor` drops exceptions of
that thread from the shutdown on, and no one else's.
"""

from __future__ import annotations

import threading

import pytest

from sim.apps import loky_teardown as ex


class _Executor:
    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def shutdown(self, wait: bool = True, kill_workers: bool = False) -> None:
        self.calls.append((wait, kill_workers))


def _raise_in(name: str) -> None:
    def boom() -> None:
        raise KeyError(15)

    t = threading.Thread(target=boom, name=name)
    t.start()
    t.join()


def test_the_manager_threads_race_is_silent_and_others_are_not(monkeypatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: seen.append(args.thread.name if args.thread else ""))
    fake = _Executor()
    ex.kill_loky_executor(fake)
    assert fake.calls == [(False, True)]          # killed, not waited for
    _raise_in(ex.LOKY_MANAGER_THREAD)
    assert seen == []
    _raise_in("some-other-thread")
    assert seen == ["some-other-thread"]
    # A second abort in the same process does not wrap the hook again.
    hook = threading.excepthook
    ex.kill_loky_executor(fake)
    assert threading.excepthook is hook and fake.calls == [(False, True)] * 2


def test_the_name_is_lokys() -> None:
    loky = pytest.importorskip("joblib.externals.loky.process_executor")
    import inspect

    assert f'name="{ex.LOKY_MANAGER_THREAD}"' in inspect.getsource(loky._ExecutorManagerThread)
