"""Measure what a training node adds to a framework op's host cost over the isolated loop.

The simulator prices an x86 host's op issue from isolated figures (TE issue #2053: one process
timing ``torch.nn.Linear``'s forward in a loop, 13.48 us on a DGX H100,
``X86_TORCH_LINEAR_CALL_CPU_S``) times ``X86_TRAINING_HOST_FACTOR``, 1.5, a factor **fitted**
on published MoE runs (docs/calibration.md, fifty-eighth session). This script measures, on the
machine it runs on, the two things the factor is thought to stand for, so that it can be
checked against a measurement instead of the rows it was fitted on:

* ``isolated``: one process, one module called in a loop on the same input (TE #2053's setup);
* ``walk``: one process, a chain of ``--layers`` distinct modules, each forward feeding the
  next, then one backward through the chain: a model's modules walked in order, every module's
  Python objects, autograd nodes and weights passing through the caches once a step;
* ``loaded``: ``--processes`` processes walking their own chains at once (a node's ranks, on
  the GPUs round-robin), beside ``--spinners`` busy processes (NCCL's proxy threads and the
  data loaders: cores kept busy, the package's turbo shared; processes, not Python threads,
  so that they hold no interpreter lock of the ranks').

Host time is the wall time a call takes to enqueue its work while the GPU is kept busy by a
long ``torch.cuda._sleep`` kernel queued first (as ``tools/measure_grouped_linear_host.py``),
so no call waits for the GPU: per op, the forward chain's enqueue time over its modules, and
the backward's over its modules. The ratios ``walk`` / ``isolated`` and ``loaded`` /
``isolated`` are the measured counterparts of the fitted factor. Needs PyTorch; a CUDA GPU for
meaningful figures (``--device cpu`` runs the same harness on the CPU, where the forward
computes before it returns, to check the script, not the host). Nothing in the package imports
it. Writes one JSON file (``--out``).

Example (one DGX H100 node: eight ranks, eight spinners)::

    python tools/measure_loaded_host.py --processes 8 --spinners 8 \
        --out h100-loaded-host.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

# The script's own folder is on sys.path when it runs (python tools/measure_loaded_host.py).
from measure_grouped_linear_host import cpu_model

SLEEP_CYCLES = 400_000_000   # about 0.2 s of GPU time at ~2 GHz: longer than a chain's enqueue


def _busy_gpu(device: str) -> None:
    """Queue a long kernel first so that what follows is enqueued, never waited on."""
    import torch

    if device != "cpu":
        torch.cuda._sleep(SLEEP_CYCLES)


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def isolated(device: str, rows: int, hidden: int, reps: int) -> dict[str, float]:
    """Median host seconds of one module's forward and backward, called again and again."""
    import torch

    dense = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):                       # warm-up: cuBLAS heuristics, the allocator
        dense(x).sum().backward()
    _sync(device)
    fwd, bwd = [], []
    for _ in range(reps):
        _busy_gpu(device)
        t0 = time.perf_counter()
        y = dense(x)
        t1 = time.perf_counter()
        grad = torch.ones_like(y)
        t2 = time.perf_counter()
        y.backward(grad)
        t3 = time.perf_counter()
        _sync(device)
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
    return {"fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd)}


def walk(device: str, rows: int, hidden: int, layers: int, reps: int) -> dict[str, float]:
    """Median host seconds per module of a chain of ``layers`` distinct modules' forward,
    then of its backward."""
    import torch

    chain = [torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=torch.bfloat16)
             for _ in range(layers)]
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def forward() -> Any:
        y = x
        for m in chain:
            y = m(y)
        return y

    for _ in range(2):
        forward().sum().backward()
    _sync(device)
    fwd, bwd = [], []
    for _ in range(reps):
        _busy_gpu(device)
        t0 = time.perf_counter()
        y = forward()
        t1 = time.perf_counter()
        grad = torch.ones_like(y)
        _sync(device)
        _busy_gpu(device)
        t2 = time.perf_counter()
        y.backward(grad)
        t3 = time.perf_counter()
        _sync(device)
        fwd.append((t1 - t0) / layers)
        bwd.append((t3 - t2) / layers)
    return {"fwd_s": statistics.median(fwd), "bwd_s": statistics.median(bwd)}


def _rank(index: int, args: dict[str, Any], barrier: Any, out: Any) -> None:
    """One rank of the loaded setting: its own device (round-robin) and chain."""
    import torch

    device = args["device"]
    if device != "cpu":
        device = f"cuda:{index % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    barrier.wait()
    out.put((index, walk(device, args["rows"], args["hidden"], args["layers"], args["reps"])))


def _spin(stop: Any) -> None:
    """A core kept busy until told to stop (no interpreter lock shared with any rank)."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def loaded(args: dict[str, Any], processes: int, spinners: int) -> dict[str, Any]:
    """The ``walk`` of ``processes`` ranks at once beside ``spinners`` busy processes: the
    ranks' per-op medians and their median."""
    ctx = mp.get_context("spawn")
    barrier, out, stop = ctx.Barrier(processes), ctx.Queue(), ctx.Event()
    spin = [ctx.Process(target=_spin, args=(stop,)) for _ in range(spinners)]
    ranks = [ctx.Process(target=_rank, args=(i, args, barrier, out)) for i in range(processes)]
    for p in spin + ranks:
        p.start()
    results = dict(out.get() for _ in ranks)
    for p in ranks:
        p.join()
    stop.set()
    for p in spin:
        p.join()
    per_rank = [results[i] for i in range(processes)]
    return {"processes": processes, "spinners": spinners, "per_rank": per_rank,
            "fwd_s": statistics.median(r["fwd_s"] for r in per_rank),
            "bwd_s": statistics.median(r["bwd_s"] for r in per_rank)}


def ratios(base: dict[str, float], other: dict[str, Any]) -> dict[str, float]:
    """Per-op host seconds of ``other`` over ``base``, forward and backward."""
    return {"fwd": other["fwd_s"] / base["fwd_s"], "bwd": other["bwd_s"] / base["bwd_s"]}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192, help="tokens (TE #2053: 8,192)")
    ap.add_argument("--hidden", type=int, default=2048, help="features in and out (2,048)")
    ap.add_argument("--layers", type=int, default=128,
                    help="distinct modules a walk passes (its backward's kernels stay under "
                         "CUDA's ~1,024 pending launches)")
    ap.add_argument("--processes", type=int, default=8, help="ranks of the loaded setting")
    ap.add_argument("--spinners", type=int, default=8, help="busy processes beside them")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    common = {"device": a.device, "rows": a.rows, "hidden": a.hidden, "layers": a.layers,
              "reps": a.reps}
    device = "cuda:0" if a.device == "cuda" else "cpu"
    iso = isolated(device, a.rows, a.hidden, a.reps)
    print("isolated", json.dumps(iso), flush=True)
    alone = walk(device, a.rows, a.hidden, a.layers, a.reps)
    print("walk", json.dumps(alone), flush=True)
    busy = loaded(common, a.processes, a.spinners)
    print("loaded", json.dumps({k: busy[k] for k in ("fwd_s", "bwd_s")}), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "none (cpu)",
            "gpus": torch.cuda.device_count() if a.device == "cuda" else 0,
            "torch": torch.__version__, "cpu": cpu_model(), "cores": os.cpu_count(),
            "measured": time.strftime("%Y-%m-%d"), "settings": common,
            "method": __doc__.split("\n\n")[1]}
    a.out.write_text(json.dumps({
        "meta": meta, "isolated": iso, "walk": alone, "loaded": busy,
        "walk_over_isolated": ratios(iso, alone), "loaded_over_isolated": ratios(iso, busy),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
