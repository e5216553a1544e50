"""Fit ``torch._grouped_mm``'s time over the cuBLAS-priced grouped GEMM, per GPU generation
(``sim.workload.grouped_gemm`` ``TORCH_GROUPED_MM_SLOWDOWN``), on torchao's kernel benchmarks.

Hopper: the first row of ``sim/catalog/reference/torchao_grouped_mm_h100.yaml`` (forward, 16
groups, K 5,120, N 8,192 on an H100); the second checks it. Blackwell: the Llama 4 Scout rows
of ``torchao_grouped_mm.yaml`` (forward plus backward, 1-8 groups on a B200); the DeepSeek-V3
rows check it. Each kernel benchmark prices the part at its burst clock
(``sim.hardware.power.burst_spec``); the Blackwell benchmark's loss and gradient accumulation
are memory-bound kernels, not slowed, so each row's factor is ``(measured - those) / the
grouped GEMMs``. The factor is the geometric mean over the fit rows, rounded to 0.01. Prints
the factors and the check rows' errors; writes nothing: copy the factors into
``grouped_gemm.py``.

    python tools/fit_torch_grouped_mm.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim import catalog  # noqa: E402
from sim.hardware.compute import ComputeModel  # noqa: E402
from sim.hardware.power import burst_spec  # noqa: E402
from sim.workload.grouped_gemm import grouped_gemm_time  # noqa: E402

REF = Path(catalog.__file__).parent / "reference"
BF16 = 2


def _burst(gpu: str) -> ComputeModel:
    return ComputeModel(burst_spec(catalog.gpu(gpu)), precision="bf16")


def hopper_rows() -> list[tuple[float, float]]:
    """(measured seconds, cuBLAS-priced grouped GEMM seconds) of each H100 row."""
    cm = _burst("h100-sxm")
    out = []
    for r in yaml.safe_load((REF / "torchao_grouped_mm_h100.yaml").read_text())["rows"]:
        offs = r["offs"]
        rows = [b - a for a, b in zip([0, *offs[:-1]], offs, strict=True)]
        out.append((r["seconds"], grouped_gemm_time(cm, rows, r["k"], r["n"], "fwd")))
    return out


def blackwell_rows(model: str) -> list[tuple[float, float, float]]:
    """(measured, grouped GEMMs, loss and accumulation) seconds of each B200 row of
    ``model``: forward, dgrad and wgrad grouped GEMMs; mse_loss over the output and its
    backward; A.grad and B.grad accumulated."""
    ref = yaml.safe_load((REF / "torchao_grouped_mm.yaml").read_text())
    cm = _burst("b200")
    m = ref["total_m"]
    out = []
    for r in ref["shapes"][model]:
        n, k, g = r["n"], r["k"], r["g"]
        gemms = sum(grouped_gemm_time(cm, [m / g] * g, k, n, p)
                    for p in ("fwd", "dgrad", "wgrad"))
        o = m * n * BF16
        other = (cm.membound_time(2 * o, "reduction") + cm.membound_time(3 * o)
                 + cm.membound_time(3 * m * k * BF16) + cm.membound_time(3 * g * n * k * BF16))
        out.append((r["us"] * 1e-6, gemms, other))
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    h = hopper_rows()
    hopper = round(h[0][0] / h[0][1], 2)
    print(f"hopper    {hopper:.2f} (fit row {h[0][0] / h[0][1]:.3f})")
    for meas, gemm in h[1:]:
        print(f"  check: {gemm * hopper * 1e3:.3f} ms against {meas * 1e3:.3f} "
              f"({(gemm * hopper - meas) / meas:+.1%})")
    fit = blackwell_rows("llama4_scout")
    blackwell = round(_geomean([(meas - other) / gemm for meas, gemm, other in fit]), 2)
    print(f"blackwell {blackwell:.2f}")
    for meas, gemm, other in blackwell_rows("deepseek_v3"):
        sim = gemm * blackwell + other
        print(f"  check: {sim * 1e3:.3f} ms against {meas * 1e3:.3f} ({(sim - meas) / meas:+.1%})")


if __name__ == "__main__":
    main()
