"""A Dask cluster started for a sweep that is left with no worker gets new ones.

distributed's nanny starts a new worker process when one dies (a variant that segfaults, the
OOM killer). Where that restart fails, as it can on a loaded machine, the nanny logs "Failed
to restart worker after its process exited" and keeps no worker (``distributed.nanny``,
``Nanny._on_worker_exit``); the scheduler then holds the sweep's tasks with nowhere to run
them and ``as_completed`` waits forever (seen once in `make test`: the killed-worker test of
``tests/integration/test_sweep_resume.py`` hung with no worker process left). The watch polls
the scheduler from a thread; once the cluster has had no worker for :data:`REVIVE_AFTER_S`
it replaces the cluster's workers (``scale(0)``, then ``scale(n)``), and the queued tasks run
on the new ones. Only for a cluster the sweep started: one given by ``--address`` is its
owner's to manage.
"""

from __future__ import annotations

import threading
import time
from typing import Any

REVIVE_AFTER_S = 60.0
"""Seconds with no worker before the cluster's workers are replaced: well above a worker's
start (2-5 s here, imports included; a dead worker's nanny restarts it within that), so a
restart that is only slow is not cut short."""

POLL_S = 1.0
"""How often the scheduler is asked how many workers it has."""


class ClusterWatch:
    """Replaces a local cluster's workers when it has had none for ``revive_after_s``.

    Parameters
    ----------
    client, cluster : distributed's Client and the LocalCluster it is connected to
    workers : how many workers the cluster should have
    revive_after_s : seconds with no worker before they are replaced (default
        :data:`REVIVE_AFTER_S`)
    """

    def __init__(self, client: Any, cluster: Any, workers: int,
                 revive_after_s: float | None = None) -> None:
        self.client, self.cluster, self.workers = client, cluster, workers
        self.revive_after_s = REVIVE_AFTER_S if revive_after_s is None else revive_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fabricsim-cluster-watch",
                                        daemon=True)
        self._thread.start()

    def _workers_now(self) -> int | None:
        try:
            return len(self.client.scheduler_info().get("workers", {}))
        except Exception:   # noqa: BLE001 - a scheduler busy or closing: ask again later
            return None

    def _watch(self) -> None:
        empty_since: float | None = None
        while not self._stop.wait(POLL_S):
            n = self._workers_now()
            if n is None or n > 0:
                empty_since = None
                continue
            now = time.monotonic()
            if empty_since is None:
                empty_since = now
            elif now - empty_since >= self.revive_after_s and not self._stop.is_set():
                self.cluster.scale(0)
                self.cluster.scale(self.workers)
                empty_since = None

    def stop(self) -> None:
        """End the watch (before the cluster closes)."""
        self._stop.set()
        self._thread.join(timeout=5 * POLL_S)
