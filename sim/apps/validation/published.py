"""The ``published`` suite: simulated throughput against training runs whose owners published
their setup and tokens per second per GPU (``sim/catalog/reference/published.yaml``):
torchtitan's FSDP2 runs, NVIDIA's Megatron-Bridge (NeMo) performance summary and MosaicML
llm-foundry's MPT benchmarks.

Each entry carries the scenario it was measured on; no measured value enters the simulation.
``measured`` maps summary keys to the published figures: ``tokens_per_s_per_gpu``, and
``peak_reserved_gib`` where the source reports the caching allocator's reserved peak
(torchtitan's logged memory), ``peak_memory_gib`` where it reports the allocated peak
(``torch.cuda.max_memory_allocated``, Megatron-LM's ``mem-max-allocated-bytes``); each is one
case. A memory figure is the busiest rank's unless the entry says ``memory_rank: last``: the
job's last rank's (Megatron-LM writes its logs there), read from that rank's class.
Entries marked ``ci: false`` are too large for the test suite's time budget and run only with
``fabricsim validate --suite published`` (or ``published_cases(ci_only=False)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.apps.validation.cases import map_in_order
from sim.catalog import load_yaml
from sim.scenario import scenario_from_dict

if TYPE_CHECKING:
    from sim.api import RunResult

REFERENCE = Path(__file__).resolve().parents[2] / "catalog" / "reference" / "published.yaml"


def entries() -> list[dict[str, Any]]:
    """The published runs, as written in the reference file."""
    return list(load_yaml(REFERENCE.read_text()))


def published_cases(ci_only: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    workers: int = 1) -> list[dict[str, Any]]:
    """One case per published figure: ``{suite, id, metric, measured, simulated, error}``;
    ``progress(done, total)`` as the runs go and at the end; ``workers`` processes
    simulating the entries at once (:func:`~sim.apps.validation.cases.map_in_order`: the
    same cases, in order)."""
    todo = [e for e in entries() if not ci_only or e.get("ci", False)]
    cases = [c for got in map_in_order(entry_cases, todo, workers, progress) for c in got]
    if progress is not None:
        progress(len(todo), len(todo))
    return cases


def entry_cases(e: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cases of one entry of the reference file: its scenario simulated once, each
    measured figure against the simulated one."""
    from sim.api import simulate

    sc = scenario_from_dict({"name": e["id"], **e["scenario"]}, origin=f"published {e['id']}")
    result = simulate(sc)
    # The metrics are the data file's keys: read the summary as a plain mapping.
    summary: Mapping[str, Any] = result.summary
    last_rank = _last_rank_memory(result) if e.get("memory_rank") == "last" else {}
    cases = []
    for metric, measured in e["measured"].items():
        simulated = float(last_rank.get(metric, summary[metric]))
        cases.append({"suite": "published", "id": e["id"], "metric": metric,
                      "measured": float(measured), "simulated": simulated,
                      "error": (simulated - float(measured)) / float(measured),
                      "source": e["source"]})
    return cases


def _last_rank_memory(result: RunResult) -> dict[str, float]:
    """The summary's memory peaks (``peak_memory_gib``, ``peak_reserved_gib``: the maxima over
    rank classes) read on the rank class holding the job's highest rank instead.

    Megatron-LM logs memory (``mem-max-allocated-bytes``) on rank ``world_size - 1`` only,
    the tensorboard writer's rank: with pipeline parallelism that is a last-stage rank, whose
    peak differs from the busiest stage's."""
    last = max(r for c in result.program.classes for r in c.members)
    cls = next(c.id for c in result.program.classes if last in c.members)
    row = next(r for r in result.summary["memory_by_rank_class"] if r["rank_class"] == cls)
    return {"peak_memory_gib": float(row["peak_gib"]),
            "peak_reserved_gib": float(row["peak_reserved_gib"])}
