"""Measure one GEMM's rate alone, held back to back, and interleaved with memory-bound work.

A training step does not hold its GEMMs back to back: copies, norms and elementwise kernels
sit between them. Under a power limit the firmware sets the SM clock from the board's draw,
so a GEMM's rate may depend on what runs around it (issue 11, item 6: compute without
optimism). For each shape this script times the GEMM (``F.linear`` of X[M, K] and W[N, K],
bf16) in four regimes on the GPU it runs on:

* ``synced``: each call timed alone between two synchronisations after warm-up, the median
  (how ``sim/catalog/calibration/h200-kernels.json`` was taken);
* ``held``: back to back for ``--seconds`` first, then timed back to back (CUDA events);
* ``interleaved``: alternating with a device-to-device copy about as long as the GEMM for
  ``--seconds`` first, then each GEMM timed between its neighbours (CUDA events, median);
* ``cold``: one call after ``--pause`` seconds idle (CUDA events, median of 5).

With each regime the SM clock, power and throttle reasons ``nvidia-smi`` reads right after.
Needs PyTorch and a CUDA GPU; nothing in the package imports it. Writes one JSON file.

Example::

    python tools/measure_gemm_duty.py --out h200-gemm-duty.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_timing import once_seconds

#: (M, K, N): the forward GEMMs of Llama 3.2 1B at 4 x 4096 tokens (q/o, k/v, gate/up, down,
#: the output layer) and of Llama 3 8B's layer at 2 x 4096 (q/o, gate/up, down).
SHAPES = [(16384, 2048, 2048), (16384, 2048, 512), (16384, 2048, 8192), (16384, 8192, 2048),
          (16384, 2048, 128256), (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def smi() -> dict[str, Any]:
    try:
        out = subprocess.run(["nvidia-smi", "--id=0", f"--query-gpu={QUERY}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {}
    sm, power, reasons = (x.strip() for x in out.split(","))
    return {"sm_clock_mhz": float(sm), "power_w": float(power), "throttle_reasons": reasons}


def measure(m: int, k: int, n: int, seconds: float, pause: float) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    flops = 2.0 * m * k * n

    def gemm() -> Any:
        return F.linear(x, w)

    for _ in range(5):
        gemm()
    torch.cuda.synchronize()
    # A copy about as long as the GEMM at ~4 TB/s (read plus written).
    t0 = time.perf_counter()
    for _ in range(10):
        gemm()
    torch.cuda.synchronize()
    gemm_s = (time.perf_counter() - t0) / 10
    src = torch.empty(max(1, int(gemm_s * 4.0e12 / 4)), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {"M": m, "K": k, "N": n}

    synced = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gemm()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t0)
    out["synced"] = {"s": statistics.median(synced), **smi()}

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            gemm()
        torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(50):
        gemm()
    ev[1].record()
    ev[1].synchronize()
    out["held"] = {"s": ev[0].elapsed_time(ev[1]) / 1e3 / 50, **smi()}

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            gemm()
            dst.copy_(src)
        torch.cuda.synchronize()
    pairs = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(30)]
    copies = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(30)]
    for (a, b), (c, d) in zip(pairs, copies, strict=True):
        a.record()
        gemm()
        b.record()
        c.record()
        dst.copy_(src)
        d.record()
    torch.cuda.synchronize()
    out["interleaved"] = {"s": statistics.median(a.elapsed_time(b) / 1e3 for a, b in pairs),
                          "copy_s": statistics.median(c.elapsed_time(d) / 1e3
                                                      for c, d in copies),
                          "copy_bytes": 2 * src.numel() * 2, **smi()}

    cold = []
    for _ in range(5):
        time.sleep(pause)
        cold.append(once_seconds(gemm))
    out["cold"] = {"s": statistics.median(cold), **smi()}
    for regime in ("synced", "held", "interleaved", "cold"):
        out[regime]["tflops"] = flops / out[regime]["s"] / 1e12
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--pause", type=float, default=0.3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    for m, k, n in SHAPES:
        rows.append(measure(m, k, n, a.seconds, a.pause))
        r = rows[-1]
        print(f"{m:6d} {k:6d} {n:6d} " + " ".join(
            f"{g} {r[g]['tflops']:5.0f} ({r[g].get('sm_clock_mhz', 0):.0f} MHz)"
            for g in ("synced", "held", "interleaved", "cold")), flush=True)
    meta = {"measured": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "method": " ".join((__doc__ or "").split("\n\n")[1:3]),
            "script": "tools/measure_gemm_duty.py"}
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
