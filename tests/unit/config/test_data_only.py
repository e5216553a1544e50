"""Scenario and topology files are data (issue 16, item 4; sim/config/load.py read_yaml).

Truth: what YAML itself allows. A tag that would construct a Python object is not data;
aliases nested into an exponential expansion ("billion laughs", 9 levels of 10 = 10^9
values) are not a scenario; neither is a file of several megabytes or a binary file. Each is
one line naming the file, exit 2, and nothing is constructed or walked for long.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.config.load import MAX_EXPANDED_NODES, MAX_FILE_BYTES, read_yaml
from sim.scenario import ScenarioError

LAUGHS = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
    f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
    f"*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]) + "\n"


@pytest.mark.parametrize("text, message", [
    ("name: !!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    ("name: !!python/name:os.system\n", "not valid YAML"),
    (LAUGHS, f"expand to more than {MAX_EXPANDED_NODES:,} values"),
    ("a: &a [*a]\n", "expand to more than"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_what_is_not_data_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    t0 = time.perf_counter()
    with pytest.raises(ScenarioError) as err:
        read_yaml(path)
    assert time.perf_counter() - t0 < 5.0
    assert message in str(err.value) and str(err.value).startswith(str(path))
    assert "\n" not in str(err.value)


def test_anchors_within_reason_are_plain_data(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("base: &b {tp: 2, pp: 1}\nparallelism: *b\n")
    assert read_yaml(path)["parallelism"] == {"tp": 2, "pp": 1}


def test_oversized_and_binary_files_are_refused_before_parsing(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with pytest.raises(ScenarioError, match="more than a scenario file holds"):
        read_yaml(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(ScenarioError, match="not a text file|not valid YAML"):
        read_yaml(binary)


def test_cli_exits_2_on_a_billion_laughs(tmp_path: Path) -> None:
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    fabricsim = Path(sys.executable).parent / "fabricsim"
    out = subprocess.run([str(fabricsim), "run", str(tmp_path / "laughs.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0
