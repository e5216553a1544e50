"""``run.zone_outage`` end to end: the CLI's one-line refusal, the run object's keys, the
shrunk layout simulated (checked against the same layout written by hand), and compare and
sweep over the outage keys (issue 15 item 5's "2 zones with a zone outage").

The scenario: Llama 3.2 1B with DDP on two DGX H100 in two zones (16 GPUs, a batch of 32
sequences of micro-batch 2); with zone 0 down, one server with 8 replicas accumulating two
micro-batches each. A step is a fraction of a second, simulated in ~50 ms.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sim.api import simulate
from sim.apps import compare as cmp
from sim.apps.runlength import run_length
from sim.apps.sweep import run_sweep
from sim.cli.commands import app
from sim.scenario import load_scenario

DDP = "llama3.2-1b-ddp-8xh100"
TWO_ZONES = ["cluster.nodes=2", "cluster.azs=2", "training.global_batch_size=32",
             "training.tokens_total=2e9", "run.checkpoint_interval_steps=100",
             "run.checkpoint.storage=object_store", "run.checkpoint.gbytes_per_s=2",
             "run.samples=400"]


def _run(overrides: list[str]) -> tuple[dict, dict]:
    result = simulate(load_scenario(DDP, TWO_ZONES + overrides))
    return result.summary, dict(run_length(result))


def test_one_zone_is_refused_in_one_line_naming_file_and_key() -> None:
    res = CliRunner().invoke(app, ["run", DDP, "--json", "--set", "training.tokens_total=2e9",
                                   "--set", "run.checkpoint_interval_steps=100", "--set",
                                   "run.zone_outage={per_year: 1, hours: 8}"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1
    assert f"{DDP}.yaml: run.zone_outage: needs a cluster over 2 or more zones" in lines[0]


@pytest.mark.parametrize("policy", ["wait", "shrink"])
def test_a_zero_rate_gives_exactly_the_run_without_the_key(policy: str) -> None:
    _, without = _run([])
    _, zero = _run([f"run.zone_outage={{per_year: 0, hours: 8, policy: {policy}}}"])
    assert {k: zero[k] for k in without} == without
    assert zero["zone_outages_expected"] == 0 and zero["zone_outage_days_lost"] == 0


def test_shrink_simulates_the_surviving_zone() -> None:
    summary, run = _run(["run.zone_outage={per_year: 12, hours: 8, policy: shrink}"])
    # The same layout written by hand: one DGX H100, 8 DDP replicas, the batch of 32.
    by_hand = simulate(load_scenario(DDP, ["training.global_batch_size=32"])).summary
    assert run["shrunk_step_time_s"] == pytest.approx(by_hand["step_time_s"], rel=1e-12)
    assert (run["shrunk_dp"], run["shrunk_nodes"]) == (8, 1)
    # Twice the micro-batches per replica (gradient accumulation 2): more compute per GPU
    # (forward and backward twice, the optimizer step once).
    assert 1.5 * summary["compute_time_s"] < by_hand["compute_time_s"] \
        < 2 * summary["compute_time_s"]
    # The whole cluster's step waits on its all-reduce over the 100 Gb/s zone link (the
    # cluster.az_link_gbps default), which the surviving zone does not cross.
    assert run["shrunk_step_time_s"] < summary["step_time_s"]
    assert run["zone_outage_policy"] == "shrink" and run["zone_outage_checkpoint_survives"]


def test_wait_costs_its_outages_in_the_ettr_and_days() -> None:
    _, without = _run([])
    _, wait = _run(["run.zone_outage={per_year: 365, hours: 1}"])
    # 2 zones x 1 a day over ~0.13 days of run: about a quarter of an outage per run, each
    # ~1 h 10 min plus lost work.
    assert 0.15 < wait["zone_outages_expected"] < 0.4
    assert wait["expected_days"] > without["expected_days"]
    assert wait["ettr"] < without["ettr"]
    per_outage_h = wait["zone_outage_days_lost"] * 24 / wait["zone_outages_expected"]
    assert 1 + 10 / 60 < per_outage_h < 1 + 10 / 60 + 0.5


def test_local_checkpoints_do_not_survive_by_default() -> None:
    _, run = _run(["run.checkpoint.storage=local_nvme", "run.checkpoint.gbytes_per_s=null",
                   "run.zone_outage={per_year: 1, hours: 8}"])
    assert run["zone_outage_checkpoint_survives"] is False


def test_sweep_and_compare_over_the_outage_rate() -> None:
    result = run_sweep(DDP, [*TWO_ZONES, "run.zone_outage.hours=4",
                             "run.zone_outage.per_year=0,365"],
                       workers=1, use_cache=False)
    rows = result.rows
    assert [r["error"] for r in rows] == [None, None]
    assert rows[0]["run.zone_outages_expected"] == 0
    assert rows[1]["run.zone_outages_expected"] > 0
    assert rows[1]["run.ettr"] < rows[0]["run.ettr"]
    variants = cmp.what_if_variants(DDP, "run.zone_outage.policy=wait,shrink",
                                    [*TWO_ZONES, "run.zone_outage.per_year=365",
                                     "run.zone_outage.hours=8"])
    cmp.simulate_variants(variants)
    d = cmp.compare_result(variants)["deltas"][0]
    assert "run.zone_outage_days_lost" in d and "run.zone_outages_expected" in d
    # Same draws, the same outages met; the surviving server steps faster than the two
    # zones (no all-reduce over the zone link), so shrink trains through them and loses less.
    assert d["run.zone_outage_days_lost"]["abs"] < 0
