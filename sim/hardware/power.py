"""What the power limit, and a cap below it (``cluster.gpu_power_w``), do to the compute rates.

A power cap is enforced by the GPU's firmware as a clock limit: the power management unit
lowers the SM (graphics) clock until the board's draw fits under the cap; the HBM clock is
not part of that loop (``nvidia-smi -q -d CLOCK`` shows the memory clock fixed while the
graphics clock throttles). So a cap slows the kernels whose time is set by the SM clock
(tensor-core GEMMs, fused attention) and leaves the ones set by HBM bandwidth nearly as they
are.

On a 700 W Hopper part the draw of a GEMM held back to back is measured (the lent H200's
duty sweep, ``GEMM_POWER_W_AT_1500_MHZ`` and ``GEMM_POWER_W_PER_GHZ`` below): nearly linear in
the clock over 1.44-1.98 GHz, so the clock under a cap is where that line meets it
(:func:`held_gemm_clock_mhz`) and a GEMM's rate follows the clock as ``f^0.857``
(:func:`gemm_clock_speed`). Other parts, with no such measurement, take the DVFS law for a
workload that holds the board at its TDP at clock ``f_tdp``::

    P(f) = P_static + (P_tdp - P_static) * (f / f_tdp) ** 3

Dynamic CMOS power is ``a C V^2 f``; over the DVFS range the voltage rises about in
proportion to the clock, so the dynamic part grows as ``f^3`` (Weste & Harris, "CMOS VLSI
Design", 4th ed., sec. 5.2 on dynamic power and 5.3 on DVFS). ``P_static`` (leakage, HBM
and I/O) does not follow the SM clock; the catalogue's ``static_w`` is the board's draw at
idle. (The H200's measured line is not cubic: a cube law with the idle draw as floor misses
its three clocks by 60-90 W.)

A step's own clock (``cluster.sm_clock: balanced``) is where its mix's mean draw meets the
limit: :func:`balanced_sm_clock_mhz`, below.

The clock at TDP is itself below the boost clock short benchmarks run at: a GEMM held back to
back draws the board to its limit and the firmware settles the clock lower. S. Bekman's
``mamf-finder.py`` measures both regimes on the same node with the same protocol, the best
burst (MAMF) and the best rate held at the limit (MSMF), every GPU of the node busy
(stas00/ml-engineering, compute/accelerator/benchmarks/README.md, "What was measured: alone vs
all-8 concurrent", torch 2.14 + CUDA 13.0, 40 runs each): H200 MSMF 755.5 / MAMF 852.1 TFLOP/s
at 1,850-1,938 MHz sustained (boost 1,980); B200 1,437.5 / 1,746.7 at 1,368-1,527 MHz (boost
1,965). The 1,000 W Blackwell part gives up far more of its clock than the 700 W Hopper one.
Hopper's rates are anchored on Hopper training steps (the H200 fit,
checked against measured H100 and H200 runs), so what a Hopper step loses to its power limit
is already in them; the factors that carry them to Blackwell (``matmul_efficiency``: MAMF and
OpenXLA's autotuner table; FlashAttention-4's and TE's Blackwell figures) are burst figures, so
they carry the burst ratio, where a training step runs at the sustained one. Each part
therefore carries ``saturated_rate_factor``, its MSMF/MAMF over the H200's: 1 on Hopper,
(1,437.5 / 1,746.7) / (755.5 / 852.1) = 0.928 on the B200. The same behaviour -- DGEMM
throughput and SM frequency falling with the cap while the memory-bound Schoenauer triad
barely moves -- is what "Architectural and Power-Capping Trade-offs in NVIDIA H100 and H200
GPUs" (arXiv 2604.11391) measured on H100 and H200 under caps from 200 W to 700 W.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from statistics import NormalDist

import numpy as np

from sim.catalog import GpuSpec


class PowerCapError(ValueError):
    """A power cap the part cannot be set to."""


@cache
def expected_max_standard_normal(n: int) -> float:
    """Expected largest of ``n`` independent standard normal draws, the integral of
    ``x n phi(x) Phi(x)^(n-1)`` (the first moment of the largest order statistic; H. A. David &
    H. N. Nagaraja, "Order Statistics", 3rd ed., sec. 2.1), by the trapezoid rule over
    [-9, 9]; 0 for one draw.

    Examples
    --------
    >>> expected_max_standard_normal(1)
    0.0
    >>> round(expected_max_standard_normal(2), 4)   # 1 / sqrt(pi)
    0.5642
    >>> round(expected_max_standard_normal(8), 4)   # tabulated: 1.4236
    1.4236
    """
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 36001)
    nd = NormalDist()
    cdf = np.array([nd.cdf(v) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    y = x * n * pdf * cdf ** (n - 1)
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2.0)   # trapezoids (numpy >= 1.26)


def slowest_chip_ratio(gpu: GpuSpec) -> float:
    """Sustained rate of the slowest of the job's ``lockstep_gpus`` chips over the part's
    mean: ``1 - chip_rate_sigma x E[max of n standard normals]``.

    Chips of one part hold different clocks at the same power limit (each die's own
    voltage-frequency curve), and a synchronous step waits at every collective for its
    slowest member, so the job runs at the slowest chip's pace. Measured (S. Bekman,
    ml-engineering compute/accelerator/benchmarks/README.md, every GPU of a node busy, five
    rounds): the slowest of 8 H200 chips held 743.4 TFLOP/s against a node mean of 755.5
    (1.60% below), the slowest of 8 B200 1,417.2 against 1,437.5 (1.41%); over
    E[max of 8] = 1.4236 standard deviations that is ``chip_rate_sigma`` 0.0113 and 0.0099.

    Examples
    --------
    >>> from sim import catalog
    >>> slowest_chip_ratio(catalog.gpu("h200"))                   # one GPU: its own pace
    1.0
    >>> round(slowest_chip_ratio(catalog.gpu("h200", lockstep_gpus=8)), 3)   # 743.4 / 755.5
    0.984
    >>> round(slowest_chip_ratio(catalog.gpu("h100-sxm", lockstep_gpus=1024)), 3)
    0.963
    """
    return 1.0 - gpu.chip_rate_sigma * expected_max_standard_normal(gpu.lockstep_gpus)


def sustained_clock_ratio(gpu: GpuSpec, cap_w: float | None = None) -> float:
    """SM clock held in training over the clock the kernel references imply: the part's
    ``saturated_rate_factor`` (1 on Hopper, below 1 where the power limit binds harder than on
    the calibration H200) at the pace of the job's slowest chip (:func:`slowest_chip_ratio`),
    times what a cap below TDP takes off the clock at TDP: on a 700 W Hopper part the rate a
    held GEMM keeps at the clock where its measured draw meets the cap
    (:func:`held_gemm_clock_mhz`, :func:`gemm_clock_speed`), elsewhere the cube law.

    ``cap_w`` defaults to the spec's own cap (:attr:`GpuSpec.power_cap_w`).

    Examples
    --------
    >>> from sim import catalog
    >>> h100 = catalog.gpu("h100-sxm")
    >>> sustained_clock_ratio(h100, 700.0)
    1.0
    >>> round(sustained_clock_ratio(h100, 500.0), 3)   # (1,194 / 1,520 MHz) ** 0.857
    0.813
    >>> a100 = catalog.gpu("a100-80gb")                # the cube law: no measured line
    >>> round(sustained_clock_ratio(a100, 300.0), 3)   # ((300 - 60) / (400 - 60)) ** (1/3)
    0.89
    >>> round(sustained_clock_ratio(catalog.gpu("b200")), 3)   # MSMF/MAMF over the H200's
    0.928
    """
    saturated = gpu.saturated_rate_factor * slowest_chip_ratio(gpu)
    cap = gpu.power_cap_w if cap_w is None else cap_w
    if cap is None or cap >= gpu.tdp_w:
        return saturated
    problem = gpu.power_cap_problem(cap)
    if problem:
        raise PowerCapError(problem)
    if has_power_balance(gpu):
        # The measured line of a held GEMM's draw against its clock, and its rate's clock law.
        return saturated * gemm_clock_speed(held_gemm_clock_mhz(cap),
                                            held_gemm_clock_mhz(gpu.tdp_w))
    return saturated * float(((cap - gpu.static_w) / (gpu.tdp_w - gpu.static_w)) ** (1.0 / 3.0))


def held_gemm_clock_mhz(limit_w: float) -> float:
    """The SM clock at which a GEMM held back to back draws ``limit_w`` on a 700 W Hopper
    part: the measured line ``GEMM_POWER_W_AT_1500_MHZ + GEMM_POWER_W_PER_GHZ x (f - 1.5)``
    solved for ``f`` (measured over 1,440-1,980 MHz; a cap takes it below, where the line is
    extrapolated).

    Examples
    --------
    >>> round(held_gemm_clock_mhz(700.0))     # the H200's held GEMMs: 1,441-1,544 MHz
    1520
    >>> round(held_gemm_clock_mhz(500.0))
    1194
    """
    return 1e3 * (1.5 + (limit_w - GEMM_POWER_W_AT_1500_MHZ) / GEMM_POWER_W_PER_GHZ)


def sustained_matrix_flops(gpu: GpuSpec, precision: str = "bf16") -> float:
    """FLOP/s a large GEMM sustains in training: the dense peak of ``precision`` times the share
    of it the part reaches in a burst (catalogue ``matmul_efficiency``), at the clock its power
    limit and cap allow (:func:`sustained_clock_ratio`).

    Examples
    --------
    >>> from sim import catalog
    >>> round(sustained_matrix_flops(catalog.gpu("h100-sxm")) / 1e12, 1)   # 989.4 x 0.803
    794.5
    """
    return gpu.peak_flops(precision) * gpu.matmul_efficiency * sustained_clock_ratio(gpu)



def sustained_gemm_flops(gpu: GpuSpec, precision: str = "bf16") -> float:
    """FLOP/s a large GEMM sustains in a training node: :func:`sustained_matrix_flops` times
    the part's ``gemm_rate_factor`` (1 where unmeasured; the H100 SXM's is fitted on eight busy
    H100s running a Megatron MoE layer).

    Examples
    --------
    >>> from sim import catalog
    >>> round(sustained_gemm_flops(catalog.gpu("h100-sxm")) / 1e12, 1)   # 794.5 x 0.86
    683.3
    >>> sustained_gemm_flops(catalog.gpu("h200")) == sustained_matrix_flops(catalog.gpu("h200"))
    True
    """
    return sustained_matrix_flops(gpu, precision) * gpu.gemm_rate_factor


def burst_spec(gpu: GpuSpec) -> GpuSpec:
    """The same part at the burst clock a short benchmark runs it at (``saturated_rate_factor``
    and ``gemm_rate_factor`` 1): what kernel microbenchmarks (OpenXLA's table, FlashAttention-4's
    and TE's figures) measure, for checking the model against them.

    Examples
    --------
    >>> from sim import catalog
    >>> burst_spec(catalog.gpu("b200")).saturated_rate_factor
    1.0
    >>> burst_spec(catalog.gpu("h100-sxm")).gemm_rate_factor
    1.0
    """
    return dataclasses.replace(gpu, saturated_rate_factor=1.0, gemm_rate_factor=1.0)


# --------------------------------------------------------------------------- the clock in a step
# A step is not a held GEMM: copies, norms and elementwise loops sit between its GEMMs, and
# the firmware sets one SM clock for all of them from the board's draw, averaged over far
# longer than a kernel (NVML's readings move every ~100 ms; blocks of 1, 8 and 64 GEMMs
# between copies gave the same clock at the same duty). So the clock is where the step's mean
# draw meets the limit, and what a GEMM gets depends on what else the step runs. Measured on
# the lent H200 (``sim/catalog/calibration/h200-step-power.json``,
# ``tools/measure_step_power.py``): a GEMM alternating with a copy at duties 0.2-1 and alone,
# each kind of kernel held alone, and whole training steps with their mean clock. The
# constants below are **fitted** on the duty sweep with the copy partner and the kinds held
# alone; the sleep-partner points, and the whole steps' clocks and times, validate them
# (``tests/integration/test_calibration_h200_power.py``).

#: Board draw of a bf16 GEMM at 1,500 MHz and its rise per GHz: least squares over the duty
#: sweep's copy-partner points (mean power = duty x P_gemm(f) + (1 - duty) x P_copy, the copy
#: held alone drawing 407 W at 1,980 MHz), both Llama shapes. Nearly linear over 1.4-1.98 GHz
#: (a cube law with the idle draw as its floor misses the three clocks by 60-90 W).
GEMM_POWER_W_AT_1500_MHZ = 687.8
GEMM_POWER_W_PER_GHZ = 614.7
#: cuDNN's fused attention draws this share of a GEMM's power at the same clock: held alone,
#: forward 702 W at 1,818 MHz (0.794), backward 668 W at 1,843 MHz (0.744).
ATTENTION_POWER_SHARE = 0.77
#: The same kernel handed an explicit mask (Hugging Face's causal mask under
#: ``torch.compile``) computes the whole rectangle and draws less: on a third machine
#: (``h200-step-power-c.json``) its forward drew 0.96 and its backward 0.89 of the causal
#: call's share at their clocks (the backward, held alone, never reached the limit: 634 W at
#: 1,980 MHz), 0.911 weighted by their times: 0.77 x 0.911.
MASKED_ATTENTION_POWER_SHARE = 0.70
#: A memory-bound kernel's draw at the full clock (HBM-bound: it never reaches the limit),
#: held alone: a kernel that reads one tensor and writes one (a bf16 copy 407 W, a
#: bf16-to-fp32 cast 535: their mean) draws less than one that combines operands or reduces
#: (an fp32 product with a broadcast operand 584, an fp32 row reduction 599), whose threads
#: do more work per byte.
COPY_POWER_W = 471.0
MEMORY_BOUND_POWER_W = 591.5
#: Between kernels (host gaps) the board idles at its clock: 124 W measured.
IDLE_POWER_W = 124.0
#: A GEMM's rate follows the clock as f^0.857 (least squares over the sweep's points below
#: 1,900 MHz, each shape against its own held point) up to the clock where it reaches its
#: burst rate, 1.19x the held one for both shapes (1,505 MHz x 1.19^(1/0.857)): above it the
#: rate stays (HBM and L2 feed the tiles).
GEMM_CLOCK_EXPONENT = 0.857
GEMM_SATURATION_MHZ = 1843.0
#: The clock the H200 fit's kernel tables hold (``h200-fit.json``): its GEMM rates are the
#: rates five Llama GEMMs held back to back reached at 1,441-1,656 MHz, carried to one clock
#: by the exponent (median 1,525); its attention forward is cuDNN's held alone at 1,818 MHz
#: (1,828 carried). Its attention backward is 9% faster than held at any clock (a known
#: error of the form, docs/calibration.md), so the forward's clock serves both.
GEMM_REFERENCE_MHZ = 1525.0
ATTENTION_REFERENCE_MHZ = 1828.0
#: The SXM parts' maximum SM clock (H100 SXM and H200 datasheets; ``nvidia-smi`` clocks.max.sm
#: on the lent H200: 1,980 MHz).
HOPPER_MAX_SM_MHZ = 1980.0


@dataclasses.dataclass(frozen=True)
class StepMix:
    """Seconds of one step's GPU work by kind, priced at the reference clocks."""

    gemm_s: float
    attention_s: float
    other_s: float
    """Memory-bound kernels that combine operands or reduce (elementwise products, norms,
    reductions, the optimizer)."""
    idle_s: float = 0.0
    masked_attention_s: float = 0.0
    """Fused attention handed an explicit mask tensor (part of no other field)."""
    copy_s: float = 0.0
    """Memory-bound kernels reading one tensor and writing one (copies, casts, unary ops)."""


def has_power_balance(gpu: GpuSpec) -> bool:
    """Whether the step's clock is solved from its mix (:func:`balanced_sm_clock_mhz`): the
    700 W Hopper SXM parts, whose die and limit the H200 measurements describe. Other parts
    keep the clock their calibration implies."""
    return gpu.arch == "hopper" and gpu.tdp_w == 700.0


def gemm_clock_speed(clock_mhz: float, reference_mhz: float = GEMM_REFERENCE_MHZ) -> float:
    """A tensor-core kernel's rate at ``clock_mhz`` over its rate at ``reference_mhz``.

    Examples
    --------
    >>> gemm_clock_speed(GEMM_REFERENCE_MHZ)
    1.0
    >>> round(gemm_clock_speed(1980.0, 1505.0), 3)    # burst over held: 1.19 measured
    1.19
    """
    def rate(f: float) -> float:
        return min(f, GEMM_SATURATION_MHZ) ** GEMM_CLOCK_EXPONENT
    return rate(clock_mhz) / rate(reference_mhz)


def _mean_power_w(mix: StepMix, clock_mhz: float) -> tuple[float, float]:
    """The step's mean draw at ``clock_mhz`` and its length there."""
    ghz = clock_mhz / 1e3
    gemm_w = GEMM_POWER_W_AT_1500_MHZ + GEMM_POWER_W_PER_GHZ * (ghz - 1.5)
    gemm_s = mix.gemm_s / gemm_clock_speed(clock_mhz)
    attention_speed = gemm_clock_speed(clock_mhz, ATTENTION_REFERENCE_MHZ)
    attention_s = mix.attention_s / attention_speed
    masked_s = mix.masked_attention_s / attention_speed
    span = gemm_s + attention_s + masked_s + mix.other_s + mix.copy_s + mix.idle_s
    energy = (gemm_s * gemm_w + attention_s * ATTENTION_POWER_SHARE * gemm_w
              + masked_s * MASKED_ATTENTION_POWER_SHARE * gemm_w
              + mix.other_s * MEMORY_BOUND_POWER_W + mix.copy_s * COPY_POWER_W
              + mix.idle_s * IDLE_POWER_W)
    return energy / span, span


def balanced_sm_clock_mhz(gpu: GpuSpec, mix: StepMix) -> float | None:
    """The SM clock at which the step's mean draw meets the part's power limit (its cap
    where one is set, else its TDP), or the maximum clock if the step never reaches the
    limit there; None for a part without the balance (:func:`has_power_balance`) or an empty
    mix. A cap so low that the mix's memory-bound draw alone exceeds it gives the floor of
    the search, 600 MHz.

    Examples
    --------
    >>> from sim import catalog
    >>> h200 = catalog.gpu("h200")
    >>> round(balanced_sm_clock_mhz(h200, StepMix(1.0, 0.0, 0.0)))      # a GEMM held alone
    1520
    >>> balanced_sm_clock_mhz(h200, StepMix(0.3, 0.0, 0.7))             # mostly memory-bound
    1980.0
    >>> capped = catalog.gpu("h200", power_w=500)                        # the held line's 1,194
    >>> round(balanced_sm_clock_mhz(capped, StepMix(1.0, 0.0, 0.0)))
    1194
    """
    if not has_power_balance(gpu) or (mix.gemm_s + mix.attention_s + mix.masked_attention_s
                                      + mix.other_s + mix.copy_s) <= 0:
        return None
    limit = gpu.tdp_w if gpu.power_cap_w is None else min(gpu.power_cap_w, gpu.tdp_w)
    lo, hi = 600.0, HOPPER_MAX_SM_MHZ
    if _mean_power_w(mix, hi)[0] <= limit:
        return hi
    for _ in range(50):    # the mean draw rises with the clock: bisection
        mid = 0.5 * (lo + hi)
        if _mean_power_w(mix, mid)[0] > limit:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)
