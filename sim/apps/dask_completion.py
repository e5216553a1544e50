"""Dask tasks gathered as they finish, without waiting forever on one whose end was missed.

``distributed.as_completed(futures, with_results=True)`` tracks each future with a callback
that waits for it and then fetches its result; the callback catches only cancellation. A
future that finished and then lost its result (its worker killed before the fetch, the task
rerun and failed on the next worker) makes the fetch raise inside that callback, which then
never queues the future, and the iterator waits for it forever. Seen in `make test` under
load (``tests/integration/test_sweep_resume.py``'s killed-Dask-worker test: the scheduler held
the task as ``erred``, wanted by the client, while the sweep waited on ``as_completed`` with a
live, idle worker). :func:`completed` iterates the same way and, once nothing has finished for
:data:`RESYNC_S`, looks at the futures itself: one already done locally is taken as it is, and
one the scheduler holds as ``erred`` is reported failed with the scheduler's error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

RESYNC_S = 5.0
"""Seconds with no finished task before the pending futures are checked directly: the check is
one call to the scheduler, and a healthy sweep's tasks take seconds to minutes."""

POLL_S = 0.05
"""How often the iterator's queue is looked at while waiting."""


class TaskFailed(Exception):
    """A task the scheduler holds as failed whose failure the client never received."""


def _scheduler_states(dask_scheduler: Any, keys: list[Any]) -> dict[Any, tuple[str, str]]:
    """The scheduler's state and error text of each of ``keys`` it knows (one just submitted
    may not have reached it yet); run on the scheduler (``Client.run_on_scheduler``)."""
    out = {}
    for k in keys:
        ts = dask_scheduler.tasks.get(k)
        if ts is not None:
            out[k] = (ts.state, ts.exception_text or "")
    return out


def _local_outcome(fut: Any) -> tuple[bool, Any]:
    """A future that is done on the client: (True, its result) or (False, its exception)."""
    if fut.status == "error":
        return False, fut.exception(timeout=RESYNC_S)
    try:
        return True, fut.result(timeout=RESYNC_S)
    except Exception as exc:   # noqa: BLE001 - its result went with its worker
        return False, exc


def completed(client: Any, futures: list[Any], resync_s: float = RESYNC_S
              ) -> Iterator[tuple[Any, bool, Any]]:
    """Yield ``(future, ok, value)`` for each of ``futures`` once, as it finishes: ``ok`` True
    with its result, False with the exception it failed with (``KilledWorker`` when its worker
    died; :class:`TaskFailed` where only the scheduler knew).

    Parameters
    ----------
    client : distributed.Client the futures belong to
    futures : distributed futures
    resync_s : seconds with nothing finished before the pending futures are checked directly
        (default :data:`RESYNC_S`)

    Examples
    --------
    With a cluster at hand (not run as a doctest: it starts one)::

        from distributed import Client
        client = Client(processes=False)
        [(ok, v) for _, ok, v in completed(client, [client.submit(abs, -2)])]
        # [(True, 2)]
    """
    from distributed import as_completed

    pending = set(futures)
    ac = as_completed(list(futures), with_results=True, raise_errors=False)
    quiet_since = time.monotonic()
    while pending:
        batch = ac.next_batch(block=False)
        for fut, result in batch:
            if fut in pending:
                pending.discard(fut)
                if fut.status == "error":   # `result` is then sys.exc_info()
                    yield fut, False, result[1]
                else:
                    yield fut, True, result
        if batch:
            quiet_since = time.monotonic()
            continue
        if time.monotonic() - quiet_since >= resync_s:
            yield from _resync(client, pending)
            quiet_since = time.monotonic()
        time.sleep(POLL_S)


def _resync(client: Any, pending: set[Any]) -> Iterator[tuple[Any, bool, Any]]:
    """The pending futures the iterator missed: done on the client, or failed on the
    scheduler; removed from ``pending`` as they are yielded."""
    for fut in [f for f in pending if f.done()]:
        pending.discard(fut)
        ok, value = _local_outcome(fut)
        yield fut, ok, value
    if not pending:
        return
    by_key = {f.key: f for f in pending}
    try:
        states = client.run_on_scheduler(_scheduler_states, keys=list(by_key))
    except Exception:   # noqa: BLE001 - a scheduler busy or closing: ask again later
        return
    for key, (state, text) in states.items():
        if state == "erred" and key in by_key:
            fut = by_key[key]
            pending.discard(fut)
            yield fut, False, TaskFailed(text or "the scheduler holds the task as erred")
