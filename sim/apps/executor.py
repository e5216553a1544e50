"""The executor: simulate many scenarios, here or on a cluster, and keep each failure as a
record with its one-line error instead of stopping.

One home for what ``fabricsim compare``, ``sweep`` and ``plan`` share when they run their
variants:

- :func:`attempt` runs one piece of work, timed; an exception becomes the
  :class:`Outcome`'s ``error`` (one line, in the caller's :data:`ErrorText` form) and the
  others go on. :func:`simulate_task` is that for one scenario through
  :func:`sim.api.simulate`; :func:`run_batch` for several, as a worker process runs them.
- :class:`Pool` runs functions in this process (one worker) or in joblib's loky processes
  (several), with futures either way (the planner's builds and simulations).
- The backends (:data:`BACKENDS`): local processes (:class:`LocalBackend`, loky), a Ray
  cluster (:class:`RayBackend`) or a Dask cluster (:class:`DaskBackend`), opened with
  :func:`make_backend`. :func:`run_tasks` drives :class:`Task` s on one to completion,
  several to a worker task (:func:`batch_size`), and turns a worker process that dies (a
  segfault, the kernel's OOM killer, ``os._exit``) into a ``WorkerDied`` error for the
  variant that killed it, every other variant kept; :func:`simulate_in_order` waits for
  all of them and returns them in the tasks' order.

Each app words an error its own way, as it always has (:data:`ErrorText`): a sweep row's
:func:`one_line`, the planner's :func:`type_and_message`, compare's
:func:`sim.apps.compare.variant_error`.

Nothing here knows of grids, deltas or layouts: each app turns outcomes into its own rows
(``sim/apps/sweep/__init__.py``), variants (``sim/apps/compare.py``) or candidates
(``sim/apps/plan/__init__.py``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.analysis.summary import Summary
from sim.apps.cluster_watch import ClusterWatch
from sim.apps.dask_completion import completed
from sim.apps.loky_teardown import kill_loky_executor
from sim.scenario import Scenario, ScenarioError

BACKENDS = ("local", "ray", "dask")
"""Where variants run: processes on this machine, a Ray cluster, a Dask cluster."""

TASKS_PER_WORKER = 4
"""Tasks per worker a sweep is cut into: enough that a slow task at the end leaves the other
workers idle for at most about a quarter of one worker's share (load balance), few enough that
per-task overhead stays small."""

MAX_BATCH = 16
"""Most variants in one task. A task's results come back together, so this bounds how much a
dying worker loses and how coarse the progress bar is. Per-task overhead, measured with 400
no-op tasks on 2 workers on this project's 2-core machine: loky 0.2 ms, Ray 0.8 ms, Dask
3.8 ms; a variant of the smallest scenarios takes 5-40 ms (``llama3.2-1b-ddp-8xh100``:
20-40 ms), so 16 to a task bring Dask's overhead to 0.24 ms a variant, under 5% of even the
5 ms ones."""

MAX_WORKER_LOSSES = 3
"""A variant that loses its worker this many times without being shown to be the culprit
(the worker died outside any variant) gets an error row instead of another try."""


# --------------------------------------------------------------------------- one variant
ErrorText = Callable[[BaseException], str]
"""How an app words a failed variant's error (one line)."""


def type_and_message(exc: BaseException) -> str:
    """``Type: message``, the message's whitespace runs collapsed to one space (the
    planner's records: an empty message leaves ``Type: ``)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a sweep row's ``error``): :func:`type_and_message`
    without the trailing ``": "`` an empty message leaves."""
    return type_and_message(exc).rstrip(": ")


@dataclass(frozen=True)
class Task:
    """One variant to simulate, as shipped to a worker."""

    index: int
    scenario: Scenario
    values: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What a worker returns for one variant: a summary or an error, and its wall seconds."""

    index: int
    summary: Summary | None
    error: str | None
    wall_s: float


def attempt(index: int, work: Callable[[], Summary],
            describe: ErrorText = one_line) -> Outcome:
    """Run ``work`` (which returns a summary), timed; an exception becomes the outcome's
    error, worded by ``describe``, instead of propagating."""
    t0 = time.perf_counter()
    try:
        summary = work()
    except Exception as exc:   # a failed variant is a record, not a crash
        return Outcome(index, None, describe(exc), time.perf_counter() - t0)
    return Outcome(index, summary, None, time.perf_counter() - t0)


def simulate_task(task: Task, steps: int, origin: str, describe: ErrorText = one_line,
                  before_variant: Callable[[dict[str, Any]], None] | None = None) -> Outcome:
    """Simulate one variant with :func:`sim.api.simulate` (``origin`` names it in
    messages), with its ``run`` object when the scenario has a ``run:`` block
    (:func:`sim.apps.runlength.run_length`); its failure, ``before_variant``'s included,
    becomes the outcome's error."""
    from sim.api import simulate

    def work() -> Summary:
        if before_variant is not None:
            before_variant(task.values)
        result = simulate(task.scenario, steps, origin=origin)
        if task.scenario.run is not None:
            # The whole run (``run:`` block), as ``fabricsim run`` adds it: compare's and a
            # sweep's rows carry ETTR, days and dollars for a what-if over faults or checkpoints.
            from sim.apps.runlength import run_length

            result.summary["run"] = run_length(result)
        return result.summary

    return attempt(task.index, work, describe)


def run_batch(tasks: list[Task], steps: int, origin: str,
              marker_dir: str | None = None,
              before_variant: Callable[[dict[str, Any]], None] | None = None
              ) -> list[Outcome]:
    """Simulate a batch of variants in a worker; an exception becomes that variant's error.

    ``marker_dir`` (local backend only) holds a file per variant while it runs, so that when
    a worker process dies the gathering process knows which variants were running.
    ``before_variant`` is called with each variant's grid values first (tests use it to make
    a worker die).
    """
    out: list[Outcome] = []
    for t in tasks:
        marker = Path(marker_dir) / str(t.index) if marker_dir else None
        if marker is not None:
            marker.write_text(str(os.getpid()))
        out.append(simulate_task(t, steps, origin, one_line, before_variant))
        if marker is not None:
            marker.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- here
class Pool:
    """Runs functions now (one worker) or in joblib's loky processes (several)."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._executor: Any = None
        if self.workers > 1:
            from joblib.externals.loky import get_reusable_executor

            # Ctrl-C is the parent's (:meth:`abort`), as for the sweep's workers.
            self._executor = get_reusable_executor(max_workers=self.workers,
                                                   initializer=_ignore_interrupt)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is not None:
            return self._executor.submit(fn, *args)
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:   # surfaced by fut.result(), as a process pool would
            fut.set_exception(exc)
        return fut

    def abort(self) -> None:
        """Kill the worker processes now (on an interrupt: they ignore Ctrl-C themselves and
        may be deep in a long simulation, so they are not waited for)."""
        if self._executor is not None:
            kill_loky_executor(self._executor)
            self._executor = None

    @contextmanager
    def killed_on_interrupt(self) -> Iterator[Pool]:
        """Within it, Ctrl-C kills the workers (:meth:`abort`) before it propagates."""
        try:
            yield self
        except KeyboardInterrupt:
            self.abort()
            raise

    def map_chunks(self, fn: Callable[..., list[Any]], items: list[Any], *args: Any
                   ) -> list[Any]:
        """``fn(*args[:1], chunk, *args[1:])`` over chunks of ``items``, results in order."""
        if not items:
            return []
        n = self.workers * 4 if self.workers > 1 else 1
        size = max(1, math.ceil(len(items) / n))
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        futures = [self.submit(fn, args[0], chunk, *args[1:]) for chunk in chunks]
        out: list[Any] = []
        for f in futures:
            out.extend(f.result())
        return out


# --------------------------------------------------------------------------- backends
def batch_size(variants: int, workers: int) -> int:
    """Variants per task: about :data:`TASKS_PER_WORKER` tasks per worker, at most
    :data:`MAX_BATCH` variants each.

    Examples
    --------
    >>> batch_size(200, 2), batch_size(20, 2), batch_size(3, 8)
    (16, 2, 1)
    """
    return max(1, min(MAX_BATCH, variants // (TASKS_PER_WORKER * max(1, workers))))


@dataclass
class Lost:
    """A task whose worker process died."""

    message: str
    """How the worker ended."""
    started: frozenset[int] | None = None
    """The variants that were running when it died (None: unknown, all of the task's)."""
    own: bool = False
    """The death is the task's own: it was a single variant and nothing else was lost with
    it (Ray and Dask fail only the task a dead worker was running; the local backend when
    one variant ran alone)."""


class Backend:
    """Runs batches of tasks somewhere and yields each batch with its outcomes (or
    :class:`Lost`) as it finishes."""

    name = "backend"
    workers = 1

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`run` started."""

    def abort(self) -> None:
        """Stop at once (an interrupt): what runs is abandoned; then :meth:`close`."""
        self.close()


class LocalBackend(Backend):
    """Processes on this machine: joblib's loky executor (``get_reusable_executor``), the
    one behind ``joblib.Parallel(backend="loky")``, used directly because ``Parallel`` runs
    ``n_jobs=1`` in the calling process, where a dying variant would take the sweep down.

    loky cannot tell which task killed a worker: when one dies, the executor terminates
    every worker and fails every pending task (``TerminatedWorkerError``). So each variant
    leaves a marker file while it runs (:func:`run_batch`); the markers left after a crash
    name the variants that were running. Those are run again one at a time (``isolated``),
    where a death is the variant's own.
    """

    name = "local"

    def __init__(self, workers: int, steps: int, origin: str,
                 before_variant: Callable[[dict[str, Any]], None] | None) -> None:
        self.workers = workers
        self.steps = steps
        self.origin = origin
        self.before_variant = before_variant
        self.marker_root = Path(tempfile.mkdtemp(prefix="fabricsim-sweep-"))
        self.rounds = 0
        self.executor: Any = None

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        from joblib.externals.loky import get_reusable_executor

        # A folder per round: a worker killed late in one round cannot mark the next.
        self.rounds += 1
        markers = self.marker_root / str(self.rounds)
        markers.mkdir()
        executor = get_reusable_executor(
            max_workers=1 if isolated else min(self.workers, len(batches)),
            initializer=_ignore_interrupt)
        self.executor = executor
        futures = {executor.submit(run_batch, b, self.steps, self.origin, str(markers),
                                   self.before_variant): b for b in batches}
        lost: Lost | None = None
        for fut in as_completed(futures):
            exc = fut.exception()
            if exc is None:
                yield futures[fut], fut.result()
            elif isinstance(exc, BrokenProcessPool):  # loky's TerminatedWorkerError
                if lost is None:
                    started = frozenset(int(p.name) for p in markers.iterdir())
                    # Alone (one worker, one task at a time) the marked variant is the one.
                    lost = Lost(_worker_death(exc), started or None,
                                own=isolated and len(started) == 1)
                yield futures[fut], lost
            else:
                raise exc

    def close(self) -> None:
        shutil.rmtree(self.marker_root, ignore_errors=True)

    def abort(self) -> None:
        # The reusable executor outlives a sweep; on an interrupt its workers may be deep in
        # a long variant, so they are killed rather than waited for.
        try:
            if self.executor is not None:
                kill_loky_executor(self.executor)
        finally:
            self.close()


def _ignore_interrupt() -> None:
    """A loky worker's initializer: Ctrl-C (SIGINT to the terminal's process group) is the
    parent's to handle, which kills the workers (:meth:`LocalBackend.abort` for the sweep,
    :meth:`Pool.abort` for the planner); a worker that took it would die mid-start and print
    multiprocessing's traceback beside the parent's one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_death(exc: BaseException) -> str:
    # loky's message is a paragraph; keep what says how the worker ended.
    codes = re.search(r"exit codes of the workers are (\{[^}]*\})", str(exc))
    if codes:
        return f"the worker process died (exit codes {codes.group(1)})"
    return f"the worker process died ({_first_sentence(exc)})"


def _first_sentence(exc: BaseException) -> str:
    # Ray's and Dask's messages go on to advise where to look; the row needs what happened.
    text = one_line(exc)
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


class RayBackend(Backend):
    """Tasks on a Ray cluster (``ray.init(address)``), or on a local Ray started for the
    sweep when no address is given; gathered with ``ray.wait`` as they finish."""

    name = "ray"

    def __init__(self, address: str | None, workers: int | None, steps: int, origin: str,
                 before_variant: Callable[[dict[str, Any]], None] | None) -> None:
        import logging

        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            if address:
                ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            else:
                ray.init(num_cpus=workers, include_dashboard=False,
                         logging_level=logging.ERROR, log_to_driver=False)
        self.workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.steps = steps
        self.origin = origin
        self.before_variant = before_variant
        # No automatic retry: a task whose worker died is split and retried by run_sweep,
        # which tells the variant that kills its worker from the ones beside it.
        self.remote = ray.remote(num_cpus=1, max_retries=0)(run_batch)
        self.waiting: list[Any] = []

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        ray = self.ray
        refs = {self.remote.remote(b, self.steps, self.origin, None, self.before_variant): b
                for b in batches}
        waiting = list(refs)
        self.waiting = waiting
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            if waiting:   # and whatever else is done, without waiting again
                more, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                ready += more
            self.waiting = waiting
            for ref in ready:
                try:
                    yield refs[ref], ray.get(ref)
                except Exception as exc:  # WorkerCrashedError, NodeDiedError, ...
                    yield refs[ref], Lost(f"the worker process died ({_first_sentence(exc)})",
                                          own=len(refs[ref]) == 1)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()

    def abort(self) -> None:
        # On a cluster that outlives the sweep, what it still runs would go on for nothing.
        try:
            for ref in self.waiting:
                self.ray.cancel(ref, force=True)
        except Exception:   # noqa: BLE001 - best effort on the way out
            pass
        finally:
            self.close()


class DaskBackend(Backend):
    """Tasks on a Dask cluster (``distributed.Client(address)``), or on a LocalCluster of
    single-threaded worker processes started for the sweep; gathered with
    ``as_completed`` as they finish."""

    name = "dask"

    def __init__(self, address: str | None, workers: int | None, steps: int, origin: str,
                 before_variant: Callable[[dict[str, Any]], None] | None) -> None:
        import logging

        import dask
        from distributed import Client, LocalCluster

        # The scheduler's own logging (workers lost, tasks rescheduled) would interleave with
        # the progress bar; what matters reaches the rows.
        self.logger = logging.getLogger("distributed")
        self.log_level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)
        self.cluster = None
        if address:
            self.client = Client(address)
        else:
            # One thread per process: the simulator is pure Python (the GIL would serialise
            # threads); no dashboard, whose port may be taken. worker-saturation 1.0 (default
            # 1.1, which rounds up to 2 tasks on a 1-thread worker): a worker holds only the
            # task it runs, so a dying worker takes no other task with it, and that task is
            # failed at once (allowed-failures 0, default 3): run_sweep retries its variants
            # itself and tells which one killed the worker.
            with dask.config.set({"distributed.scheduler.allowed-failures": 0,
                                  "distributed.scheduler.worker-saturation": 1.0}):
                self.cluster = LocalCluster(n_workers=workers or cpu_count(),
                                            threads_per_worker=1, processes=True,
                                            dashboard_address=None,
                                            silence_logs=logging.CRITICAL)
            self.client = Client(self.cluster)
        self.workers = workers or max(1, sum(self.client.nthreads().values()))
        self.watch = None if self.cluster is None else ClusterWatch(self.client, self.cluster,
                                                                    self.workers)
        self.futures: dict[Any, list[Task]] = {}
        self.steps = steps
        self.origin = origin
        self.before_variant = before_variant

    def run(self, batches: list[list[Task]], isolated: bool
            ) -> Iterator[tuple[list[Task], list[Outcome] | Lost]]:
        futures = {self.client.submit(run_batch, b, self.steps, self.origin, None,
                                      self.before_variant, pure=False): b for b in batches}
        self.futures = futures
        # Each result is fetched as its task finishes, before a later worker death can lose
        # it; a lost task comes back as its exception (KilledWorker).
        for fut, ok, value in completed(self.client, list(futures)):
            batch = futures.pop(fut)
            fut.release()
            if ok:
                yield batch, value
            else:
                yield batch, Lost(f"the worker process died ({_first_sentence(value)})",
                                  own=len(batch) == 1)

    def abort(self) -> None:
        # On a cluster that outlives the sweep, what it still runs would go on for nothing.
        try:
            self.client.cancel(list(self.futures), force=True)
        except Exception:   # noqa: BLE001 - best effort on the way out
            pass
        finally:
            self.close()

    def close(self) -> None:
        try:
            if self.watch is not None:
                self.watch.stop()
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.logger.setLevel(self.log_level)


def cpu_count() -> int:
    """Processes this machine may run at once."""
    try:
        from joblib import cpu_count as joblib_cpu_count

        return int(joblib_cpu_count())   # honours CPU affinity and cgroup quotas
    except ImportError:
        return os.cpu_count() or 1


def backend_missing(backend: str) -> str | None:
    """The one line a backend whose package is not installed is refused with, or None."""
    module, extra = {"local": ("joblib", "fabricsim"), "ray": ("ray", "fabricsim[ray]"),
                     "dask": ("distributed", "fabricsim[dask]")}[backend]
    try:
        __import__(module)
    except ImportError:
        return f"--backend {backend} needs the {module} package (pip install '{extra}')"
    return None


def make_backend(backend: str, address: str | None, workers: int | None, steps: int,
                 origin: str, before_variant: Callable[[dict[str, Any]], None] | None = None
                 ) -> Backend:
    """Start (or connect to) the backend; raise ScenarioError for a bad choice."""
    if backend not in BACKENDS:
        raise ScenarioError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    missing = backend_missing(backend)
    if missing:
        raise ScenarioError(missing)
    if backend == "local":
        if address:
            raise ScenarioError("--address: only with --backend ray or dask")
        return LocalBackend(workers or cpu_count(), steps, origin, before_variant)
    if backend == "ray":
        return RayBackend(address, workers, steps, origin, before_variant)
    return DaskBackend(address, workers, steps, origin, before_variant)


def run_tasks(be: Backend, tasks: list[Task], size: int = 1) -> Iterator[Outcome]:
    """Run ``tasks`` on an open backend, ``size`` per worker task, yielding each outcome as
    it finishes (in any order); a dead worker costs only its own variant. For callers that
    bring their own variants (``fabricsim plan --backend ray|dask``)."""
    return _drive(be, tasks, size)


def simulate_in_order(be: Backend, tasks: list[Task], size: int = 1) -> list[Outcome]:
    """:func:`run_tasks`, waiting for every outcome: one per task, in the tasks' order
    (task indices must be distinct)."""
    got = {o.index: o for o in run_tasks(be, tasks, size)}
    return [got[t.index] for t in tasks]


def _drive(be: Backend, todo: list[Task], size: int) -> Iterator[Outcome]:
    """Run tasks to completion on ``be``, surviving dead workers.

    A task whose worker died is split: its variants that were running (all of them where
    the backend cannot tell) are run again alone (``isolated``); its other variants are run
    again as before. A variant is retried once before a death is taken as its own: one
    that dies again alone gets a ``WorkerDied`` error (so does one lost
    :data:`MAX_WORKER_LOSSES` times without being shown the culprit).
    """
    queue = list(todo)
    suspects: list[Task] = []
    losses: dict[int, int] = {}
    while queue or suspects:
        isolated = bool(suspects)
        if isolated:
            current, suspects = suspects, []
            batches = [[t] for t in current]
        else:
            current, queue = queue, []
            batches = [current[i:i + size] for i in range(0, len(current), size)]
        for batch, result in be.run(batches, isolated):
            if not isinstance(result, Lost):
                yield from result
                continue
            for t in batch:
                if result.started is not None and t.index not in result.started:
                    (suspects if isolated else queue).append(t)   # had not started
                    continue
                losses[t.index] = losses.get(t.index, 0) + 1
                # Retried once at least, alone: a node lost or a worker killed from
                # outside costs one retry; a variant that kills its worker again is the
                # culprit and gets its error row.
                if (result.own and losses[t.index] >= 2) \
                        or losses[t.index] >= MAX_WORKER_LOSSES:
                    yield Outcome(t.index, None, f"WorkerDied: {result.message} while "
                                  "simulating this variant", 0.0)
                else:
                    suspects.append(t)


__all__ = ["BACKENDS", "Backend", "DaskBackend", "ErrorText", "LocalBackend", "Lost", "Outcome",
           "Pool", "RayBackend", "Task", "attempt", "backend_missing", "batch_size",
           "cpu_count", "make_backend", "one_line", "run_batch", "run_tasks", "simulate_in_order",
           "simulate_task",
           "type_and_message"]
