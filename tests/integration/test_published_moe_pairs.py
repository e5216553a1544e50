"""Two same-layout pairs of ``published-moe`` rows whose ratio is a measurement in itself
(sim/catalog/reference/published_moe.yaml; docs/calibration.md, forty-fifth session).

* Megatron-LM's DeepSeek-V3 GB200 optimization log (256 GB200, MXFP8, PP8 VP4 EP32): its
  baseline (NCCL all-to-all, no CUDA graphs) measured 494.46 TFLOP/s/GPU and its final
  configuration (HybridEP, CUDA graphs over attention, router and preprocessing) 970.01:
  1.96x, most of it host work the log says the baseline could not launch fast enough.
* Megatron-Bridge PR #1760's B200 presets for Qwen3-235B on 64 GPUs: MXFP8 16.9 s a step,
  BF16 16.0 s (its BF16 preset interleaves 4 virtual stages, the MXFP8 one none).
* Megatron-Bridge PR #3561 (2026-04-29), GPT-OSS-120B on 64 GB200 (EP64, MBS 4, GBS 1280,
  recompute [layernorm, moe_act], EP overlap), BF16: NCCL all-to-all 423.6 against HybridEP
  406.6 model TFLOP/s/GPU, the same stack and model FLOPs, so 1.042x in throughput.

The final GB200 configuration is checked against its measurement; the two ratios the
simulation does not reproduce are strict xfails with their simulated values.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of

LOG = "mlm-gb200-log-deepseek-v3-nomtp-256xgb200-mxfp8-pp8vp4ep32-"
PR1760 = "mbridge-pr1760-qwen3-235b-a22b-64xb200-"
GPT_OSS_HYBRIDEP = "nemo-26.04-gpt-oss-120b-64xgb200-bf16-ep64-hybridep-a2aoverlap"


@cache
def _row(rid: str) -> tuple[float, float]:
    """(measured, simulated) tokens/s/GPU of one row."""
    e = {r["id"]: r for r in entries()}[rid]
    return (e["measured"]["tokens_per_s_per_gpu"],
            simulate(scenario_of(e)).summary["tokens_per_s_per_gpu"])


def test_the_logs_final_configuration_is_within_ten_percent() -> None:
    measured, simulated = _row(LOG + "hybridep-final")
    assert simulated == pytest.approx(measured, rel=0.10)


def test_the_logs_baseline_is_slower_than_its_final_configuration() -> None:
    # Measured 1,979 against 3,883 tokens/s/GPU; whatever the simulation misses of the
    # baseline's host work, it must not put the baseline ahead.
    (m0, s0), (m1, s1) = _row(LOG + "baseline"), _row(LOG + "hybridep-final")
    assert m1 / m0 > 1.9
    assert s1 > s0


@pytest.mark.xfail(strict=True, reason="the host-bound regime on a Grace host: the log's "
                   "optimizations gain 1.96x measured, 1.09x simulated (the baseline's step "
                   "16.6 s measured, 10.0 s simulated with 1.4 s host-bound)")
def test_the_logs_gain_from_baseline_to_final_as_measured() -> None:
    (m0, s0), (m1, s1) = _row(LOG + "baseline"), _row(LOG + "hybridep-final")
    assert s1 / s0 == pytest.approx(m1 / m0, rel=0.15)


# 40 s of two 64-GPU simulations for a known gap: `make gaps`, not `make test`.
@pytest.mark.gap
@pytest.mark.xfail(strict=True, reason="MXFP8 over BF16 on the all-to-all path: measured "
                   "0.947x, simulated 1.005x (the FP8 all-to-all rows' lean; with DeepEP inside "
                   "a node the simulated FP8 gains hold: docs/calibration.md)")
def test_mxfp8_over_bf16_on_b200_as_measured() -> None:
    (m8, s8), (m16, s16) = _row(PR1760 + "mxfp8-pp8ep8"), _row(PR1760 + "bf16-pp8vp4ep8")
    assert m8 / m16 == pytest.approx(16.0 / 16.9, rel=1e-3)     # the rows are the PR's steps
    assert s8 / s16 == pytest.approx(m8 / m16, rel=0.05)


@pytest.mark.xfail(strict=True, reason="HybridEP against NCCL's all-to-all for GPT-OSS's small "
                   "experts on one GB200 rack: measured 1.042x for all-to-all (PR #3561), "
                   "simulated 0.983x: the PR's reason, HybridEP's setup overhead left "
                   "unamortized by small experts, is not in the model (docs/calibration.md, "
                   "fifty-sixth session)")
def test_alltoall_over_hybridep_for_gpt_oss_on_gb200_as_measured() -> None:
    # The 26.04 row (HybridEP with the EP overlap) and the same scenario with the alltoall
    # dispatcher and its fused permutation, as the PR's A/B changed only the dispatcher.
    e = {r["id"]: r for r in entries()}[GPT_OSS_HYBRIDEP]
    a = copy.deepcopy(e)
    fw = a["scenario"]["framework"]
    fw["moe_token_dispatcher_type"] = "alltoall"
    fw["moe_permute_fusion"] = True
    for key in ("moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms"):
        del fw[key]
    hybridep = simulate(scenario_of(e)).summary["tokens_per_s_per_gpu"]
    alltoall = simulate(scenario_of(a)).summary["tokens_per_s_per_gpu"]
    assert alltoall / hybridep == pytest.approx(423.6 / 406.6, rel=0.03)
