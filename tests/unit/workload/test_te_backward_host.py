"""Host time of Transformer Engine modules' backward (sim/workload/megatron_host_ops.py
``backward_host_s``, used by the dense Megatron layer and the MoE layer's host calls).

Independent truths: TE's own CPU-time benchmark (NVIDIA/TransformerEngine PR 3523, GB200,
forward and forward + backward CPU time of Linear and LayerNormLinear in BF16 and MXFP8) gives
each module's backward at 2.8-4.3x its forward; a plain PyTorch autograd node stays at half a
call (Megatron's local layers, which the host cost was fitted on, do not move); a layer too
small for its GPU work to hide the host is slowed, one whose GPU work is long is not.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.workload import megatron_host_ops
from sim.workload.megatron_host_ops import (
    TE_BWD_OVER_FWD,
    TE_FUNCTION_BWD,
    backward_host_s,
    te_function_bwd,
)
from sim.workload.megatron_ops import WINDOWED
from sim.workload.model import ModelSpec
from sim.workload.moe_host_ops import TE_FUNCTIONS_BWD, MoEHostConfig, moe_host_calls

# PR 3523's table, CPU time before the PR's change (us): forward, forward + backward.
PR_3523 = {("Linear", "bf16"): (59.19, 311.30), ("LayerNormLinear", "bf16"): (83.48, 397.73),
           ("Linear", "mxfp8"): (114.51, 440.93), ("LayerNormLinear", "mxfp8"): (135.42, 518.67)}


def test_ratio_is_the_benchmarks_backward_over_forward() -> None:
    ratios = [(both - fwd) / fwd for fwd, both in PR_3523.values()]
    assert min(ratios) > 2.8 and max(ratios) < 4.3
    assert TE_BWD_OVER_FWD == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)


def test_backward_host_closed_form() -> None:
    call = 34e-6
    # Plain autograd nodes only (Megatron's local layers): half a call each, as before.
    assert backward_host_s(24, 0, call) == pytest.approx(12 * call)
    # A TE attention block: 3 Function bodies at the measured ratio, 3 light nodes at half.
    assert backward_host_s(6, 3, call) == pytest.approx(3 * call * TE_BWD_OVER_FWD + 1.5 * call)
    # The backward of a TE module now costs more than its forward call, as measured.
    assert backward_host_s(1, 1, call) > 2.5 * call


def test_function_bodies_per_block() -> None:
    llama = ModelSpec.from_ref("llama3-8b")
    dsv3 = ModelSpec.from_ref("deepseek-v3")
    assert te_function_bwd(llama, "attn_main") == TE_FUNCTION_BWD["attn_main"] == 3
    assert te_function_bwd(llama, WINDOWED) == 3
    assert te_function_bwd(llama, "mlp_main") == 2
    assert te_function_bwd(llama, "embed") == te_function_bwd(llama, "head") == 0
    # MLA: kv down and up projections, and the query latent's two linears for the one.
    assert te_function_bwd(dsv3, "attn_main") == 3 + 2 + 1
    # Never more Function bodies than backward nodes in a block.
    for m in (llama, dsv3):
        ops = megatron_host_ops.python_ops(m, legacy=False)
        assert all(te_function_bwd(m, k) <= ops[k][1] for k in ops)


def test_moe_modules_backward_bodies() -> None:
    calls = moe_host_calls(MoEHostConfig(local_experts=16, shared=True))
    assert calls["experts"].te_bwd == TE_FUNCTIONS_BWD["experts"] <= calls["experts"].mod_bwd
    assert calls["shared"].te_bwd == TE_FUNCTIONS_BWD["shared"] <= calls["shared"].mod_bwd
    assert calls["router"].te_bwd == 0


TINY = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn_hidden": 1024,
        "vocab": 32000}


def _step(seq: int, impl: str, mp: pytest.MonkeyPatch | None = None) -> float:
    if mp is not None:   # TE bodies priced as plain nodes, as before this rule
        mp.setattr(megatron_host_ops, "TE_BWD_OVER_FWD", 0.5)
    s = megatron_scenario({"tp": 1}, 8, model=TINY if seq < 4096 else None, seq=seq,
                          framework={"name": "megatron", "implementation": impl})
    return simulate(s).summary["step_time_s"]


def test_host_bound_layer_slows_gpu_bound_does_not() -> None:
    with pytest.MonkeyPatch.context() as mp:
        tiny0, big0, local0 = _step(128, "transformer_engine", mp), \
            _step(8192, "transformer_engine", mp), _step(128, "local", mp)
    tiny, big, local = _step(128, "transformer_engine"), _step(8192, "transformer_engine"), \
        _step(128, "local")
    assert tiny > 1.1 * tiny0          # a tiny TE layer: its backward is host-bound
    assert big == pytest.approx(big0, rel=0.01)   # long GPU work hides the host
    assert local == local0             # Megatron's local layers: plain nodes, unchanged


def test_fp8_linear_ratios_are_the_benchmarks() -> None:
    # PR 3523's MXFP8 over BF16 CPU times, forward and backward, Linear and LayerNormLinear.
    fwd = [PR_3523[(m, "mxfp8")][0] / PR_3523[(m, "bf16")][0]
           for m in ("Linear", "LayerNormLinear")]
    bwd = [(PR_3523[(m, "mxfp8")][1] - PR_3523[(m, "mxfp8")][0])
           / (PR_3523[(m, "bf16")][1] - PR_3523[(m, "bf16")][0])
           for m in ("Linear", "LayerNormLinear")]
    assert megatron_host_ops.TE_FP8_FWD_OVER_BF16 == pytest.approx(sum(fwd) / 2, rel=1e-12)
    assert megatron_host_ops.TE_FP8_BWD_OVER_BF16 == pytest.approx(sum(bwd) / 2, rel=1e-12)
    assert 1.6 < megatron_host_ops.TE_FP8_FWD_OVER_BF16 < 2.0
    assert 1.2 < megatron_host_ops.TE_FP8_BWD_OVER_BF16 < 1.3


def test_fp8_linears_per_block_and_their_host_time() -> None:
    llama, dsv3 = ModelSpec.from_ref("llama3-8b"), ModelSpec.from_ref("deepseek-v3")
    # QKV and output projection; fc1 and fc2; MLA's q down / up, kv down / up and output.
    assert megatron_host_ops.te_linears(llama, "attn_main") == 2
    assert megatron_host_ops.te_linears(llama, "mlp_main") == 2
    assert megatron_host_ops.te_linears(dsv3, "attn_main") == 5
    assert megatron_host_ops.te_linears(llama, "embed") == 0
    call = 34e-6
    fwd, bwd = megatron_host_ops.fp8_linear_host_s(2, call)
    assert fwd == pytest.approx(2 * (megatron_host_ops.TE_FP8_FWD_OVER_BF16 - 1) * call)
    assert bwd == pytest.approx(2 * (megatron_host_ops.TE_FP8_BWD_OVER_BF16 - 1)
                                * TE_BWD_OVER_FWD * call)
    # The MoE layer's FP8 linears: the experts' two GroupedLinear modules and the shared MLP's.
    fp8 = moe_host_calls(MoEHostConfig(local_experts=8, shared=True, fp8=True))
    bf16 = moe_host_calls(MoEHostConfig(local_experts=8, shared=True))
    assert (fp8["experts"].fp8_linears, fp8["shared"].fp8_linears) == (2, 2)
    assert (bf16["experts"].fp8_linears, bf16["shared"].fp8_linears) == (0, 0)


def test_fp8_host_slows_a_host_bound_te_layer_only() -> None:
    # A tiny TE layer is host-bound: FP8's dearer module calls slow it; the same model at a
    # long sequence hides them; Megatron's local layers have no TE modules to slow.
    def step(seq: int, fp8_ratio: bool) -> float:
        with pytest.MonkeyPatch.context() as mp:
            if not fp8_ratio:
                mp.setattr(megatron_host_ops, "TE_FP8_FWD_OVER_BF16", 1.0)
                mp.setattr(megatron_host_ops, "TE_FP8_BWD_OVER_BF16", 1.0)
            s = megatron_scenario({"tp": 1}, 8, model=TINY if seq < 4096 else None, seq=seq,
                                  framework={"name": "megatron", "fp8_recipe": "tensorwise"},
                                  precision="fp8")
            return simulate(s).summary["step_time_s"]
    assert step(128, True) > 1.05 * step(128, False)
    assert step(8192, True) == pytest.approx(step(8192, False), rel=0.01)
