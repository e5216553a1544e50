"""One Megatron-Core MoE layer on eight H100s against NVIDIA's own timings of it
(``sim/catalog/reference/megatron_moe_layer.yaml``: Megatron-LM's ``moe_perf`` baselines).

The bf16 cases fit the H100's GEMM rate (``h100-sxm.gemm_rate_factor``,
``tools/fit_h100_gemm_rate.py``); here they guard that fit. The blockwise FP8 cases were
fitted on nothing: their forward is checked, and their backward, which the model prices well
under the measured time, is recorded as a strict xfail until it is explained."""

from __future__ import annotations

import math

import pytest
import yaml

import sim.apps.validation as validation
from sim.apps.validation.moe_layer import REFERENCE, moe_layer_cases, reference, scenario_of
from sim.scenario import scenario_from_dict

REF = reference()


@pytest.fixture(scope="module")
def fit_cases() -> list[dict]:
    return moe_layer_cases("fit")


@pytest.fixture(scope="module")
def fp8_cases() -> list[dict]:
    return moe_layer_cases("validate")


def test_the_suites_are_registered_and_the_fit_half_runs_only_when_named() -> None:
    assert {"moe-layer", "moe-layer-fit"} <= set(validation.SUITES)
    assert "moe-layer-fit" in validation.FIT_SUITES
    assert "moe-layer" not in validation.FIT_SUITES


def test_the_reference_is_the_upstream_file() -> None:
    # Twelve cases: two proxies x three dispatchers x two precisions, each a forward and a
    # backward time and the peak allocation, as recorded; every case names a proxy.
    cases = REF["cases"]
    assert len(cases) == 12 == len({c["id"] for c in cases})
    for c in cases:
        model, dispatcher, _, precision = c["id"].split("_")
        assert c["model"] == f"{model}-proxy" and c["precision"] == precision
        assert c["dispatcher"] == {"a2a": "alltoall"}.get(dispatcher, dispatcher)
        assert 0 < c["forward_ms"] < c["backward_ms"] < 20
    assert "cf39a4ddcfe6882cf578a26c00d0b76f6daf19cd" in REFERENCE.read_text()


def test_each_case_is_the_tests_layer() -> None:
    for c in REF["cases"]:
        sc = scenario_of(c, REF["models"])
        proxy = REF["models"][c["model"]]
        assert sc.model.layers == 1 and sc.model.mlp == "gelu" and not sc.model.bias
        assert (sc.model.hidden, sc.model.experts, sc.model.experts_per_token) == \
            (proxy["hidden"], proxy["experts"], proxy["experts_per_token"])
        assert sc.parallelism.ep == 8 and sc.parallelism.tp == 1
        assert sc.training.seq_len * sc.training.micro_batch_size == 4096
        # The same scenario written out and read back: a replayable file.
        assert scenario_from_dict(yaml.safe_load(yaml.safe_dump(
            sc.model_dump(mode="json", exclude_none=True)))) == sc


def test_the_bf16_layers_fit_within_five_percent(fit_cases: list[dict]) -> None:
    # The fit's residual (docs/calibration.md: 3.4% MAPE, mean +0.2% at the fitted 0.86).
    errors = [c["error"] for c in fit_cases]
    assert len(errors) == 12
    assert sum(abs(e) for e in errors) / len(errors) < 0.05
    assert abs(sum(math.log1p(e) for e in errors) / len(errors)) < 0.02


def test_the_fp8_forward_is_within_ten_percent(fp8_cases: list[dict]) -> None:
    fwd = [c for c in fp8_cases if c["metric"] == "forward_ms"]
    assert len(fwd) == 6
    assert all(abs(c["error"]) < 0.10 for c in fwd), [(c["id"], c["error"]) for c in fwd]


@pytest.mark.xfail(strict=True, reason="blockwise FP8 backward on Hopper priced 2-15% under "
                   "the measured time, the Mixtral layer's 13-15% (7-20% before the 1-D x 1-D "
                   "wgrad's promotion was priced; docs/calibration.md, moe-layer); the rest "
                   "not explained yet")
def test_the_fp8_backward_is_within_ten_percent(fp8_cases: list[dict]) -> None:
    bwd = [c for c in fp8_cases if c["metric"] == "backward_ms"]
    assert all(abs(c["error"]) < 0.10 for c in bwd), [(c["id"], c["error"]) for c in bwd]
