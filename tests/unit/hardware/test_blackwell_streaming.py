"""Memory-bound kernels on Blackwell: streaming capped by the bytes each SM keeps in flight.

Truth: torchao's published cast-kernel timings on a B200 and an H100
(``sim/catalog/reference/torchao_cast_kernels.yaml``, pytorch/ao READMEs, BSD-3-Clause). The
cap :data:`sim.hardware.memory_bound.STREAM_BYTES_PER_SM_S` is derived from them here, step by
step; it is checked on other data (Transformer Engine's B300 quantization table,
``tests/unit/workload/test_te_gemm_profiling.py``) and against the published runs
(docs/calibration.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.kernel_fit import h200_fit as _fit
from sim.hardware.memory_bound import STREAM_BYTES_PER_SM_S

REF = yaml.safe_load((Path(catalog.__file__).parent / "reference"
                      / "torchao_cast_kernels.yaml").read_text())
# MXFP8 cast: bf16 read, e4m3 written, one e8m0 scale a 32-element block.
MXFP8_CAST_BYTES_PER_ELEMENT = 2 + 1 + 1 / 32


def _b200_rates() -> list[float]:
    return [math.prod(k["shape"]) * MXFP8_CAST_BYTES_PER_ELEMENT / (k["time_us"] * 1e-6)
            for k in REF["b200"]["kernels"]]


def test_byte_count_reproduces_the_printed_efficiency() -> None:
    # The README prints each kernel's rate against torchao's roofline of the time (7.36 TB/s);
    # the byte count above gives it back to the printed tenth of a point.
    roof = REF["b200"]["hbm_bytes_per_s_roofline"]
    for k, rate in zip(REF["b200"]["kernels"], _b200_rates(), strict=True):
        assert 100 * rate / roof == pytest.approx(k["efficiency_pct"], abs=0.06)


def test_cap_is_the_measured_ratio_applied_to_the_h200_add() -> None:
    b200, h100, h200 = catalog.gpu("b200"), catalog.gpu("h100-sxm"), catalog.gpu("h200")
    blackwell = sum(_b200_rates()) / len(_b200_rates()) / b200.hbm_bytes_per_s
    hopper = (sum(k["gbps"] for k in REF["h100"]["kernels"]) * 1e9 / len(REF["h100"]["kernels"])
              / h100.hbm_bytes_per_s)
    assert blackwell == pytest.approx(0.724, abs=0.001)
    assert hopper == pytest.approx(0.843, abs=0.001)
    # The H200's in-place add, the simulator's elementwise rate, as a share of its HBM.
    add_share = _fit()["membound"]["add_"]["bytes_per_s"] / h200.hbm_bytes_per_s
    per_sm = add_share * (blackwell / hopper) * b200.hbm_bytes_per_s / b200.sm_count
    assert STREAM_BYTES_PER_SM_S == pytest.approx(per_sm, rel=0.005)


@pytest.mark.parametrize("gpu", ["v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h800",
                                 "h100-hbm2e-96gb", "h200"])
def test_cap_leaves_earlier_generations_alone(gpu: str) -> None:
    # Their bandwidth per SM is below what one SM streams: every memory-bound kernel keeps
    # the H200-measured share of HBM (the fit's own GPU exactly).
    cm = ComputeModel(catalog.gpu(gpu))
    scale = cm.gpu.hbm_gbytes_per_s / _fit()["hbm_gbytes_per_s"]
    for klass, key in (("elementwise", "add_"), ("reduction", "rms_norm")):
        assert cm.stream_bytes_per_s(klass) == pytest.approx(  # type: ignore[arg-type]
            _fit()["membound"][key]["bytes_per_s"] * scale, rel=1e-12)


@pytest.mark.parametrize("gpu", ["b200", "gb200"])
def test_blackwell_streams_below_its_hbm_share(gpu: str) -> None:
    cm = ComputeModel(catalog.gpu(gpu))
    rate = cm.stream_bytes_per_s()
    assert rate == pytest.approx(STREAM_BYTES_PER_SM_S * cm.gpu.sm_count)
    # 72-76% of the part's HBM where the H200 streams 89% of its own.
    assert 0.72 < rate / cm.gpu.hbm_bytes_per_s < 0.77
    # Row reductions (fewer loads in flight) stay under the cap: HBM-scaled as before.
    assert cm.stream_bytes_per_s("reduction") < rate
    # A large memory-bound kernel takes its bytes over that rate (plus the launch floor).
    nbytes = 2.848e9
    assert cm.membound_time(nbytes) == pytest.approx(cm.kernel_min_s + nbytes / rate)
