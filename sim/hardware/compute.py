"""How long a kernel takes on a GPU.

Roofline times under efficiency curves fitted to measurements on one H200
(``catalog/calibration/h200-kernels.json``, fitted by ``tools/fit_compute.py`` into
``h200-fit.json``). Other GPUs scale from their datasheets: matrix throughput with the dense
peak of the precision, memory-bound kernels with HBM bandwidth, wave quantisation with the SM
count.

Each measurement in the calibration file is one synchronised call, so it carries a fixed
harness overhead (launch plus synchronisation) that a kernel queued behind another does not
pay. The fit separates it (``harness_overhead_s``); :meth:`ComputeModel.measured_time`
adds it back so tests can compare like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal

import numpy as np

from sim import catalog
from sim.catalog import GpuSpec
from sim.hardware import blackwell_attention
from sim.hardware.attention_cost import (
    MEASURED_BACKEND,
    causal_tiles,
    matmul_share,
    share_of_flash2,
)
from sim.hardware.fp8_attention import Format, Kind, fp8_attention_gain
from sim.hardware.masked_attention import masked_slowdown
from sim.hardware.power import (
    ATTENTION_REFERENCE_MHZ,
    GEMM_REFERENCE_MHZ,
    gemm_clock_speed,
    sustained_matrix_flops,
)

GemmPass = Literal["fwd", "dgrad", "wgrad"]
MemClass = Literal["elementwise", "norm_fused", "reduction"]

# CPU time PyTorch eager spends to issue one kernel. Training steps of small models are bound
# by it; large ones hide it because the CPU runs ahead of the GPU. Not measured here; set from
# published eager behaviour: per-op overhead of the order of 10 us (Horace He, "Making Deep
# Learning Go Brrrr From First Principles", 2022, "Overhead"), and eager Llama-7B decoding on
# an A100 running CPU-bound at about 25 tokens/s, i.e. over 1 ms per decoder layer of a few
# dozen ops (PyTorch blog, "Accelerating Generative AI with PyTorch II: GPT, Fast", 2023).
# Backward runs in the C++ autograd engine, without Python between kernels: half as much.
EAGER_FWD_OP_CPU_S = 10e-6
EAGER_BWD_OP_CPU_S = 5e-6
# Under torch.compile (inductor) each kernel is launched from the generated wrapper's call()
# through CachingAutotuner.run and the Triton launcher: 6.8 us per kernel without arguments,
# 9.1 us with 19 (tritonbench PR #1017, "Profile inductor launch overhead", 2026, on GB200;
# a bare cuLaunchKernel is 3.0 us). Fused kernels take a handful of tensors: about 8 us.
# Without CUDA graphs (mode="reduce-overhead") this stays on every launch.
COMPILED_OP_CPU_S = 8e-6
# Tensor-core time of a Hopper FP8 GEMM run without fast accumulation (the backward GEMMs of
# Transformer Engine and torchao) over the same GEMM with it: fast accumulation is a 1.1-1.2x
# speedup on H100 (pytorch/ao issue 2377, 2025-06); the midpoint. A published measurement,
# not fitted to any validation row (docs/calibration.md).
FP8_SPLIT_ACCUMULATION_SLOWDOWN = 1.15
# Reduction elements between two promotions of a block-scaled FP8 GEMM's partial sums on
# Hopper: its tensor cores apply no block scales, so every N_C = 128 elements of the reduction
# (one 1x128 scaling block) the WGMMA partial sums are copied to FP32 registers and added on
# the CUDA cores, scaled (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.3.2,
# "Increasing Accumulation Precision"; cuBLAS 12.9's and Transformer Engine's
# Float8BlockScaling GEMMs). Transcribed, not fitted: what it costs follows from the
# datasheet's FP8 tensor and FP32 CUDA-core rates (ComputeModel._accumulation).
BLOCK_SCALED_PROMOTION_K = 128
# The AdamW calibration split its parameters in 16 tensors (h200-kernels.json meta).
ADAMW_CALIBRATION_TENSORS = 16
# Bytes a second one SM keeps streaming between HBM and its registers (Little's law: the
# loads one SM holds in flight over the loaded memory latency). A memory-bound kernel runs at
# the lesser of its HBM-scaled rate and this times the SM count: it binds where a GPU's
# bandwidth per SM outgrows what a kernel tuned on Hopper keeps in flight, i.e. on Blackwell
# (B200 7,672 GB/s over 148 SMs, 51.8 GB/s an SM, against the H200's 36.4). Measured, not
# fitted to a validation row: torchao's MXFP8 cast kernels on a B200 move 72.4% of its HBM
# peak, its block-scaled FP8 casts on an H100 84.3% of its (pytorch/ao READMEs,
# sim/catalog/reference/torchao_cast_kernels.yaml); the H200's in-place add (88.7% of 4.8
# TB/s, the elementwise rate) scaled by that ratio, 0.859, is 5.85 TB/s on the B200, 39.5
# GB/s an SM. Hopper's and Ampere's streaming (at most 32.3 GB/s an SM) stays under it.
# Checked on other data: TE's B300 quantization table (tests/unit/workload/
# test_te_gemm_profiling.py); derivation re-done in tests/unit/hardware/
# test_blackwell_streaming.py.
STREAM_BYTES_PER_SM_S = 39.5e9
# Threads one SM holds resident: 2,048 on compute capabilities 8.0, 9.0 and 10.0 (A100,
# H100/H200, B200/GB200; CUDA C++ Programming Guide, "Compute Capabilities", table
# "Technical Specifications per Compute Capability").
RESIDENT_THREADS_PER_SM = 2048
# Loaded HBM latency seen by a copy that keeps one load in flight a thread. Measured
# elsewhere, not fitted: MLX's general (strided) copy on a B200, one element a thread
# (ml-explore/mlx PR 2873, "[CUDA] Faster general copy", the "Pre" column: 50 x 20 copies of
# an (8, 2048, 32, 128) swapaxes(1, 2) view in 140.5 ms in bf16 and 135.7 ms in fp32, 1.91
# and 3.96 TB/s read plus written): by Little's law 148 SMs x 2,048 threads x 2 B in flight
# over 0.955 TB/s of reads is 635 ns, and x 4 B over 1.98 TB/s is 613 ns. That both element
# sizes give the same latency is the check that such a copy is latency-bound.
STRIDED_LOAD_LATENCY_S = 624e-9
# What TensorIterator's dynamic-casting path adds to each element, as a latency in flight per
# resident thread (Little's law, as above): an op whose operands' dtypes differ loads and
# stores each element through ``fetch_and_cast``/``cast_and_store``, a switch on the dtype,
# instead of a typed vector access (aten/src/ATen/native/cuda/CUDALoops.cuh,
# ``unrolled_elementwise_kernel`` with ``LoadWithCast``/``StoreWithCast``; the legacy loop's
# ``gpu_kernel_impl`` where ``gpu_kernel_impl_nocast`` has none). Fitted on the lent H200's
# 1B eager step (h200-train-steps-ops.json, run ``1b-plain``: its unrolled casting copies,
# 231 calls in 20.77 ms, against the model's bf16-to-fp32 copies of that step; derivation in
# tests/integration/test_calibration_h200_ops.py); validated on the 8B-layer step's kernels
# (run ``8b4l-plain``) and on the casting legacy loop (RoPE's bf16 q times fp32 cos), which
# took no part in the fit.
DYNAMIC_CAST_LATENCY_S = 436e-9
# Between two kernels queued back to back on one stream the GPU idles for a moment: the
# first one's last thread blocks drain and the front end starts the next (the profiler's
# kernel intervals leave gaps of 1-5 us between them). The kernel table's times are each
# kernel's own (a synchronised harness, its overhead subtracted), so a stream of n kernels
# takes their sum plus n of these. Fitted on the lent H200's 1B eager step
# (h200-step-gaps.json, run ``1b-plain``: the kernels' span less their busy time, copies and
# gaps over 5 us, over 2,789 kernels: 1.57 us); validated on the other four profiled steps
# (8b4l-plain 1.75, 1b-recompute 1.78, 1b-fsdp2 1.36, 8b4l-fsdp2 1.09 us).
KERNEL_BOUNDARY_S = 1.57e-6
# PyTorch's eager GELU in bf16 is bound by its per-element math, not by HBM: on the lent H200
# a [16384, 8192] bf16 GELU (tanh; erf within 2%) took 180 us forward and its backward 212
# us, where their traffic streams in 128 and 191 us; in fp32 both stream (4.03 and 4.13
# TB/s). Measured elements a second, forward and backward (h200-step-power.json, ``loops``;
# tools/measure_step_power.py).
GELU_BF16_ELEMENTS_PER_S = {"fwd": 16384 * 8192 / 180.3e-6, "bwd": 16384 * 8192 / 211.6e-6}


@lru_cache(maxsize=1)
def _fit() -> dict:
    return catalog.calibration("h200-fit.json")


def exp_cost_flops() -> float:
    """One exponential in attention, in matmul FLOPs of the fitted GPU (h200-fit.json)."""
    return float(_fit()["exp_cost_flops"])


def gemm_dims(m: float, k: float, n: float, pass_: GemmPass) -> tuple[float, float, float]:
    """Output rows, output columns and reduction length of one pass of ``Y[m,n] = X[m,k] W^T``."""
    if pass_ == "fwd":
        return m, n, k
    if pass_ == "dgrad":
        return m, k, n
    return n, k, m


def _residual(table: list[tuple[np.ndarray, float]], point: np.ndarray, bw: float,
              prior: float) -> float:
    # Gaussian-kernel interpolation of measured log-time residuals: near a measured shape the
    # measurement wins, far from all of them the physical form does (the prior weight pulls
    # the correction to zero).
    if not table:
        return 0.0
    keys = np.stack([k for k, _ in table])
    vals = np.array([v for _, v in table])
    d2 = ((keys - point) ** 2).sum(1)
    w = np.exp(-d2 / (2 * bw * bw))
    return float((w @ vals) / (w.sum() + prior))


@dataclass(frozen=True)
class ComputeModel:
    """Kernel durations on one GPU.

    Examples
    --------
    >>> from sim import catalog
    >>> cm = ComputeModel(catalog.gpu("h200"))
    >>> round(cm.gemm_time(8192, 4096, 4096, "fwd") * 1e6)   # about 0.43 ms measured
    414
    """

    gpu: GpuSpec
    precision: str = "bf16"
    attention_backend: str = MEASURED_BACKEND
    """The fused-attention kernel (:mod:`sim.hardware.attention_cost`); the default is the one the
    calibration measured."""
    sm_clock_mhz: float | None = None
    """The SM clock the step runs at (:func:`sim.hardware.power.balanced_sm_clock_mhz`);
    None: the clocks the kernel tables were taken at (``GEMM_REFERENCE_MHZ``,
    ``ATTENTION_REFERENCE_MHZ``). Tensor-core kernels (GEMMs, fused attention) follow it."""

    # ------------------------------------------------------------------ scaling
    @cached_property
    def _flops_scale(self) -> float:
        # Matrix throughput scales with the dense peak times the share of it a large GEMM
        # reaches on each GPU (catalogue matmul_efficiency), relative to the fitted H200.
        # FP8 training keeps its non-GEMM math (attention, the 16-bit layers) at 16 bits: only
        # kernels marked fp8 run at the FP8 rate (:attr:`_fp8_speedup`).
        # A power cap below TDP lowers the sustained SM clock, and matrix throughput with it
        # (sim/hardware/power.py); HBM-bound kernels keep their rate.
        base = "bf16" if self.precision == "fp8" else self.precision
        h200 = catalog.gpu("h200")
        return sustained_matrix_flops(self.gpu, base) / (
            _fit()["peak_bf16_tflops"] * 1e12 * h200.matmul_efficiency)

    @cached_property
    def _fp8_speedup(self) -> float:
        # An FP8 GEMM reaches about the same share of the FP8 peak as a 16-bit GEMM of the
        # 16-bit peak: a published cuBLASLt cross-check (d-robotics test_gpu_scripts,
        # reports_cublaslt_fp8_crosscheck_20260524.md; E4M3 in, bf16 out, 8192^3, 16 GPUs of
        # Hopper nodes, model not named) measured 1,599-1,630 TFLOP/s, 81-82% of the
        # H100/H200's 1,979, against 794.5 of 989 (80%) for bf16 on H100 SXM (catalogue
        # matmul_efficiency). So FP8 GEMMs run at the ratio of the peaks; 1 without FP8 units.
        return self.gpu.peak_flops("fp8") / self.gpu.peak_flops("bf16")

    def _accumulation(self, pass_: GemmPass, block_scaled: bool) -> float:
        """Factor on an FP8 GEMM's tensor-core term for how it accumulates (1: none).

        Block scales on Hopper: one FP32 multiply-add per output element on the CUDA cores for
        every :data:`BLOCK_SCALED_PROMOTION_K` reduction elements the tensor cores multiply
        (256 FP8 FLOPs), serialised with them: ``1 + fp8 peak / (128 x fp32 peak)``, 1.23 on
        H100 and H200 (1,979 / (128 x 66.9)), in every pass (the promotion is the split
        accumulation). Blackwell's tensor cores apply MX scales and accumulate in FP32: 1.

        Examples
        --------
        >>> from sim import catalog
        >>> round(ComputeModel(catalog.gpu("h100-sxm"))._accumulation("fwd", True), 3)
        1.231
        >>> ComputeModel(catalog.gpu("b200"))._accumulation("wgrad", True)
        1.0
        """
        # The CUDA cores' FP32 rate (the datasheet's FP32 column), not TF32's tensor rate.
        fp8, fp32 = self.gpu.peak_tflops.get("fp8"), self.gpu.peak_tflops.get("fp32")
        if block_scaled and self.gpu.arch == "hopper" and fp8 and fp32:
            return 1.0 + fp8 / (BLOCK_SCALED_PROMOTION_K * fp32)
        return self._split_accumulation(pass_)

    def _split_accumulation(self, pass_: GemmPass) -> float:
        # Hopper's FP8 tensor cores accumulate with limited precision; without cuBLASLt's
        # fast-accumulation mode the kernel promotes partial sums to FP32 registers every
        # few K steps (CUBLASLT_MATMUL_DESC_FAST_ACCUM off). Both FP8 training stacks we
        # model keep fast accumulation for the forward GEMM only: Transformer Engine's
        # recipes (DelayedScaling, Float8CurrentScaling: fp8_gemm_fprop use_split_accumulator
        # False, fp8_gemm_dgrad / fp8_gemm_wgrad True) and torchao's Float8LinearConfig
        # (use_fast_accum for the output GEMM only). Blackwell accumulates in FP32 and has no
        # such mode. The cost is published, not fitted: fast accumulation is a 1.1-1.2x
        # speedup of these GEMMs on H100 (pytorch/ao issue 2377); the midpoint applies to the
        # tensor-core term.
        if self.gpu.arch != "hopper" or pass_ == "fwd":
            return 1.0
        return FP8_SPLIT_ACCUMULATION_SLOWDOWN

    @cached_property
    def _flash2_model(self) -> ComputeModel:
        # The same GPU and clock running FlashAttention-2, which the earlier kernels are
        # priced against.
        return ComputeModel(self.gpu, self.precision, "flash2", self.sm_clock_mhz)

    @cached_property
    def _gemm_clock_speed(self) -> float:
        if self.sm_clock_mhz is None:
            return 1.0
        return gemm_clock_speed(self.sm_clock_mhz, GEMM_REFERENCE_MHZ)

    @cached_property
    def _attention_clock_speed(self) -> float:
        if self.sm_clock_mhz is None:
            return 1.0
        return gemm_clock_speed(self.sm_clock_mhz, ATTENTION_REFERENCE_MHZ)

    @cached_property
    def _bw_scale(self) -> float:
        return self.gpu.hbm_gbytes_per_s / _fit()["hbm_gbytes_per_s"]

    @property
    def kernel_min_s(self) -> float:
        return float(_fit()["kernel_min_s"])

    @property
    def harness_overhead_s(self) -> float:
        return float(_fit()["harness_overhead_s"])

    @property
    def gemm_fixed_s(self) -> float:
        """The fitted per-GEMM constant of :meth:`gemm_time` (``gemm.fixed_us``): time a
        GEMM takes whatever its size, beyond the harness and its math."""
        return float(_fit()["gemm"]["fixed_us"]) * 1e-6

    @cached_property
    def _gemm_table(self) -> dict[str, list[tuple[np.ndarray, float]]]:
        table: dict[str, list[tuple[np.ndarray, float]]] = {"fwd": [], "dgrad": [], "wgrad": []}
        for r in _fit()["gemm"]["residuals"]:
            key = np.log([r["rows"], r["cols"], r["k"]])
            table[r["pass"]].append((key, r["log_ratio"]))
        return table

    @cached_property
    def _attn_table(self) -> dict[str, list[tuple[np.ndarray, float]]]:
        att = _fit()["attention"]
        return {
            p: [(np.log([r["seq"], r["heads"]]), r["log_ratio"]) for r in att[p]["residuals"]]
            for p in ("fwd", "bwd")
        }

    # ------------------------------------------------------------------ GEMM
    def gemm_time(self, m: float, k: float, n: float, pass_: GemmPass = "fwd",
                  measured_table: bool = True, fp8: bool = False,
                  block_scaled: bool = False) -> float:
        """One pass of a linear layer ``Y[m,n] = X[m,k] W[n,k]^T`` (fwd, dgrad or wgrad).

        ``measured_table=False`` gives the physical form alone, without the interpolated
        residuals of the measured shapes (to check how much the form explains). ``fp8``: the
        GEMM runs on FP8 operands (Transformer Engine, torchao float8) at the FP8 rate;
        ``block_scaled``: with block scales (MXFP8, 1x128 blocks; :meth:`_accumulation`).
        """
        # The residual table records the H200's bf16 cuBLAS kernel choices shape by shape; it
        # applies to Hopper (same SMs and tensor cores), not to other generations nor to FP8.
        measured_table = measured_table and self.gpu.arch == "hopper" and not fp8
        block_scaled = block_scaled and fp8
        key = (float(m), float(k), float(n), pass_, measured_table, fp8, block_scaled)
        cache = self._cache
        if key not in cache:
            cache[key] = self._gemm_time(float(m), float(k), float(n), pass_, measured_table,
                                         self._fp8_speedup if fp8 else 1.0,
                                         self._accumulation(pass_, block_scaled) if fp8
                                         else 1.0)
        return cache[key]

    def gemm_tiles(self, m: float, k: float, n: float, pass_: GemmPass = "fwd") -> int:
        """Output tiles of one pass of ``Y[m,n] = X[m,k] W[n,k]^T`` at the fitted tile size
        (one thread block each): how much of the GPU the GEMM can fill; against
        ``gpu.sm_count`` it says whether another GEMM could run beside it."""
        rows, cols, _ = gemm_dims(m, k, n, pass_)
        tile = _fit()["gemm"]["tile"]
        return math.ceil(rows / tile[0]) * math.ceil(cols / tile[1])

    def gemm_occupancy(self, m: float, k: float, n: float, pass_: GemmPass = "fwd") -> float:
        """Share of the SMs one pass keeps busy over its time under the fitted wave model:
        ``(tiles / sms) / waves``, the factor :meth:`gemm_time` divides the math rate by.
        With the fitted ``wave_alpha`` near 0 a GEMM of fewer tiles than SMs is priced as if
        spread over nearly all of them (cuBLAS picks smaller tiles or split-K), so this is near
        1, not ``tiles / sms``: what another stream's GEMM can still use beside it."""
        g = _fit()["gemm"]
        frac = self.gemm_tiles(m, k, n, pass_) / self.gpu.sm_count
        waves = g["wave_alpha"] * math.ceil(frac) + (1 - g["wave_alpha"]) * frac
        return frac / waves

    @cached_property
    def _cache(self) -> dict[tuple[float, float, float, str, bool, bool, bool], float]:
        return {}

    def _gemm_time(self, m: float, k: float, n: float, pass_: GemmPass, table: bool,
                   speedup: float = 1.0, accumulation: float = 1.0) -> float:
        g = _fit()["gemm"]
        rows, cols, red = gemm_dims(m, k, n, pass_)
        sms = self.gpu.sm_count
        tiles = math.ceil(rows / g["tile"][0]) * math.ceil(cols / g["tile"][1])
        alpha = g["wave_alpha"]
        waves = alpha * math.ceil(tiles / sms) + (1 - alpha) * tiles / sms
        quant = (tiles / sms) / waves
        # The fitted form is t = fixed + MAC / (peak * quant * eff) with
        # 1/eff = 1 + (small_dim/min(rows, cols))^e + (small_k/red)^e. Written as a sum, the
        # "1" is tensor-core math (it scales with the math rate, so FP8 halves it on Hopper),
        # while the two penalty terms are time each output tile spends outside the MAC loop,
        # in proportion to its MAC time: the small-K term is the per-tile prologue and
        # epilogue (filling the TMA/cp.async pipeline with the first K panels, writing the
        # 16-bit output tile, the scale and convert), which a longer K amortises; the
        # small-dim term is the same fixed per-tile work against few tiles. Neither shrinks
        # with FP8 math: an FP8 kernel loads a K-tile twice as deep (CUTLASS's Hopper FP8
        # configurations use 128x256x128 tiles against 128x256x64 for bf16; same bytes per
        # panel), writes the same bf16 output (torch._scaled_mm, Transformer Engine) and has
        # the same tile count, so the same waves. For bf16 (speedup 1) the sum is the fitted
        # form term for term, so h200-fit.json is reproduced unchanged.
        overhead = ((g["small_dim"] / min(rows, cols)) ** g["exponent"]
                    + (g["small_k"] / red) ** g["exponent"])
        peak = g["peak_tflops"][pass_] * 1e12 * self._flops_scale
        mac = 2 * rows * cols * red / (peak * quant)
        t = g["fixed_us"] * 1e-6 + mac * accumulation / speedup + mac * overhead
        corr = _residual(self._gemm_table[pass_], np.log([rows, cols, red]),
                         g["residual_bandwidth"], g["residual_prior_weight"]) if table else 0.0
        # The residual is relative to the harness-inclusive time; keep it relative.
        with_harness = (t + self.harness_overhead_s) * math.exp(corr)
        # Roofline floor: a GEMM cannot finish before its operands have been read from HBM
        # and its output written, at the rate a streaming kernel reaches. It binds for small
        # M (few tokens against a large weight), where the fitted form (fitted on M >= 2048,
        # all compute-bound) would extrapolate; it is what makes such GEMMs slower on the
        # H100's 3.35 TB/s than on the H200's 4.8.
        operand = 1.0 if speedup > 1.0 else 2.0     # FP8 operands, bf16 output
        nbytes = operand * (rows * red + cols * red) + 2.0 * rows * cols
        floor = self.kernel_min_s + nbytes / self.stream_bytes_per_s("elementwise")
        return max(floor, (with_harness - self.harness_overhead_s) / self._gemm_clock_speed)

    # ------------------------------------------------------------------ attention
    def attention_time(self, batch: int, heads: int, seq: int, head_dim: int,
                       pass_: Literal["fwd", "bwd"] = "fwd", kv_seq: int | None = None,
                       causal: bool = True, measured_table: bool = True,
                       window: int | None = None, fp8: Format | None = None,
                       masked: bool = False) -> float:
        """A fused (flash-style) attention kernel, forward or backward, of this model's
        ``attention_backend`` (FlashAttention-2/3, cuDNN: :mod:`sim.hardware.attention_cost`).

        The GPU time only: the fitted fixed term of a standalone call is dominated by CPU-side
        dispatch, which :func:`attention_cpu_s` returns separately. The measured residuals
        apply only to the backend the calibration measured, on Hopper. ``window``: a causal
        sliding window (keys per query), whose band of tiles the kernel runs
        (:func:`~sim.hardware.attention_cost.causal_tiles`); the residual stays the one of the
        same launch (``seq`` queries, ``batch x heads`` groups). ``fp8``: the call runs in
        that FP8 format (Transformer Engine's ``fp8_dpa``), at cuDNN's measured gain over
        the 16-bit kernel (:func:`~sim.hardware.fp8_attention.fp8_attention_gain`).
        ``masked``: SDPA was handed an explicit mask tensor (Hugging Face's causal mask under
        ``torch.compile``): the whole rectangle at the measured masked-call slowdown
        (:func:`~sim.hardware.masked_attention.masked_slowdown`). FlashAttention's first
        CUDA kernel and its Triton kernel run FlashAttention-2's call at their published
        share of its speed (:func:`~sim.hardware.attention_cost.share_of_flash2`).
        """
        legacy = share_of_flash2(self.attention_backend, self.gpu.arch)
        if legacy is not None:
            return self._flash2_model.attention_time(
                batch, heads, seq, head_dim, pass_, kv_seq, causal, measured_table, window,
                fp8, masked) / legacy
        if masked:
            full = self.attention_time(batch, heads, seq, head_dim, pass_, kv_seq, causal=False,
                                       measured_table=measured_table)
            return full * masked_slowdown(pass_, head_dim, seq)
        att = _fit()["attention"]
        p = att[pass_]
        blk = att["block"]
        kv_seq = seq if kv_seq is None else kv_seq
        nb = math.ceil(seq / blk)
        nbk = math.ceil(kv_seq / blk)
        groups = batch * heads
        row = nbk
        if causal:
            tiles, row = causal_tiles(nb, blk, window)
            total = groups * blk * blk * tiles
            longest = blk * blk * row
        else:
            total = groups * blk * blk * nb * nbk
            longest = blk * blk * nbk
        sms = self.gpu.sm_count
        if self.gpu.arch == "blackwell" and (
                self.attention_backend in blackwell_attention.BACKENDS):
            # Blackwell's tensor cores outgrew its exponential unit and shared memory: each
            # unit priced at its own rate, plus each row tile's fill and epilogue
            # (sim/hardware/blackwell_attention.py).
            t = (max(total / sms, longest) * blackwell_attention.score_seconds(
                self.gpu, pass_, head_dim) + blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq if pass_ == "fwd" else kv_seq, groups))
        else:
            # Matmul FLOPs per score at the kernel's own tensor-core speed, plus the
            # exponential.
            share = matmul_share(self.attention_backend, self.gpu.arch, pass_)
            per_score = (4 if pass_ == "fwd" else 10) * head_dim / share + exp_cost_flops()
            # FlashAttention-2's sm80 kernels on Blackwell run at Hopper's per-SM rates.
            scale = (blackwell_attention.sm80_kernel_scale(self.gpu)
                     if self.gpu.arch == "blackwell" else self._flops_scale)
            rate = p["peak_tflops"] * 1e12 * scale / sms
            # Plus each row tile's fill and drain, in SM cycles as on Blackwell
            # (sim/hardware/blackwell_attention.py); the H200 fit's per-score rate is fitted
            # beside it (tools/fit_compute.py), so short rows, many sequences and sliding
            # windows pay their tiles' fill.
            t = max(total / sms, longest) * per_score / rate + (
                blackwell_attention.row_fill_seconds(
                    self.gpu, pass_, seq if pass_ == "fwd" else kv_seq, groups))
        measured = measured_table and self.gpu.arch == "hopper" and (
            self.attention_backend == MEASURED_BACKEND)
        corr = _residual(self._attn_table[pass_], np.log([seq, groups]),
                         att["residual_bandwidth"], att["residual_prior_weight"]
                         ) if measured else 0.0
        # The residual is relative to the whole measured call; keep it relative.
        fixed = self.harness_overhead_s + self.attention_cpu_s(pass_)
        t16 = max(self.kernel_min_s, (t + fixed) * math.exp(corr) - fixed
                  ) / self._attention_clock_speed
        windowed = causal and row < nb     # a band shorter than the causal row
        if fp8 is None:
            return t16
        if windowed and pass_ == "bwd":
            # cuDNN's FP8 backward does not skip the band's outside: the causal call's work
            # at the causal gain (sim/hardware/fp8_attention.py).
            return self.attention_time(batch, heads, seq, head_dim, "bwd", kv_seq,
                                       causal=True, measured_table=measured_table, fp8=fp8)
        kind: Kind = "full" if not causal else "window" if windowed else "causal"
        return t16 / fp8_attention_gain(self.gpu.arch, fp8, pass_, kind, head_dim, seq)

    def cp_attention_time(self, batch: int, heads: int, seq: int, head_dim: int,
                          pass_: Literal["fwd", "bwd"], kv_seq: int,
                          fp8: Format | None = None) -> float:
        """One rank's load-balanced context-parallel attention (Megatron over Transformer
        Engine's ``AttnFuncWithCPAndKVP2P``, :func:`sim.frameworks.megatron.overlap.cp_ring`):
        ``seq`` local queries against ``kv_seq`` keys in ``kv_seq / seq`` ring steps, half
        the score rectangle in all (each rank's two chunks share the causal triangle).

        Each step is its own kernel, so on Blackwell its row tiles pay their fill
        (:func:`~sim.hardware.blackwell_attention.row_fill_seconds`): the diagonal step all
        local rows, the others all or half of them (the ranks before the key chunk's owner
        run every query on the first key chunk, the ranks after it the second query chunk on
        every key), 1 + 0.75 (cp - 1) local rows' fills over the steps, forward and backward.
        """
        t = 0.5 * self.attention_time(batch, heads, seq, head_dim, pass_, kv_seq=kv_seq,
                                      causal=False)
        if self.gpu.arch == "blackwell" and (
                self.attention_backend in blackwell_attention.BACKENDS):
            cp = max(1, round(kv_seq / seq))
            groups = batch * heads
            # The half call above paid half a fill of its own rows (queries or keys).
            t -= 0.5 * blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq if pass_ == "fwd" else kv_seq, groups)
            t += (1.0 + 0.75 * (cp - 1)) * blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq, groups)
        if fp8 is None:
            return t
        return t / fp8_attention_gain(self.gpu.arch, fp8, pass_, "full", head_dim, seq)

    def attention_cpu_s(self, pass_: Literal["fwd", "bwd"] = "fwd") -> float:
        """CPU time to issue one attention call (backend selection, graph lookup)."""
        return float(_fit()["attention"][pass_]["fixed_us"]) * 1e-6

    # ------------------------------------------------------------------ memory-bound
    def membound_time(self, nbytes: float, klass: MemClass = "elementwise") -> float:
        """A memory-bound kernel moving ``nbytes`` (read plus written).

        ``elementwise``: PyTorch's vectorised elementwise loop, at the rate measured for an
        in-place add (89% of the H200's HBM peak). ``norm_fused`` and ``reduction``: a kernel
        that reduces along rows (a norm, a mean, a softmax, a sum of a gradient over tokens)
        at the rate measured for the fused RMSNorm kernel (56% of peak): PyTorch's reduction
        kernels give each row (or a few) to one block, which must finish its reduction
        before it writes, so fewer loads are in flight than in a streaming loop.

        The fixed ``kernel_min_s`` makes the achieved bandwidth size-dependent:
        ``n / (t0 + n / B)``, half the streaming rate at ``n = t0 * B`` (8.5 MB on the H200),
        a tenth at 1 MB. Little's law puts the knee there: sustaining 4.8 TB/s through
        ~700 ns of loaded HBM latency needs ~3.4 MB in flight, so a kernel only a few times
        that size spends much of its life filling and draining the memory pipeline.
        ``B`` is :meth:`stream_bytes_per_s`.
        """
        return self.kernel_min_s + nbytes / self.stream_bytes_per_s(klass)

    def legacy_loop_time(self, elements: float, nbytes: float, operands: int = 2,
                         cast: bool = False) -> float:
        """A kernel of PyTorch's non-vectorised elementwise loop over ``elements`` outputs,
        moving ``nbytes`` (read plus written): TensorIterator's ``launch_legacy_kernel``
        (``gpu_kernel_impl_nocast``), which every elementwise op and copy takes when an operand
        is not contiguous (a transposed, sliced or broadcast view; ``.contiguous()`` of one).

        Each thread loads its element's operands, stores the result, then does the next (the
        stores may alias the loads, so the compiler keeps them in order): an SM has one
        element a resident thread (:data:`RESIDENT_THREADS_PER_SM`) in flight, and by Little's
        law finishes ``threads / latency`` elements a second. A copy's element (one load, one
        store) takes :data:`STRIDED_LOAD_LATENCY_S`; each of the ``operands`` (inputs and
        output) its share of that, so a binary op's element takes 1.5 copies' (measured on
        the lent H200: RMSNorm's broadcast multiplies 1.37x its expanded-gradient divide, a
        unary loop over as many elements). ``cast``: operands of different dtypes, each
        element also through the dynamic cast (:data:`DYNAMIC_CAST_LATENCY_S`). Never faster
        than the vectorised loop moving the same bytes (:meth:`stream_bytes_per_s`).

        Examples
        --------
        >>> from sim import catalog
        >>> cm = ComputeModel(catalog.gpu("b200"))
        >>> n = 67e6                      # a bf16 copy of 67 M elements: 268 MB moved
        >>> round(cm.legacy_loop_time(n, 4 * n) / cm.membound_time(4 * n), 1)
        2.9
        """
        latency = operands / 2 * STRIDED_LOAD_LATENCY_S + (DYNAMIC_CAST_LATENCY_S if cast
                                                           else 0.0)
        return self.kernel_min_s + max(self._one_in_flight_s(elements, latency),
                                       nbytes / self.stream_bytes_per_s("elementwise"))

    def cast_loop_time(self, elements: float, nbytes: float) -> float:
        """A kernel of PyTorch's unrolled elementwise loop with dynamic casts over ``elements``
        contiguous elements moving ``nbytes``: the vectorised loop's streaming time plus each
        element's casts (:data:`DYNAMIC_CAST_LATENCY_S` a resident thread, Little's law).
        Taken by a copy or op between dtypes other than PyTorch's special-cased fp32-to-bf16
        copy (``bfloat16_copy_kernel_cuda``, vectorised): autocast's bf16 gradients cast back
        to fp32, a bf16 branch added to an fp32 residual stream.

        Examples
        --------
        >>> from sim import catalog
        >>> cm = ComputeModel(catalog.gpu("h200"))
        >>> n = 33.5e6                    # bf16 -> fp32 of 33.5 M elements: 201 MB moved
        >>> round(cm.cast_loop_time(n, 6 * n) / cm.membound_time(6 * n), 2)
        2.1
        """
        return self.membound_time(nbytes) + self._one_in_flight_s(elements,
                                                                  DYNAMIC_CAST_LATENCY_S)

    def _one_in_flight_s(self, elements: float, latency: float) -> float:
        """``elements`` through every resident thread of the GPU, one in flight each for
        ``latency`` (Little's law over SMs x :data:`RESIDENT_THREADS_PER_SM`)."""
        return elements * latency / (self.gpu.sm_count * RESIDENT_THREADS_PER_SM)

    def stream_bytes_per_s(self, klass: MemClass = "elementwise") -> float:
        """Rate a memory-bound kernel of ``klass`` streams at on this GPU: the H200's measured
        rate scaled with HBM bandwidth, at most :data:`STREAM_BYTES_PER_SM_S` an SM (the
        bytes each SM keeps in flight bound it where bandwidth per SM is Blackwell's).

        Examples
        --------
        >>> from sim import catalog
        >>> round(ComputeModel(catalog.gpu("h200")).stream_bytes_per_s() / 1e12, 2)
        4.26
        >>> round(ComputeModel(catalog.gpu("b200")).stream_bytes_per_s() / 1e12, 2)
        5.85
        """
        return self._stream_rate(self._membound_bw[klass])

    def _stream_rate(self, h200_bytes_per_s: float) -> float:
        """A rate measured on the H200 on this GPU: scaled with HBM, capped per SM."""
        return min(h200_bytes_per_s * self._bw_scale, STREAM_BYTES_PER_SM_S * self.gpu.sm_count)

    @cached_property
    def _membound_bw(self) -> dict[str, float]:
        mb = _fit()["membound"]
        return {"elementwise": mb["add_"]["bytes_per_s"],
                "norm_fused": mb["rms_norm"]["bytes_per_s"],
                "reduction": mb["rms_norm"]["bytes_per_s"]}

    def gelu_time(self, elements: float, pass_: Literal["fwd", "bwd"] = "fwd") -> float:
        """PyTorch's eager GELU (or its backward) over ``elements`` bf16 values at the rate its
        per-element math allows (:data:`GELU_BF16_ELEMENTS_PER_S`); a kernel takes the longer
        of this and its memory traffic at the elementwise rate. The math runs on the CUDA
        cores, so other GPUs scale it by their FP32 peak.

        Examples
        --------
        >>> from sim import catalog
        >>> cm = ComputeModel(catalog.gpu("h200"))
        >>> round(cm.gelu_time(16384 * 8192) * 1e6)            # measured 180 us
        180
        """
        h200 = catalog.gpu("h200")
        scale = h200.peak_flops("fp32") / self.gpu.peak_flops("fp32")
        return elements / GELU_BF16_ELEMENTS_PER_S[pass_] * scale

    def adamw_time(self, params: float, fused: bool = True, tensors: int = 16) -> float:
        """One AdamW step over ``params`` fp32 parameters in ``tensors`` tensors.

        28 bytes move per parameter (read param, grad, two moments; write param and moments).
        The calibration's fixed cost was measured with the parameters split in 16 tensors; it
        is charged per tensor (step counters and list handling are per-tensor work).
        """
        a = _fit()["adamw"]["fused" if fused else "foreach"]
        per_tensor = a["fixed_s"] / ADAMW_CALIBRATION_TENSORS
        # A multi-tensor streaming kernel: capped per SM like any other (stream_bytes_per_s).
        return per_tensor * tensors + params * 28 / self._stream_rate(a["bytes_per_s"])

    def pcie_bytes_per_s(self) -> float:
        """Achieved pinned-memory copy rate: the H200 measurement's share of its link rate,
        applied to this GPU's link."""
        fit = _fit()["pcie_bytes_per_s"]
        share = min(fit.values()) / (catalog.gpu("h200").pcie_gbytes_per_s * 1e9)
        return share * self.gpu.pcie_gbytes_per_s * 1e9

    # ------------------------------------------------------------------ harness view
    def measured_time(self, kernel_seconds: float) -> float:
        """What the calibration harness would have measured for a kernel of this duration."""
        return kernel_seconds + self.harness_overhead_s
