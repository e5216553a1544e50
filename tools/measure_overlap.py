"""Measure a GEMM beside an NCCL-like copy kernel: what each does to the other, and the draw.

NCCL runs a collective as a copy (or reduce) loop on a few thread blocks, one per channel (16
to 32 on an H100 node), beside the compute stream's kernels (issue 11, item 8: overlap
interference from physics, "calibrated by a measurement (a GEMM beside an NCCL-like copy
kernel) when a GPU is lent"). This script emulates it with a Triton copy kernel launched on
a fixed grid of ``ctas`` programs, each streaming its share of a device buffer, on a second
stream while a bf16 GEMM (``F.linear``, Llama 3 8B's gate/up at 2 x 4096 tokens) loops on
the first. For each grid (and PyTorch's own full-grid copy) it times, after ``--settle``
seconds of the same work:

* the GEMM alone, held back to back; the copy alone; both at once;
* each kernel by CUDA events over ``--timed`` seconds, with NVML's mean power and SM clock
  of that window (a sampler process, as ``tools/measure_step_power.py``).

Needs PyTorch, Triton and nvidia-ml-py; nothing in the package imports it.

Example::

    python tools/measure_overlap.py --out h200-overlap.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from measure_step_power import Samples

GEMM = (8192, 4096, 14336)
CTAS = [16, 32, 0]      # 0: PyTorch's full-grid copy


def copy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def grid_copy(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):  # noqa: N803
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return grid_copy


def run(gemm: Any, copy: Any, settle: float, timed: float, samples: Samples,
        copies: int = 4) -> dict[str, Any]:
    """Loop whichever of ``gemm`` and ``copy`` is given, each on its own stream (4 GEMMs and
    ``copies`` copies a round, so both streams stay busy the same time); settle, then time
    every kernel over ``timed`` seconds."""
    import torch

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    work = [(s, f, r) for s, f, r in zip(streams, (gemm, copy), (4, copies), strict=True)
            if f is not None]

    def loop(seconds: float, events: list[list[tuple[Any, Any]]] | None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, (stream, fn, reps) in enumerate(work):
                with torch.cuda.stream(stream):
                    for _ in range(reps):
                        if events is None:
                            fn()
                            continue
                        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        a.record(stream)
                        fn()
                        b.record(stream)
                        events[i].append((a, b))
            torch.cuda.synchronize()

    loop(settle, None)
    events: list[list[tuple[Any, Any]]] = [[] for _ in work]
    t0 = time.time()
    loop(timed, events)
    t1 = time.time()
    out: dict[str, Any] = {}
    for (_, fn, _), evs in zip(work, events, strict=True):
        key = "gemm_s" if fn is gemm else "copy_s"
        out[key] = statistics.median(a.elapsed_time(b) / 1e3 for a, b in evs)
    return {**out, **samples.window(t0, t1)}


def main() -> None:
    import torch
    import torch.nn.functional as F

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--timed", type=float, default=1.0)
    ap.add_argument("--mib", type=int, default=512, help="bytes each copy moves, MiB")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    samples = Samples(a.out.with_suffix(".samples.csv"), 5.0)
    m, k, n = GEMM
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    src = torch.randn(a.mib * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    kernel = copy_kernel()

    def gemm() -> Any:
        return F.linear(x, w)

    rows: list[dict[str, Any]] = []
    try:
        rows.append({"case": "gemm alone", **run(gemm, None, a.settle, a.timed, samples)})
        for ctas in CTAS:
            if ctas:
                def copy(ctas: int = ctas) -> Any:
                    return kernel[(ctas,)](src, dst, src.numel(), BLOCK=4096, PROGRAMS=ctas)
            else:
                def copy(ctas: int = ctas) -> Any:
                    return dst.copy_(src)
            copy()
            alone = run(None, copy, a.settle, a.timed, samples)
            copies = max(1, round(4 * rows[0]["gemm_s"] / alone["copy_s"]))
            for case, fns in (("copy alone", (None, copy)), ("both", (gemm, copy))):
                row = {"case": case, "ctas": ctas or "full grid", "copy_bytes": 4 * src.numel(),
                       "copies_a_round": copies,
                       **(alone if case == "copy alone" else
                          run(*fns, a.settle, a.timed, samples, copies))}
                rows.append(row)
                print(row, flush=True)
            a.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    finally:
        samples.close()
    meta = {"measured": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "gemm": {"M": m, "K": k, "N": n},
            "method": " ".join((__doc__ or "").split("\n\n")[1:3]),
            "script": "tools/measure_overlap.py"}
    for r in rows:
        if "gemm_s" in r:
            r["gemm_tflops"] = 2.0 * m * k * n / r["gemm_s"] / 1e12
        if "copy_s" in r:
            r["copy_tb_s"] = r["copy_bytes"] / r["copy_s"] / 1e12
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
