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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sim.apps.validation.cases import error_of, map_in_order
from sim.catalog import load_yaml
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

REFERENCE = (Path(__file__).resolve().parents[2] / "catalog" / "reference"
             / "published_moe.yaml")
SUITE = "published-moe"


@dataclass(frozen=True)
class Window:
    """A subset of the suite's cases scored on its own as well (``fabricsim validate``'s
    ``suites[NAME].windows``): the cases on one of ``gpus`` (catalogue keys) with between
    ``min_gpus`` and ``max_gpus`` GPUs in the job.

    Examples
    --------
    >>> w = Window("w", "H100, 16-64 GPUs", frozenset({"h100-sxm"}), 16, 64)
    >>> w.holds({"gpu": "h100-sxm", "gpus": 16}), w.holds({"gpu": "h100-sxm", "gpus": 8})
    (True, False)
    """

    name: str
    label: str
    """What it holds, in words (the CLI's table)."""
    gpus: frozenset[str]
    min_gpus: int
    max_gpus: int

    def holds(self, case: Mapping[str, Any]) -> bool:
        """Whether ``case`` (with the suite's ``gpu`` and ``gpus`` fields) is in the window."""
        return case["gpu"] in self.gpus and self.min_gpus <= case["gpus"] <= self.max_gpus


# Issue 14's bar is judged on runs "on H100/H800/B200/GB200, 16 to 2,048 GPUs": the rows of
# this suite in that range, scored apart (the suite also holds one-node rows and Blackwell
# Ultra parts, which the bar does not name).
ISSUE_14_WINDOW = Window("issue-14", "H100/H800/B200/GB200, 16-2,048 GPUs",
                         frozenset({"h100-sxm", "h100-hbm2e-96gb", "h800", "b200", "gb200"}),
                         16, 2048)
WINDOWS: tuple[Window, ...] = (ISSUE_14_WINDOW,)


def entries() -> list[dict[str, Any]]:
    """The published runs, as written in the reference file."""
    return list(load_yaml(REFERENCE.read_text()))


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
    """Each setup of ``todo`` simulated once (:func:`simulate_entry` in ``workers``
    processes, :func:`~sim.apps.validation.cases.map_in_order`), keyed by
    :func:`_setup_key`; ``progress(done, total)`` over the entries as their setups finish."""
    firsts: dict[str, dict[str, Any]] = {}
    count: dict[str, int] = {}
    for e in todo:
        key = _setup_key(e)
        firsts.setdefault(key, e)
        count[key] = count.get(key, 0) + 1
    keys = list(firsts)
    got = map_in_order(simulate_entry, [firsts[k] for k in keys], workers, progress,
                       [count[k] for k in keys], len(todo))
    return dict(zip(keys, got, strict=True))


def published_moe_cases(ci_only: bool = False,
                        progress: Callable[[int, int], None] | None = None,
                        workers: int = 1) -> list[dict[str, Any]]:
    """One case per published figure: ``{suite, id, metric, measured, simulated, error,
    source, gpu, gpus}``, or ``{suite, id, metric, measured, skipped, source, gpu, gpus}``
    where the builder refuses the scenario (``gpu``: the part's catalogue key, ``gpus``: the
    job's GPUs); ``progress(done, total)`` as the runs go and at the end. ``workers``:
    processes simulating the setups at once (the numbers are the same: each simulation is
    deterministic and alone)."""
    cases: list[dict[str, Any]] = []
    todo = [e for e in entries() if not ci_only or e.get("ci", False)]
    # Two containers' figures for one setup are one simulation (same scenario, same numbers).
    seen = _simulate_setups(todo, workers, progress)
    for e in todo:
        summary = seen[_setup_key(e)]
        cluster = scenario_of(e).cluster
        # The part and the job's size, by which the windows (WINDOWS) select cases.
        where = {"gpu": cluster.gpu, "gpus": cluster.nodes * cluster.gpus_per_node}
        if isinstance(summary, ScenarioError):
            # The builder's refusal (what it does not model yet), one line naming the key.
            for metric, measured in e["measured"].items():
                cases.append({"suite": SUITE, "id": e["id"], "metric": metric,
                              "measured": float(measured), "skipped": str(summary),
                              "source": e["source"], **where})
            continue
        for metric, measured in e["measured"].items():
            simulated = float(summary[metric])
            cases.append({"suite": SUITE, "id": e["id"], "metric": metric,
                          "measured": float(measured), "simulated": simulated,
                          "error": error_of(simulated, float(measured)),
                          "source": e["source"], **where})
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
