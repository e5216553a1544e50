"""What every framework's planner search space is made of: the parallel layout a space adds
options to (:class:`SearchPoint`), options as ``(key, value)`` pairs, and the space that adds
none. Each framework's own space is its package's ``search.py``; the registry
(:mod:`sim.frameworks.registry`) points at them and the planner reads them only through it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Options = tuple[tuple[str, Any], ...]
"""Framework options as sorted ``(key, value)`` pairs (``framework.<key>``)."""


@dataclass(frozen=True)
class SearchPoint:
    """The parallel layout a search space adds its options to."""

    tp: int
    pp: int
    vp: int
    dp: int
    cp: int
    layers: int
    """Transformer layers of the model."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def no_options(pt: SearchPoint) -> Iterable[Options]:
    """One layout per parallel point, with the recipe options only."""
    yield ()
