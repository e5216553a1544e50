"""Tests of the cost object (sim/analysis/cost.py), computed by hand: GPU-hours at the hourly price
plus
cross-zone bytes at the egress price (1 GB = 1e9 bytes)."""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path

import pytest
from conftest import make_scenario
from helpers import TWO_ZONES

from sim import catalog
from sim.analysis.cost import cost_summary, gpu_hour_usd, resolve_pricing
from sim.api import simulate
from sim.scenario import Scenario, ScenarioError

H100 = catalog.gpu("h100-sxm")


# Llama 3 8B on 2 nodes x 8 GPUs = 16 GPUs: the base the by-hand tests price.
SIXTEEN_GPUS = {"model": "llama3-8b", "cluster": {"nodes": 2, "gpus_per_node": 8}}


def scenario(**kw) -> Scenario:
    """SIXTEEN_GPUS with whole sections replaced (``pricing=...``, ``cluster=...``)."""
    return make_scenario(SIXTEEN_GPUS, **kw)


def test_cost_object_by_hand():
    s = scenario(pricing={"gpu_hour_usd": 4.0, "egress_usd_per_gb": 0.01})
    tokens = 64 * 4096.0                  # 64 sequences of 4,096 tokens per step
    c = cost_summary(s, H100, step_time_s=2.0, tokens_per_step=tokens,
                     cross_az_bytes_per_step=3e9)
    assert set(c) == {"usd_per_hour", "usd_per_step", "egress_usd_per_step",
                      "usd_per_million_tokens", "run_hours", "run_usd",
                      # added by the FinOps work (the contract only grows)
                      "usd_per_day", "egress_gb_per_step", "egress_gb_per_day",
                      "egress_usd_per_day", "gpu_hour_usd", "egress_usd_per_gb",
                      "region_egress_usd_per_gb", "instance"}
    # the prices charged are reported as resolved (the scenario's, else the defaults)
    assert (c["egress_usd_per_gb"], c["region_egress_usd_per_gb"]) == (0.01, 0.02)
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


# The prices the simulated two-zone runs (helpers.TWO_ZONES: 2 nodes x 2 H100) are billed at.
TWO_ZONE_PRICES = {"gpu_hour_usd": 3.0, "egress_usd_per_gb": 0.02}


def test_simulated_summary_cost_matches_its_own_bytes_and_time():
    # Two nodes in two zones, FSDP2: its all-gathers and reduce-scatters cross the boundary.
    summary = simulate(make_scenario(TWO_ZONES, pricing=TWO_ZONE_PRICES)).summary
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
    summary = simulate(make_scenario(TWO_ZONES, pricing=TWO_ZONE_PRICES,
                                     cluster__azs=1)).summary
    assert summary["bytes"]["cross_az"] == 0.0
    assert summary["cost"]["egress_usd_per_step"] == 0.0


# --------------------------------------------------------------------------- per day
def test_per_day_arithmetic_by_hand():
    # 16 GPUs at $4/GPU-h = $64/h; a 2 s step moving 3 GB across the zone boundary.
    s = scenario(pricing={"gpu_hour_usd": 4.0, "egress_usd_per_gb": 0.01})
    c = cost_summary(s, H100, step_time_s=2.0, tokens_per_step=64 * 4096.0,
                     cross_az_bytes_per_step=3e9)
    steps_per_day = 86_400 / 2.0                                      # 43,200 steps
    assert c["egress_gb_per_step"] == pytest.approx(3.0, rel=1e-12)
    assert c["egress_gb_per_day"] == pytest.approx(3.0 * steps_per_day, rel=1e-12)  # 129,600
    assert c["egress_usd_per_day"] == pytest.approx(0.03 * steps_per_day, rel=1e-12)  # $1,296
    assert c["usd_per_day"] == pytest.approx(64.0 * 24 + 1296.0, rel=1e-12)         # $2,832
    # A day of steps costs what 43,200 steps cost: the day is the step rate, nothing else.
    assert c["usd_per_day"] == pytest.approx(c["usd_per_step"] * steps_per_day, rel=1e-12)
    assert c["gpu_hour_usd"] == 4.0 and c["egress_usd_per_gb"] == 0.01
    assert c["instance"] is None


def test_egress_is_billed_gb_times_price_exactly():
    # No rounding anywhere between the bytes, the GB and the dollars.
    s = scenario(pricing={"gpu_hour_usd": 1.0, "egress_usd_per_gb": 0.0123})
    c = cost_summary(s, H100, 1.7, 1e6, 987_654_321_012.0)
    assert c["egress_gb_per_step"] == 987_654_321_012.0 / 1e9
    assert c["egress_usd_per_step"] == c["egress_gb_per_step"] * c["egress_usd_per_gb"]
    assert c["egress_usd_per_day"] == c["egress_usd_per_step"] * (86_400 / 1.7)


def test_region_crossings_are_billed_at_the_region_price():
    s = scenario(pricing={"gpu_hour_usd": 0.0, "egress_usd_per_gb": 0.01,
                          "region_egress_usd_per_gb": 0.02})
    c = cost_summary(s, H100, 1.0, 1e6, cross_az_bytes_per_step=2e9,
                     cross_region_bytes_per_step=5e9)
    assert c["egress_gb_per_step"] == pytest.approx(7.0, rel=1e-12)   # both are billed GB
    assert c["egress_usd_per_step"] == pytest.approx(2 * 0.01 + 5 * 0.02, rel=1e-12)


# --------------------------------------------------------------------------- catalogue
DATE = re.compile(r"^\d{4}(-\d{2}(-\d{2})?)?$")   # a year, a month or a day


def test_every_catalogue_price_has_a_source_and_dates():
    names = catalog.instance_names()
    assert {"aws-p5.48xlarge", "gcp-a3-highgpu-8g", "azure-nd96isr-h100-v5"} <= set(names)
    for name in names:
        p = catalog.instance_price(name)
        assert p.source.strip() and p.instance_type.strip() and p.region.strip(), name
        assert DATE.match(p.source_date) and DATE.match(p.read_on), name
        assert p.source_date <= p.read_on <= date.today().isoformat(), name
        assert p.gpu in catalog.gpu_names(), name          # a GPU the simulator knows
        assert p.cloud in catalog.cloud_names() and name.startswith(p.cloud + "-"), name
        assert p.gpus > 0 and p.usd_per_hour > 0, name
    for cloud in catalog.cloud_names():
        prices = catalog.cloud_prices(cloud)
        assert prices.cross_zone is not None, cloud         # the price this work is about
        for t in (prices.same_zone, prices.cross_zone, prices.cross_region):
            if t is None:
                continue
            assert t.source.strip() and DATE.match(t.source_date) and DATE.match(t.read_on)
            assert t.unit in ("GB", "GiB") and t.sides_billed in (0, 1, 2) and t.usd >= 0
        # Staying in a zone is free on all three: the cost model bills only crossings.
        assert prices.same_zone is not None and prices.same_zone.usd_per_gb_crossed == 0


def test_transfer_price_per_gb_crossed():
    # AWS: $0.01/GB out of the sender's zone plus $0.01/GB into the receiver's.
    aws = catalog.cloud_prices("aws").cross_zone
    assert aws is not None and (aws.usd, aws.unit, aws.sides_billed) == (0.01, "GB", 2)
    assert aws.usd_per_gb_crossed == pytest.approx(0.02, rel=1e-12)
    # Google: $0.01 per GiB (2**30 bytes), the sender only.
    gcp = catalog.cloud_prices("gcp").cross_zone
    assert gcp is not None and (gcp.usd, gcp.unit, gcp.sides_billed) == (0.01, "GiB", 1)
    assert gcp.usd_per_gb_crossed == pytest.approx(0.01 * 1e9 / 2**30, rel=1e-12)


def test_instance_sets_gpu_hour_and_transfer_prices():
    inst = catalog.instance_price("aws-p5.48xlarge")
    s = scenario(pricing={"instance": "aws-p5.48xlarge"})
    p = resolve_pricing(s)
    assert p.gpu_hour_usd == pytest.approx(inst.usd_per_hour / inst.gpus, rel=1e-12)
    assert p.egress_usd_per_gb == pytest.approx(0.02, rel=1e-12)       # AWS, both ends
    assert p.region_egress_usd_per_gb == pytest.approx(0.02, rel=1e-12)
    assert (p.instance, p.cloud) == ("aws-p5.48xlarge", "aws")
    c = cost_summary(s, H100, 1.0, 1e6, 1e9)
    assert c["instance"] == "aws-p5.48xlarge"
    assert c["usd_per_hour"] == pytest.approx(inst.usd_per_hour / 8 * 16, rel=1e-12)  # 2 nodes


def test_scenario_prices_override_the_catalogue():
    s = scenario(pricing={"instance": "aws-p5.48xlarge", "gpu_hour_usd": 2.5,
                          "egress_usd_per_gb": 0.005})
    p = resolve_pricing(s)
    assert (p.gpu_hour_usd, p.egress_usd_per_gb) == (2.5, 0.005)
    # The region price was not given: it still comes from the instance's cloud.
    assert p.region_egress_usd_per_gb == pytest.approx(0.02, rel=1e-12)


def test_cloud_without_instance_prices_transfer_only():
    p = resolve_pricing(scenario(pricing={"cloud": "gcp"}))
    assert p.gpu_hour_usd == H100.reference_gpu_hour_usd               # GPUs priced by hand
    assert p.egress_usd_per_gb == pytest.approx(0.01 * 1e9 / 2**30, rel=1e-12)
    # Google's region price is not in the catalogue: the field's default applies.
    assert p.region_egress_usd_per_gb == 0.02
    # Without instance or cloud, nothing changes from before the catalogue existed.
    bare = resolve_pricing(scenario())
    assert (bare.egress_usd_per_gb, bare.region_egress_usd_per_gb) == (0.01, 0.02)


@pytest.mark.parametrize("pricing, cluster_gpu, expected", [
    ({"instance": "aws-p5.48xlarge"}, "a100-80gb",
     "pricing.instance: aws-p5.48xlarge has h100-sxm GPUs but cluster.gpu is a100-80gb"),
    ({"instance": "aws-p9.nope"}, "h100-sxm", "pricing.instance: unknown instance 'aws-p9.nope'"),
    ({"instance": "aws-p5.48xlarge", "cloud": "gcp"}, "h100-sxm",
     "pricing.cloud: gcp but pricing.instance aws-p5.48xlarge is on aws"),
])
def test_bad_instance_is_one_line_naming_the_key(pricing, cluster_gpu, expected):
    s = scenario(pricing=pricing, cluster={"nodes": 2, "gpus_per_node": 8, "gpu": cluster_gpu})
    with pytest.raises(ScenarioError) as err:
        resolve_pricing(s, origin="job.yaml")
    message = str(err.value)
    assert message.startswith("job.yaml: " + expected) and "\n" not in message


# --------------------------------------------------------------------------- the doc
DOC = Path(__file__).resolve().parents[3] / "docs" / "egress-arithmetic.md"


def test_doc_redoes_the_article_arithmetic():
    # The article: 400 TB every 12 hours x 1,024 GB/TB x $0.015/GB, called "per day".
    per_12h = 400 * 1024 * 0.015
    assert per_12h == pytest.approx(6144.0)
    text = DOC.read_text()
    for value in (per_12h, 2 * per_12h, 60 * per_12h,                 # 12 h, day, 30 days
                  400_000 * 0.015, 800_000 * 0.015, 800_000 * 0.015 * 30,
                  800_000 * 0.02, 800_000 * 0.02 * 30):
        assert f"${value:,.0f}" in text, value


def test_doc_arithmetic_on_a_small_two_zone_job():
    # The doc's arithmetic on 2 nodes x 2 H100 in 2 zones, FSDP2 (its all-gathers and
    # reduce-scatters cross the boundary), at the catalogue's AWS prices.
    result = simulate(make_scenario(TWO_ZONES, pricing={"instance": "aws-p5.48xlarge"}))
    s, m = result.summary, result.context.model
    # Closed form of the crossing bytes: a ring over N = 4 ranks on 2 nodes in 2 zones crosses
    # the boundary twice and carries S x (N-1)/N over each hop; one step moves 2P (bf16
    # forward all-gather) + 2(P - P_head) (backward all-gather; norm + output stay gathered)
    # + 4P (fp32 reduce-scatter) bytes.
    p, head = m.total_params, m.lm_head_params + m.norm_params
    assert s["bytes"]["cross_az"] == pytest.approx(2 * 3 / 4 * (8 * p - 2 * head), rel=1e-9)
    c = s["cost"]
    price = catalog.cloud_prices("aws").cross_zone.usd_per_gb_crossed     # $0.02
    gb_per_step = s["bytes"]["cross_az"] / 1e9
    steps_per_day = 86_400 / s["step_time_s"]
    assert c["egress_usd_per_gb"] == price
    assert c["egress_gb_per_day"] == pytest.approx(gb_per_step * steps_per_day, rel=1e-12)
    assert c["egress_usd_per_day"] == pytest.approx(gb_per_step * price * steps_per_day,
                                                    rel=1e-12)
    gpu_per_day = 4 * catalog.instance_price("aws-p5.48xlarge").usd_per_gpu_hour * 24
    assert c["usd_per_day"] == pytest.approx(gpu_per_day + c["egress_usd_per_day"], rel=1e-12)
