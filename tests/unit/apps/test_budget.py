"""The cost estimate before a simulation (sim/apps/budget.py; issue 16, item 1): a lower
bound on the ops and seconds a run needs, checked against the programs the builders really
emit, and the refusal of what would not finish in an hour or fit in memory (``fabricsim run``
exits 2 with one line; ``--force`` skips the check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.apps import budget
from sim.config import resources
from sim.frameworks import JobContext, build_program
from sim.scenario import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["llama3.2-1b-1xh200", "llama3.2-1b-ddp-8xh100",
                                  "llama3-8b-fsdp2-8xh100-mbs4",
                                  "qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100"])
def test_the_estimate_is_a_lower_bound_on_the_built_program(name: str) -> None:
    sc = load_scenario(name)
    est = budget.estimate(sc, steps=1)
    assert est is not None
    ctx = JobContext.from_scenario(sc, name)
    # The closed form: layers x micro-batches x the fewest ops per layer per micro-batch.
    assert est.ops == ctx.model.layers * ctx.micro_batches * budget.OPS_PER_LAYER_MICRO_BATCH
    assert len(build_program(ctx).ops) >= est.ops


def test_steps_multiply_the_work_not_the_program() -> None:
    sc = load_scenario("llama3.2-1b-1xh200")
    one, three = budget.estimate(sc, 1), budget.estimate(sc, 3)
    assert one is not None and three is not None
    assert (three.ops, three.seconds, three.bytes) == (3 * one.ops, 3 * one.seconds, one.bytes)


def test_no_shipped_scenario_is_refused() -> None:
    for name in resources.available("scenarios"):
        est = budget.estimate(load_scenario(name), steps=10)
        assert est is not None and budget.refusal(est, budget.physical_memory()) is None, name


def test_a_run_of_more_than_an_hour_is_refused_with_the_estimate() -> None:
    # 16 layers x 2**24 micro-batches (one sequence each on one GPU) x 4 ops = 1.07e9 ops,
    # x 50 us = 53,687 s = 14.9 h at the least.
    sc = load_scenario("llama3.2-1b-1xh200", ["training.micro_batch_size=1",
                                              f"training.global_batch_size={2**24}"])
    with pytest.raises(ScenarioError) as info:
        budget.check(sc, 1, "s.yaml")
    assert str(info.value) == (
        "s.yaml: training.global_batch_size: at least 1,073,741,824 ops to simulate "
        "(16 layers x 16,777,216 micro-batches), 14.9 h or more; shrink "
        "training.global_batch_size, or pass --force to run it anyway")


def test_a_program_larger_than_memory_is_refused() -> None:
    est = budget.Estimate(layers=80, micro_batches=1000, steps=1, ops=320_000, seconds=16.0,
                          bytes=320_000 * budget.BYTES_PER_OP)
    assert budget.refusal(est, memory=2.0**30) is None   # 153 MiB of 1 GiB
    why = budget.refusal(est, memory=2.0**27)             # of 128 MiB
    assert why is not None and why.startswith("training.global_batch_size: at least 320,000")
    assert "needs 0.1 GiB or more, this machine has 0.1 GiB" in why


def test_run_refuses_in_one_line_and_force_is_an_option() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "sim.cli", "run", "llama3.2-1b-1xh200", "--set",
            f"training.global_batch_size={2**24}", "--json"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert "pass --force to run it anyway" in proc.stderr
    helped = subprocess.run([*args[:4], "--help"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert "--force" in helped.stdout


def test_a_fabric_larger_than_memory_is_refused_naming_cluster_nodes() -> None:
    # A 1B model over 4,000,000 GPUs is 16 layers x 1 micro-batch of ops, but its fabric
    # needs 4e6 x 25 KB = 93 GiB at the least (found by fuzzing: 131,072 GPUs ran out of
    # memory in the flow folding, now fixed; beyond the machine it is refused first).
    sc = load_scenario("llama3.2-1b-ddp-8xh100", ["cluster.nodes=500000",
                                                  "training.global_batch_size=8000000"])
    est = budget.estimate(sc, 1)
    assert est is not None and est.gpus == 4_000_000
    assert est.fabric_bytes == pytest.approx(4e6 * budget.BYTES_PER_GPU)
    why = budget.refusal(est, memory=2.0**34)
    assert why is not None and why.startswith(
        "cluster.nodes: a fabric of 4,000,000 GPUs and its program need 93.1 GiB or more, "
        "this machine has 16.0 GiB")
    assert budget.refusal(est, memory=2.0**37) is None   # 128 GiB


def test_collective_refuses_a_fabric_larger_than_memory() -> None:
    from sim.apps.nccltests import collective_table

    memory = budget.physical_memory()
    assert memory is not None
    gpus = int(2 * memory / budget.BYTES_PER_GPU)
    with pytest.raises(ScenarioError, match=rf"^--gpus: a fabric of {gpus:,} GPUs needs "):
        collective_table("dgx-h100", "all_reduce", gpus, [8])


QWEN_MOE = "qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100"
TWO_NODES_EP16 = ["cluster.nodes=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.ep=16",
                  "training.global_batch_size=32"]


def test_expert_groups_across_alternating_zones_get_a_note_and_nothing_else_does() -> None:
    # An expert group spans etp x ep consecutive ranks (Megatron-Core's expert layout); with
    # nodes alternating zones (round robin) a group over two or more nodes crosses them.
    note = budget.zone_note(load_scenario(QWEN_MOE, [*TWO_NODES_EP16, "cluster.azs=2"]))
    assert note is not None and "16-rank expert-parallel group (2 nodes)" in note
    assert "cluster.az_placement: blocks" in note
    # etp 4 x ep 4 = 16 ranks: two nodes as well.
    assert budget.zone_note(load_scenario(QWEN_MOE, ["cluster.nodes=4", "cluster.azs=2",
                                                     "parallelism.etp=4",
                                                     "training.global_batch_size=64"]))
    for keys in (TWO_NODES_EP16,                                        # one zone
                 [*TWO_NODES_EP16, "cluster.azs=2", "cluster.az_placement=blocks"],
                 ["cluster.nodes=2", "cluster.azs=2"]):   # etp 1 x ep 4: inside a node
        assert budget.zone_note(load_scenario(QWEN_MOE, keys)) is None, keys
    dense = load_scenario("llama3-8b-fsdp2-8xh100-mbs4", ["cluster.nodes=2", "cluster.azs=2"])
    assert budget.zone_note(dense) is None


def test_run_prints_the_zone_note_once_the_program_is_built() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sets = [x for k in [*TWO_NODES_EP16, "cluster.azs=2"] for x in ("--set", k)]
    args = [sys.executable, "-m", "sim.cli", "run", QWEN_MOE, *sets, "--json"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    note = budget.zone_note(load_scenario(QWEN_MOE, [*TWO_NODES_EP16, "cluster.azs=2"]))
    assert proc.stderr.splitlines() == [f"fabricsim: note: {note}"]
    assert json.loads(proc.stdout)["step_time_s"] > 0
    # A scenario the builder refuses still gets its one line alone.
    bad = subprocess.run([*args[:-1], "--set", "training.global_batch_size=16", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert "note" not in bad.stderr


def test_a_host_paced_moe_step_on_an_x86_host_gets_a_note_and_nothing_else_does() -> None:
    # The published-moe rows: the dropless B200 run, 51% host-bound simulated with the fitted
    # x86 host factor (+9.1%; 1.6x slower than simulated without it), gets the note; 26.04's
    # GPU-paced B300 run and the host-paced GB200 run (a Grace host, priced from its own
    # per-op cost) get none.
    from sim.api import simulate
    from sim.apps.validation.published_moe import entries, scenario_of
    by_id = {e["id"]: e for e in entries()}
    seen = {}
    for rid in ("nemo-26.02-qwen3-30b-a3b-8xb200-mxfp8-ep8-alltoall",
                "nemo-26.04-qwen3-30b-a3b-8xb300-mxfp8-ep8",
                "nemo-26.02-qwen3-30b-a3b-8xgb200-mxfp8-ep8"):
        sc = scenario_of(by_id[rid])
        summary = simulate(sc).summary
        seen[rid] = (summary["host_bound_s"] / summary["step_time_s"],
                     budget.host_note(sc, summary))
    share, note = seen["nemo-26.02-qwen3-30b-a3b-8xb200-mxfp8-ep8-alltoall"]
    assert share > budget.HOST_PACED_SHARE and note is not None and f"{share:.0%}" in note
    assert seen["nemo-26.04-qwen3-30b-a3b-8xb300-mxfp8-ep8"][1] is None
    gb200_share, gb200_note = seen["nemo-26.02-qwen3-30b-a3b-8xgb200-mxfp8-ep8"]
    assert gb200_share > budget.HOST_PACED_SHARE and gb200_note is None
    # A dense model is never noted, however host-paced.
    dense = load_scenario("llama3-8b-fsdp2-8xh100-mbs4")
    assert budget.host_note(dense, {"step_time_s": 1.0, "host_bound_s": 0.9}) is None


def test_run_prints_the_host_note_after_the_step(tmp_path) -> None:
    import yaml

    from sim.apps.validation.published_moe import entries
    rid = "nemo-26.02-qwen3-30b-a3b-8xb200-mxfp8-ep8-alltoall"
    e = next(x for x in entries() if x["id"] == rid)
    path = tmp_path / "dropless.yaml"
    path.write_text(yaml.safe_dump({"name": "dropless", **e["scenario"]}))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "sim.cli", "run", str(path), "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fabricsim: note: the simulated step is "
                                                   "host-paced")
    assert json.loads(proc.stdout)["host_bound_s"] > 0
