"""The ``run:`` block end to end: ``fabricsim run --json`` adds the ``run`` object, the
checkpoint bytes come from the simulated job's own sharded states, bad keys exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import make_scenario
from helpers import fabricsim_in_process

from sim.api import simulate
from sim.apps.runlength import run_length

TINY = "llama3.2-1b-1xh200"
RUN = ["--set", "run.checkpoint_interval_steps=200", "--set", "training.tokens_total=1e9",
       "--set", "run.samples=50"]
CONTRACT_KEYS = ["ettr", "expected_days", "days_p5", "days_p95", "expected_usd",
                 "checkpoint_interval_steps", "optimal_checkpoint_interval_steps",
                 "interruptions_expected"]


def fabricsim(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a subprocess: its start-up and its own streams."""
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_run_json_adds_the_run_object() -> None:
    with_run = fabricsim("run", TINY, "--json", *RUN)
    assert with_run.returncode == 0, with_run.stderr
    s = json.loads(with_run.stdout)
    r = s["run"]
    assert list(r)[:len(CONTRACT_KEYS)] == CONTRACT_KEYS
    assert r["checkpoint_interval_steps"] == 200
    # 1e9 tokens at 16,384 per step: 61,036 steps; wall time at least the work.
    assert r["steps_total"] == 61_036
    assert r["expected_days"] * 86_400 >= 61_036 * s["step_time_s"]
    assert r["days_p5"] <= r["expected_days"] <= r["days_p95"]
    assert 0 < r["ettr"] < 1
    # The whole wall time at the summary's price per hour of the job's one GPU (no egress).
    assert r["expected_usd"] == pytest.approx(
        r["expected_days"] * 24 * s["cost"]["usd_per_hour"])
    plain = json.loads(fabricsim_in_process("run", TINY, "--json").stdout)
    assert "run" not in plain
    assert {k: v for k, v in s.items() if k not in ("run", "sim", "cost")} == \
        {k: v for k, v in plain.items() if k not in ("sim", "cost")}


def test_human_output_prints_the_run() -> None:
    out = fabricsim_in_process("run", TINY, *RUN)
    assert out.returncode == 0, out.stderr
    assert "run: ETTR" in out.stdout and "run: checkpoint" in out.stdout


@pytest.mark.parametrize(("sets", "message"), [
    (["run.bogus=1"], "run.bogus: unknown key"),
    (["run.checkpoint.storage=tape"], "run.checkpoint.storage"),
    (["run.checkpoint.storage=pfs"], "run.checkpoint.gbytes_per_s: needed for storage pfs"),
    (["run.failures=nope"], "run.failures: unknown catalogue 'nope'"),
    (["run.failures.gpu.basis=rack", "run.failures.gpu.rate_per_unit_per_day=0.1"],
     "run.failures.gpu.basis"),
    (["run.samples=0"], "run.samples"),
    # A failure a second against saves every 200 steps of 0.4 s: it never finishes.
    (["run.failures.x.basis=job", "run.failures.x.rate_per_unit_per_day=86400"],
     "the run would practically never finish"),
])
def test_bad_run_keys_exit_2_with_one_line(sets: list[str], message: str) -> None:
    args = [x for kv in sets for x in ("--set", kv)]
    # In-process through the command's entry point; the run block's one subprocess run is
    # test_run_json_adds_the_run_object's, and test_cli.py's bad input exits 2 as one.
    proc = fabricsim_in_process("run", TINY, "--json", *RUN, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""


def test_run_needs_tokens_total() -> None:
    proc = fabricsim_in_process("run", TINY, "--set", "run.checkpoint_interval_steps=10")
    assert proc.returncode == 2
    assert "run: needs training.tokens_total" in proc.stderr


# The checkpoint is the job's distinct states: AdamW's two fp32 moments beside fp32
# parameters (DDP, FSDP2: 12 B per parameter), or beside 16-bit weights with an fp32 master
# (Megatron, DeepSpeed: 14 B), whatever the sharding (torch DCP and Megatron dist-ckpt save
# each replicated tensor once).
@pytest.mark.parametrize(("framework", "parallelism", "per_param"), [
    ({"name": "ddp"}, {}, 12.0),
    ({"name": "fsdp2"}, {}, 12.0),
    ({"name": "megatron", "distributed_optimizer": True}, {"tp": 2}, 14.0),
    ({"name": "megatron", "distributed_optimizer": False}, {"tp": 2}, 14.0),
    ({"name": "deepspeed", "zero_stage": 1}, {}, 14.0),
    ({"name": "deepspeed", "zero_stage": 3}, {}, 14.0),
])
def test_checkpoint_bytes_follow_the_framework(framework: dict[str, object],
                                               parallelism: dict[str, object],
                                               per_param: float) -> None:
    s = make_scenario(framework=framework, parallelism=parallelism,
                      training={"seq_len": 1024, "micro_batch_size": 1, "tokens_total": 1e9},
                      run={"checkpoint_interval_steps": 100, "samples": 20})
    result = simulate(s)
    r = run_length(result)
    params = result.context.model.total_params
    assert r["checkpoint_gb"] * 1e9 == pytest.approx(per_param * params, rel=0.02)
