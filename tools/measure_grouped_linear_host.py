"""Measure the host (CPU) time a grouped expert GEMM costs per local expert, beside its GPU time.

The published MoE runs that the simulator finds most optimistic hold many local experts (the
model zoo's Qwen3-235B at TP4 EP8, 16 a GPU: +60%; docs/calibration.md, "Re-simulated
2026-12-02, sixth session"), and the host time of Transformer Engine's ``GroupedLinear`` per
expert is priced from counts and unmeasured unit costs (``sim/workload/moe_host_ops.py``:
C++ objects and cuBLASLt calls at ``CPP_LAUNCH_CPU_S``). This script measures it on the machine
it runs on, for issue 11:

* ``te``: ``transformer_engine.pytorch.GroupedLinear`` (TE's multi-stream cuBLASLt path), when
  Transformer Engine is installed;
* ``loop``: a Python loop of ``torch.nn.functional.linear`` over ``torch.split`` (always);
* with ``--linear``, one dense linear as TE issue #2053 timed it (``te_linear``:
  ``transformer_engine.pytorch.Linear``; ``torch_linear``: ``torch.nn.Linear``), the unit
  ``sim/hardware/host.py`` prices a Transformer Engine module call in
  (``te_module_call_cpu_s``: measured on GB200 only, derived for x86 hosts).

Host time is the wall time the Python call takes to enqueue its work while the GPU is kept busy
by a long ``torch.cuda._sleep`` kernel queued first, so the call never waits for the GPU (the
regime of a training step whose host runs ahead). GPU time is CUDA events around the same call
with nothing queued before it. Forward and backward separately; experts x rows per expert x
(hidden, output) as given. Needs a CUDA GPU and PyTorch; nothing in the package imports it.
Writes one JSON file (``--out``).

Example::

    python tools/measure_grouped_linear_host.py --experts 1 2 4 8 16 32 --rows 512 2048 \
        --shape 4096 3072 --shape 1536 4096 --out h200-grouped-linear-host.json
    python tools/measure_grouped_linear_host.py --linear --rows 8192 --shape 2048 2048 \
        --out h100-te-linear-host.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

SLEEP_CYCLES = 200_000_000   # about 0.1 s of GPU time at ~2 GHz: longer than any enqueue here


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") or line.startswith("CPU part"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build(kind: str, experts: int, rows: int, k: int, n: int):  # noqa: ANN201 - torch closure
    """The call under test: one forward of the module (or loop) on its input and splits."""
    import torch

    x = torch.randn(experts * rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = [rows] * experts
    if kind == "te":
        import transformer_engine.pytorch as te

        layer = te.GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16)
        return lambda: layer(x, splits)
    if kind in ("te_linear", "torch_linear"):
        if kind == "te_linear":
            import transformer_engine.pytorch as te

            dense = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16)
        else:
            dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        return lambda: dense(x)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(experts)]

    def loop():  # noqa: ANN202
        parts = torch.split(x, splits)
        return torch.cat([torch.nn.functional.linear(p, w) for p, w in zip(parts, weights,
                                                                            strict=True)])
    return loop


def host_seconds(call, reps: int) -> tuple[float, float]:  # noqa: ANN001
    """Median enqueue time of the forward and of the backward with the GPU kept busy."""
    import torch

    fwd, bwd = [], []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        y = call()
        t1 = time.perf_counter()
        grad = torch.ones_like(y)
        torch.cuda._sleep(SLEEP_CYCLES)
        t2 = time.perf_counter()
        y.backward(grad)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd)


def gpu_seconds(call, reps: int) -> tuple[float, float]:  # noqa: ANN001
    """Median GPU time (CUDA events) of the forward and of the backward."""
    import torch

    fwd, bwd = [], []
    for _ in range(reps):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        e[0].record()
        y = call()
        e[1].record()
        grad = torch.ones_like(y)
        e[2].record()
        y.backward(grad)
        e[3].record()
        torch.cuda.synchronize()
        fwd.append(e[0].elapsed_time(e[1]) / 1e3)
        bwd.append(e[2].elapsed_time(e[3]) / 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def measure(kind: str, experts: int, rows: int, k: int, n: int, reps: int) -> dict[str, Any]:
    call = build(kind, experts, rows, k, n)
    import torch

    for _ in range(3):                     # warm-up: cuBLASLt heuristics, allocator, TE caches
        call().sum().backward()

    torch.cuda.synchronize()
    h_f, h_b = host_seconds(call, reps)
    g_f, g_b = gpu_seconds(call, reps)
    return {"kind": kind, "experts": experts, "rows_per_expert": rows, "k": k, "n": n,
            "host_fwd_s": h_f, "host_bwd_s": h_b, "gpu_fwd_s": g_f, "gpu_bwd_s": g_b,
            "host_fwd_s_per_expert": h_f / experts, "host_bwd_s_per_expert": h_b / experts}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--shape", type=int, nargs=2, action="append", metavar=("K", "N"),
                    help="input and output features (repeatable); default 4096 3072")
    ap.add_argument("--linear", action="store_true",
                    help="time one dense te.Linear and torch.nn.Linear instead (experts 1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    shapes = a.shape or [[4096, 3072]]
    kinds = ["torch_linear"] if a.linear else ["loop"]
    experts = [1] if a.linear else a.experts
    te_version = None
    try:
        import transformer_engine

        te_version = getattr(transformer_engine, "__version__", "unknown")
        kinds.insert(0, "te_linear" if a.linear else "te")
    except ImportError:
        pass
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        for k, n in shapes:
            for r in a.rows:
                for e in experts:
                    rows.append(measure(kind, e, r, k, n, a.reps))
                    print(json.dumps(rows[-1]), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformer_engine": te_version, "cpu": cpu_model(),
            "measured": time.strftime("%Y-%m-%d"), "method": __doc__.split("\n\n")[1]}
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
