"""Validation suites: predictions against published measurements (``fabricsim validate``).

A suite is a function returning cases ``{suite, id, metric, measured, simulated, error}``
with ``error = (simulated - measured) / measured``. Suites are registered by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.validation.nccl import nccl_cases
from sim.validation.published import published_cases
from sim.validation.vtrain import vtrain_cases

Case = dict[str, Any]
SUITES: dict[str, Callable[[], list[Case]]] = {
    "nccl": nccl_cases,
    "published": published_cases,
    "vtrain-single": lambda: vtrain_cases("single"),
    "vtrain-multi": lambda: vtrain_cases("multi"),
}


def run_suites(names: list[str] | None = None) -> dict[str, Any]:
    """The ``fabricsim validate --json`` object for the named suites (all by default)."""
    chosen = names or sorted(SUITES)
    cases: list[Case] = []
    suites: dict[str, Any] = {}
    for name in chosen:
        got = SUITES[name]()
        cases += got
        errors = [abs(c["error"]) for c in got]
        suites[name] = {"cases": len(got),
                        "mape": sum(errors) / len(errors) if errors else 0.0,
                        "max_abs_error": max(errors) if errors else 0.0}
    return {"suites": suites, "cases": cases}
