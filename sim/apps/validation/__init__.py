"""Validation suites: predictions against published measurements (``fabricsim validate``).

A suite is a function returning cases ``{suite, id, metric, measured, simulated, error}``
with ``error = (simulated - measured) / measured``. Suites are registered by name.
A suite may also return skipped cases, ``{suite, id, metric, measured, skipped: reason}``,
for entries the simulator refuses to build today (``published-moe``): they are listed apart
under a top-level ``skipped`` (and a suite's ``skipped`` count), present only when some were,
and count in no error statistic.

Each suite's statistics are ``{cases, mape, max_abs_error, mean_error}`` (``mean_error``: the
signed mean, the bias: positive where the simulator is fast). A suite with windows
(:data:`WINDOWS`: subsets it also scores apart, such as ``published-moe``'s rows in issue 14's
range of parts and sizes) adds ``windows: {NAME: {label, cases, mape, max_abs_error,
mean_error}}``.

``vtrain-single`` and ``vtrain-multi`` report vTrain's VALIDATE half only; the FIT half, on
which constants are fitted (``docs/calibration.md``), runs as ``vtrain-single-fit`` and
``vtrain-multi-fit`` when named, and is not part of the default (all validation suites).
Likewise ``moe-layer`` reports Megatron-LM's blockwise FP8 MoE layer timings and
``moe-layer-fit`` the bf16 ones the H100's GEMM rate is fitted on, and ``llm-foundry`` the
MPT benchmark rows the Triton attention kernel's factor was not fitted on
(``llm-foundry-fit`` those it was).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.apps.validation.llm_foundry import llm_foundry_cases
from sim.apps.validation.moe_layer import moe_layer_cases
from sim.apps.validation.nccl import nccl_cases
from sim.apps.validation.published import published_cases
from sim.apps.validation.published_moe import WINDOWS as PUBLISHED_MOE_WINDOWS
from sim.apps.validation.published_moe import Window, published_moe_cases
from sim.apps.validation.vtrain import vtrain_cases

Case = dict[str, Any]
Progress = Callable[[int, int], None] | None
SUITES: dict[str, Callable[[Progress], list[Case]]] = {
    "llm-foundry": lambda progress: llm_foundry_cases(progress=progress),
    "llm-foundry-fit": lambda progress: llm_foundry_cases("fit", progress=progress),
    "moe-layer": lambda progress: moe_layer_cases(progress=progress),
    "moe-layer-fit": lambda progress: moe_layer_cases("fit", progress=progress),
    "nccl": lambda progress: nccl_cases(),
    "published": lambda progress: published_cases(progress=progress),
    "published-moe": lambda progress: published_moe_cases(progress=progress),
    "vtrain-single": lambda progress: vtrain_cases("single", progress=progress),
    "vtrain-multi": lambda progress: vtrain_cases("multi", progress=progress),
    "vtrain-single-fit": lambda progress: vtrain_cases("single", progress=progress, half="fit"),
    "vtrain-multi-fit": lambda progress: vtrain_cases("multi", progress=progress, half="fit"),
}
# Suites whose entries run in several processes with ``workers`` (each one a long
# simulation; the others' cases are many short ones, or none, and run here).
PARALLEL_SUITES: dict[str, Callable[[Progress, int], list[Case]]] = {
    "published": lambda progress, workers: published_cases(progress=progress,
                                                           workers=workers),
    "published-moe": lambda progress, workers: published_moe_cases(progress=progress,
                                                                   workers=workers),
}
# Suites that report the rows constants were fitted on: run only when named.
FIT_SUITES = frozenset(name for name in SUITES if name.endswith("-fit"))
# Subsets of a suite's cases scored apart as well (their cases carry what the windows select on).
WINDOWS: dict[str, tuple[Window, ...]] = {"published-moe": PUBLISHED_MOE_WINDOWS}


def error_statistics(errors: list[float]) -> dict[str, Any]:
    """``{cases, mape, max_abs_error, mean_error}`` of signed relative errors (all 0 when
    there are none).

    Examples
    --------
    >>> error_statistics([0.25, -0.75])
    {'cases': 2, 'mape': 0.5, 'max_abs_error': 0.75, 'mean_error': -0.25}
    """
    n = len(errors)
    return {"cases": n,
            "mape": sum(abs(e) for e in errors) / n if n else 0.0,
            "max_abs_error": max(abs(e) for e in errors) if n else 0.0,
            "mean_error": sum(errors) / n if n else 0.0}


def run_suites(names: list[str] | None = None,
               progress: Callable[[str, int, int], None] | None = None,
               workers: int = 1) -> dict[str, Any]:
    """The ``fabricsim validate --json`` object for the named suites (by default all but the
    fit halves, :data:`FIT_SUITES`); ``progress(suite, done, total)`` as cases finish (the
    suites that report them); ``workers`` processes for the suites that can use them
    (:data:`PARALLEL_SUITES`), the same numbers either way."""
    chosen = names or sorted(set(SUITES) - FIT_SUITES)
    cases: list[Case] = []
    skipped: list[Case] = []
    suites: dict[str, Any] = {}
    for name in chosen:
        report = None if progress is None else (
            lambda done, total, _name=name: progress(_name, done, total))
        got = (PARALLEL_SUITES[name](report, workers) if workers > 1 and name in PARALLEL_SUITES
               else SUITES[name](report))
        scored = [c for c in got if "skipped" not in c]
        cases += scored
        skipped += [c for c in got if "skipped" in c]
        suites[name] = error_statistics([c["error"] for c in scored])
        if name in WINDOWS:
            suites[name]["windows"] = {
                w.name: {"label": w.label,
                         **error_statistics([c["error"] for c in scored if w.holds(c)])}
                for w in WINDOWS[name]}
        if len(got) > len(scored):
            suites[name]["skipped"] = len(got) - len(scored)
    out: dict[str, Any] = {"suites": suites, "cases": cases}
    if skipped:
        out["skipped"] = skipped
    return out
