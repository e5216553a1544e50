"""Bad ``run.checkpoint.simulate`` / ``run.checkpoint.zone`` input: one line naming the file
and the key, exit 2, nothing on stdout; a good one adds the summary's ``checkpoint`` object."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import fabricsim_in_process

TINY = "llama3.2-1b-1xh200"   # one GPU, no NICs
RUN = ["--set", "run.checkpoint_interval_steps=200", "--set", "training.tokens_total=1e9",
       "--set", "run.samples=20"]


def fabricsim(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a subprocess (test_outputs_show_the_saves); the other checks run it
    in-process through its entry point (tests/helpers.py), as test_cli.py's subprocess runs
    already cover the start-up and the exit status of bad input."""
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.parametrize(("sets", "message"), [
    (["run.checkpoint.zone=1"], "run.checkpoint.zone: only for pfs or object_store"),
    (["run.checkpoint.storage=pfs", "run.checkpoint.gbytes_per_s=10",
      "run.checkpoint.zone=-1"], "run.checkpoint.zone"),
    (["run.checkpoint.simulate=maybe"], "run.checkpoint.simulate"),
    # A file system is reached over the network; this server has no NICs.
    (["run.checkpoint.storage=pfs", "run.checkpoint.gbytes_per_s=10",
      "run.checkpoint.simulate=true"],
     "run.checkpoint.storage: pfs is reached over the network"),
])
def test_bad_checkpoint_keys_exit_2_with_one_line(sets: list[str], message: str) -> None:
    args = [x for kv in sets for x in ("--set", kv)]
    proc = fabricsim_in_process("run", TINY, "--json", *RUN, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert TINY in lines[0]
    assert proc.stdout == ""


def test_simulated_save_to_nvme_on_one_gpu() -> None:
    proc = fabricsim_in_process("run", TINY, "--json", *RUN, "--set",
                                "run.checkpoint.simulate=true")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    ck = s["checkpoint"]
    assert ck["saves"] == 1 and ck["storage"] == "local_nvme" and not ck["asynchronous"]
    assert s["run"]["checkpoint_simulated"]
    # Synchronous: the run model's save is the one measured on the timeline.
    assert s["run"]["checkpoint_blocking_s"] == ck["blocking_s"]


def test_outputs_show_the_saves(tmp_path) -> None:   # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    proc = fabricsim("run", TINY, *RUN, "--steps", "2", "--set", "run.checkpoint.simulate=true",
                     "--set", "run.checkpoint.async=true", "--out", str(out), "--hta")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint (simulated)" in proc.stdout
    trace = json.loads((out / "trace.json").read_text())
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"checkpoint", "checkpoint_writer"} <= threads
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "checkpoint"}
    assert names == {"checkpoint wait previous write", "checkpoint stage d2h",
                     "checkpoint write"}
    assert any((out / "hta").iterdir())
