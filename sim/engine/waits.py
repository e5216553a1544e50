"""Lean stand-ins for the two simpy conditions the engine waits on per op (issue 13).

A stream waits for an op's dependencies with ``simpy.AllOf`` and a draining compute op for
"its end or a load change" with ``done | changed`` (an ``AnyOf``). simpy's
:class:`~simpy.events.Condition` is general (nested conditions, a
:class:`~simpy.events.ConditionValue` built on every trigger, a check that every event
belongs to the environment), and at the 3,072-GPU Megatron-LM 1T step it builds about 700k of
them. :class:`AllDone` and :class:`FirstOf` do what those two conditions do for the engine's
cases and nothing else, in the same order: each is scheduled by the same call, at the same
moment, as the condition it replaces (``succeed`` from the check callback of the event that
completes it), and a first-of removes its check callbacks when it is processed, as
``Condition._build_value`` does. So every simpy event is scheduled in the same sequence as
with simpy's conditions and the run is the same to the last bit
(``tests/unit/engine/test_waits.py`` runs both side by side).

simpy 4 ``simpy/events.py``: ``Condition.__init__``, ``_check``, ``_build_value``,
``_remove_check_callbacks``, ``Condition.all_events`` / ``any_events``.
"""

from __future__ import annotations

from collections.abc import Sequence

import simpy
from simpy.events import PENDING


class AllDone(simpy.Event):
    """``simpy.AllOf(env, events)`` for events none of which is processed yet: succeeds
    (value None) when the last of them is processed; fails as the first failing one."""

    def __init__(self, env: simpy.Environment, events: Sequence[simpy.Event]) -> None:
        self.env = env
        self.callbacks = []
        self._value = PENDING
        self._left = len(events)
        check = self._check
        for ev in events:
            assert ev.callbacks is not None, "AllDone waits only for unprocessed events"
            ev.callbacks.append(check)

    def _check(self, event: simpy.Event) -> None:
        if self._value is not PENDING:
            return
        self._left -= 1
        if not event._ok:
            event._defused = True
            self.fail(event._value)
        elif not self._left:
            self.succeed()


class FirstOf(simpy.Event):
    """``a | b`` for two unprocessed events: succeeds (value None) when the first of them is
    processed. Read which with ``a.processed`` after the wait (simpy's
    :class:`~simpy.events.ConditionValue` holds exactly the events processed by then)."""

    def __init__(self, env: simpy.Environment, a: simpy.Event, b: simpy.Event) -> None:
        self.env = env
        self.callbacks = [self._unhook]
        self._value = PENDING
        self._pair = (a, b)
        check = self._check
        assert a.callbacks is not None and b.callbacks is not None
        a.callbacks.append(check)
        b.callbacks.append(check)

    def _check(self, event: simpy.Event) -> None:
        if self._value is not PENDING:
            return
        if not event._ok:
            event._defused = True
            self.fail(event._value)
        else:
            self.succeed()

    def _unhook(self, _event: simpy.Event) -> None:
        # As Condition._build_value: an event still to come no longer calls this one.
        check = self._check
        for ev in self._pair:
            if ev.callbacks and check in ev.callbacks:
                ev.callbacks.remove(check)
