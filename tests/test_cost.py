"""Tests of the cost object (sim/cost.py), computed by hand: GPU-hours at the hourly price plus
cross-zone bytes at the egress price (1 GB = 1e9 bytes)."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.api import simulate
from sim.cost import cost_summary, gpu_hour_usd
from sim.scenario import Scenario, scenario_from_dict

H100 = catalog.gpu("h100-sxm")


def scenario(**kw) -> Scenario:
    # 2 nodes x 8 GPUs = 16 GPUs.
    data = {"model": "llama3-8b", "cluster": {"nodes": 2, "gpus_per_node": 8}}
    data.update(kw)
    return Scenario.model_validate(data)


def test_cost_object_by_hand():
    s = scenario(pricing={"gpu_hour_usd": 4.0, "egress_usd_per_gb": 0.01})
    tokens = 64 * 4096.0                  # 64 sequences of 4,096 tokens per step
    c = cost_summary(s, H100, step_time_s=2.0, tokens_per_step=tokens,
                     cross_az_bytes_per_step=3e9)
    assert set(c) == {"usd_per_hour", "usd_per_step", "egress_usd_per_step",
                      "usd_per_million_tokens", "run_hours", "run_usd"}
    assert c["usd_per_hour"] == pytest.approx(4.0 * 16, rel=1e-12)          # $64 per hour
    assert c["egress_usd_per_step"] == pytest.approx(3e9 / 1e9 * 0.01, rel=1e-12)  # $0.03
    gpu_part = 64.0 * 2.0 / 3600.0                                           # $0.0355556
    assert c["usd_per_step"] == pytest.approx(gpu_part + 0.03, rel=1e-12)
    assert c["usd_per_million_tokens"] == pytest.approx((gpu_part + 0.03) / tokens * 1e6,
                                                        rel=1e-12)
    # Without training.tokens_total there is no run.
    assert c["run_hours"] is None and c["run_usd"] is None


def test_run_hours_and_cost_with_tokens_total():
    s = scenario(pricing={"gpu_hour_usd": 4.0, "egress_usd_per_gb": 0.01},
                 training={"tokens_total": 1e12})
    tokens = 64 * 4096.0
    c = cost_summary(s, H100, 2.0, tokens, 3e9)
    steps = 1e12 / tokens                  # 3,814,697.265625 steps
    assert c["run_hours"] == pytest.approx(steps * 2.0 / 3600.0, rel=1e-12)  # 2,119.3 h
    per_step = 64.0 * 2.0 / 3600.0 + 0.03
    assert c["run_usd"] == pytest.approx(steps * per_step, rel=1e-12)
    # The run's cost is also its hours times the hourly rate plus every step's egress.
    assert c["run_usd"] == pytest.approx(c["run_hours"] * 64.0 + steps * 0.03, rel=1e-12)


def test_default_price_is_the_catalogue_reference():
    # gpus.yaml: h100-sxm reference_gpu_hour_usd 4.916 (AWS Capacity Blocks p5 rate).
    s = scenario()
    assert gpu_hour_usd(s, H100) == 4.916
    c = cost_summary(s, H100, 1.0, 1e6, 0.0)
    assert c["usd_per_hour"] == pytest.approx(4.916 * 16, rel=1e-12)
    assert c["egress_usd_per_step"] == 0.0


def test_free_gpus_leave_only_egress():
    s = scenario(pricing={"gpu_hour_usd": 0.0, "egress_usd_per_gb": 0.02})
    c = cost_summary(s, H100, 5.0, 1e6, 2.5e9)
    assert c["usd_per_hour"] == 0.0
    assert c["usd_per_step"] == pytest.approx(2.5 * 0.02, rel=1e-12) == c["egress_usd_per_step"]


def test_cost_scales_linearly_with_step_time():
    # Twice the step time, twice the GPU cost (no egress): cost is price x time.
    s = scenario(pricing={"gpu_hour_usd": 3.0})
    a = cost_summary(s, H100, 1.0, 1e6, 0.0)
    b = cost_summary(s, H100, 2.0, 1e6, 0.0)
    assert b["usd_per_step"] == pytest.approx(2 * a["usd_per_step"], rel=1e-12)
    assert b["usd_per_million_tokens"] == pytest.approx(2 * a["usd_per_million_tokens"],
                                                        rel=1e-12)


TINY_TWO_ZONES = {
    "name": "tiny-2az",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2,
                "azs": 2},
    "framework": "fsdp2",
    "training": {"seq_len": 1024, "micro_batch_size": 1},
    "pricing": {"gpu_hour_usd": 3.0, "egress_usd_per_gb": 0.02},
}


def test_simulated_summary_cost_matches_its_own_bytes_and_time():
    # Two nodes in two zones, FSDP2: its all-gathers and reduce-scatters cross the boundary.
    summary = simulate(scenario_from_dict(TINY_TWO_ZONES)).summary
    c, step = summary["cost"], summary["step_time_s"]
    cross = summary["bytes"]["cross_az"]
    assert cross > 0
    assert c["usd_per_hour"] == pytest.approx(3.0 * 4, rel=1e-12)
    assert c["egress_usd_per_step"] == pytest.approx(cross / 1e9 * 0.02, rel=1e-12)
    assert c["usd_per_step"] == pytest.approx(12.0 * step / 3600 + cross / 1e9 * 0.02,
                                              rel=1e-12)
    assert c["usd_per_million_tokens"] == pytest.approx(
        c["usd_per_step"] / summary["tokens_per_step"] * 1e6, rel=1e-12)


def test_one_zone_has_no_egress():
    # One zone: no byte crosses a zone boundary, so nothing is billed for egress.
    data = {**TINY_TWO_ZONES, "cluster": {**TINY_TWO_ZONES["cluster"], "azs": 1}}
    summary = simulate(scenario_from_dict(data)).summary
    assert summary["bytes"]["cross_az"] == 0.0
    assert summary["cost"]["egress_usd_per_step"] == 0.0
