"""Which attention Transformer Engine trains a layer's head dims with
(sim/hardware/te_fused_attention.py, sim/hardware/attention_cost.py ``resolve``).

Independent truth: the head-dim clause of ``nvte_get_fused_attn_backend``
(transformer_engine/common/fused_attn/fused_attn.cpp) at the releases it names -- v2.2 to v2.4
refuse any head dim above 128 on sm100 (``!(sm_arch_ >= 100 && (head_dim_qk > 128 ||
head_dim_v > 128))``), v2.5 to v2.16 train 192 / 128 there from cuDNN 9.11 ("9.11: d_qk = 192,
d_v = 128 + Blackwell + bprop + non-paged") -- and ``get_attention_backend``'s "Disabling
FlashAttention as it does not support MLA" when the two dims differ.
"""

from __future__ import annotations

import pytest

from sim.api import simulate
from sim.frameworks.common.base import JobContext
from sim.hardware.te_fused_attention import te_fallback, te_fused_attention_trains
from sim.scenario import ScenarioError, scenario_from_dict


@pytest.mark.parametrize("te,cudnn,trains", [
    ((2, 2, 0), None, False), ((2, 4, 0), (9, 11, 0), False),   # no Blackwell clause yet
    ((2, 5, 0), (9, 10, 2), False), ((2, 5, 0), (9, 11, 0), True),
    ((2, 7, 0), (9, 11, 0), True), (None, None, True)])
def test_blackwell_trains_mla_from_te_2_5_with_cudnn_9_11(te, cudnn, trains) -> None:
    assert te_fused_attention_trains("blackwell", 192, 128, te, cudnn) is trains


def test_blackwell_trains_no_other_wide_head_dim_and_any_narrow_one() -> None:
    for te in ((2, 2, 0), (2, 7, 0), None):
        assert te_fused_attention_trains("blackwell", 128, 128, te, (9, 8, 0))
        assert not te_fused_attention_trains("blackwell", 256, 256, te, None)


def test_hopper_trains_up_to_256_with_the_cudnn_each_release_asks() -> None:
    assert te_fused_attention_trains("hopper", 192, 128, (2, 2, 0), (9, 1, 0))
    assert not te_fused_attention_trains("hopper", 192, 128, (2, 7, 0), (9, 1, 0))
    assert te_fused_attention_trains("hopper", 192, 128, (2, 7, 0), (9, 5, 0))
    assert not te_fused_attention_trains("hopper", 320, 128, None, None)


def test_te_falls_back_to_flash_only_with_one_head_dim() -> None:
    assert te_fallback(192, 128) == "unfused"
    assert te_fallback(256, 256) == "flash2"


def _dsv3(topology: str, te: str | None, cudnn: str | None) -> dict:
    training = {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8,
                "precision": "bf16"}
    if te:
        training["transformer_engine_version"] = te
    if cudnn:
        training["cudnn_version"] = cudnn
    return {"name": "t", "model": "deepseek-v2-lite",
            "cluster": {"topology": topology, "nodes": 1},
            "framework": {"name": "megatron", "distributed_optimizer": True},
            "parallelism": {"tp": 1, "pp": 1, "ep": 8},
            "training": training}


@pytest.mark.parametrize("topology,te,cudnn,backend", [
    ("dgx-b200", "2.2", None, "unfused"), ("dgx-b200", "2.7", "9.10.2", "unfused"),
    ("dgx-b200", "2.7", "9.11.0", "cudnn"), ("dgx-b200", None, None, "cudnn"),
    ("dgx-h100", "2.2", None, "cudnn")])
def test_a_megatron_mla_job_runs_what_te_picks(topology, te, cudnn, backend) -> None:
    ctx = JobContext.from_scenario(scenario_from_dict(_dsv3(topology, te, cudnn)))
    assert ctx.compute.attention_backend == backend


def test_the_unfused_fallback_makes_a_blackwell_mla_step_slower_never_faster() -> None:
    fused = simulate(scenario_from_dict(_dsv3("dgx-b200", "2.7", "9.11.0"))).summary
    unfused = simulate(scenario_from_dict(_dsv3("dgx-b200", "2.2", None))).summary
    assert unfused["step_time_s"] > fused["step_time_s"]


def test_fp8_attention_is_refused_where_te_has_no_fused_kernel_for_mla() -> None:
    # TE disables its unfused attention under FP8 (get_attention_backend), so with no fused
    # kernel for 192 / 128 on Blackwell before TE 2.5 no backend is left: refused, naming
    # the key; with TE 2.7 and cuDNN 9.11 the same job builds.
    def job(te: str, cudnn: str | None) -> dict:
        d = _dsv3("dgx-b200", te, cudnn)
        d["framework"] |= {"fp8_recipe": "tensorwise", "fp8_dot_product_attention": True}
        d["training"]["precision"] = "fp8"
        return d

    with pytest.raises(ScenarioError, match="framework.fp8_dot_product_attention: .*head dims"):
        simulate(scenario_from_dict(job("2.2", None)))
    assert simulate(scenario_from_dict(job("2.7", "9.11.0"))).summary["step_time_s"] > 0
