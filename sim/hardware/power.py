"""What a GPU power cap (``cluster.gpu_power_w``) does to the compute rates.

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
idle. Dense BF16 GEMMs on the 700 W Hopper parts run at the power limit (the catalogue's
matmul rates are sustained ones, measured at TDP), so the cap's clock ratio is the GEMM rate
ratio. The same behaviour -- DGEMM throughput and SM frequency falling with the cap while the
memory-bound Schoenauer triad barely moves -- is what "Architectural and Power-Capping
Trade-offs in NVIDIA H100 and H200 GPUs" (arXiv 2604.11391) measured on H100 and H200 under
caps from 200 W to 700 W.
"""

from __future__ import annotations

from sim.catalog import GpuSpec


class PowerCapError(ValueError):
    """A power cap the part cannot be set to."""


def sustained_clock_ratio(gpu: GpuSpec, cap_w: float | None = None) -> float:
    """SM clock under the cap over the clock at TDP (1.0 at or above TDP).

    ``cap_w`` defaults to the spec's own cap (:attr:`GpuSpec.power_cap_w`).

    Examples
    --------
    >>> from sim import catalog
    >>> h100 = catalog.gpu("h100-sxm")
    >>> sustained_clock_ratio(h100, 700.0)
    1.0
    >>> round(sustained_clock_ratio(h100, 500.0), 3)   # ((500 - 70) / (700 - 70)) ** (1/3)
    0.88
    """
    cap = gpu.power_cap_w if cap_w is None else cap_w
    if cap is None or cap >= gpu.tdp_w:
        return 1.0
    problem = gpu.power_cap_problem(cap)
    if problem:
        raise PowerCapError(problem)
    return float(((cap - gpu.static_w) / (gpu.tdp_w - gpu.static_w)) ** (1.0 / 3.0))


def sustained_matrix_flops(gpu: GpuSpec, precision: str = "bf16") -> float:
    """FLOP/s a large GEMM sustains: the dense peak of ``precision`` times the share of it the
    part reaches (catalogue ``matmul_efficiency``), at the clock its power cap allows.

    Examples
    --------
    >>> from sim import catalog
    >>> round(sustained_matrix_flops(catalog.gpu("h100-sxm")) / 1e12, 1)   # 989.4 x 0.803
    794.5
    """
    return gpu.peak_flops(precision) * gpu.matmul_efficiency * sustained_clock_ratio(gpu)

