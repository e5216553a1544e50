"""``--out DIR`` is whole or absent, and a previous result is replaced only with
``--overwrite`` (issue 16, item 3; sim/outputs/folder.py).

Truth: the file system itself. After a run, DIR holds exactly one run's files; after a run
that fails while writing, DIR is as it was (absent, or the previous run byte for byte) and no
temporary folder is left beside it; a second run into a full DIR is refused with one line and
exit 2 before it simulates, unless ``--overwrite``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from helpers import fabricsim_in_process

from sim.outputs.folder import OutputError, OutputExists, check_out, staged_folder

FABRICSIM = Path(sys.executable).parent / "fabricsim"
TINY = {  # 2 nodes x 2 H100, FSDP2: a run of well under a second
    "name": "tiny-atomic",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "fsdp2",
    "training": {"seq_len": 1024, "micro_batch_size": 1},
}


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FABRICSIM_DEBUG"}
    env["MPLBACKEND"] = "Agg"
    return subprocess.run([str(FABRICSIM), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_run_out_is_refused_when_full_and_replaced_with_overwrite(tmp_path: Path) -> None:
    # In-process through the command's entry point (tests/helpers.py); the subprocess runs
    # of `run --out` are test_an_out_that_cannot_be_written_is_one_line_before_simulating's
    # here and test_cli.py's.
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(TINY))
    first = fabricsim_in_process("run", "s.yaml", "--json", "--out", "res", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = _snapshot(tmp_path / "res")
    assert "summary.json" in before and "timeline.png" in before
    again = fabricsim_in_process("run", "s.yaml", "--set", "training.seq_len=2048", "--out",
                                 "res", cwd=tmp_path)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().count("\n") == 0 and "--overwrite" in again.stderr
    assert _snapshot(tmp_path / "res") == before
    replaced = fabricsim_in_process("run", "s.yaml", "--json", "--set",
                                    "training.seq_len=2048", "--out", "res", "--overwrite",
                                    cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["tokens_per_step"] == 2 * json.loads(before["summary.json"])[
        "tokens_per_step"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fabricsim-")]


def test_an_empty_folder_is_not_a_previous_result(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert check_out(tmp_path / "empty", overwrite=False) == tmp_path / "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExists, match="is a file"):
        check_out(tmp_path / "file", overwrite=False)


@pytest.mark.parametrize("previous", [False, True])
def test_a_failure_while_writing_leaves_the_folder_as_it_was(tmp_path: Path,
                                                             previous: bool) -> None:
    out = tmp_path / "res"
    if previous:
        with staged_folder(out) as tmp:
            (tmp / "summary.json").write_text('{"old": true}')
    before = _snapshot(out) if previous else None
    with pytest.raises(RuntimeError, match="disk full"), \
            staged_folder(out, overwrite=True) as tmp:
        (tmp / "summary.json").write_text('{"new": true}')
        raise RuntimeError("disk full")
    assert (_snapshot(out) if out.exists() else None) == before
    assert [p.name for p in tmp_path.iterdir()] == (["res"] if previous else [])


def test_the_run_writer_failing_mid_way_leaves_nothing(tmp_path: Path) -> None:
    # The CLI's writer through the same folder: a plot that raises half-way through.
    from sim.api import simulate
    from sim.cli import render
    from sim.scenario import scenario_from_dict

    result = simulate(scenario_from_dict(TINY))
    with mock.patch("sim.outputs.plot.memory_over_time",
                    side_effect=OSError(28, "No space left on device")), \
            pytest.raises(OutputError, match="cannot write .No space left on device"):
        render.write_run_outputs(tmp_path / "res", result)
    assert list(tmp_path.iterdir()) == []


def test_compare_and_plan_outputs_are_staged_too(tmp_path: Path) -> None:
    from sim.apps import compare as cmp

    result = {"variants": [], "baseline": None}
    with mock.patch.object(cmp, "compare_figure", side_effect=OSError("no space")), \
            pytest.raises(OutputError):
        cmp.write_outputs(tmp_path / "cmp", result)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "compare.json").write_text("{}")
    with pytest.raises(OutputExists):
        cmp.write_outputs(tmp_path / "cmp", result)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_written_is_one_line_before_simulating(tmp_path: Path) -> None:
    # /proc takes no new folders, even for root (who passes every permission check).
    with pytest.raises(OutputError, match="cannot create /proc"):
        check_out(Path("/proc/fabricsim-out/run"), overwrite=False)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(TINY))
    for cmd in (["run", "s.yaml"], ["export-chakra", "s.yaml"]):
        done = _cli(tmp_path, *cmd, "--out", "/proc/fabricsim-out/x")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "cannot create /proc" in done.stderr and "Traceback" not in done.stderr
