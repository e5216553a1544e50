"""Killing joblib's loky executor on an interrupt without its teardown race's traceback.

:class:`sim.apps.executor.Pool` and :class:`sim.apps.executor.LocalBackend` kill their
workers on Ctrl-C (they ignore it themselves and may be deep in a long simulation); this is
the one place that shutdown happens.
"""

from __future__ import annotations

import threading
from typing import Any

LOKY_MANAGER_THREAD = "ExecutorManagerThread"
"""The name of the thread loky's executor feeds its workers from
(``joblib.externals.loky.process_executor``)."""


def kill_loky_executor(executor: Any) -> None:
    """Shut a loky executor down with its workers killed, silencing its manager thread.

    Killed mid-task, loky's manager thread can trip over the work items the shutdown has just
    cancelled (``KeyError`` in ``add_call_item_to_queue``, seen under load) and print a
    traceback after the command's one-line interrupt message; the exception is loky's
    teardown race, not the command's, so exceptions of that thread are dropped from then on.
    """
    if not getattr(threading.excepthook, "drops_loky_teardown", False):  # installed once
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if args.thread is not None and args.thread.name == LOKY_MANAGER_THREAD:
                return
            previous(args)

        hook.drops_loky_teardown = True  # type: ignore[attr-defined]
        threading.excepthook = hook
    executor.shutdown(wait=False, kill_workers=True)
