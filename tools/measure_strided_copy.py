"""Measure PyTorch's copies of transposed views against a contiguous clone (issue 11, issue 14).

The simulator prices ``.contiguous()`` of a non-contiguous view as latency-bound (one load a
thread in flight, ``ComputeModel.strided_copy_time``; the latency from MLX's B200 benchmark,
not from PyTorch). This script times, on the GPU it runs on, at the shapes Megatron-Core 0.14's
drop-and-pad dispatcher copies (``transpose(0, 1).contiguous()`` of ``[ep, local experts,
capacity, hidden]``, token_dispatcher.py) and in fp32 for the element-size dependence:

* ``clone``: a contiguous copy of the same bytes (the vectorised loop);
* ``transpose``: the dispatcher's copy;
* ``gqa_query``: the query reshape after Megatron's ``SplitAlongDim`` (Qwen3-30B's GQA: four
  groups of 8 query heads, 2 key and value heads a group), not priced yet.

Needs a CUDA GPU and PyTorch; nothing in the package imports it. Writes one JSON file.

Example::

    python tools/measure_strided_copy.py --out h200-strided-copy.json
"""
from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable


def _time_us(fn: Callable[[], object], repeats: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def measure(ep: int, experts: int, capacity: int, hidden: int) -> list[dict[str, object]]:
    import torch

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(ep * experts * capacity, hidden, device="cuda", dtype=dtype)
        view = x.view(ep, experts, capacity, hidden)
        moved = 2 * x.numel() * x.element_size()
        fns: tuple[tuple[str, Callable[[], object]], ...] = (
            ("clone", x.clone), ("transpose", view.transpose(0, 1).contiguous))
        for name, fn in fns:
            us = _time_us(fn)
            rows.append({"kernel": name, "dtype": str(dtype), "shape": list(view.shape),
                         "us": us, "bytes_moved": moved, "gbps": moved / us / 1e3})
    qkv = torch.randn(4096, 1, 4, 1280, device="cuda", dtype=torch.bfloat16)
    query = qkv[..., :1024]
    us = _time_us(lambda: query.reshape(4096, 1, 32, 128))
    moved = 2 * query.numel() * 2
    rows.append({"kernel": "gqa_query", "dtype": "torch.bfloat16", "shape": [4096, 1, 32, 128],
                 "us": us, "bytes_moved": moved, "gbps": moved / us / 1e3})
    return rows


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16, help="local experts")
    ap.add_argument("--capacity", type=int, default=256, help="rows an expert and source rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = measure(a.ep, a.experts, a.capacity, a.hidden)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "machine": platform.node(),
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['kernel']:10s} {r['dtype']:15s} {r['us']:9.1f} us {r['gbps']:8.0f} GB/s")


if __name__ == "__main__":
    main()
