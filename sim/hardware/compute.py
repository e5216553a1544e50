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
from functools import cached_property
from typing import Literal

import numpy as np

from sim import catalog
from sim.catalog import GpuSpec
from sim.hardware import blackwell_attention
from sim.hardware.attention_cost import (
    MEASURED_BACKEND,
    WGMMA_ATTENTION,
    causal_tiles,
    flex_share,
    matmul_share,
    share_of_flash2,
)
from sim.hardware.flash_curves import flash2_causal_speedup
from sim.hardware.fp8_attention import Format, Kind, fp8_attention_gain_on
from sim.hardware.kernel_fit import h200_fit as _fit
from sim.hardware.masked_attention import masked_slowdown
from sim.hardware.memory_bound import MemoryBoundKernels
from sim.hardware.power import (
    ATTENTION_REFERENCE_MHZ,
    GEMM_REFERENCE_MHZ,
    gemm_clock_speed,
    sustained_gemm_flops,
    sustained_matrix_flops,
)

GemmPass = Literal["fwd", "dgrad", "wgrad"]

# CPU time PyTorch eager spends to issue one kernel. Training steps of small models are bound
# by it; large ones hide it because the CPU runs ahead of the GPU. Not measured here; set from
# published eager behaviour: per-op overhead of the order of 10 us (Horace He, "Making Deep
# Learning Go Brrrr From First Principles", 2022, "Overhead"), and eager Llama-7B decoding on
# an A100 running CPU-bound at about 25 tokens/s, i.e. over 1 ms per decoder layer of a few
# dozen ops (PyTorch blog, "Accelerating Generative AI with PyTorch II: GPT, Fast", 2023).
# Backward runs in the C++ autograd engine, without Python between kernels: half as much.
EAGER_FWD_OP_CPU_S = 10e-6
EAGER_BWD_OP_CPU_S = 5e-6
VIEW_CPU_S = 1.5e-6
"""Host seconds of one view made in C++ with no Python of its own (``narrow``, ``view``, each
output of ``torch.split``): the dispatcher plus a TensorImpl and its autograd view metadata,
no kernel; an estimate (no published per-view measurement), used where a call makes many."""
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
# Tensor-core time of a Blackwell GEMM on MX block-scaled operands (MXFP8: one E8M0 scale per
# 32 elements, applied by the tensor cores) over the same GEMM on per-tensor-scaled FP8. The
# datasheet gives both one peak, but the block-scaled MMA also stages every operand tile's
# scale factors (TMA loads beside the tile, a shared-to-tensor-memory copy per K block), which
# takes shared-memory stages and issue slots from the main loop. Measured, not derived:
# Transformer Engine's GEMM profiling table on a B300, both operands pre-quantized, the twelve
# GEMMs of a hidden-4,096 layer at 15,872 tokens: MXFP8 7.161 ms against per-tensor FP8 6.812
# (fprop 1.096, dgrad 1.029, wgrad 1.032; reference/te_gemm_profiling.yaml). cuDNN's
# block-scaled dot on a GB200 shows the same sign (Marin issue 7282, 2026-07: MXFP8 1.33x
# bf16 against per-tensor FP8's 1.35x at 2,560^2, behind it at narrow shapes). Blackwell's
# FP8 emulation of 1x128 block scaling runs the same MXFP8 GEMMs (TE PR 2157). The table's
# calls also run the two small kernels TE launches per pre-quantized MXFP8 GEMM to swizzle
# the operands' scales (sim.workload.mx_swizzle), priced as kernels of their own: 0.075 ms of
# the layer's 7.161 on the B300 as the simulator prices them (te_gemm_benchmark; a test
# keeps the two in step), so the GEMMs' own share is the rest.
BLACKWELL_BLOCK_SCALED_SLOWDOWN = (7.161 - 0.075) / 6.812
# Between two kernels queued back to back on one stream the GPU idles for a moment: the
# first one's last thread blocks drain and the front end starts the next (the profiler's
# kernel intervals leave gaps of 1-5 us between them). The kernel table's times are each
# kernel's own (a synchronised harness, its overhead subtracted), so a stream of n kernels
# takes their sum plus n of these. Fitted on the lent H200's 1B eager step
# (h200-step-gaps.json, run ``1b-plain``: the kernels' span less their busy time, copies and
# gaps over 5 us, over 2,789 kernels: 1.57 us); validated on the other four profiled steps
# (8b4l-plain 1.75, 1b-recompute 1.78, 1b-fsdp2 1.36, 8b4l-fsdp2 1.09 us).
KERNEL_BOUNDARY_S = 1.57e-6
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
class ComputeModel(MemoryBoundKernels):
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
    deterministic: bool = False
    """The attention backward runs deterministically (``training.deterministic``):
    :func:`sim.hardware.attention_cost.deterministic_backward_factor` of its time."""
    cudnn_release: tuple[int, ...] | None = None
    """cuDNN release (``training.cudnn_version``): Blackwell's cuDNN attention runs at its
    measured speed (:func:`sim.hardware.blackwell_attention.cudnn_release_gap`); None: the
    newest measured."""

    # ------------------------------------------------------------------ scaling
    @cached_property
    def _flops_scale(self) -> float:
        # Matrix throughput scales with the dense peak times the share of it a large GEMM
        # reaches on each GPU (catalogue matmul_efficiency), relative to the fitted H200.
        # FP8 training keeps its non-GEMM math (attention, the 16-bit layers) at 16 bits: only
        # kernels marked fp8 run at the FP8 rate (:attr:`_fp8_speedup`).
        # A power cap below TDP lowers the sustained SM clock, and matrix throughput with it
        # (sim/hardware/power.py); HBM-bound kernels keep their rate.
        return sustained_matrix_flops(self.gpu, self._base_precision) / self._fitted_flops

    @cached_property
    def _gemm_flops_scale(self) -> float:
        # GEMMs also carry the part's gemm_rate_factor (sustained_gemm_flops): what its GEMMs
        # hold in a node whose GPUs all run; of fused attention only Hopper's wgmma kernels
        # carry it too (attention_time, WGMMA_ATTENTION).
        return sustained_gemm_flops(self.gpu, self._base_precision) / self._fitted_flops

    @property
    def _base_precision(self) -> str:
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def _fitted_flops(self) -> float:
        # The matrix rate the H200 fit's peaks stand for.
        return _fit()["peak_bf16_tflops"] * 1e12 * catalog.gpu("h200").matmul_efficiency

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

        Block scales on Hopper: FP32 work per output element on the CUDA cores for every
        :data:`BLOCK_SCALED_PROMOTION_K` reduction elements the tensor cores multiply (256
        FP8 FLOPs), serialised with them: ``1 + ops x fp8 peak / (128 x fp32 peak)``.
        The forward and dgrad GEMMs scale one operand by 1x128 blocks and the other (the
        weight) by 128x128 blocks, one scale per block of 128 output columns: the product of
        the row's and the block's scale is formed once per row, and each element takes one
        fused multiply-add (``ops`` 1: 1.23 on H100 and H200, 1,979 / (128 x 66.9)). The
        wgrad GEMM reduces over tokens, along which both operands (the output gradient and
        the input) carry 1x128 scales, one per row of each: every element has its own
        scale product, a multiply and then the multiply-add (``ops`` 2: 1.46). Transformer
        Engine's Float8BlockScaling (1-D blocks for activations and gradients, 2-D for
        weights) and DeepSeek-V3's recipe (arXiv 2412.19437 sec. 3.3: 1x128 tiles for Wgrad's
        activations and gradients) both run wgrad so; DeepGEMM's own 1-D x 1-D wgrad kernel
        (deepseek-ai/DeepGEMM PR 95: 878-1,092 TFLOP/s on H800) runs below its 1-D x 2-D
        GEMMs (1,166-1,470, PR 74). Blackwell's tensor cores apply MX scales and accumulate
        in FP32, no promotion; staging the scales costs the measured
        :data:`BLACKWELL_BLOCK_SCALED_SLOWDOWN` (1.040) instead.

        Examples
        --------
        >>> from sim import catalog
        >>> round(ComputeModel(catalog.gpu("h100-sxm"))._accumulation("fwd", True), 3)
        1.231
        >>> round(ComputeModel(catalog.gpu("h100-sxm"))._accumulation("wgrad", True), 3)
        1.462
        >>> round(ComputeModel(catalog.gpu("b200"))._accumulation("wgrad", True), 3)
        1.04
        >>> ComputeModel(catalog.gpu("b200"))._accumulation("wgrad", False)
        1.0
        """
        # The CUDA cores' FP32 rate (the datasheet's FP32 column), not TF32's tensor rate.
        fp8, fp32 = self.gpu.peak_tflops.get("fp8"), self.gpu.peak_tflops.get("fp32")
        if block_scaled and self.gpu.arch == "hopper" and fp8 and fp32:
            ops = 2.0 if pass_ == "wgrad" else 1.0
            return 1.0 + ops * fp8 / (BLOCK_SCALED_PROMOTION_K * fp32)
        if block_scaled and self.gpu.arch == "blackwell":
            return BLACKWELL_BLOCK_SCALED_SLOWDOWN
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
        peak = g["peak_tflops"][pass_] * 1e12 * self._gemm_flops_scale
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
                       masked: bool = False, published_curve: bool = True) -> float:
        """A fused (flash-style) attention kernel, forward or backward, of this model's
        ``attention_backend`` (FlashAttention-2/3, cuDNN: :mod:`sim.hardware.attention_cost`).

        The GPU time only: the fitted fixed term of a standalone call is dominated by CPU-side
        dispatch, which :func:`attention_cpu_s` returns separately. The measured residuals
        apply only to the backend the calibration measured, on Hopper. ``window``: a causal
        sliding window (keys per query), whose band of tiles the kernel runs
        (:func:`~sim.hardware.attention_cost.causal_tiles`); the residual stays the one of the
        same launch (``seq`` queries, ``batch x heads`` groups). ``fp8``: the call runs in
        that FP8 format (Transformer Engine's ``fp8_dpa``), at cuDNN's measured gain over
        the 16-bit kernel, carried to other parts of the generation by the units
        (:func:`~sim.hardware.fp8_attention.fp8_attention_gain_on`).
        ``masked``: SDPA was handed an explicit mask tensor (Hugging Face's causal mask under
        ``torch.compile``): the whole rectangle at the measured masked-call slowdown
        (:func:`~sim.hardware.masked_attention.masked_slowdown`). FlashAttention's first
        CUDA kernel and its Triton kernel run FlashAttention-2's call at their published
        share of its speed (:func:`~sim.hardware.attention_cost.share_of_flash2`), and
        FlexAttention at its own (:func:`~sim.hardware.attention_cost.flex_share`).
        FlashAttention-2's causal calls follow its published curve over length
        (:func:`~sim.hardware.flash_curves.flash2_causal_speedup`; ``published_curve``
        False: the form alone).
        """
        row_len = seq if window is None else min(seq, window)
        if self.attention_backend == "flex":
            return self._flash2_model.attention_time(
                batch, heads, seq, head_dim, pass_, kv_seq, causal, measured_table, window,
                fp8, masked, published_curve) / flex_share(self.gpu.arch, pass_)
        legacy = share_of_flash2(self.attention_backend, self.gpu.arch, head_dim, row_len)
        if legacy is not None:
            return self._flash2_model.attention_time(
                batch, heads, seq, head_dim, pass_, kv_seq, causal, measured_table, window,
                fp8, masked, published_curve) / legacy
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
            gap = (blackwell_attention.cudnn_release_gap(self.cudnn_release, pass_)
                   if self.attention_backend == "cudnn" else 1.0)
            t = (max(total / sms, longest) * blackwell_attention.score_seconds(
                self.gpu, pass_, head_dim) * gap + blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq if pass_ == "fwd" else kv_seq, groups))
        else:
            # Matmul FLOPs per score at the kernel's own tensor-core speed, plus the
            # exponential.
            share = matmul_share(self.attention_backend, self.gpu.arch, pass_)
            per_score = (4 if pass_ == "fwd" else 10) * head_dim / share + exp_cost_flops()
            # FlashAttention-2's sm80 kernels on Blackwell run at Hopper's per-SM rates.
            scale = (blackwell_attention.sm80_kernel_scale(self.gpu)
                     if self.gpu.arch == "blackwell" else self._flops_scale)
            if self.attention_backend in WGMMA_ATTENTION:
                scale *= self.gpu.gemm_rate_factor
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
        if published_curve and causal and self.attention_backend == "flash2":
            t16 /= flash2_causal_speedup(self.gpu.arch, head_dim, row_len)
        windowed = causal and row < nb     # a band shorter than the causal row
        if fp8 is None:
            return t16
        if windowed and pass_ == "bwd":
            # cuDNN's FP8 backward does not skip the band's outside: the causal call's work
            # at the causal gain (sim/hardware/fp8_attention.py).
            return self.attention_time(batch, heads, seq, head_dim, "bwd", kv_seq,
                                       causal=True, measured_table=measured_table, fp8=fp8)
        kind: Kind = "full" if not causal else "window" if windowed else "causal"
        return t16 / fp8_attention_gain_on(self.gpu, fp8, pass_, kind, head_dim, seq)

    def cp_attention_time(self, batch: int, heads: int, seq: int, head_dim: int,
                          pass_: Literal["fwd", "bwd"], kv_seq: int,
                          fp8: Format | None = None) -> float:
        """One rank's load-balanced context-parallel attention (Megatron over Transformer
        Engine's ``AttnFuncWithCPAndKVP2P``, :func:`sim.frameworks.megatron.overlap.cp_ring`):
        ``seq`` local queries against ``kv_seq`` keys in ``kv_seq / seq`` ring steps, half
        the score rectangle in all (each rank's two chunks share the causal triangle).

        Forward, TE issues the steps on two alternating streams ("to resolve wave
        quantization"), so consecutive calls share the SMs: half the whole rectangle, and on
        Blackwell each step's row tiles pay their fill
        (:func:`~sim.hardware.blackwell_attention.row_fill_seconds`): the diagonal step all
        local rows, the others all or half of them (the ranks before the key chunk's owner
        run every query on the first key chunk, the ranks after it the second query chunk on
        every key), 1 + 0.75 (cp - 1) local rows' fills over the steps. Backward, TE runs the
        steps one after another on one stream (``AttnFuncWithCPAndKVP2P.backward``), each its
        own call: the diagonal step causal over the local rows, then cp - 1 steps each as
        slow as the slower of its two kinds (all queries on half the keys, half the queries
        on all keys), as every rank waits for its neighbour's key/value gradients.
        """
        cp = max(1, round(kv_seq / seq))
        if pass_ == "bwd" and cp > 1 and seq % 2 == 0:
            t = self.attention_time(batch, heads, seq, head_dim, "bwd", causal=True)
            t += (cp - 1) * max(
                self.attention_time(batch, heads, seq // 2, head_dim, "bwd", kv_seq=seq,
                                    causal=False),
                self.attention_time(batch, heads, seq, head_dim, "bwd", kv_seq=seq // 2,
                                    causal=False))
            return t if fp8 is None else t / fp8_attention_gain_on(
                self.gpu, fp8, pass_, "full", head_dim, seq)
        t = 0.5 * self.attention_time(batch, heads, seq, head_dim, pass_, kv_seq=kv_seq,
                                      causal=False)
        if self.gpu.arch == "blackwell" and (
                self.attention_backend in blackwell_attention.BACKENDS):
            groups = batch * heads
            # The half call above paid half a fill of its own rows (queries or keys).
            t -= 0.5 * blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq if pass_ == "fwd" else kv_seq, groups)
            t += (1.0 + 0.75 * (cp - 1)) * blackwell_attention.row_fill_seconds(
                self.gpu, pass_, seq, groups)
        if fp8 is None:
            return t
        return t / fp8_attention_gain_on(self.gpu, fp8, pass_, "full", head_dim, seq)

    def attention_cpu_s(self, pass_: Literal["fwd", "bwd"] = "fwd") -> float:
        """CPU time to issue one attention call (backend selection, graph lookup)."""
        return float(_fit()["attention"][pass_]["fixed_us"]) * 1e-6

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
