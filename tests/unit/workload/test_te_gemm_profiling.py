"""The FP8 linear's kernels against Transformer Engine's published GEMM profiling tables.

Truth: TE's GEMM profiling tutorial (``sim/catalog/reference/te_gemm_profiling.yaml``:
``docs/examples/gemm_profiling/gemm_profiling.rst`` at TE 1609c890e, Apache-2.0), per-layer
GEMM times of a hidden-4,096, intermediate-16,384 layer at 15,872 tokens on an H200 NVL and a
B300, BF16 and FP8 (current and delayed scaling; MXFP8 on the B300, 1x128 block scaling on the
H200 NVL), with quantization (autocast) and without (pre-quantized).
:mod:`sim.workload.te_gemm_benchmark` builds each benchmark call from the kernels a training
step emits. The H200 NVL is the catalogue's H200 capped at its 600 W TDP
(the part's datasheet; ``sim/hardware/power.py``). The B300 is the catalogue's ``b300`` (its dense
BF16 / FP8 peaks are the B200's; its HBM the datasheet's 8 TB/s, 4% above the B200's measured
7.67); the checks there are on ratios and on the quantization's milliseconds (HBM-bound).

Run-to-run spread of the reference (the same FP8 DelayedScaling autocast path timed in both
runs): 0.6% on the H200 NVL (18.978 / 19.099 ms), 4.1% on the B300 (7.802 / 8.123 ms); the
tolerances below are stated against it.
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.power import burst_spec
from sim.workload import te_gemm_benchmark as tb
from sim.workload.kernels import Kernel, Tensor, is_reduction
from sim.workload.layer_rules import scaled_cast

REF = tb.reference()
PASSES = ("fprop", "dgrad", "wgrad", "total")


def _h200_nvl() -> ComputeModel:
    return ComputeModel(catalog.gpu("h200", power_w=600), precision="fp8")


def _b300() -> ComputeModel:
    # TE's tables are benchmark bursts at the boost clock (sim/hardware/power.py, burst_spec).
    return ComputeModel(burst_spec(catalog.gpu("b300")), precision="fp8")


def _measured(gpu: str, mode: str, recipe: str) -> dict[str, float]:
    return {p: REF[gpu][mode]["per_layer"][p][recipe] for p in PASSES}


def test_benchmark_shapes_are_the_tutorials() -> None:
    # gemm_profiling.rst "Forward Summary" and "Full Backward Table": 6.39 TFLOP forward,
    # 19.17 TFLOP a layer.
    shapes = tb.layer_shapes(4096, 16384, 15872)
    assert shapes["dgrad"][0] == (15872, 12288, 4096)
    assert shapes["wgrad"][3] == (16384, 15872, 4096)
    flops = {p: sum(2 * m * k * n for m, k, n in s) for p, s in shapes.items()}
    assert flops["fprop"] == flops["dgrad"] == flops["wgrad"]
    assert sum(flops.values()) / 1e12 == pytest.approx(19.17, abs=0.01)


def test_bf16_layer_on_the_h200_nvl() -> None:
    # The NVL is priced as a 600 W H200: a held GEMM's measured draw line gives 0.91x the
    # 700 W part's rate (the cube law gave 0.94x, and the simulator 5.6-6.9% fast per pass;
    # the datasheet's 835 dense BF16 TFLOP/s against 989 says 0.84x): now 1.9-3.3% fast.
    # 8% bounds it.
    sim = tb.layer_ms(_h200_nvl(), "BF16")
    for p, ms in _measured("h200_nvl", "prequantized", "BF16").items():
        assert sim[p] == pytest.approx(ms, rel=0.08)


@pytest.mark.parametrize("gpu", ["h200_nvl", "b300"])
def test_fp8_gemm_against_bf16(gpu: str) -> None:
    # GEMM alone (pre-quantized): measured FP8 / BF16 per pass 0.525-0.527 (H200 NVL),
    # 0.508-0.526 (B300); simulated 0.504-0.511 (FP8 at the peak ratio, the per-tile
    # prologue and epilogue at 16-bit cost). 5% bounds it; a model that gave FP8 GEMMs 2.2x
    # the BF16 rate, or only 1.6x, fails.
    cm = _h200_nvl() if gpu == "h200_nvl" else _b300()
    bf16 = tb.layer_ms(cm, "BF16")
    fp8 = tb.layer_ms(cm, "FP8Current", prequantized=True)
    m16 = _measured(gpu, "prequantized", "BF16")
    m8 = _measured(gpu, "prequantized", "FP8Current")
    for p in PASSES:
        assert fp8[p] / bf16[p] == pytest.approx(m8[p] / m16[p], rel=0.05)


def test_quantization_overhead_on_the_h200_nvl() -> None:
    # Autocast minus pre-quantized is what quantizing costs: every call casts its input (with
    # Hopper's transpose) and its weight. Current scaling, measured per pass 0.926 / 1.134 /
    # 1.440 ms, simulated 0.941 / 1.125 / 1.392; delayed scaling (its autocast minus the
    # current-scaling GEMM, the same FP8 GEMM) 0.611 / 0.645 / 0.937 against 0.585 / 0.707 /
    # 0.856. 6% on the current-scaling totals and passes, 12% on the delayed ones (their
    # difference of two runs carries the runs' spread).
    cm = _h200_nvl()
    gemm = tb.layer_ms(cm, "FP8Current", prequantized=True)
    cur = tb.layer_ms(cm, "FP8Current")
    dly = tb.layer_ms(cm, "FP8Delayed")
    m_gemm = _measured("h200_nvl", "prequantized", "FP8Current")
    m_cur = _measured("h200_nvl", "autocast", "FP8Current")
    m_dly = _measured("h200_nvl", "autocast", "FP8Delayed")
    for p in PASSES:
        assert cur[p] - gemm[p] == pytest.approx(m_cur[p] - m_gemm[p], rel=0.06)
        assert dly[p] - gemm[p] == pytest.approx(m_dly[p] - m_gemm[p], rel=0.12)


def test_amax_pass_streams() -> None:
    # Current minus delayed scaling is the amax pass (and its extra launches): 4.97 GB of
    # bf16 read per layer. Measured on the H200 NVL 1.307 ms a layer; simulated 1.310 with
    # Transformer Engine's amax kernel streaming (grid-stride 32-byte loads, one atomicMax a
    # block: common/recipe/current_scaling.cu) at the elementwise rate. Priced as a row
    # reduction (the fused-RMSNorm rate, 56% of HBM) it was 2.005 ms, +53%.
    cm = _h200_nvl()
    sim = tb.layer_ms(cm, "FP8Current")["total"] - tb.layer_ms(cm, "FP8Delayed")["total"]
    meas = (REF["h200_nvl"]["autocast"]["per_layer"]["total"]["FP8Current"]
            - REF["h200_nvl"]["autocast"]["per_layer"]["total"]["FP8Delayed"])
    assert sim == pytest.approx(meas, rel=0.08)
    x = Tensor("x", 2e8)
    te_amax = scaled_cast("fc1", "in", x, (Tensor("y", 1e8),), amax=True, te=True)[0]
    assert te_amax.streams and not is_reduction(te_amax)
    # Other amax reductions (torchao's torch.max(torch.abs(x))) keep the row-reduction rate.
    assert is_reduction(Kernel("amax", "elementwise", (x,), ()))


def test_quantization_ratios_on_blackwell() -> None:
    # B300: autocast over pre-quantized, delayed scaling
    # 1.145 measured (7.802 / 6.812 ms), 1.191 simulated (+4.0%: the benchmark reuses its
    # tensors every call, and the B300's L2 may keep part of them); current scaling 1.343
    # measured, 1.334 simulated (see test_current_scaling_overhead_on_blackwell). Blackwell
    # writes no transposed copy (nvte_is_non_tn_fp8_gemm_supported): with Hopper's second
    # copy the delayed ratio would be 1.19.
    cm = _b300()
    gemm = tb.layer_ms(cm, "FP8Current", prequantized=True)["total"]
    per = REF["b300"]
    m_gemm = per["prequantized"]["per_layer"]["total"]["FP8Current"]
    dly = tb.layer_ms(cm, "FP8Delayed")["total"] / gemm
    assert dly == pytest.approx(per["autocast"]["per_layer"]["total"]["FP8Delayed"] / m_gemm,
                                rel=0.05)
    cur = tb.layer_ms(cm, "FP8Current")["total"] / gemm
    assert cur == pytest.approx(per["autocast"]["per_layer"]["total"]["FP8Current"] / m_gemm,
                                rel=0.06)


def test_current_scaling_overhead_on_blackwell() -> None:
    # What current scaling costs a layer to quantize on the B300 (autocast minus
    # pre-quantized): measured 2.335 ms, simulated 2.316 (-0.8%). Its amax pass streams 4.97
    # GB at 3.7 TB/s there, the absolute rate the H200 NVL reaches (3.8): a streaming kernel
    # is held by the bytes each SM keeps in flight, not by Blackwell's HBM
    # (memory_bound.STREAM_BYTES_PER_SM_S, taken from torchao's B200 cast kernels, not from this
    # table). With the H200's share of HBM scaled to Blackwell it was 1.941 ms, -17%.
    cm = _b300()
    sim = tb.layer_ms(cm, "FP8Current")["total"] - tb.layer_ms(
        cm, "FP8Current", prequantized=True)["total"]
    per = REF["b300"]
    meas = (per["autocast"]["per_layer"]["total"]["FP8Current"]
            - per["prequantized"]["per_layer"]["total"]["FP8Current"])
    assert sim == pytest.approx(meas, rel=0.10)


def test_blockwise_on_the_h200_nvl() -> None:
    # Float8BlockScaling (1x128 activations, 128x128 weights) against current scaling, both
    # autocast, the whole layer: measured 22.882 / 20.285 = 1.128; simulated 1.115 from the
    # datasheet alone (no amax pass, 1/32 byte of scales, and the CUDA cores' promotion of the
    # partial sums every 128 reduction elements: 1 + 1,979 / (128 x 66.9) on the tensor-core
    # term, ComputeModel._accumulation). Nothing here was fitted to this table. 3% (the
    # reference's H200 spread is 0.6%); without the promotion the ratio is 0.96 and fails.
    cm = _h200_nvl()
    per = REF["h200_nvl"]["autocast"]["per_layer"]
    for p in PASSES:
        sim = tb.layer_ms(cm, "FP8Block")[p] / tb.layer_ms(cm, "FP8Current")[p]
        assert sim == pytest.approx(per[p]["FP8Block"] / per[p]["FP8Current"], rel=0.03)


def test_mxfp8_gemm_on_blackwell() -> None:
    # MXFP8 GEMMs alone (pre-quantized) against BF16's on the B300: measured 0.547 of the
    # BF16 time per layer (7.161 / 13.102 ms), simulated 0.534. Not independent in full: the
    # MXFP8-over-per-tensor factor (7.161 / 6.812 ms, compute.BLACKWELL_BLOCK_SCALED_SLOWDOWN)
    # is this table's; what is checked is the rest, the FP8 rate over BF16's from the
    # datasheet (0.509 without the factor, which failed 4%). 4% is the reference's B300 spread.
    cm = _b300()
    m = REF["b300"]["prequantized"]["per_layer"]["total"]
    sim = (tb.layer_ms(cm, "MXFP8", prequantized=True)["total"]
           / tb.layer_ms(cm, "BF16")["total"])
    assert sim == pytest.approx(m["MXFP8"] / m["BF16"], rel=0.04)


@pytest.mark.xfail(strict=True, reason="B300 MXFP8 quantization costs 1.823 ms a layer "
                   "(autocast minus pre-quantized), simulated 1.559 (-14%; -27% before "
                   "streaming was capped per SM; 1.599 before the pre-quantized calls' second "
                   "scale swizzle was priced): TE's MXFP8 cast (both layouts from one read) "
                   "runs below the per-SM streaming rate torchao's MXFP8 casts reach on the "
                   "B200; cause not established")
def test_mxfp8_quantization_on_blackwell() -> None:
    cm = _b300()
    sim = tb.layer_ms(cm, "MXFP8")["total"] - tb.layer_ms(cm, "MXFP8", prequantized=True)["total"]
    per = REF["b300"]
    meas = (per["autocast"]["per_layer"]["total"]["MXFP8"]
            - per["prequantized"]["per_layer"]["total"]["MXFP8"])
    assert sim == pytest.approx(meas, rel=0.10)


def test_training_quantizes_less_than_the_benchmark() -> None:
    # The benchmark quantizes both operands of all twelve GEMMs (2.48e9 elements a layer);
    # a training micro-batch quantizes each linear's input and output gradient once and each
    # weight once a step: 1.04e9 activation elements and the weights' 2.0e8 times the share.
    bench = tb.benchmark_quantizations()
    train = tb.training_quantizations(weight_share=1 / 8)
    assert bench.activations + bench.weights == pytest.approx(2.483e9, rel=1e-3)
    assert train.activations == 15872 * (4096 + 12288 + 4096 + 4096 + 4096 + 16384
                                         + 16384 + 4096)
    assert train.weights == pytest.approx(4096 * 49152 / 8)
    assert train.activations + train.weights < 0.45 * (bench.activations + bench.weights)
