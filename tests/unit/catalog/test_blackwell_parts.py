"""The GB200 entry against what a real GB200 and B200 report of themselves.

Readings: ``nvidia-smi -q -x`` of 4 GB200 (AWS p6e-gb200.36xlarge, driver 580.173.02) and of
8 B200 (driver 580.105.08), NVIDIA/k8s-test-infra
``tests/e2e/go/assertions/nvidiasmi/testdata/hardware/qx-gb200.xml`` and ``qx-b200.xml``
(2026-08, PR #694); physical SM counts from flashinfer PR #4445 (B200 148, GB200 152).
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.power import sustained_matrix_flops

MIB = 2**20

# qx-gb200.xml fb_memory_usage: total 189,471 MiB, reserved 742 MiB.
GB200_FB_TOTAL_MIB, GB200_FB_RESERVED_MIB = 189_471, 742
# max_clocks sm_clock of each capture.
GB200_MAX_SM_MHZ, B200_MAX_SM_MHZ = 2062, 1965
# qx-gb200.xml / qx-b200.xml power_readings default_power_limit (= max_power_limit).
GB200_POWER_LIMIT_W, B200_POWER_LIMIT_W = 1200.0, 1000.0


def test_gb200_memory_is_what_cuda_can_fill_on_a_real_part() -> None:
    # CUDA's total device memory is nvidia-smi's FB total less the driver's reserve (on the
    # H100 80GB HBM3, 81,559 - 480 MiB against CUDA's 85,031,714,816 B: 14 MiB apart).
    gib = (GB200_FB_TOTAL_MIB - GB200_FB_RESERVED_MIB) * MIB / 2**30
    assert catalog.gpu("gb200").usable_memory_gib == pytest.approx(gib, abs=0.05)
    # ... and more than the marketed "186 GB" read as 186e9 bytes (173.2 GiB, the old value).
    assert catalog.gpu("gb200").usable_memory_gib > 186e9 / 2**30


def test_gb200_has_four_more_sms_than_the_hgx_b200() -> None:
    assert (catalog.gpu("b200").sm_count, catalog.gpu("gb200").sm_count) == (148, 152)


def test_gb200_power_limit_is_the_real_parts() -> None:
    assert catalog.gpu("gb200").tdp_w == GB200_POWER_LIMIT_W
    assert catalog.gpu("b200").tdp_w == B200_POWER_LIMIT_W


def test_gb200_gemm_rate_over_b200_is_sms_times_max_clock() -> None:
    # The sustained GEMM rate of a GB200 over a B200's: SMs x maximum SM clock of the real
    # parts (1.078), not the datasheet peaks' 2,500 / 2,250 = 1.111. To the 3 decimals the
    # catalogue writes the efficiency with.
    gb200, b200 = catalog.gpu("gb200"), catalog.gpu("b200")
    ratio = sustained_matrix_flops(gb200) / sustained_matrix_flops(b200)
    expected = (152 * GB200_MAX_SM_MHZ) / (148 * B200_MAX_SM_MHZ)
    assert ratio == pytest.approx(expected, rel=1e-3)
    assert ratio < gb200.peak_flops("bf16") / b200.peak_flops("bf16")


# PyTorch's torch.cuda.mem_get_info total on a B200 (driver 580.82.07): 182,631 MiB, beside
# nvidia-smi's 183,359 MiB FB total (environment notes of a torchtitan run on 8 B200; qx-b200.xml
# gives the same total with 728 MiB reserved).
B200_CUDA_TOTAL_MIB = 182_631


def test_b200_memory_is_what_cuda_reports_on_a_real_part() -> None:
    gib = B200_CUDA_TOTAL_MIB * MIB / 2**30
    assert catalog.gpu("b200").usable_memory_gib == pytest.approx(gib, abs=0.01)
    assert catalog.gpu("b200").usable_memory_gib > 180e9 / 2**30
