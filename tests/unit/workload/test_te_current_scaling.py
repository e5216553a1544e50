"""Transformer Engine's FP8 current-scaling quantization and FP8 padding, counted from TE 2.7.

Truths used (the source, not the simulator):

* ``Float8CurrentScalingQuantizer::quantize_impl`` (``pytorch/csrc/quantizer.cpp``) issues,
  per quantized tensor, a ``cudaMemsetAsync`` of the amax and the amax kernel
  (``nvte_compute_amax``, ``common/recipe/current_scaling.cu``), the one-thread
  ``compute_scale_from_amax_kernel`` and the cast (``nvte_quantize_v2``): 4 launches.
* ``split_quantize`` (``pytorch/csrc/extensions/cast.cpp``) fuses the splits into one
  ``nvte_multi_cast_transpose`` only for the delayed recipe's ``Float8Quantizer``; a current-
  scaling quantizer runs per split, so a grouped linear over ``n`` experts makes ``4 n``.
* ``Fp8Padding`` / ``Fp8Unpadding`` (``pytorch/module/fp8_padding.py``, ``fp8_unpadding.py``)
  return their input when every split is already a multiple of the alignment (16).
"""

from __future__ import annotations

import dataclasses

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Tensor
from sim.workload.layer_rules import scaled_cast, te_scaled_cast
from sim.workload.megatron_ops import MegatronLayout, mlp_block
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

LAUNCHES_PER_TENSOR = 4   # memset, amax, compute scale, cast (quantizer.cpp, TE 2.7)


def _casts(kernels, tag):
    return [k for k in kernels if k.name.endswith(f".amax_{tag}") or k.name.endswith(
        f".cast_{tag}")]


@pytest.mark.parametrize("pieces", [1, 4, 16])
def test_current_scaling_launches_and_fixed_cost(pieces: int) -> None:
    x, y = Tensor("x", 64e6), Tensor("y", 32e6)
    te = te_scaled_cast("fc1", "in", x, (y,), amax=True, pieces=pieces)
    assert sum(k.launches for k in te) == LAUNCHES_PER_TENSOR * pieces
    # The bytes stream once; every launch beyond the two kernels pays the fixed kernel time.
    cm = ComputeModel(catalog.gpu("b200"), precision="fp8")
    base = sum(kernel_time(cm, k) for k in scaled_cast("fc1", "in", x, (y,), True, te=True))
    extra = sum(kernel_time(cm, k) for k in te) - base
    assert extra == pytest.approx((LAUNCHES_PER_TENSOR * pieces - 2) * cm.kernel_min_s)


def test_delayed_scaling_is_one_launch() -> None:
    x, y = Tensor("x", 64e6), Tensor("y", 32e6)
    ks = te_scaled_cast("fc1", "in", x, (y,), amax=False, pieces=16)
    assert [(k.name, k.launches) for k in ks] == [("fc1.cast_in", 1)]


def test_dense_linear_quantizes_input_and_gradient_with_four_launches() -> None:
    m = ModelSpec.from_ref("llama3-8b")
    _, main = mlp_block(m, MegatronLayout(tp=1, fp8="tensorwise"), 1, 4096)
    fwd = _casts(main.forward, "in")
    bwd = _casts(main.backward, "g")
    assert fwd and bwd
    for name in ("fc1", "fc2"):
        assert sum(k.launches for k in bwd if k.name.startswith(name)) == LAUNCHES_PER_TENSOR
    # fc2's input comes from Megatron's own fused SwiGLU: a full quantize.
    assert sum(k.launches for k in fwd if k.name.startswith("fc2")) == LAUNCHES_PER_TENSOR
    # fc1 is LayerNormLinear's: the norm kernel records the amax (normalization.cpp,
    # create_hp_tensor_with_amax), so amax.zero_(), compute-scale and cast, no amax pass.
    fc1 = [k for k in fwd if k.name.startswith("fc1")]
    assert sum(k.launches for k in fc1) == LAUNCHES_PER_TENSOR - 1
    src = next(k for k in fc1 if k.name == "fc1.cast_in").reads[0]
    assert not any(src in k.reads for k in fc1 if k.name == "fc1.amax_in")
    # With sequence parallelism the norm runs on the local shard before the gather: the
    # gathered input keeps its own quantize here.
    _, sp = mlp_block(m, MegatronLayout(tp=2, sequence_parallel=True, fp8="tensorwise"), 1,
                      4096)
    assert sum(k.launches for k in _casts(sp.forward, "in") if k.name.startswith("fc1")) \
        == LAUNCHES_PER_TENSOR
    # The weight's cast (first micro-batch only, see MegatronLayout.weight_cast_share) is not
    # charged per launch.
    assert all(k.launches == 1 for k in _casts(main.forward, "w"))


def test_grouped_linear_quantizes_each_expert() -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")          # 128 experts: 16 local at EP8
    ops = moe_layer_ops(m, MoELayout(ep=8, fp8="tensorwise"), 4096)
    local = m.moe.experts // 8
    for tag, ks in (("in", ops.experts.forward), ("g", ops.experts.backward)):
        for name in ("fc1", "fc2"):
            got = sum(k.launches for k in _casts(ks, tag) if k.name.startswith(name))
            assert got == LAUNCHES_PER_TENSOR * local
    # An expert without tokens is an empty split: quantize_impl returns before any launch.
    counts = (0.0,) * 4 + (4096.0,) * 12
    ops = moe_layer_ops(m, MoELayout(ep=8, fp8="tensorwise"), 4096, tokens_per_expert=counts)
    got = sum(k.launches for k in _casts(ops.experts.forward, "in") if k.name.startswith("fc1"))
    assert got == LAUNCHES_PER_TENSOR * 12


def test_fp8_padding_only_when_an_expert_is_unaligned() -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    pads = {"fp8_pad", "fp8_unpad", "fp8_pad.bwd", "fp8_unpad.bwd"}
    # Padded to capacity: 2,048 rows each, fixed, multiples of 16: TE pads nothing.
    assert m.moe is not None
    capped = dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=1.0))
    fixed = moe_layer_ops(capped, MoELayout(ep=8, fp8="tensorwise", token_drop="pad"), 4096)
    assert all(c % 16 == 0 for c in fixed.tokens_per_expert)
    assert not pads & {k.name for k in fixed.experts.forward + fixed.experts.backward}
    # Dropless: the balanced counts are aligned only by the idealisation; a real routing's
    # are not, so the copies run (with the rows unchanged).
    lay = MoELayout(ep=8, fp8="tensorwise")
    aligned = moe_layer_ops(m, lay, 4096)
    assert pads <= {k.name for k in aligned.experts.forward + aligned.experts.backward}
    skew = (2047.0, 2049.0) + (2048.0,) * 14           # the same rows, two experts unaligned
    ragged = moe_layer_ops(m, lay, 4096, tokens_per_expert=skew)
    fwd = {k.name: k for k in ragged.experts.forward}
    assert "fp8_pad" in fwd and "fp8_unpad" in fwd
    # Each padded up to 16 from its own routed count (expected_aligned_rows: about 7.5 rows).
    from sim.workload.moe_ops import expected_aligned_rows

    var = 1 - m.moe.top_k / m.moe.experts
    assert fwd["fc1.fwd"].group[:2] == tuple(expected_aligned_rows(c, 16, c * var)
                                             for c in skew[:2])
    assert all(c + 6 < g < c + 9 for c, g in zip(skew, fwd["fc1.fwd"].group, strict=True))
    # Without FP8 nothing is padded, aligned or not.
    bf16 = moe_layer_ops(m, MoELayout(ep=8), 4096, tokens_per_expert=skew)
    assert "fp8_pad" not in {k.name for k in bf16.experts.forward}


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_blackwell_casts_write_one_layout(recipe: str) -> None:
    # nvte_is_non_tn_fp8_gemm_supported (TE 2.7 common/transformer_engine.cpp): compute
    # capability 10.x; the quantizers then allocate no _transpose (quantizer.cpp create_tensor).
    m = ModelSpec.from_ref("llama3-8b")
    tokens, h = 4096, m.hidden
    hop = mlp_block(m, MegatronLayout(fp8=recipe), 1, tokens)[1]
    bw = mlp_block(m, MegatronLayout(fp8=recipe, fp8_transpose=False), 1, tokens)[1]

    def written(block, name):
        k = next(k for k in block.forward + block.backward if k.name == name)
        return sum(t.nbytes for t in k.writes)
    # fc1's input: [tokens, hidden] in FP8, once on Blackwell, with its transpose on Hopper.
    assert written(hop, "fc1.cast_in") == 2 * tokens * h
    assert written(bw, "fc1.cast_in") == tokens * h
    # What the wgrad reads is what the forward saved: the same bytes either way.
    assert sum(t.nbytes for t in hop.saved) == sum(t.nbytes for t in bw.saved)
    assert "mlp_main.fc1.in_fp8_t" in {t.name for t in bw.saved}   # what recompute looks up
    # The grouped linears: the delayed recipe's fused multi-tensor cast needs both layouts,
    # so on Blackwell each expert is its own launch.
    q = ModelSpec.from_ref("qwen3-30b-a3b")
    ops = moe_layer_ops(q, MoELayout(ep=8, fp8=recipe, fp8_transpose=False), 4096)
    cast = next(k for k in ops.experts.forward if k.name == "fc1.cast_in")
    assert cast.launches == (2 if recipe == "tensorwise" else 1) * 16
    hops = moe_layer_ops(q, MoELayout(ep=8, fp8=recipe), 4096)
    assert next(k for k in hops.experts.forward if k.name == "fc1.cast_in").launches == \
        (2 * 16 if recipe == "tensorwise" else 1)
