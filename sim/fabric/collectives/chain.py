"""Latency of an algorithm's chain of dependent steps, and the flows that move in lock-step.

A collective's data cannot outrun light: a ring all-reduce's chunk crosses 2(n-1) edges one
after the other (n-1 for all-gather or reduce-scatter), a tree's reduce climbs its depth and
the broadcast comes back down, a send crosses its path once. The time of a small collective is
therefore at least the sum of the propagation latencies along that chain, and a large one pays
it once on top of its bandwidth term (the pipeline fills once). NCCL's latency model
(``ncclTopoTuneModel`` in ``src/graph/tuning.cc``: ``baseLat + nsteps * hwLat``) is calibrated
inside one datacenter, so it already holds the ~1-3 us of an in-datacenter hop; what it
cannot know is the propagation of a link between zones or regions. The chain latency here
counts only those long-haul links (``cross_az`` and ``cross_region``), so nothing is counted
twice. Beside it, the bytes each rank of a ring sends (:func:`ring_bytes_per_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ring_chain(hop_latency: Sequence[float], steps: int) -> float:
    """Longest sum of ``steps`` consecutive hop latencies round a ring (the ring's hops in
    order, the last one closing it): every chunk starts at a different rank, and the slowest
    chunk ends the collective.

    Examples
    --------
    Four ranks, one slow hop: 6 consecutive hops (an all-reduce) cross it twice, 3 hops (an
    all-gather) once.

    >>> ring_chain([0.0, 1.0, 0.0, 0.0], 6), ring_chain([0.0, 1.0, 0.0, 0.0], 3)
    (2.0, 1.0)
    """
    lat = np.asarray(hop_latency, dtype=float)
    n = len(lat)
    if n == 0 or steps <= 0 or not lat.any():
        return 0.0
    reps = steps // n + 2
    c = np.concatenate([[0.0], np.cumsum(np.tile(lat, reps))])
    start = np.arange(n)
    return float((c[start + steps] - c[start]).max())


def tree_depth(parents: Sequence[int], up: Sequence[float], down: Sequence[float]) -> float:
    """Latency of a reduce up a tree then a broadcast down it: the slowest leaf-to-root path
    up plus the slowest root-to-leaf path down.

    ``parents[i]`` is node i's parent (-1 for the root); ``up[i]`` the latency of the hop
    from i to its parent, ``down[i]`` from its parent to i.

    Examples
    --------
    >>> tree_depth([-1, 0, 0, 1], [0.0, 1.0, 2.0, 4.0], [0.0, 1.0, 2.0, 4.0])
    10.0
    """
    n = len(parents)
    to_root_up = [-1.0] * n
    to_root_down = [-1.0] * n

    def walk(i: int) -> tuple[float, float]:
        # Iterative: climb to a node whose distance is known, then fill in the way back.
        path = []
        j = i
        while j >= 0 and to_root_up[j] < 0:
            path.append(j)
            j = parents[j]
        base_u = to_root_up[j] if j >= 0 else 0.0
        base_d = to_root_down[j] if j >= 0 else 0.0
        for k in reversed(path):
            if parents[k] >= 0:
                base_u += up[k]
                base_d += down[k]
            to_root_up[k], to_root_down[k] = base_u, base_d
        return to_root_up[i], to_root_down[i]

    best_up = best_down = 0.0
    for i in range(n):
        u, d = walk(i)
        best_up, best_down = max(best_up, u), max(best_down, d)
    return best_up + best_down


def ring_bytes_per_rank(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective (nccl-tests' bus-bandwidth factors).

    ``nbytes`` is the message size as nccl-tests counts it: the buffer of an all-reduce, the
    gathered output of an all-gather, the input of a reduce-scatter.
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    raise ValueError(f"not a ring collective: {op}")
