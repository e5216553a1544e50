"""Simulated time on a grid: every delay a whole number of quanta (issue 13, item 3).

A double holds every multiple of :data:`QUANTUM_S` below ``2**53`` quanta (``2**17`` s, about
36 hours) exactly, so on the grid ``now + delay``, ``end - start`` and any sum of durations are
exact, and an interval's arithmetic does not depend on where in the run it falls: a period of a
schedule whose state repeats repeats to the last bit. Off the grid ``t + p + p`` is not
``t + 2p`` and no two periods of a steady pipeline would be bit-identical.

The quantum, ``2**-36`` s (15 ps), is far below anything the simulator prices (an NVLink
hop's latency is about 100 ns, a kernel launch some microseconds): rounding every delay up
to it moves a step by 15 ns at most per thousand dependent events, and a flow that ends up to
a quantum after its last byte carries under a byte more at 50 GB/s (the network counts each
flow's bytes as exactly its size all the same, ``FlowNetwork._credit_residue``).
"""

from __future__ import annotations

import math
from heapq import heappush

import simpy
from simpy.events import NORMAL, Event, EventPriority

QUANTUM_S = 2.0 ** -36
"""The grid's spacing in seconds; a power of two, so scaling by it is exact."""

_PER_S = 2.0 ** 36


def on_grid(delay: float) -> float:
    """``delay`` rounded up to a whole number of quanta (0 and infinity stay as they are).

    >>> on_grid(1e-9) == 69 * QUANTUM_S
    True
    >>> on_grid(3 * QUANTUM_S) == 3 * QUANTUM_S
    True
    """
    if delay <= 0 or delay == math.inf:
        return delay
    return math.ceil(delay * _PER_S) * QUANTUM_S


class GridEnvironment(simpy.Environment):
    """A simpy environment whose events all fall on the grid: each delay is rounded up to a
    whole number of quanta (:func:`on_grid`) before it is added to ``now``, so ``now`` stays
    on the grid and the sum is exact."""

    def schedule(self, event: Event, priority: EventPriority = NORMAL,
                 delay: float = 0) -> None:
        if delay:
            delay = on_grid(delay)
        heappush(self._queue, (self._now + delay, priority, next(self._eid), event))
