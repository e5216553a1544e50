"""RMSNorm kernels as NVIDIA measured them (sim/catalog/reference/cudnn_norms.yaml:
cudnn-frontend's norm benchmark on a GB200 and an H200) against the memory-bound pricing of
a fused norm (``norm_fused``, :meth:`sim.hardware.compute.ComputeModel.membound_time`),
the kernels the simulator prices for PyTorch's fused ``F.rms_norm`` (one forward kernel; an
input-gradient and a weight-gradient kernel backward: ``sim/workload/layer_builder.py``).
Nothing here was fitted; the gap at per-head widths is a strict xfail. (cuDNN's own norm
kernels, in the same file, stream 1.3-1.5x faster forward than this pricing and about 2x
backward, one fused kernel for both gradients; Transformer Engine's norms, which Megatron
runs, were not measured there.)"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import yaml

from sim import catalog
from sim.catalog import CATALOG_DIR
from sim.hardware.compute import ComputeModel
from sim.hardware.power import burst_spec
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Kernel, Tensor


def _rows() -> list[dict[str, Any]]:
    with open(CATALOG_DIR / "reference" / "cudnn_norms.yaml") as fh:
        ref = yaml.safe_load(fh)
    return [dict(zip(ref["columns"], r, strict=True)) for r in ref["rows"]]


ROWS = _rows()


def _model_ms(gpu: str, rows: int, hidden: int) -> tuple[float, float]:
    """(forward, backward) ms of torch's fused RMSNorm as the simulator prices it."""
    cm = ComputeModel(burst_spec(catalog.gpu(gpu)))
    n = float(rows) * hidden
    x, y, gy, gx = (Tensor(name, 2.0 * n) for name in ("x", "y", "gy", "gx"))
    rstd, gw = Tensor("rstd", 4.0 * rows), Tensor("gw", 2.0 * hidden)
    fwd = kernel_time(cm, Kernel("norm.fused", "norm_fused", (x,), (y, rstd)))
    bwd = (kernel_time(cm, Kernel("norm.bwd_input", "norm_fused", (gy, x, rstd), (gx,)))
           + kernel_time(cm, Kernel("norm.bwd_weight", "norm_fused", (gy, x, rstd), (gw,))))
    return fwd * 1e3, bwd * 1e3


def _ratios(gpu: str, pass_index: int, wide: bool) -> list[float]:
    out = []
    for r in ROWS:
        if r["gpu"] != gpu or r["backend"] != "pytorch" or (r["hidden"] >= 2048) != wide:
            continue
        model = _model_ms(gpu, r["rows"], r["hidden"])[pass_index]
        out.append(model / (r["fwd_ms"] if pass_index == 0 else r["bwd_ms"]))
    return out


@pytest.mark.parametrize("gpu", ["gb200", "h200"])
@pytest.mark.parametrize("pass_index,mean_tol", [(0, 0.15), (1, 0.20)])
def test_torch_rms_norm_at_hidden_widths(gpu: str, pass_index: int, mean_tol: float) -> None:
    # Hidden sizes 2,048-16,384, 2k-16k rows: model over measured 0.89-1.28 forward and
    # 0.77-1.18 backward (the GB200's backward the fastest side, 0.77-0.88).
    ratios = _ratios(gpu, pass_index, wide=True)
    assert len(ratios) >= 8
    assert all(0.75 < x < 1.3 for x in ratios)
    assert abs(statistics.mean(ratios) - 1.0) < mean_tol


@pytest.mark.xfail(strict=True, reason="torch's F.rms_norm over 8-16k rows of 128 runs 2-7x "
                   "slower than its bytes (a per-row cost the bandwidth pricing lacks); the "
                   "simulator prices torchtitan's per-head query/key norms so")
@pytest.mark.parametrize("gpu", ["gb200", "h200"])
def test_torch_rms_norm_at_the_per_head_width(gpu: str) -> None:
    assert all(0.75 < x < 1.3 for x in _ratios(gpu, 0, wide=False) + _ratios(gpu, 1, wide=False))
