"""The cyclic garbage collector held off while a step is built and run (issue 13).

While a program is built and run, millions of objects that live to the end (ops, op records,
rate series) are created and the collector would traverse them again and again while nothing
cyclic dies: a fifth of a 1,024-GPU step's wall time, and 20 s of building and running a
3,072-GPU one (docs/performance.md, item 1). :func:`paused_gc` holds it off inside.

What it then saves: the collector's first young-generation pass after the pause traverses
everything the run made, and nearly all of it survives (at the 1T 3,072-GPU step about eight
million objects, 4-5 s; at 64 micro-batches 1.24 million objects of which 8% were garbage).
A run that made more than :data:`PROMOTE_ABOVE` objects hands them straight to the oldest
generation instead (``gc.freeze(); gc.unfreeze()``: two list splices), where CPython itself
would move what survives two passes.

The price is that CPython no longer counts them: its full collection waits until the objects
that survived into the oldest generation since the last one exceed a quarter of those it kept
(``long_lived_pending > long_lived_total / 4``, CPython 3.11 ``Modules/gcmodule.c``,
``gc_collect_generations``), and objects moved here never enter that count. Alone, that let
the cyclic garbage of finished runs pile up (60 runs in one process: 877k live objects
against 194k). So this module keeps the same rule for what it moves: when the objects it
handed over since its last full collection exceed a quarter of what that collection kept, the
next paused section starts with a full collection (before anything is built: the garbage of
the runs before, not the run's own objects). A single run never pays it; a process that runs
many (the planner, a sweep) pays one full pass per run, as it would have paid the young pass,
over less (what the caller still holds, not the run's own objects).

Nothing simulated depends on when the collector runs.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

PROMOTE_ABOVE = 200_000
"""Young objects (``gc.get_count()[0]``, allocations less deallocations of tracked objects)
above which a pause hands them to the oldest generation. Below, the young pass is cheap (about
0.1 s at 200k objects) and left to CPython."""

_state = {"moved": 0, "kept": 0}
"""``moved``: objects handed to the oldest generation since this module's last full
collection; ``kept``: objects tracked right after it (0 before the first)."""


def _count_tracked() -> int:
    """Objects the collector tracks, all in the oldest generation right after a full
    collection: counted by moving them to the permanent generation and back (a walk of the
    list, no list of them built)."""
    gc.freeze()
    n = gc.get_freeze_count()
    gc.unfreeze()
    return n


def _collect_if_due() -> None:
    if _state["moved"] and _state["moved"] > _state["kept"] // 4 \
            and gc.get_freeze_count() == 0:
        gc.collect()
        _state["moved"] = 0
        _state["kept"] = _count_tracked()


def _promote() -> None:
    """Hand the young objects to the oldest generation when there are many, unless someone
    else keeps objects frozen (``gc.freeze`` before a fork): unfreezing would thaw theirs."""
    young = gc.get_count()[0]
    if young > PROMOTE_ABOVE and gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
        _state["moved"] += young


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off inside, as it was after (nested: only the outermost
    acts). Objects still die by reference count inside; cycles wait for a later collection.

    Examples
    --------
    >>> with paused_gc():
    ...     pass
    """
    collecting = gc.isenabled()
    if collecting:
        _collect_if_due()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            _promote()
            gc.enable()
