"""A leaner ``simpy.Environment.run(until=event)`` for the engine's hot loop (issue 13).

The 3,072-GPU Megatron-LM 1T step processes about six million simpy events; simpy's
``run`` calls ``Environment.step`` once per event. :func:`run_until` is the same loop with
``step``'s body inlined (simpy 4's ``core.py``, line for line: the same heap, the same order
of callbacks, the same handling of ``StopSimulation`` and of failed events), so every event
runs as it would, for one Python call less each. simpy stays the engine's model.
"""

from __future__ import annotations

from heapq import heappop
from typing import Any

import simpy
from simpy.core import EmptySchedule, StopSimulation
from simpy.events import EventPriority


def run_until(env: simpy.Environment, until: simpy.Event) -> Any:
    """``env.run(until=until)`` for an event ``until``; returns its value."""
    if until.callbacks is None:
        return until.value   # already processed
    until.callbacks.append(StopSimulation.callback)
    queue = env._queue
    try:
        while True:
            try:
                env._now, _, _, event = heappop(queue)
            except IndexError:
                raise EmptySchedule from None
            callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
            try:
                for callback in callbacks:
                    callback(event)
            except StopSimulation:
                # As simpy: the remaining callbacks run when the simulation resumes.
                event.callbacks = callbacks[callbacks.index(callback) + 1:]
                env.schedule(event, EventPriority(-1))
                raise
            if not event._ok and not hasattr(event, "_defused"):
                exc = type(event._value)(*event._value.args)
                exc.__cause__ = event._value
                raise exc
    except StopSimulation as stop:
        return stop.args[0]
    except EmptySchedule:
        assert not until.triggered
        raise RuntimeError(f'No scheduled events left but "until" event was not '
                           f"triggered: {until}") from None
