"""The notebooks are commit-ready and use the public API; the README pictures redraw.

Executing the notebooks is nbmake's job (``pytest --nbmake notebooks``, about 40 s on
2 cores); these tests check what can be checked without a kernel: each notebook is valid
nbformat 4 with its outputs cleared (the repository keeps them small; CI executes them), and
imports from fabricsim only the public modules. The pictures test draws
``docs/images/*.png`` with ``tools/readme_pictures.py`` into a temporary folder (about 5 s)
and verifies them against their figures and the committed pictures.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PUBLIC_MODULES = {"sim.api", "sim.scenario", "sim.outputs.plot", "sim.apps.compare",
                  "sim.apps.runlength", "sim.apps.runlength.goodput", "sim.apps.multijob",
                  "sim.config.multijob", "sim.apps.replay", "sim.outputs.export.chakra"}
"""What the notebooks may import from fabricsim (README, "Using it from Python")."""


def _code_cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text())
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def test_the_seven_notebooks_are_there() -> None:
    assert [p.name for p in NOTEBOOKS] == [
        "01-quickstart.ipynb", "02-fabric-what-if.ipynb", "03-cross-az-finops.ipynb",
        "04-pipeline-bubbles.ipynb", "05-moe-zones.ipynb", "06-goodput.ipynb",
        "07-shared-fabric.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_its_outputs_are_cleared(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell keeps its outputs"
            assert cell.execution_count is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_imports_only_the_public_api(path: Path) -> None:
    imported: set[str] = set()
    for cell in _code_cells(path):
        # IPython magics (%matplotlib inline) are not Python; drop them before parsing.
        code = "\n".join(line for line in _source(cell).splitlines()
                         if not line.lstrip().startswith("%"))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.split(".")[0] == "sim"}
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.module.split(".")[0] == "sim":
                    # ``from sim.outputs import plot`` imports the module sim.outputs.plot
                    for a in node.names:
                        full = f"{node.module}.{a.name}"
                        imported.add(full if full in PUBLIC_MODULES else node.module)
    assert imported, f"{path.name} uses nothing from fabricsim"
    assert imported <= PUBLIC_MODULES, f"{path.name} imports {imported - PUBLIC_MODULES}"


# ----------------------------------------------------------------------------- pictures
def _pictures_tool() -> ModuleType:
    """tools/readme_pictures.py as a module (tools/ is not a package)."""
    name = "readme_pictures"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "readme_pictures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_png_size_reads_what_matplotlib_wrote(tmp_path: Path) -> None:
    tool = _pictures_tool()
    fig = Figure(figsize=(2.5, 1.0))
    fig.savefig(tmp_path / "a.png", dpi=40)
    # 2.5 in x 40 dpi = 100 px, 1.0 in x 40 dpi = 40 px.
    assert tool.png_size(tmp_path / "a.png") == (100, 40)
    (tmp_path / "b.png").write_bytes(b"GIF89a" + bytes(40))
    with pytest.raises(ValueError):
        tool.png_size(tmp_path / "b.png")


def test_readme_pictures_redraw_and_match_the_committed_ones(tmp_path: Path) -> None:
    tool = _pictures_tool()
    fresh = tmp_path / "fresh"
    expected = tool.draw(fresh)
    assert set(expected) == set(tool.NAMES)
    assert tool.verify(fresh, expected, tool.IMAGES) == []

    # The check can fail: a picture of another size, a blank one, a missing one.
    stale = tmp_path / "stale"
    stale.mkdir()
    small = Figure(figsize=(2.0, 1.0))
    small.savefig(stale / "timeline.png", dpi=50)
    for name in ("memory.png", "bytes.png", "links.png"):
        (stale / name).write_bytes((fresh / name).read_bytes())
    problems = tool.verify(fresh, expected, stale)
    assert any(p.startswith("timeline.png: committed picture is 100x50 px") for p in problems)
    assert any(p.startswith("compare.png: missing") for p in problems)
    assert len(problems) == 2

    blank = tmp_path / "blank"
    Figure(figsize=(14, 6.64)).savefig(blank.with_suffix(".png"), dpi=120)
    blank.mkdir()
    for name in tool.NAMES:
        (blank / name).write_bytes((fresh / name).read_bytes())
    (blank / "timeline.png").write_bytes(blank.with_suffix(".png").read_bytes())
    problems = tool.verify(blank, expected, fresh)
    assert any("timeline.png: blank" in p for p in problems)
