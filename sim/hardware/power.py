"""What the power limit, and a cap below it (``cluster.gpu_power_w``), do to the compute rates.

A power cap is enforced by the GPU's firmware as a clock limit: the power management unit
lowers the SM (graphics) clock until the board's draw fits under the cap; the HBM clock is
not part of that loop (``nvidia-smi -q -d CLOCK`` shows the memory clock fixed while the
graphics clock throttles). So a cap slows the kernels whose time is set by the SM clock
(tensor-core GEMMs, fused attention) and leaves the ones set by HBM bandwidth nearly as they
are.

Power at clock ``f``, for a workload that holds the board at its TDP at clock ``f_tdp``::

    P(f) = P_static + (P_tdp - P_static) * (f / f_tdp) ** 3

Dynamic CMOS power is ``a C V^2 f``; over the DVFS range the voltage rises about in
proportion to the clock, so the dynamic part grows as ``f^3`` (Weste & Harris, "CMOS VLSI
Design", 4th ed., sec. 5.2 on dynamic power and 5.3 on DVFS). ``P_static`` (leakage, HBM
and I/O) does not follow the SM clock; the catalogue's ``static_w`` is the board's draw at
idle.

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
    times what a cap below TDP takes off the clock at TDP.

    ``cap_w`` defaults to the spec's own cap (:attr:`GpuSpec.power_cap_w`).

    Examples
    --------
    >>> from sim import catalog
    >>> h100 = catalog.gpu("h100-sxm")
    >>> sustained_clock_ratio(h100, 700.0)
    1.0
    >>> round(sustained_clock_ratio(h100, 500.0), 3)   # ((500 - 70) / (700 - 70)) ** (1/3)
    0.88
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
    return saturated * float(((cap - gpu.static_w) / (gpu.tdp_w - gpu.static_w)) ** (1.0 / 3.0))


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



def burst_spec(gpu: GpuSpec) -> GpuSpec:
    """The same part at the burst clock a short benchmark runs it at (``saturated_rate_factor``
    1): what kernel microbenchmarks (OpenXLA's table, FlashAttention-4's and TE's figures)
    measure, for checking the model against them.

    Examples
    --------
    >>> from sim import catalog
    >>> burst_spec(catalog.gpu("b200")).saturated_rate_factor
    1.0
    """
    return dataclasses.replace(gpu, saturated_rate_factor=1.0)
