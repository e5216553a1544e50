"""One validation case: a measured figure against the simulated one (the shape every suite
returns, :mod:`sim.apps.validation`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def error_of(simulated: float, measured: float) -> float:
    """Signed relative error of a simulated figure against the measured one.

    Examples
    --------
    >>> error_of(110.0, 100.0)
    0.1
    """
    return (simulated - measured) / measured


def scored_case(suite: str, case_id: str, metric: str, measured: float, simulated: float,
                **extra: Any) -> dict[str, Any]:
    """``{suite, id, metric, measured, simulated, error, **extra}``.

    Examples
    --------
    >>> scored_case("s", "a", "t", 2.0, 3.0, source="x")["error"]
    0.5
    """
    return {"suite": suite, "id": case_id, "metric": metric, "measured": float(measured),
            "simulated": float(simulated), "error": error_of(float(simulated), float(measured)),
            **extra}


def map_in_order(fn: Callable[[T], R], items: Sequence[T], workers: int = 1,
                 progress: Callable[[int, int], None] | None = None,
                 weights: Sequence[int] | None = None, total: int | None = None) -> list[R]:
    """``[fn(item) for item in items]``, in ``workers`` processes when more than one (joblib's
    loky, :class:`sim.apps.executor.Pool`; ``fn`` and the items are pickled), the results in
    the items' order either way. ``progress(done, total)`` as items finish, each counting
    its ``weights`` entry (1 without; ``total`` defaults to their sum): the suites that run one
    simulation for several entries count the entries.

    Examples
    --------
    >>> map_in_order(abs, [-2, 3, -1])
    [2, 3, 1]
    """
    weight = list(weights) if weights is not None else [1] * len(items)
    whole = total if total is not None else sum(weight)
    done = 0
    if workers <= 1:
        out: list[R] = []
        for item, w in zip(items, weight, strict=True):
            if progress is not None:
                progress(done, whole)
            out.append(fn(item))
            done += w
        return out
    from concurrent.futures import as_completed

    from sim.apps.executor import Pool

    pool = Pool(workers)
    got: dict[int, R] = {}
    with pool.killed_on_interrupt(), warnings.catch_warnings():
        # loky retires a worker whose memory grew by a large simulation (its leak guard) once
        # that task is done and hands the rest to a fresh one; nothing is lost, so its
        # "A worker stopped while some jobs were given to the executor" is not the user's.
        warnings.filterwarnings("ignore", message="A worker stopped while some jobs",
                                category=UserWarning)
        futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
        if progress is not None:
            progress(0, whole)
        for fut in as_completed(futures):
            i = futures[fut]
            got[i] = fut.result()
            done += weight[i]
            if progress is not None:
                progress(done, whole)
    return [got[i] for i in range(len(items))]
