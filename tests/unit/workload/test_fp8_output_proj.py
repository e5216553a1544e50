"""``fp8_output_proj`` (Megatron-Core's ``TELMHeadColumnParallelLinear``): the LM head's
output projection under the MXFP8 recipe. Independent truths: Megatron-Core's assert (FP8
training with ``fp8_recipe='mxfp8'`` only), the same GEMM FLOPs ``2 x tokens x h x vocab``
in either precision, and FP8's doubled tensor rate on Blackwell (the head's GEMMs can only get
faster, its casts being memory-bound extras)."""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim import catalog
from sim.frameworks import JobContext, build_program
from sim.hardware.compute import ComputeModel
from sim.scenario import ScenarioError
from sim.workload.block_pricing import price_block
from sim.workload.megatron_ops import STYLE, MegatronLayout, head_block
from sim.workload.model import ModelSpec


def test_the_head_runs_its_gemms_in_mxfp8_with_the_same_flops() -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    lay = MegatronLayout(fp8="mxfp8", fp8_transpose=True)
    plain, fp8 = head_block(m, lay, 1, 4096), head_block(m, lay.__class__(
        **{**lay.__dict__, "fp8_output": True}), 1, 4096)
    gemm = lambda b: [k for k in b.forward + b.backward if k.klass == "gemm"]  # noqa: E731
    assert not any(k.fp8 for k in gemm(plain))
    assert all(k.fp8 and k.fp8_block for k in gemm(fp8))
    assert sum(k.flops for k in gemm(fp8)) == sum(k.flops for k in gemm(plain))
    assert sum(k.flops for k in gemm(plain)) == pytest.approx(
        3 * 2 * 4096 * m.hidden * (m.vocab + (-m.vocab % 128)), rel=0.01)
    cm = ComputeModel(catalog.gpu("gb200"))
    a, b = price_block(plain, STYLE, cm), price_block(fp8, STYLE, cm)
    assert b.fwd_gpu_s < a.fwd_gpu_s


def test_megatron_refuses_it_outside_mxfp8() -> None:
    model = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
             "vocab": 32000}
    s = megatron_scenario({"tp": 1}, 1, model=model, seq=1024, precision="fp8",
                          framework={"name": "megatron", "fp8_recipe": "tensorwise",
                                     "fp8_output_proj": True})
    with pytest.raises(ScenarioError, match="framework.fp8_output_proj"):
        build_program(JobContext.from_scenario(s, "s.yaml"))
