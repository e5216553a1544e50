"""Measure how a power-limited GPU's clock follows the work mix: GEMMs at set duty cycles,
whole training steps, and the memory-bound loops priced by rule (issue 11, item 6).

Held back to back, a bf16 GEMM draws an H200 to its 700 W limit and the firmware settles the
SM clock near 1,500 MHz; interleaved with a copy as long as itself the same GEMM ran at 1,965
(``h200-gemm-duty.json``). A training step lies between (tensor-core duty 0.54-0.84 in the
profiled H200 steps), so the clock its GEMMs get depends on the energy the rest of the step
leaves under the limit. This script measures, on the GPU it runs on, with a sampler process
reading NVML every ``--sample-ms`` (instantaneous board power where the driver has it, SM
clock, clock-event reasons):

* ``duty``: one GEMM (``F.linear`` of X[M, K] and W[N, K], bf16) alternating with a partner
  kernel sized so the GEMM takes a set share of the time: the partner a device-to-device copy
  (HBM-bound, high power) or ``torch.cuda._sleep`` (one thread spinning: the GPU nearly idle);
  each point settled ``--settle`` seconds, then timed (CUDA events on every kernel) for
  ``--timed`` seconds with the samples of that window; blocks of 1, 8 and 64 GEMMs show the
  controller's time constant;
* ``alone``: the copy held alone, and the GPU idle;
* ``kinds``: each kind of kernel a step runs (attention forward and backward, broadcast and
  casting loops, a row reduction, GEMMs of small and large N) held back to back alone;
* ``steps``: training steps of ``tools/measure_train_step.py``'s runs (the same model,
  wrapper and timing), ``--steps`` timed after warm-up, with the samples of those steps;
* ``gaps``: one profiled step of each run: its kernels by name, and the GPU's idle gaps;
* ``loops``: RoPE's ``rotate_half`` (``torch.cat((-x2, x1), -1)`` of a transposed view's
  halves, and its parts), GELU and SiLU forward and backward, each the median of 20 calls.

Writes ``--out`` (JSON) after each part and the raw samples beside it (``.samples.csv``).
Needs PyTorch, transformers and nvidia-ml-py; nothing in the package imports it.

Example::

    python tools/measure_step_power.py --out h200-step-power.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_timing import once_seconds

#: (M, K, N): Llama 3.2 1B's gate/up GEMM at 4 x 4096 tokens, Llama 3 8B's at 2 x 4096.
DUTY_SHAPES = [(16384, 2048, 8192), (8192, 4096, 14336)]
COPY_DUTIES = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.35, 0.2]
SLEEP_DUTIES = [0.85, 0.7, 0.5]
BLOCKS = [8, 64]
STEP_RUNS = ["1b-plain", "8b4l-plain", "70b2l-plain", "1b-fsdp2", "8b4l-compile"]

SAMPLER = r"""
import sys, time, pynvml as n
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); period = float(sys.argv[2]) / 1e3
fid = getattr(n, "NVML_FI_DEV_POWER_INSTANT", 186)
reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
    n.nvmlDeviceGetCurrentClocksThrottleReasons
def power():
    try:
        v = n.nvmlDeviceGetFieldValues(h, [fid])[0]
        if v.nvmlReturn == 0:
            return v.value.uiVal / 1e3
    except Exception:
        pass
    return n.nvmlDeviceGetPowerUsage(h) / 1e3
with open(sys.argv[1], "w", buffering=1) as f:
    f.write("t,power_w,sm_mhz,mem_mhz,reasons,temp_c\n")
    while True:
        t = time.time()
        f.write(f"{t:.4f},{power():.1f},{n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)},"
                f"{n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)},{reasons(h)},"
                f"{n.nvmlDeviceGetTemperature(h, 0)}\n")
        time.sleep(max(0.0, period - (time.time() - t)))
"""


class Samples:
    """The sampler process, and the windows of wall-clock time the parts mark."""

    def __init__(self, path: Path, period_ms: float) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", SAMPLER, str(path), str(period_ms)])
        time.sleep(1.0)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Mean power and clock over [t0, t1], the clock's spread, and the share of samples
        the software power cap (reason bit 0x4) was active in."""
        rows = []
        for line in self.path.read_text().splitlines()[1:]:
            parts = line.split(",")
            if len(parts) == 6 and t0 <= float(parts[0]) <= t1:
                rows.append(parts)
        if not rows:
            return {"samples": 0}
        power = [float(r[1]) for r in rows]
        sm = sorted(float(r[2]) for r in rows)
        return {"samples": len(rows), "power_w": statistics.fmean(power),
                "power_max_w": max(power), "sm_mhz": statistics.fmean(sm),
                "sm_mhz_p10": sm[len(sm) // 10], "sm_mhz_p50": sm[len(sm) // 2],
                "sm_mhz_p90": sm[(9 * len(sm)) // 10],
                "mem_mhz": statistics.fmean(float(r[3]) for r in rows),
                "power_cap_share": sum(int(r[4]) & 4 != 0 for r in rows) / len(rows),
                "temp_c": max(float(r[5]) for r in rows)}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def duty_point(gemm: Any, partner: Any, block: int, settle: float, timed: float,
               samples: Samples) -> dict[str, Any]:
    """``block`` GEMMs then one partner, repeated: settled, then every kernel timed."""
    import torch

    end = time.monotonic() + settle
    while time.monotonic() < end:
        for _ in range(max(1, 16 // block)):
            for _ in range(block):
                gemm()
            if partner is not None:
                partner()
        torch.cuda.synchronize()
    ev: list[tuple[str, Any, Any]] = []
    t0 = time.time()
    end = time.monotonic() + timed
    while time.monotonic() < end:
        for _ in range(max(1, 16 // block)):
            for _ in range(block):
                ev.append(("g", *(torch.cuda.Event(enable_timing=True) for _ in range(2))))
                ev[-1][1].record()
                gemm()
                ev[-1][2].record()
            if partner is not None:
                ev.append(("p", *(torch.cuda.Event(enable_timing=True) for _ in range(2))))
                ev[-1][1].record()
                partner()
                ev[-1][2].record()
        torch.cuda.synchronize()
    t1 = time.time()
    g = [a.elapsed_time(b) / 1e3 for kind, a, b in ev if kind == "g"]
    p = [a.elapsed_time(b) / 1e3 for kind, a, b in ev if kind == "p"]
    gemm_s, partner_s = sum(g), sum(p)
    return {"block": block, "gemm_s": statistics.median(g), "gemm_mean_s": gemm_s / len(g),
            "partner_s": statistics.median(p) if p else 0.0,
            "duty": gemm_s / (gemm_s + partner_s), **samples.window(t0, t1)}


def duty_part(a: argparse.Namespace, samples: Samples) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    rows = []
    src = torch.empty(3 * 2**30, device="cuda", dtype=torch.bfloat16)   # 6 GiB
    dst = torch.empty_like(src)
    for m, k, n in DUTY_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        flops = 2.0 * m * k * n

        def gemm(x: Any = x, w: Any = w) -> Any:
            return F.linear(x, w)

        burst = statistics.median(once_seconds(gemm) for _ in range(10))
        per_elem = statistics.median(once_seconds(lambda: dst[:2**28].copy_(src[:2**28]))
                                     for _ in range(5)) / 2**28
        points = [("copy", d, 1) for d in COPY_DUTIES]
        points += [("sleep", d, 1) for d in SLEEP_DUTIES]
        if (m, k, n) == DUTY_SHAPES[0]:
            points += [("copy", 0.5, b) for b in BLOCKS]
        for kind, duty, block in points:
            partner_s = burst * block * (1.0 - duty) / duty
            if duty >= 1.0:
                partner = None
            elif kind == "copy":
                count = min(src.numel(), max(1, int(partner_s / per_elem)))

                def partner(count: int = count) -> Any:
                    return dst[:count].copy_(src[:count])
            else:
                cycles = int(partner_s * 1.98e9)

                def partner(cycles: int = cycles) -> Any:
                    return torch.cuda._sleep(cycles)
            row = {"M": m, "K": k, "N": n, "partner": kind, "target_duty": duty,
                   **duty_point(gemm, partner, block, a.settle, a.timed, samples)}
            row["tflops"] = flops / row["gemm_s"] / 1e12
            rows.append(row)
            print(f"{m}x{k}x{n} {kind:5s} duty {row['duty']:.2f} block {block:2d}: "
                  f"{row['tflops']:5.0f} TFLOP/s, {row.get('sm_mhz', 0):.0f} MHz, "
                  f"{row.get('power_w', 0):.0f} W", flush=True)
        rows.append({"M": m, "K": k, "N": n, "partner": "none", "regime": "burst",
                     "gemm_s": burst, "tflops": flops / burst / 1e12})
    t0 = time.time()
    end = time.monotonic() + a.settle + a.timed
    while time.monotonic() < end:
        for _ in range(8):
            dst.copy_(src)
        torch.cuda.synchronize()
    rows.append({"partner": "copy", "regime": "copy held alone", "bytes": 4 * src.numel(),
                 "copy_s": once_seconds(lambda: dst.copy_(src)),
                 **samples.window(t0 + a.settle, time.time())})
    src = dst = None    # the buffers go before the idle reading
    torch.cuda.empty_cache()
    t0 = time.time()
    time.sleep(2.0)
    rows.append({"regime": "idle", **samples.window(t0 + 0.5, time.time())})
    return rows


def steps_part(a: argparse.Namespace, samples: Samples, start: float) -> dict[str, Any]:
    import measure_train_step as mts

    out: dict[str, Any] = {"runs": [], "skipped": [], "failed": []}
    for name in a.runs:
        if time.monotonic() - start > a.budget:
            out["skipped"].append(name)
            continue
        try:
            model, optimizer, run = mts.build(name, "cuda")
            mts.step_times(model, optimizer, run, "cuda", a.warmup, 1)
            t0 = time.time()
            run.update(mts.step_times(model, optimizer, run, "cuda", 0, a.steps))
            run["power"] = samples.window(t0, time.time())
            if name in a.profile:
                run["profile"] = mts.step_times(model, optimizer, run, "cuda", 0, 1,
                                                profiled=True)["profile"]
            out["runs"].append(run)
            print(f"{name:14s} step {run['step_s']:.4f} s, {run['power'].get('power_w', 0):.0f}"
                  f" W, {run['power'].get('sm_mhz', 0):.0f} MHz", flush=True)
        except Exception as err:  # noqa: BLE001 - one run's failure is recorded, not fatal
            out["failed"].append({"name": name, "error": f"{type(err).__name__}: {err}"})
            print(f"{name:14s} FAILED {type(err).__name__}: {err}", flush=True)
        model = optimizer = None
        mts.release()
    return out


def kinds_part(a: argparse.Namespace, samples: Samples) -> list[dict[str, Any]]:
    """Each kind of kernel a step runs, held back to back alone: its clock and power."""
    import torch
    import torch.nn.functional as F

    rows = []
    q, k, v = (torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    # Hugging Face's mask under torch.compile: SDPA gets the causal rectangle as a tensor.
    mask = torch.ones(4096, 4096, device="cuda", dtype=torch.bool).tril().expand(4, 1, -1, -1)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x32 = torch.randn(4, 4096, 2048, device="cuda")
    r32 = torch.randn(4, 4096, 1, device="cuda")
    big = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    w = {n: torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
         for n in (512, 2048, 128256)}
    x16 = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    x8 = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w8b = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    w[8192] = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    kinds = {
        "sdpa causal forward [4, 32, 4096, 64]":
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa causal backward [4, 32, 4096, 64]":
            lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
        "sdpa masked forward [4, 32, 4096, 64]":
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa masked backward [4, 32, 4096, 64]":
            lambda: torch.autograd.grad(masked, (q, k, v), grad, retain_graph=True),
        "fp32 mul by a broadcast [4, 4096, 1]": lambda: x32 * r32,
        "bf16 to fp32 cast [16384, 8192]": lambda: big.float(),
        "fp32 row mean of squares [4, 4096, 2048]": lambda: x32.pow(2).mean(-1),
        "gemm 16384x2048x512": lambda: F.linear(x16, w[512]),
        "gemm 16384x2048x2048": lambda: F.linear(x16, w[2048]),
        "gemm 16384x2048x128256": lambda: F.linear(x16, w[128256]),
        "gemm 16384x2048x8192": lambda: F.linear(x16, w[8192]),
        "gemm 8192x4096x14336": lambda: F.linear(x8, w8b),
    }
    if a.kinds:
        kinds = {k: v for k, v in kinds.items() if any(k.startswith(p) for p in a.kinds)}
    for name, fn in kinds.items():
        row = {"kind": name, **duty_point(fn, None, 1, a.settle, a.timed, samples)}
        row["s"] = row.pop("gemm_s")
        rows.append(row)
        print(f"{name:42s} {row['s'] * 1e6:8.1f} us, {row.get('sm_mhz', 0):.0f} MHz, "
              f"{row.get('power_w', 0):.0f} W", flush=True)
    return rows


def gaps_part(a: argparse.Namespace) -> list[dict[str, Any]]:
    """One profiled step of each run: every kernel by name (calls, total us), and the GPU's
    idle gaps between kernels (over 5 us): their total, and the longest with the kernels
    around them and their offset into the step."""
    import measure_train_step as mts
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = []
    for name in a.runs:
        model, optimizer, run = mts.build(name, "cuda")
        mts.step_times(model, optimizer, run, "cuda", a.warmup, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            mts.step_times(model, optimizer, run, "cuda", 0, 1)
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA
                         and not e.name.startswith("Optimizer."))
        by_name: dict[str, list[float]] = {}
        gaps = []
        reach, before = kernels[0][1], kernels[0][2]
        for start, end, kname in kernels:
            calls_us = by_name.setdefault(kname[:160], [0, 0.0])
            calls_us[0] += 1
            calls_us[1] += end - start
            if start - reach > 5.0:
                gaps.append((start - reach, start - kernels[0][0], before[:100], kname[:100]))
            if end > reach:
                reach, before = end, kname
        gaps.sort(reverse=True)
        out.append({"name": name, "kernels": len(kernels),
                    "span_us": kernels[-1][1] - kernels[0][0],
                    "idle_us": sum(g[0] for g in gaps), "gaps": len(gaps),
                    "longest": [{"us": round(g, 1), "at_us": round(t, 1), "after": b,
                                 "before": n} for g, t, b, n in gaps[:40]],
                    "by_name": sorted(([n, c, round(us, 1)] for n, (c, us) in by_name.items()),
                                      key=lambda x: -x[2])})
        print(f"{name:14s} {len(kernels)} kernels, span {out[-1]['span_us'] / 1e3:.1f} ms, "
              f"idle {out[-1]['idle_us'] / 1e3:.1f} ms in {len(gaps)} gaps", flush=True)
        model = optimizer = None
        mts.release()
    return out


def loops_part() -> list[dict[str, Any]]:
    """RoPE's rotate_half and the activations, each timed alone (median of 20 calls)."""
    import torch
    import torch.nn.functional as F

    rows = []

    def timed(name: str, fn: Any, nbytes: int, **shape: Any) -> None:
        fn()
        s = statistics.median(once_seconds(fn) for _ in range(20))
        rows.append({"op": name, "s": s, "bytes": nbytes, "tb_s": nbytes / s / 1e12, **shape})

    for b, h, s, d in [(4, 32, 4096, 64), (4, 8, 4096, 64), (2, 32, 4096, 128),
                       (2, 8, 4096, 128)]:
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        neg = -x2
        e = x.numel() * 2
        shape = {"shape": [b, h, s, d]}
        timed("neg of the strided half", lambda x2=x2: -x2, e, **shape)
        timed("cat((-x2, x1), -1)", lambda neg=neg, x1=x1: torch.cat((neg, x1), -1),
              2 * e, **shape)
        timed("rotate_half", lambda x1=x1, x2=x2: torch.cat((-x2, x1), -1), 3 * e, **shape)
        timed("contiguous copy of the view", lambda x=x: x.contiguous(), 2 * e, **shape)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(16384, 8192, device="cuda", dtype=dtype)
        g = torch.randn_like(x)
        e = x.numel() * x.element_size()
        shape = {"shape": [16384, 8192], "dtype": str(dtype)}
        timed("gelu tanh", lambda x=x: F.gelu(x, approximate="tanh"), 2 * e, **shape)
        timed("gelu erf", lambda x=x: F.gelu(x), 2 * e, **shape)
        timed("gelu tanh backward", lambda g=g, x=x: torch.ops.aten.gelu_backward(
            g, x, approximate="tanh"), 3 * e, **shape)
        timed("silu", lambda x=x: F.silu(x), 2 * e, **shape)
        timed("silu backward", lambda g=g, x=x: torch.ops.aten.silu_backward(g, x), 3 * e,
              **shape)
    return rows


def main() -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["loops", "duty", "steps"])
    ap.add_argument("--runs", nargs="+", default=STEP_RUNS)
    ap.add_argument("--kinds", nargs="*", default=[],
                    help="only the kinds whose names start with these (default: all)")
    ap.add_argument("--profile", nargs="*", default=["70b2l-plain"])
    ap.add_argument("--settle", type=float, default=2.5)
    ap.add_argument("--timed", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds after which the remaining step runs are skipped")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    start = time.monotonic()
    samples = Samples(a.out.with_suffix(".samples.csv"), a.sample_ms)
    result: dict[str, Any] = {"meta": {
        "measured": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "method": " ".join((__doc__ or "").split("\n\n")[1:3]), "settle_s": a.settle,
        "timed_s": a.timed, "sample_ms": a.sample_ms, "script": "tools/measure_step_power.py",
        "pid": os.getpid()}}
    try:
        for part in a.parts:
            if part == "loops":
                result["loops"] = loops_part()
            elif part == "gaps":
                result["gaps"] = gaps_part(a)
            elif part == "kinds":
                result["kinds"] = kinds_part(a, samples)
            elif part == "duty":
                result["duty"] = duty_part(a, samples)
            elif part == "steps":
                result["steps"] = steps_part(a, samples, start)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        samples.close()


if __name__ == "__main__":
    main()
