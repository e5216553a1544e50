"""torchtitan's expert GEMMs (``torch._grouped_mm``, bf16) on an H100 against torchao's timing,
and who runs it.

Truth: ``sim/catalog/reference/torchao_grouped_mm_h100.yaml`` (pytorch/ao PR 2490, an H100's
forward over 16 groups of row offsets the benchmark printed). ``TORCH_GROUPED_MM_SLOWDOWN
["hopper"]`` is fitted on its first row (``tools/fit_torch_grouped_mm.py``); the second row
checks it. Only torchtitan's ``GroupedExperts`` call ``torch._grouped_mm``: Megatron's
Transformer Engine GroupedLinear and NeMo AutoModel's ``grouped_gemm`` keep cuBLAS's price.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.power import burst_spec
from sim.workload.block_pricing import kernel_time
from sim.workload.grouped_gemm import TORCH_GROUPED_MM_SLOWDOWN, grouped_gemm_time
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

ROWS = yaml.safe_load((Path(catalog.__file__).parent / "reference"
                       / "torchao_grouped_mm_h100.yaml").read_text())["rows"]


def _priced_s(r: dict) -> float:
    cm = ComputeModel(burst_spec(catalog.gpu("h100-sxm")), precision="bf16")
    offs = r["offs"]
    rows = [b - a for a, b in zip([0, *offs[:-1]], offs, strict=True)]
    assert sum(rows) == r["m"] and all(x % 16 == 0 for x in rows)
    return grouped_gemm_time(cm, rows, r["k"], r["n"], "fwd") * TORCH_GROUPED_MM_SLOWDOWN["hopper"]


@pytest.mark.parametrize("row", ROWS, ids=["fit-k5120", "check-k8192"])
def test_h100_forward_against_torchao(row: dict) -> None:
    # 2 x 8,192 x 5,120 x 8,192 = 687 GFLOP in 1.31 ms: 525 TFLOP/s, 53% of the H100's peak.
    assert _priced_s(row) == pytest.approx(row["seconds"], rel=0.05)


def test_only_torchtitans_experts_pay_it() -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    cm = ComputeModel(catalog.gpu("h100-sxm"), precision="bf16")
    times = {}
    for torch_mm in (False, True):
        ops = moe_layer_ops(m, MoELayout(ep=8, torch_grouped_mm=torch_mm), 8192)
        experts = next(b for b in ops.blocks if b.name == "moe_experts")
        gemms = [k for k in experts.forward + experts.backward if k.klass == "gemm"]
        assert gemms and all(k.grouped_impl == ("torch" if torch_mm else "cublas")
                             for k in gemms)
        times[torch_mm] = sum(kernel_time(cm, k) for k in gemms)
    assert times[True] == pytest.approx(times[False] * 1.23, rel=1e-9)
