"""The layer contracts hold, and each one fails when its rule is broken.

The contracts are import-linter's, in ``pyproject.toml`` (``[tool.importlinter]``, explained in
``docs/layers.md``); ``make lint`` runs them too. This test makes CI (``make test``) check them,
and shows on a copy of the package that each contract really catches the import it forbids.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = {
    c["id"]: c["name"]
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
}

# One deliberate violation per contract: (file of the copy, import appended to it).
VIOLATIONS = {
    "core-not-above": ("sim/engine/core.py", "import sim.cli.commands"),
    "core-not-frameworks": ("sim/workload/model.py", "import sim.frameworks.megatron.build"),
    "engine-not-frameworks": ("sim/engine/core.py", "from sim.frameworks.common import base"),
    "fabric-not-engine": ("sim/fabric/network.py", "from sim.engine.core import Engine"),
    "workload-not-fabric": ("sim/workload/layer_ops.py", "import sim.fabric.collectives.nccl"),
    "config-at-bottom": ("sim/scenario.py", "import sim.program.ir"),
    "hardware-program-not-fabric": ("sim/program/ir.py", "import sim.fabric.network"),
    "framework-options-are-schema": ("sim/frameworks/ddp/options.py",
                                     "import sim.frameworks.ddp.build"),
    "apps-through-registry": ("sim/apps/compare.py", "import sim.frameworks.megatron.build"),
    "outputs-draw-only": ("sim/outputs/plot/timeline.py", "import sim.apps.sweep"),
}


def _lint(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` on the package under ``root`` (its ``sim`` first on the path)."""
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", "--no-logo", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    """The package's Python files and the contracts, copied to ``tmp_path``."""
    def skip(folder: str, names: list[str]) -> list[str]:
        def data(n: str) -> bool:
            return not n.endswith(".py") and not (Path(folder) / n).is_dir()

        return [n for n in names if n == "__pycache__" or data(n)]

    shutil.copytree(ROOT / "sim", tmp_path / "sim", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_every_contract_is_exercised():
    assert set(VIOLATIONS) == set(CONTRACTS)


def test_contracts_hold():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in run.stdout


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory):
    """One copy of the package for the module's violations, linted once against every
    contract: the untouched copy passes them all, so what fails below is the added import,
    not the copying. Each test puts back the file it changed."""
    root = _copy(tmp_path_factory.mktemp("layers"))
    clean = _lint(root)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in clean.stdout
    return root


@pytest.mark.parametrize("contract", sorted(VIOLATIONS))
def test_a_deliberate_violation_fails(clean_copy, contract):
    root = clean_copy
    path, line = VIOLATIONS[contract]
    untouched = (root / path).read_bytes()
    try:
        with open(root / path, "a") as f:
            f.write(f"\n{line}  # deliberate layer violation\n")
        run = _lint(root, "--contract", contract)
    finally:
        (root / path).write_bytes(untouched)   # the next contract's copy is clean again
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{CONTRACTS[contract]} BROKEN" in run.stdout
    importer = path.removesuffix(".py").replace("/", ".")
    # the report names the added import's module (as the first link of the chain it breaks)
    assert f"{importer} -> " in run.stdout
