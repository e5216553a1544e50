"""The ``published-moe`` suite: simulated throughput of mixture-of-experts training runs whose
owners published the layout and tokens per second per GPU (issue 14, item 7;
``sim/catalog/reference/published_moe.yaml``: NVIDIA's NeMo / Megatron-Bridge performance
summaries for Qwen3-MoE, Mixtral, GPT-OSS and DeepSeek-V3 on H100, B200 and GB200).

It reads its entries the way the ``published`` suite does (:mod:`sim.apps.validation.published`)
and differs in one thing: an entry whose model the framework's builder refuses today (a feature
it does not price yet, such as GPT-OSS's attention sinks) is not an error of the suite but a
**skipped** case, ``{suite, id, metric, skipped: reason, source}``, with the builder's one-line
reason, as a sweep records a failing variant in its row and goes on. Every entry must still
load (schema errors are bugs in the data file and raise). :func:`sim.apps.validation.run_suites`
keeps skipped cases out of the error statistics and lists them apart.

Entries marked ``ci: false`` are too large for the test suite's time budget and run only with
``fabricsim validate --suite published-moe`` (or ``published_moe_cases(ci_only=False)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from sim.apps.validation.cases import error_of
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

REFERENCE = (Path(__file__).resolve().parents[2] / "catalog" / "reference"
             / "published_moe.yaml")
SUITE = "published-moe"


def entries() -> list[dict[str, Any]]:
    """The published runs, as written in the reference file."""
    return list(yaml.safe_load(REFERENCE.read_text()))


def scenario_of(entry: Mapping[str, Any]) -> Scenario:
    """The validated scenario of one entry (a schema error raises :class:`ScenarioError`).

    An entry's ``model_overrides`` (e.g. ``{capacity_factor: 1.0}`` for the scripts' token
    drop, Megatron-Bridge's ``apply_moe_token_drop``) are laid over its catalogue model's
    dimensions, written into the scenario as an inline model."""
    scenario = dict(entry["scenario"])
    overrides = entry.get("model_overrides")
    if overrides:
        from sim import catalog
        dims = {k: v for k, v in catalog.model_entry(scenario["model"]).items()
                if k != "source"}
        scenario["model"] = {**dims, **overrides}
    return scenario_from_dict({"name": entry["id"], **scenario},
                              origin=f"published-moe {entry['id']}")


def _setup_key(e: Mapping[str, Any]) -> str:
    """Entries with one key are one setup: one simulation (two containers' figures for it)."""
    return yaml.safe_dump([e["scenario"], e.get("model_overrides")], sort_keys=True)


def simulate_entry(e: Mapping[str, Any]) -> Mapping[str, Any] | ScenarioError:
    """One entry's summary, or the builder's refusal (a worker process's task)."""
    from sim.api import simulate

    try:
        return simulate(scenario_of(e), origin=f"published-moe {e['id']}").summary
    except ScenarioError as refused:
        return refused


def _simulate_setups(todo: list[dict[str, Any]], workers: int,
                     progress: Callable[[int, int], None] | None
                     ) -> dict[str, Mapping[str, Any] | ScenarioError]:
    """Each setup of ``todo`` simulated once, in ``workers`` processes (in this one for 1, in
    the entries' order), keyed by :func:`_setup_key`; ``progress(done, total)`` over the
    entries as their setups finish."""
    firsts: dict[str, dict[str, Any]] = {}
    for e in todo:
        firsts.setdefault(_setup_key(e), e)
    per_key: dict[str, int] = {}
    for e in todo:
        per_key[_setup_key(e)] = per_key.get(_setup_key(e), 0) + 1
    seen: dict[str, Mapping[str, Any] | ScenarioError] = {}
    done = 0
    if workers <= 1:
        for key, e in firsts.items():
            if progress is not None:
                progress(done, len(todo))
            seen[key] = simulate_entry(e)
            done += per_key[key]
        return seen
    from concurrent.futures import as_completed

    from sim.apps.executor import Pool

    pool = Pool(workers)
    with pool.killed_on_interrupt(), warnings.catch_warnings():
        # loky retires a worker whose memory grew by a large simulation (its leak guard) once
        # that task is done and hands the rest to a fresh one; nothing is lost, so its
        # "A worker stopped while some jobs were given to the executor" is not the user's.
        warnings.filterwarnings("ignore", message="A worker stopped while some jobs",
                                category=UserWarning)
        futures = {pool.submit(simulate_entry, e): key for key, e in firsts.items()}
        if progress is not None:
            progress(0, len(todo))
        for fut in as_completed(futures):
            key = futures[fut]
            seen[key] = fut.result()
            done += per_key[key]
            if progress is not None:
                progress(done, len(todo))
    return seen


def published_moe_cases(ci_only: bool = False,
                        progress: Callable[[int, int], None] | None = None,
                        workers: int = 1) -> list[dict[str, Any]]:
    """One case per published figure: ``{suite, id, metric, measured, simulated, error,
    source}``, or ``{suite, id, metric, measured, skipped, source}`` where the builder refuses
    the scenario; ``progress(done, total)`` as the runs go and at the end. ``workers``:
    processes simulating the setups at once (the numbers are the same: each simulation is
    deterministic and alone)."""
    cases: list[dict[str, Any]] = []
    todo = [e for e in entries() if not ci_only or e.get("ci", False)]
    # Two containers' figures for one setup are one simulation (same scenario, same numbers).
    seen = _simulate_setups(todo, workers, progress)
    for e in todo:
        summary = seen[_setup_key(e)]
        if isinstance(summary, ScenarioError):
            # The builder's refusal (what it does not model yet), one line naming the key.
            for metric, measured in e["measured"].items():
                cases.append({"suite": SUITE, "id": e["id"], "metric": metric,
                              "measured": float(measured), "skipped": str(summary),
                              "source": e["source"]})
            continue
        for metric, measured in e["measured"].items():
            simulated = float(summary[metric])
            cases.append({"suite": SUITE, "id": e["id"], "metric": metric,
                          "measured": float(measured), "simulated": simulated,
                          "error": error_of(simulated, float(measured)),
                          "source": e["source"]})
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
