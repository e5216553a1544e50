"""One timed call on the GPU (CUDA events) or the host (wall clock): shared by the
``tools/measure_*.py`` scripts, which import it as a sibling module."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def once_seconds(fn: Callable[[], Any], device: str = "cuda") -> float:
    """Seconds one call of ``fn`` takes: CUDA events around it on a GPU (the kernels it
    queues, waited for), the wall clock elsewhere."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import torch

    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
