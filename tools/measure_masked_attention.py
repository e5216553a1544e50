"""Measure PyTorch SDPA with an explicit causal mask against ``is_causal`` (issue 11, item 6).

Hugging Face transformers skips the causal mask and calls SDPA with ``is_causal=True`` only
when it is not being traced (``masking_utils._ignore_causal_mask_sdpa``: ``is_tracing``
returns False under ``torch.compile``), so a whole model compiled with ``torch.compile``
passes a boolean ``[batch, 1, seq, seq]`` mask to every layer's SDPA, and ``repeat_kv`` expands
grouped keys and values to every query head first (``use_gqa_in_sdpa`` needs no mask). This
script times, on the GPU it runs on, each way SDPA is then called:

* ``causal_gqa``: ``is_causal=True, enable_gqa=True`` on the grouped keys (HF eager);
* ``causal``: ``is_causal=True`` on keys repeated to every head;
* ``full``: no mask at all (the whole score rectangle);
* ``bool_mask``: the causal mask as a boolean tensor (HF under ``torch.compile``);
* ``float_mask``: the same mask as an additive bf16 tensor;

forward and backward apart (CUDA events, median of ``--reps``), and which kernels ran (one
call under ``torch.profiler``). Needs PyTorch and a CUDA GPU (``--device cpu`` only checks the
script); nothing in the package imports it. Writes one JSON file.

Example::

    python tools/measure_masked_attention.py --out h200-masked-attention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_timing import once_seconds

VARIANTS = ("causal_gqa", "causal", "full", "bool_mask", "float_mask")


def timed(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    return statistics.median(once_seconds(fn, device) for _ in range(reps))


def kernels_of(fn: Callable[[], Any], device: str) -> list[str]:
    """The names of the GPU kernels one call of ``fn`` launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:120] for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def measure(variant: str, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
            device: str, reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    bf16 = torch.bfloat16
    groups = 1 if variant == "causal_gqa" else heads // kv_heads
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads * groups, seq, head_dim, device=device, dtype=bf16,
                        requires_grad=True) for _ in range(2))
    kwargs: dict[str, Any] = {}
    if variant in ("causal", "causal_gqa"):
        kwargs["is_causal"] = True
    if variant == "causal_gqa":
        kwargs["enable_gqa"] = True
    if variant in ("bool_mask", "float_mask"):
        keep = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
        mask = keep[None, None].expand(batch, 1, seq, seq)
        if variant == "float_mask":
            mask = torch.zeros(batch, 1, seq, seq, device=device, dtype=bf16).masked_fill(
                ~mask, torch.finfo(bf16).min)
        kwargs["attn_mask"] = mask

    def fwd() -> Any:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=bf16)
    state: dict[str, Any] = {}

    def prepare_bwd() -> None:
        state["out"] = fwd()

    def bwd() -> None:
        state["out"].backward(grad)

    fwd_s = timed(fwd, device, reps)
    bwd_times = []
    for _ in range(reps):                  # a fresh graph each time, only backward timed
        prepare_bwd()
        bwd_times.append(once_seconds(bwd, device))
        q.grad = k.grad = v.grad = None
    names = kernels_of(lambda: fwd().backward(grad), device)
    return {"variant": variant, "batch": batch, "seq": seq, "heads": heads,
            "kv_heads": kv_heads * groups, "head_dim": head_dim, "fwd_s": fwd_s,
            "bwd_s": statistics.median(bwd_times[2:] or bwd_times), "kernels": names}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seq of every call")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    for head_dim in a.head_dims:
        for seq in a.seqs:
            for variant in VARIANTS:
                row = measure(variant, max(1, a.tokens // seq), seq, a.heads, a.kv_heads,
                              head_dim, a.device, a.reps)
                rows.append(row)
                print(f"hd {head_dim:3d} seq {seq:5d} {variant:10s} fwd {row['fwd_s'] * 1e3:7.3f}"
                      f" ms bwd {row['bwd_s'] * 1e3:7.3f} ms", flush=True)
    meta = {"measured": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
            "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None,
            "method": " ".join((__doc__ or "").split("\n\n")[1:3]), "script":
            "tools/measure_masked_attention.py"}
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
