"""Step-to-step compute variation (``faults.jitter``): each rank class's factor per step.

Each rank's compute kernels in step ``s`` take ``X_{rank,s}`` times their time, ``X`` log-normal
(:class:`sim.config.faults.Jitter`). A rank class stands for ``n`` ranks that meet at every
collective, so it runs at its slowest member's pace: its factor is ``max`` of ``n`` draws. The
maximum of ``n`` independent draws with CDF ``F`` has CDF ``F^n``, so it is drawn with one
uniform ``U``: ``F^{-1}(U^{1/n})`` (inverse transform), here ``exp(sigma Phi^{-1}(U^{1/n}))``, in
constant time whatever ``n`` (16,384 ranks cost one draw). One draw per class and step, from a
generator seeded by ``(seed, step)``: deterministic per seed, and step ``s`` is the same
whatever the number of steps run.

The maximum over a class's ranks per step bounds what those ranks would do if each drew its
own factor per step and synchronised only at the step's end; ranks that meet at every
collective with factors drawn per op would wait less (a max of sums is at most the sum of
maxes), so this is the pessimistic side of per-rank noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def max_normal(u: float, n: int) -> float:
    """The largest of ``n`` standard normal draws, from one uniform ``u`` in (0, 1):
    ``Phi^{-1}(u^{1/n})``, written as ``-Phi^{-1}(1 - u^{1/n})`` with ``1 - u^{1/n}`` from
    ``expm1`` so that it keeps its digits when ``n`` is large.

    Examples
    --------
    >>> abs(max_normal(0.5, 1)) < 1e-12       # the median of one draw
    True
    >>> max_normal(0.5, 1000) > max_normal(0.5, 10) > 0
    True
    """
    tail = -math.expm1(math.log(u) / n)       # 1 - u^(1/n), in (0, 1)
    return -_NORMAL.inv_cdf(min(max(tail, 1e-300), 1.0 - 1e-16))


@dataclass(frozen=True)
class StepJitter:
    """Per-step compute factors of the rank classes (``faults.jitter``)."""

    sigma: float
    seed: int = 0

    def factors(self, step: int, classes: Iterable[tuple[int, int]]) -> dict[int, float]:
        """``{class id: factor}`` for step ``step``; ``classes`` gives ``(id, ranks)``
        pairs. Every factor is 1 when ``sigma`` is 0."""
        pairs = sorted(classes)
        if self.sigma == 0:
            return {cid: 1.0 for cid, _ in pairs}
        rng = np.random.default_rng((self.seed, step))
        u = rng.random(len(pairs))
        # random() is in [0, 1): 0 is the one value log() refuses; it maps to the smallest draw.
        return {cid: math.exp(self.sigma * max_normal(float(x) or 1e-300, n))
                for (cid, n), x in zip(pairs, u, strict=True)}


def expected_max_factor(sigma: float, n: int, points: int = 20_000) -> float:
    """``E[max of n draws of exp(sigma Z)]`` = ``E[exp(sigma M_n)]``, by the midpoint rule over
    ``u`` in (0, 1) of ``exp(sigma Phi^{-1}(u^{1/n}))`` (the closed form tests compare the
    mean jittered step with; ``n = 1`` gives ``exp(sigma^2 / 2)``).

    Examples
    --------
    >>> round(expected_max_factor(0.1, 1), 5) == round(math.exp(0.005), 5)
    True
    """
    u = (np.arange(points) + 0.5) / points
    return float(np.mean([math.exp(sigma * max_normal(float(x), n)) for x in u]))
