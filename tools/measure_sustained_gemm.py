"""Measure one GEMM's throughput and the GPU's SM clock in bursts and held back to back.

Every kernel reference the simulator is priced from (OpenXLA's table, Transformer Engine's
GEMM tables, FlashAttention-4's figures, ``sim/catalog/calibration/h200-kernels.json``) times
kernels in short bursts; a training step holds the GPU at its power limit for seconds, where the
firmware lowers the SM clock (flashinfer PR 2899: a B200 running attention back to back drops
from 1,965 to about 1,580 MHz and 15% of its TFLOP/s). This script measures both regimes on the
GPU it runs on, for issue 11 (docs/calibration.md, "Re-simulated 2026-12-02, fifth session"):

* ``burst``: one GEMM, synchronised, then a pause (as microbenchmarks do), repeated;
* ``sustained``: the same GEMM back to back for ``--seconds``, sampled every ``--sample`` s.

Each sample records TFLOP/s (CUDA events over the sample's GEMMs) and, from ``nvidia-smi``,
the SM clock, the power draw and the active throttle reasons. Needs a CUDA GPU and PyTorch;
nothing in the package imports it. Writes one JSON file (``--out``).

Example::

    python tools/measure_sustained_gemm.py --size 8192 --dtype bf16 --seconds 60 \
        --out h200-sustained-gemm.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

KERNELS = {"bf16": "torch.mm", "fp8": "torch._scaled_mm, E4M3, unit scales, bf16 out"}
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu"


def smi_sample(index: int) -> dict[str, Any]:
    """One ``nvidia-smi`` reading of the GPU: SM clock (MHz), power (W), throttle bits, temp."""
    out = subprocess.run(
        ["nvidia-smi", f"--id={index}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True).stdout.strip()
    sm, power, reasons, temp = (x.strip() for x in out.split(","))
    return {"sm_clock_mhz": float(sm), "power_w": float(power), "throttle_reasons": reasons,
            "temperature_c": float(temp)}


def make_gemm(size: int, dtype: str):  # noqa: ANN201 - returns a torch closure
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        return lambda: torch.mm(a, b)
    # FP8 (E4M3) with unit per-tensor scales, bf16 output: the GEMM Transformer Engine and
    # torchao run (torch._scaled_mm needs the second operand column-major).
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def timed(gemm, count: int) -> float:  # noqa: ANN001
    """Seconds per GEMM over ``count`` back-to-back launches (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        gemm()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=8192, help="M = N = K")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the sustained run")
    p.add_argument("--sample", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--bursts", type=int, default=20, help="burst measurements")
    p.add_argument("--pause", type=float, default=0.5, help="seconds between bursts")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import torch

    torch.cuda.set_device(args.gpu)
    gemm = make_gemm(args.size, args.dtype)
    flops = 2.0 * args.size ** 3
    for _ in range(10):      # warm-up: cuBLAS heuristics, clocks up from idle
        gemm()
    torch.cuda.synchronize()

    bursts = []
    for _ in range(args.bursts):
        time.sleep(args.pause)
        s = timed(gemm, 5)
        bursts.append({"tflops": flops / s / 1e12, **smi_sample(args.gpu)})

    # Sustained: enough GEMMs per sample to fill ``--sample`` seconds at the burst rate.
    per_sample = max(1, int(args.sample / (flops / (max(b["tflops"] for b in bursts) * 1e12))))
    sustained = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        s = timed(gemm, per_sample)
        sustained.append({"t_s": time.monotonic() - t0, "tflops": flops / s / 1e12,
                          **smi_sample(args.gpu)})

    result = {
        "meta": {
            "gpu": torch.cuda.get_device_name(args.gpu),
            "sm_count": torch.cuda.get_device_properties(args.gpu).multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "measured": time.strftime("%Y-%m-%d"),
            "gemm": f"{args.dtype} {args.size}^3 ({KERNELS[args.dtype]})",
            "method": (f"burst: {args.pause} s pause, then 5 GEMMs timed with CUDA events, "
                       f"{args.bursts} times; sustained: {per_sample} GEMMs per sample back to "
                       f"back for {args.seconds} s; nvidia-smi read after each timing"),
            "script": "tools/measure_sustained_gemm.py",
        },
        "burst": bursts,
        "sustained": sustained,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    last = sustained[len(sustained) // 2:]
    print(f"burst {sum(b['tflops'] for b in bursts) / len(bursts):.0f} TFLOP/s; sustained "
          f"(second half) {sum(x['tflops'] for x in last) / len(last):.0f} TFLOP/s at "
          f"{sum(x['sm_clock_mhz'] for x in last) / len(last):.0f} MHz -> {args.out}")


if __name__ == "__main__":
    main()
