"""Shared test set-up: the one scenario factory every test module builds scenarios with.

Test modules live in ``tests/unit/`` (one module of the package each) and
``tests/integration/`` (whole scenarios, the CLI, notebooks, goldens, benchmarks). This file
sits above both, so pytest puts ``tests/`` on ``sys.path`` and ``from helpers import ...`` and
``from conftest import make_scenario`` work from either folder.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from sim.scenario import Scenario, scenario_from_dict

# A small dense model (4 layers, hidden 1,024) so a program builds and simulates in well under a
# second; shaped like the Llama family (SwiGLU, grouped-query attention, 32,000-token
# vocabulary).
SMALL_MODEL: dict[str, Any] = {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4,
                               "ffn_hidden": 4096, "vocab": 32000, "mlp": "swiglu"}

# One DGX-H100-like node running DDP: the base every override starts from.
BASE: dict[str, Any] = {
    "name": "t", "model": SMALL_MODEL,
    "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8},
    "framework": {"name": "ddp"},
    "training": {"seq_len": 1024, "micro_batch_size": 1}}


def make_scenario(base: Mapping[str, Any] | None = None, /, **overrides: Any) -> Scenario:
    """A validated Scenario: ``base`` (default :data:`BASE`) with ``overrides`` applied.

    A plain key (``framework={"name": "fsdp2"}``) replaces that whole section; a nested key,
    written ``cluster__nodes=2`` or ``**{"cluster.nodes": 2}``, sets one leaf and keeps the
    rest of its section. ``None`` removes a key. Validation is the loader's
    (:func:`sim.scenario.scenario_from_dict`), so bad input fails as it would from a file.
    """
    data: dict[str, Any] = copy.deepcopy(dict(BASE if base is None else base))
    for key, value in overrides.items():
        path = key.replace("__", ".").split(".")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = copy.deepcopy(value)
    return scenario_from_dict(data)


@pytest.fixture
def scenario_factory() -> Callable[..., Scenario]:
    """:func:`make_scenario` as a fixture, for tests that prefer injection to an import."""
    return make_scenario


# The slowest test files on 2 cores (seconds of setup and calls, `pytest --durations=0`,
# 2026-12-07), slowest first. `make test` hands whole files to its two workers as they free
# up, in collection order (`--dist loadfile --no-loadscope-reorder`; xdist's default order,
# the most tests first, put these few-test files last): a 60-80 s file run last keeps one
# worker busy while the other idles. Collected first, they run while the many short files
# fill the other worker. An order hint only: a file missing here runs where pytest collects
# it.
SLOW_FILES = (
    "integration/test_published_moe_pairs.py",              # 79 s
    "integration/test_sweep_resume.py",                     # 66 s
    "integration/test_golden.py",                           # 56 s
    "integration/test_plan.py",                             # 48 s
    "unit/apps/test_validation_moe.py",                     # 40 s
    "unit/apps/test_validation_vtrain_multi.py",            # 38 s
    "integration/test_scenarios.py",                        # 37 s
    "unit/apps/test_validation.py",                         # 34 s
    "integration/test_published_moe_ep_overlap.py",         # 32 s
    "integration/test_llm_foundry_table.py",                # 25 s
    "integration/test_sweep.py",                            # 23 s
    "integration/test_cli.py",                              # 20 s
    "integration/test_splice.py",                           # 20 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect :data:`SLOW_FILES` first, in that order (each file's tests in their own)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}

    def slow_rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        tail = path[path.rfind("/tests/") + len("/tests/"):]
        return rank.get(tail, len(SLOW_FILES))

    items.sort(key=slow_rank)   # stable: everything else keeps pytest's order
