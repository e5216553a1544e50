"""Tests of the verdicts on published figures (sim/analysis/claims.py): physically impossible (with
the
reason), consistent within 10%, or off by N%."""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim import catalog
from sim.analysis.claims import judge, judge_ratio, zone_link_bytes_per_s
from sim.api import simulate
from sim.scenario import Claims, Scenario, ScenarioError, load_scenario
from sim.workload.model import ModelSpec

H100 = catalog.gpu("h100-sxm")
PEAK_BF16 = 989.4e12      # H100 SXM datasheet: 989.4 TFLOP/s dense BF16
GIB = 2**30

# Llama 3 70B, 4,096-token sequences: 6 x 69,503,033,344 matmul params = 417,018,200,064
# plus causal attention 6 x 80 layers x 4096 x 8192 = 16,106,127,360 -> 433,124,327,424 FLOP.
FLOPS_70B = 6 * 69_503_033_344 + 6 * 80 * 4096 * 8192
# Model states under FSDP on 64 GPUs: fp32 params + fp32 grads + two fp32 Adam moments
# = 16 bytes per parameter, sharded 64 ways: 70,553,706,496 x 16 / 64 = 17,638,426,624 bytes
# (16.43 GiB).
STATES_70B_64 = 70_553_706_496 * 16 / 64


def summary_70b(step_time_s: float = 10.0) -> dict:
    """A summary of Llama 3 70B on 64 H100s: 64 sequences of 4,096 tokens per step."""
    tokens = 64 * 4096.0
    return {
        "gpus": 64,
        "step_time_s": step_time_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_time_s,
        "tokens_per_s_per_gpu": tokens / step_time_s / 64,     # 409.6 at 10 s
        "mfu": tokens * FLOPS_70B / (step_time_s * 64 * PEAK_BF16),
        "peak_memory_gib": 50.0,
    }


def run(claims: dict, summary: dict | None = None, states: float = STATES_70B_64) -> list[dict]:
    return judge(Claims(source="test", **claims), summary or summary_70b(), H100, "bf16",
                 FLOPS_70B, states)


def one(claims: dict, **kw) -> dict:
    out = run(claims, **kw)
    assert len(out) == 1
    return out[0]


def test_flops_per_token_is_the_model_modules():
    assert ModelSpec.from_ref("llama3-70b").model_flops_per_token(4096) == FLOPS_70B
    assert H100.peak_flops("bf16") == PEAK_BF16


def test_throughput_above_dense_peak_is_impossible():
    # 2,910 tokens/s/GPU x 433.1e9 FLOP/token = 1.260e15 FLOP/s > 989.4e12.
    assert 2910 * FLOPS_70B > PEAK_BF16
    v = one({"tokens_per_s_per_gpu": 2910})
    assert v["verdict"] == "physically impossible"
    assert v["claimed"] == 2910 and v["simulated"] == pytest.approx(409.6, rel=1e-12)
    assert "989" in v["reason"] and "peak" in v["reason"]
    assert "1,260" in v["reason"]          # the TFLOP/s the claim needs, rounded
    assert "433.1 GFLOP per token" in v["reason"]


def test_throughput_just_below_peak_is_judged_against_the_simulation():
    # 99% of the peak rate: 0.99 x 989.4e12 / 433.1e9 = 2,261.5 tokens/s/GPU is possible,
    # and (2,261.5 - 409.6) / 409.6 = +452% against the simulated 409.6.
    claim = 0.99 * PEAK_BF16 / FLOPS_70B
    assert claim == pytest.approx(2261.5, abs=0.1)
    assert one({"tokens_per_s_per_gpu": claim})["verdict"] == "off by +452%"


def test_whole_cluster_throughput_is_divided_by_gpus():
    # 64 x 2,910 tokens/s for the cluster is the same impossible per-GPU rate.
    assert one({"tokens_per_s": 64 * 2910})["verdict"] == "physically impossible"
    # 64 x 400 = 25,600 tokens/s: 400 x 433.1e9 = 173 TFLOP/s, possible; vs 26,214.4 simulated.
    v = one({"tokens_per_s": 25_600})
    assert v["verdict"] == "consistent"           # -2.3%
    assert v["simulated"] == pytest.approx(26_214.4, rel=1e-12)


def test_step_time_that_implies_too_much_math_is_impossible():
    # 262,144 tokens per step on 64 GPUs in 1 s = 4,096 tokens/s/GPU: 1.77e15 FLOP/s > peak.
    assert one({"step_time_s": 1.0})["verdict"] == "physically impossible"
    assert one({"step_time_s": 10.5})["verdict"] == "consistent"   # +5% of 10 s


@pytest.mark.parametrize("claimed, verdict", [
    (409.6, "consistent"),          # equal
    (409.6 * 1.05, "consistent"),   # +5%
    (409.6 * 0.91, "consistent"),   # -9%
    (409.6 * 1.2, "off by +20%"),
    (409.6 * 0.7, "off by -30%"),
    (409.6 * 2.0, "off by +100%"),
])
def test_consistent_within_ten_percent_else_off_by(claimed, verdict):
    v = one({"tokens_per_s_per_gpu": claimed})
    assert v["verdict"] == verdict
    if verdict == "consistent":
        assert v["reason"] == "within 10% of the simulation"
    else:
        assert "409.6" in v["reason"]


def test_ten_percent_boundary():
    # Exactly 10% over a simulated 1,000 is consistent; 11% is not. (1100-1000)/1000 == 0.1.
    base = summary_70b()
    base["tokens_per_s_per_gpu"] = 1000.0
    assert one({"tokens_per_s_per_gpu": 1100.0}, summary=base)["verdict"] == "consistent"
    assert one({"tokens_per_s_per_gpu": 1110.0}, summary=base)["verdict"] == "off by +11%"


def test_memory_below_model_states_is_impossible():
    # 10 GiB < 16.43 GiB of sharded fp32 params, grads and Adam moments.
    v = one({"peak_memory_gib": 10})
    assert v["verdict"] == "physically impossible"
    assert "16.4 GiB" in v["reason"]


def test_memory_above_the_gpu_is_impossible():
    # gpus.yaml: the H100 SXM has 79.19 GiB usable (CUDA's total_memory).
    v = one({"peak_memory_gib": 90})
    assert v["verdict"] == "physically impossible"
    assert "79.2 GiB" in v["reason"]


def test_memory_between_states_and_capacity_is_compared():
    # 53 vs a simulated 50 is +6%: within 10%; 70 is +40%.
    assert one({"peak_memory_gib": 53})["verdict"] == "consistent"
    assert one({"peak_memory_gib": 70})["verdict"] == "off by +40%"


def test_memory_in_gigabytes_is_converted():
    # 50 GiB simulated = 53.687 GB; a 53.7 GB claim is the same figure.
    v = one({"peak_memory_gb": 53.7})
    assert v["simulated"] == pytest.approx(50 * GIB / 1e9, rel=1e-12)
    assert v["verdict"] == "consistent"
    # 15 GB = 13.97 GiB, below the 16.43 GiB of model states.
    assert one({"peak_memory_gb": 15})["verdict"] == "physically impossible"


def test_mfu_above_one_is_impossible():
    assert one({"mfu": 1.2}) == {"metric": "mfu", "claimed": 1.2,
                                 "simulated": summary_70b()["mfu"],
                                 "verdict": "physically impossible",
                                 "reason": "MFU cannot exceed 1"}


def test_one_verdict_per_claimed_figure():
    out = run({"tokens_per_s_per_gpu": 400, "peak_memory_gib": 53, "mfu": 0.18})
    assert [v["metric"] for v in out] == ["tokens_per_s_per_gpu", "mfu", "peak_memory_gib"]
    assert all(set(v) == {"metric", "claimed", "simulated", "verdict", "reason"} for v in out)
    assert run({}) == []


def test_claims_end_to_end_on_the_one_gpu_scenario():
    # Llama 3.2 1B on an H200 (989.4 TFLOP/s bf16, same compute as H100): 8,220,192,768
    # FLOP/token (tests/unit/workload/test_model.py) caps the rate at 989.4e12 / 8.22e9 = 120,363
    # tokens/s.
    # Plain PyTorch keeps fp32 params + fp32 grads + two fp32 Adam moments: 16 x 1,235,814,400
    # = 19,773,030,400 bytes = 18.4 GiB.
    s = load_scenario("llama3.2-1b-1xh200", [
        "claims.source=test", "claims.tokens_per_s_per_gpu=200000",
        "claims.peak_memory_gib=10", "claims.mfu=1.5"])
    out = {v["metric"]: v for v in simulate(s).summary["claims"]}
    assert out["tokens_per_s_per_gpu"]["verdict"] == "physically impossible"
    assert "H200" in out["tokens_per_s_per_gpu"]["reason"]
    assert "989" in out["tokens_per_s_per_gpu"]["reason"]
    assert out["peak_memory_gib"]["verdict"] == "physically impossible"
    assert "18.4 GiB" in out["peak_memory_gib"]["reason"]
    assert out["mfu"]["verdict"] == "physically impossible"


# --------------------------------------------------------------------------- added claims
# Llama 3 70B on 8 H100: 16 bytes per parameter over 8 GPUs = 141,107,412,992 bytes per GPU,
# more than the H100's 85,031,714,816 bytes (gpus.yaml).
STATES_70B_8 = 70_553_706_496 * 16 / 8


def summary_8(step_time_s: float = 4.0, oom: bool = True) -> dict:
    """Llama 3 70B on one 8-GPU node: 8 sequences of 4,096 tokens per step."""
    tokens = 8 * 4096.0
    return {"gpus": 8, "step_time_s": step_time_s, "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_time_s, "tokens_per_s_per_gpu": tokens / step_time_s / 8,
            "mfu": 0.4, "peak_memory_gib": 150.0, "oom": oom, "exposed_comm_s": 0.02,
            "model_params": 70_553_706_496}


def test_model_states_below_sixteen_bytes_per_parameter_are_impossible():
    # The benchmarks article's 35 GB per GPU for 70B over 8 GPUs is 3.97 bytes per parameter.
    v = one({"model_state_memory_gb": 35}, summary=summary_8(), states=STATES_70B_8)
    assert v["verdict"] == "physically impossible"
    assert v["simulated"] == pytest.approx(141.107, rel=1e-5)
    assert "141.1 GB" in v["reason"] and "16.0 bytes per parameter" in v["reason"]
    assert "70.6e9 parameters / 8 GPUs" in v["reason"]
    # 150 GB is above the states, +6.3%: consistent (the claimant may count buffers too).
    assert one({"model_state_memory_gb": 150}, summary=summary_8(),
               states=STATES_70B_8)["verdict"] == "consistent"


def test_a_setup_whose_states_exceed_the_gpu_cannot_run():
    # 1,024 tokens/s/GPU is below the FLOP/s bound (2,284), but nothing runs at all when the
    # states alone (131.4 GiB) exceed the H100's 79.2 GiB.
    assert 1024 * FLOPS_70B < PEAK_BF16 and STATES_70B_8 > H100.usable_memory_bytes
    v = one({"tokens_per_s_per_gpu": 1024}, summary=summary_8(), states=STATES_70B_8)
    assert v["verdict"] == "physically impossible"
    assert "cannot run" in v["reason"] and "131.4 GiB" in v["reason"]
    for claim in ({"mfu": 0.4}, {"exposed_comm_fraction": 0.1}, {"step_time_s": 4.0}):
        assert one(claim, summary=summary_8(), states=STATES_70B_8)["verdict"] == \
            "physically impossible"
    # Above the FLOP/s bound too: both reasons.
    v = one({"tokens_per_s_per_gpu": 2910}, summary=summary_8(), states=STATES_70B_8)
    assert "989" in v["reason"] and "cannot run" in v["reason"]


def test_an_oom_simulation_is_noted_when_the_states_fit():
    s = summary_70b()
    s["oom"], s["peak_memory_gib"] = True, 105.8
    v = one({"tokens_per_s_per_gpu": 300}, summary=s)
    assert v["verdict"] == "off by -27%"          # (300 - 409.6) / 409.6
    assert "does not fit" in v["reason"] and "105.8 GiB" in v["reason"]


def test_fractions_of_the_step():
    s = summary_70b()
    s["exposed_comm_s"], s["bubble_fraction"] = 1.0, 0.2      # 10% of a 10 s step exposed
    assert one({"exposed_comm_fraction": 0.105}, summary=s)["verdict"] == "consistent"
    assert one({"exposed_comm_fraction": 0.2}, summary=s)["verdict"] == "off by +100%"
    assert one({"exposed_comm_fraction": 1.5}, summary=s)["verdict"] == "physically impossible"
    assert one({"bubble_fraction": 0.1}, summary=s)["verdict"] == "off by -50%"
    assert one({"bubble_fraction": 1.2}, summary=s)["verdict"] == "physically impossible"


def with_cost(s: dict, tokens_total: float | None, gpu_hour_usd: float = 4.0) -> dict:
    """The cost object cost_summary gives: GPU-hours at the price, run length from the rate."""
    hours = tokens_total / s["tokens_per_s"] / 3600 if tokens_total else None
    per_hour = s["gpus"] * gpu_hour_usd
    s["cost"] = {"usd_per_hour": per_hour, "run_hours": hours,
                 "run_usd": hours * per_hour if hours else None,
                 "egress_usd_per_step": 0.0}
    return s


def test_run_length_and_cost():
    # 1e12 tokens at 26,214.4 tokens/s = 10,596.4 h; x 64 GPUs x $4 = $2,712,668.
    s = with_cost(summary_70b(), 1e12)
    assert s["cost"]["run_hours"] == pytest.approx(10_596.4, abs=0.1)
    assert one({"run_hours": 10_600}, summary=s)["verdict"] == "consistent"
    # 1,000 h means 1e12 / 3.6e6 s / 64 = 4,340 tokens/s/GPU, above 2,284 (the bf16 bound).
    v = one({"run_hours": 1000}, summary=s)
    assert v["verdict"] == "physically impossible" and "989" in v["reason"]
    assert one({"run_usd": 2_700_000}, summary=s)["verdict"] == "consistent"
    # $100,000 buys 390.6 h of 64 GPUs at $4: at least 11,111 tokens/s/GPU, impossible.
    assert one({"run_usd": 100_000}, summary=s)["verdict"] == "physically impossible"
    # $1,000,000 buys 3,906 h: 1,111 tokens/s/GPU is possible, -63% against the simulation.
    assert one({"run_usd": 1_000_000}, summary=s)["verdict"] == "off by -63%"


def test_run_claims_need_the_run_length():
    with pytest.raises(ScenarioError, match="claims.run_usd: needs training.tokens_total"):
        run({"run_usd": 1e6}, summary=with_cost(summary_70b(), None))


# Llama 3 70B and nothing else: the cluster section is all the zone checks read.
MINIMAL_70B = {"model": "llama3-70b"}


def two_zone_scenario(**cluster) -> Scenario:
    return make_scenario(MINIMAL_70B, cluster={"nodes": 8, "azs": 2, "az_link_gbps": 800,
                                               **cluster})


def test_zone_capacity():
    # Two zones, 800 Gb/s each way: 2 x 100 GB/s.
    assert zone_link_bytes_per_s(two_zone_scenario()) == 200e9
    # Three zones in one region: 6 ordered pairs.
    assert zone_link_bytes_per_s(two_zone_scenario(azs=3)) == 6 * 100e9
    # Three zones over two regions (zone z in region z % 2): only zones 0 and 2 share one.
    assert zone_link_bytes_per_s(two_zone_scenario(azs=3, regions=2)) == 2 * 100e9
    assert zone_link_bytes_per_s(make_scenario(MINIMAL_70B, cluster={"nodes": 1})) is None


def test_cross_zone_bytes_and_dollars_per_day():
    # 1e12 bytes cross per 10 s step: 8.64e15 bytes a day; $10 of transfer a step: $86,400.
    s = with_cost(summary_70b(), None)
    s["bytes"] = {"cross_az": 1e12}
    s["cost"]["egress_usd_per_step"] = 10.0
    sc = two_zone_scenario()

    def judged(claim: dict) -> dict:
        out = judge(Claims(source="test", **claim), s, H100, "bf16", FLOPS_70B, STATES_70B_64,
                    scenario=sc)
        return out[0]

    assert judged({"cross_az_bytes_per_day": 8e14})["verdict"] == "off by -91%"
    assert judged({"cross_az_bytes_per_day": 8.7e15})["verdict"] == "consistent"
    # The zone links carry 200 GB/s x 86,400 s = 17.28e15 bytes a day at most.
    v = judged({"cross_az_bytes_per_day": 2e16})
    assert v["verdict"] == "physically impossible" and "17,280 TB a day" in v["reason"]
    assert judged({"egress_usd_per_day": 86_000})["verdict"] == "consistent"
    # At $0.01/GB (the scenario's default) $200,000 buys 20e15 bytes: above 17.28e15.
    assert judged({"egress_usd_per_day": 200_000})["verdict"] == "physically impossible"
    # Without the scenario there is no capacity to check against.
    assert one({"cross_az_bytes_per_day": 2e16}, summary=s)["verdict"] == "off by +131%"


def test_nvlink_traffic_above_line_rate_is_impossible():
    # 100 GB/s per GPU out, 2 NVLink hops per transfer, 64 GPUs, 10 s.
    s = summary_70b()
    s["bytes"] = {"nvlink": 100e9 * 2 * 64 * 10}
    v = one({"nvlink_gbytes_per_s": 900}, summary=s)
    assert v["simulated"] == pytest.approx(100.0)
    assert v["verdict"] == "physically impossible"
    assert "450 GB/s per GPU per direction" in v["reason"]    # H100: NVLink 4, 900 GB/s both ways
    assert one({"nvlink_gbytes_per_s": 105}, summary=s)["verdict"] == "consistent"
    faster = make_scenario(MINIMAL_70B, cluster={"nvlink_gbytes_per_s": 1000})
    out = judge(Claims(source="t", nvlink_gbytes_per_s=900), s, H100, "bf16", FLOPS_70B,
                STATES_70B_64, scenario=faster)
    assert out[0]["verdict"] == "off by +800%"


def test_ratio_claims():
    assert judge_ratio("tokens_per_s", 1.12, 1.10)["verdict"] == "consistent"
    assert judge_ratio("bytes.network", 0.25, 0.774)["verdict"] == "off by -68%"
    v = judge_ratio("x", 1.0, 1.0, impossible="because")
    assert (v["verdict"], v["reason"]) == ("physically impossible", "because")


def test_verdicts_come_in_contract_order_then_the_added_fields():
    s = with_cost(summary_70b(), 1e12)
    s["bytes"] = {"cross_az": 0.0, "nvlink": 1e12}
    s["bubble_fraction"], s["exposed_comm_s"] = 0.1, 1.0
    s["cost"]["egress_usd_per_step"] = 0.0
    claims = {"nvlink_gbytes_per_s": 1, "egress_usd_per_day": 1, "cross_az_bytes_per_day": 1,
              "run_usd": 1e7, "run_hours": 1e4, "bubble_fraction": 0.1,
              "exposed_comm_fraction": 0.1, "model_state_memory_gb": 20, "mfu": 0.2,
              "tokens_per_s": 1e4}
    assert [v["metric"] for v in run(claims, summary=s)] == [
        "tokens_per_s", "mfu", "model_state_memory_gb", "exposed_comm_fraction",
        "bubble_fraction", "run_hours", "run_usd", "cross_az_bytes_per_day",
        "egress_usd_per_day", "nvlink_gbytes_per_s"]
