"""Tests of the verdicts on published figures (sim/claims.py): physically impossible (with the
reason), consistent within 10%, or off by N%."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.api import simulate
from sim.claims import judge
from sim.model import ModelSpec
from sim.scenario import Claims, load_scenario

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
    # FLOP/token (tests/test_model.py) caps the rate at 989.4e12 / 8.22e9 = 120,363 tokens/s.
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
