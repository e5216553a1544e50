"""The B300 and GB300 entries against what real parts report of themselves.

Readings: ``nvidia-smi -q -x`` of 4 GB300 (driver 580.173.02), NVIDIA/k8s-test-infra
``tests/e2e/go/assertions/nvidiasmi/testdata/hardware/qx-gb300.xml`` (and ``qx-b200.xml`` for
the B200's clock); ``nvidia-smi`` on a DGX B300 (AWS p6-b300.48xlarge, driver 590.48.01,
QwenLM/FlashQLA PR #29); physical SM counts from flashinfer PR #4571 (B300 148, GB300 152);
the HGX B300's dense rates from its specification (G. Lockwood's table). Blackwell Ultra's
doubled exponential unit: NVIDIA's technical blog "Making Softmax More Efficient with NVIDIA
Blackwell Ultra" (2026-02).
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware import blackwell_attention as bw
from sim.hardware.power import burst_spec, sustained_matrix_flops

MIB = 2**20

# qx-gb300.xml fb_memory_usage: total 284,208 MiB, reserved 947 MiB.
GB300_FB_TOTAL_MIB, GB300_FB_RESERVED_MIB = 284_208, 947
# nvidia-smi's memory total on a B300 SXM6 AC (FlashQLA PR #29).
B300_FB_TOTAL_MIB = 275_040
# max_clocks sm_clock: qx-gb300.xml, qx-b200.xml.
GB300_MAX_SM_MHZ, B200_MAX_SM_MHZ = 2070, 1965
# Power limits: qx-gb300.xml default = max; the B300 capture's cap.
GB300_POWER_LIMIT_W, B300_POWER_LIMIT_W = 1400.0, 1100.0


def test_gb300_memory_is_what_cuda_can_fill_on_a_real_part() -> None:
    gib = (GB300_FB_TOTAL_MIB - GB300_FB_RESERVED_MIB) * MIB / 2**30
    assert catalog.gpu("gb300").usable_memory_gib == pytest.approx(gib, abs=0.05)


def test_b300_memory_is_its_total_less_the_gb300s_reserve() -> None:
    # The B300 capture gives the total only; the reserve is assumed the GB300's (the same
    # eight 12-high HBM3e stacks). Either way more than the B200 by the stacks' 1.5x.
    gib = (B300_FB_TOTAL_MIB - GB300_FB_RESERVED_MIB) * MIB / 2**30
    assert catalog.gpu("b300").usable_memory_gib == pytest.approx(gib, abs=0.05)
    ratio = catalog.gpu("b300").usable_memory_gib / catalog.gpu("b200").usable_memory_gib
    assert 1.45 < ratio < 1.55


def test_blackwell_ultra_sms_and_power_limits() -> None:
    assert (catalog.gpu("b300").sm_count, catalog.gpu("gb300").sm_count) == (148, 152)
    assert catalog.gpu("gb300").tdp_w == GB300_POWER_LIMIT_W
    assert catalog.gpu("b300").tdp_w == B300_POWER_LIMIT_W


def test_b300_dense_matrix_rates_are_the_b200s() -> None:
    # HGX B300: 72 PF FP8 and 36 PF BF16 with sparsity for 8 GPUs, as the HGX B200; FP64 cut
    # to 10 TF for the 8.
    b300, b200 = catalog.gpu("b300"), catalog.gpu("b200")
    for p in ("bf16", "fp8"):
        assert b300.peak_flops(p) == b200.peak_flops(p) == (72e15 if p == "fp8" else 36e15) / 16
    assert sustained_matrix_flops(b300) == pytest.approx(sustained_matrix_flops(b200))
    assert b300.peak_tflops["fp64"] == pytest.approx(10 / 8)


def test_gb300_gemm_rate_over_b200_is_sms_times_max_clock() -> None:
    gb300, b200 = catalog.gpu("gb300"), catalog.gpu("b200")
    ratio = sustained_matrix_flops(gb300) / sustained_matrix_flops(b200)
    expected = (152 * GB300_MAX_SM_MHZ) / (148 * B200_MAX_SM_MHZ)
    # To the 3 decimals the catalogue writes the efficiency with.
    assert ratio == pytest.approx(expected, rel=1.5e-3)


def test_blackwell_ultra_doubles_only_the_exponentials() -> None:
    # The unit model (FA-4's roofline): at head dim 128 the forward is bound by its MMAs
    # (1,024 cycles) on both parts and the backward by shared memory, so nothing moves; at
    # head dim 64 the B200's forward is exponential-bound (845 cycles with FA-4's emulated
    # share against 512 of MMA) and Blackwell Ultra's doubled MUFU makes it MMA-bound:
    # 845 / 512 = 1.65x faster per SM cycle.
    b200, b300 = burst_spec(catalog.gpu("b200")), burst_spec(catalog.gpu("b300"))
    assert (b200.sfu_exp_per_clock_sm, b300.sfu_exp_per_clock_sm) == (16, 32)
    for p in ("fwd", "bwd"):
        assert bw.score_seconds(b300, p, 128) == pytest.approx(bw.score_seconds(b200, p, 128))
    gain = bw.score_seconds(b200, "fwd", 64) / bw.score_seconds(b300, "fwd", 64)
    emulated = 1 - bw.FA4_EMULATED_EXP_SHARE
    assert gain == pytest.approx(128 * 128 * emulated / 16 / 512, rel=1e-9)
    assert 1.6 < gain < 1.7
