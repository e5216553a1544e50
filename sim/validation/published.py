"""The ``published`` suite: simulated throughput against training runs whose owners published
their setup and tokens per second per GPU (``sim/catalog/reference/published.yaml``):
torchtitan's FSDP2 runs and NVIDIA's Megatron-Bridge (NeMo) performance summary.

Each entry carries the scenario it was measured on; no measured value enters the simulation.
Entries marked ``ci: false`` are too large for the test suite's time budget and run only with
``fabricsim validate --suite published`` (or ``published_cases(ci_only=False)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sim.scenario import scenario_from_dict

REFERENCE = Path(__file__).resolve().parents[1] / "catalog" / "reference" / "published.yaml"


def entries() -> list[dict[str, Any]]:
    """The published runs, as written in the reference file."""
    return list(yaml.safe_load(REFERENCE.read_text()))


def published_cases(ci_only: bool = False) -> list[dict[str, Any]]:
    """One case per published figure: ``{suite, id, metric, measured, simulated, error}``."""
    from sim.api import simulate

    cases = []
    for e in entries():
        if ci_only and not e.get("ci", False):
            continue
        sc = scenario_from_dict({"name": e["id"], **e["scenario"]},
                                origin=f"published {e['id']}")
        summary = simulate(sc).summary
        for metric, measured in e["measured"].items():
            simulated = float(summary[metric])
            cases.append({"suite": "published", "id": e["id"], "metric": metric,
                          "measured": float(measured), "simulated": simulated,
                          "error": (simulated - float(measured)) / float(measured),
                          "source": e["source"]})
    return cases
