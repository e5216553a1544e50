"""The H200 kernel fit every kernel's price scales from: ``catalog/calibration/h200-fit.json``,
fitted by ``tools/fit_compute.py`` on the lent H200's kernel timings (``h200-kernels.json``)."""

from __future__ import annotations

from functools import lru_cache

from sim import catalog


@lru_cache(maxsize=1)
def h200_fit() -> dict:
    """The fitted constants (GEMM, attention, memory-bound rates, fixed costs), read once."""
    return catalog.calibration("h200-fit.json")
