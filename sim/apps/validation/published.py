"""The ``published`` suite: simulated throughput against training runs whose owners published
their setup and tokens per second per GPU (``sim/catalog/reference/published.yaml``):
torchtitan's FSDP2 runs, NVIDIA's Megatron-Bridge (NeMo) performance summary and MosaicML
llm-foundry's MPT benchmarks.

Each entry carries the scenario it was measured on; no measured value enters the simulation.
``measured`` maps summary keys to the published figures: ``tokens_per_s_per_gpu``, and
``peak_reserved_gib`` where the source reports the caching allocator's reserved peak
(torchtitan's logged memory); each is one case.
Entries marked ``ci: false`` are too large for the test suite's time budget and run only with
``fabricsim validate --suite published`` (or ``published_cases(ci_only=False)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from sim.scenario import scenario_from_dict

REFERENCE = Path(__file__).resolve().parents[2] / "catalog" / "reference" / "published.yaml"


def entries() -> list[dict[str, Any]]:
    """The published runs, as written in the reference file."""
    return list(yaml.safe_load(REFERENCE.read_text()))


def published_cases(ci_only: bool = False,
                    progress: Callable[[int, int], None] | None = None
                    ) -> list[dict[str, Any]]:
    """One case per published figure: ``{suite, id, metric, measured, simulated, error}``;
    ``progress(done, total)`` after each run."""
    from sim.api import simulate

    cases = []
    todo = [e for e in entries() if not ci_only or e.get("ci", False)]
    for done, e in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        sc = scenario_from_dict({"name": e["id"], **e["scenario"]},
                                origin=f"published {e['id']}")
        # The metrics are the data file's keys: read the summary as a plain mapping.
        summary: Mapping[str, Any] = simulate(sc).summary
        for metric, measured in e["measured"].items():
            simulated = float(summary[metric])
            cases.append({"suite": "published", "id": e["id"], "metric": metric,
                          "measured": float(measured), "simulated": simulated,
                          "error": (simulated - float(measured)) / float(measured),
                          "source": e["source"]})
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
