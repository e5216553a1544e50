"""Transformer Engine's per-call swizzle of MXFP8 scale factors, against TE's source.

Truths used (TE's code at each release, not the simulator):

* ``pytorch/csrc/extensions/gemm.cpp`` swizzles, before every MXFP8 GEMM, the scales of each
  operand not already in the GEMM's layout, one kernel an operand into a new buffer
  (``swizzle_scaling_factors`` to 2.11, ``swizzle_scales_for_gemm`` from 2.12); the grouped
  GEMM one multi-tensor kernel an operand over all experts.
* To 2.11 (v2.7, v2.9 tags) no quantizer writes swizzled scales: every operand is swizzled.
* From 2.12 (PR #2486) ``Linear`` and ``GroupedLinear`` set ``optimize_for_gemm`` on their
  input and output-gradient quantizers, but not on a sequence-parallel column linear's input
  nor a row linear's gradient; weights are still swizzled at every call.
* From 2.18 (PR #3093) weights are swizzled once, when quantized, unless the primary weights
  are FP8 (``_enable_weight_preswizzle``: ``primary_weights_in_fp8`` -> False).
* One E8M0 scale byte per 32 elements (OCP Microscaling Formats v1.0).
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.api import simulate
from sim.hardware.compute import BLACKWELL_BLOCK_SCALED_SLOWDOWN, ComputeModel
from sim.hardware.power import burst_spec
from sim.scenario import scenario_from_dict
from sim.workload.block_pricing import kernel_time
from sim.workload.megatron_ops import MegatronLayout, mlp_block
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops
from sim.workload.mx_swizzle import ALL, NONE, WEIGHT, swizzled_operands

LLAMA = ModelSpec.from_ref("llama3-8b")
QWEN = ModelSpec.from_ref("qwen3-30b-a3b")


@pytest.mark.parametrize(("release", "primary_fp8", "expect"), [
    ((2, 7, 0), False, ALL), ((2, 9, 0), True, ALL), ((2, 12, 0), False, WEIGHT),
    ((2, 14, 0), False, WEIGHT), ((2, 18, 0), True, WEIGHT), ((2, 18, 0), False, NONE),
    (None, False, NONE), (None, True, WEIGHT)])
def test_which_operands_each_release_swizzles(release: tuple[int, ...] | None,
                                              primary_fp8: bool, expect: frozenset) -> None:
    assert swizzled_operands(release, primary_fp8) == expect


def _swizzles(ks: list) -> list:
    return [k for k in ks if ".swizzle_" in k.name]


def test_a_linear_swizzles_both_operands_of_each_gemm_before_2_12() -> None:
    _, main = mlp_block(LLAMA, MegatronLayout(fp8="mxfp8", fp8_transpose=True,
                                              mx_swizzled=ALL), 1, 4096)
    fwd, bwd = _swizzles(main.forward), _swizzles(main.backward)
    # fc1 and fc2: two operands of one forward GEMM, of dgrad and of wgrad each.
    assert len(fwd) == 2 * 2 and len(bwd) == 2 * 4
    w = next(k for k in fwd if k.name == "fc2.swizzle_fwd_w")
    # The scales, read and written: 1/32 byte an element of the weight, twice.
    assert w.nbytes == pytest.approx(2 * LLAMA.ffn_hidden * LLAMA.hidden / 32)


def test_only_weights_are_swizzled_from_2_12_and_per_tensor_fp8_never() -> None:
    _, main = mlp_block(LLAMA, MegatronLayout(fp8="mxfp8", fp8_transpose=True,
                                              mx_swizzled=WEIGHT), 1, 4096)
    names = [k.name for k in _swizzles(main.forward + main.backward)]
    assert sorted(names) == sorted(f"{n}.swizzle_{p}_w" for n in ("fc1", "fc2")
                                   for p in ("fwd", "dgrad"))
    _, cs = mlp_block(LLAMA, MegatronLayout(fp8="tensorwise", fp8_transpose=False,
                                            mx_swizzled=ALL), 1, 4096)
    assert not _swizzles(cs.forward + cs.backward)


def test_sequence_parallel_gathers_leave_their_operands_unswizzled_from_2_12() -> None:
    # linear.py _get_quantizers: no optimize_for_gemm for a column linear's input nor a row
    # linear's output gradient under sequence parallelism (quantized before the gather).
    _, main = mlp_block(LLAMA, MegatronLayout(tp=2, sequence_parallel=True, fp8="mxfp8",
                                              fp8_transpose=True, mx_swizzled=WEIGHT), 1, 4096)
    names = {k.name for k in _swizzles(main.forward + main.backward)}
    assert {"fc1.swizzle_fwd_in", "fc1.swizzle_wgrad_in", "fc2.swizzle_dgrad_g",
            "fc2.swizzle_wgrad_g"} <= names
    assert not names & {"fc1.swizzle_dgrad_g", "fc2.swizzle_fwd_in"}


def test_a_grouped_linear_swizzles_all_experts_in_one_launch_per_operand() -> None:
    ops = moe_layer_ops(QWEN, MoELayout(ep=8, fp8="mxfp8", fp8_transpose=True,
                                        mx_swizzled=ALL), tokens=4096)
    fwd = _swizzles(ops.experts.forward)
    bwd = _swizzles(ops.experts.backward)
    assert len(fwd) == 2 * 2 and len(bwd) == 2 * 4
    assert all(k.launches == 1 for k in fwd + bwd)


def test_the_fitted_block_scaled_slowdown_leaves_out_the_priced_swizzles() -> None:
    # TE's B300 table: pre-quantized MXFP8 GEMMs 7.161 ms a layer against per-tensor FP8's
    # 6.812. The slowdown fitted on it plus the 24 swizzle kernels the simulator prices for
    # those calls (at the benchmark's burst clock, as test_te_gemm_profiling) must give the
    # measured 7.161 again: neither counted twice nor left out.
    from sim.workload import te_gemm_benchmark as tb
    cm = ComputeModel(burst_spec(catalog.gpu("b300")), precision="fp8")
    ms = 1e3 * sum(kernel_time(cm, k) for shapes in tb.layer_shapes(4096, 16384, 15872).values()
                   for (m, k_, n) in shapes
                   for k in tb.call_kernels(m, k_, n, "MXFP8", True, prequantized=True)
                   if ".swizzle_" in k.name)
    assert ms > 0
    assert BLACKWELL_BLOCK_SCALED_SLOWDOWN * 6.812 + ms == pytest.approx(7.161, abs=0.002)


def _step(te: str | None) -> float:
    d = {"name": "mx", "model": "qwen3-30b-a3b",
         "cluster": {"topology": "dgx-b200", "nodes": 1},
         "framework": {"name": "megatron", "fp8_recipe": "mxfp8", "moe_router_fusion": True,
                       "distributed_optimizer": True},
         "parallelism": {"ep": 8},
         "training": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 16,
                      "precision": "fp8", **({"transformer_engine_version": te} if te else {})}}
    return float(simulate(scenario_from_dict(d)).summary["step_time_s"])


def test_older_releases_never_make_the_step_faster() -> None:
    old, mid, new = _step("2.9"), _step("2.12"), _step(None)
    assert old > mid >= new


def test_an_unquoted_release_is_refused_with_its_key() -> None:
    with pytest.raises(Exception, match="transformer_engine_version"):
        scenario_from_dict({"name": "x", "model": "llama3-8b",
                            "cluster": {"topology": "dgx-b200", "nodes": 1},
                            "framework": {"name": "megatron"},
                            "training": {"transformer_engine_version": 2.10}})
