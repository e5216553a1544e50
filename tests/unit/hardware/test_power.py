"""Power caps (``cluster.gpu_power_w``) against the power laws of :mod:`sim.hardware.power`.

Independent truth: the measured line of a held GEMM's draw (700 W Hopper parts) and, for the
parts without one, ``P = P_static + (P_tdp - P_static) (f/f_tdp)^3``, each solved by hand for
the cap; and the invariants a clock-only cap must keep (HBM-bound kernels unchanged).
"""

from __future__ import annotations

import pytest
from conftest import make_scenario
from helpers import ONE_GPU_1B

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.power import PowerCapError, sustained_clock_ratio
from sim.scenario import ScenarioError


def _cm(cap: float | None) -> ComputeModel:
    return ComputeModel(catalog.gpu("h100-sxm", power_w=cap))


def test_at_tdp_nothing_changes() -> None:
    free, at_tdp = _cm(None), _cm(700.0)
    assert at_tdp.gemm_time(8192, 8192, 8192) == free.gemm_time(8192, 8192, 8192)
    assert at_tdp.attention_time(1, 32, 8192, 128) == free.attention_time(1, 32, 8192, 128)
    assert at_tdp.membound_time(1e9) == free.membound_time(1e9)


def test_500w_h100_gemm_rate_follows_the_measured_power_line() -> None:
    # By hand: a held GEMM draws 687.8 W at 1.5 GHz plus 614.7 W a GHz (the lent H200's duty
    # sweep): 700 W at 1.5198 GHz, 500 W at 1.1945 GHz; its rate goes as f^0.857.
    f_tdp, f_cap = 1.5 + (700 - 687.8) / 614.7, 1.5 + (500 - 687.8) / 614.7
    ratio = (f_cap / f_tdp) ** 0.857
    assert sustained_clock_ratio(catalog.gpu("h100-sxm"), 500) == pytest.approx(ratio)
    free, capped = _cm(None), _cm(500.0)
    # A large GEMM is all math: its time grows by 1/ratio (less the fixed launch term).
    m = 16384
    t0, t1 = free.gemm_time(m, m, m), capped.gemm_time(m, m, m)
    assert t1 / t0 == pytest.approx(1 / ratio, rel=0.01)
    assert capped.attention_time(1, 64, 16384, 128) > free.attention_time(1, 64, 16384, 128)


def test_300w_a100_gemm_rate_drops_by_the_cube_root_law() -> None:
    # By hand: A100 SXM TDP 400 W, static 60 W (catalogue) -> (240/340)^(1/3) = 0.8903.
    ratio = (240 / 340) ** (1 / 3)
    assert sustained_clock_ratio(catalog.gpu("a100-80gb"), 300) == pytest.approx(ratio)


def test_memory_bound_kernels_keep_their_rate_under_a_cap() -> None:
    free, capped = _cm(None), _cm(500.0)
    assert capped.membound_time(4e9) == free.membound_time(4e9)
    assert capped.adamw_time(1e9) == free.adamw_time(1e9)


def test_cap_below_the_parts_minimum_is_refused() -> None:
    with pytest.raises(PowerCapError):
        sustained_clock_ratio(catalog.gpu("h100-sxm"), 150)
    with pytest.raises(ScenarioError, match="gpu_power_w"):
        make_scenario({"name": "x", "model": "llama3-8b",
                       "cluster": {"gpu": "h100-sxm", "gpu_power_w": 100}})


def test_a_capped_scenario_runs_slower() -> None:
    from sim.api import simulate
    full = simulate(make_scenario(ONE_GPU_1B, name="cap")).summary["step_time_s"]
    capped = simulate(make_scenario(ONE_GPU_1B, name="cap",
                                    cluster__gpu_power_w=500)).summary["step_time_s"]
    # Slower, but by less than the GEMM factor: memory-bound kernels do not slow down.
    assert full < capped < full / sustained_clock_ratio(catalog.gpu("h100-sxm"), 500)


def test_h800_and_gb200_are_in_the_catalogue() -> None:
    # H800: the H100 SXM with NVLink cut to 400 GB/s (200 per direction); same math and HBM.
    h800, h100 = catalog.gpu("h800"), catalog.gpu("h100-sxm")
    assert h800.nvlink_gbytes_per_s == 200 and h800.peak_flops("bf16") == h100.peak_flops("bf16")
    assert h800.hbm_gbytes_per_s == h100.hbm_gbytes_per_s
    # GB200 NVL72 datasheet per GPU: 360 PFLOPS sparse BF16 / 72 / 2 = 2.5 PFLOPS dense; HBM
    # as CUDA reports it, a 992-byte bus at nvidia-smi's 3,996 MHz memory clock, double data
    # rate (7,928.1 GB/s in torchao's GB200 run), within 1% of the datasheet's 576 TB/s / 72.
    gb200 = catalog.gpu("gb200")
    assert gb200.peak_flops("bf16") == pytest.approx(360e15 / 72 / 2)
    assert gb200.hbm_gbytes_per_s == pytest.approx(992 * 3.996 * 2, abs=0.5)
    assert gb200.hbm_gbytes_per_s == pytest.approx(576e3 / 72, rel=0.01)
    sc = make_scenario({"name": "x", "model": "llama3-8b",
                        "cluster": {"gpu": "h800", "gpu_power_w": 600}})
    assert sc.cluster.gpu == "h800" and sc.cluster.gpu_power_w == 600


@pytest.mark.parametrize("n,tabulated", [(2, 0.5642), (3, 0.8463), (4, 1.0294), (5, 1.1630),
                                         (10, 1.5388), (100, 2.5076)])
def test_expected_largest_normal_matches_the_tables(n: int, tabulated: float) -> None:
    # Expected values of the largest of n standard normals as tabulated (Harter, "Expected
    # values of normal order statistics", Biometrika 48, 1961; n = 2 is 1/sqrt(pi)).
    from sim.hardware.power import expected_max_standard_normal
    assert expected_max_standard_normal(n) == pytest.approx(tabulated, abs=1e-4)


def test_the_slowest_of_eight_chips_is_the_measured_one() -> None:
    # The constant's own source: on a busy 8-GPU node the slowest H200 held 743.4 of a 755.5
    # mean, the slowest B200 1,417.2 of 1,437.5 (Bekman, ml-engineering benchmarks README).
    from sim.hardware.power import slowest_chip_ratio
    assert slowest_chip_ratio(catalog.gpu("h200", lockstep_gpus=8)) == pytest.approx(
        743.4 / 755.5, abs=5e-4)
    assert slowest_chip_ratio(catalog.gpu("b200", lockstep_gpus=8)) == pytest.approx(
        1417.2 / 1437.5, abs=5e-4)


def test_a_larger_job_waits_on_a_slower_chip_and_one_gpu_on_none() -> None:
    from sim.hardware.power import slowest_chip_ratio
    ratios = [slowest_chip_ratio(catalog.gpu("h100-sxm", lockstep_gpus=n))
              for n in (1, 8, 64, 1024, 16384)]
    assert ratios[0] == 1.0
    assert all(a > b for a, b in zip(ratios[:-1], ratios[1:], strict=True))
    # Unmeasured parts (A100) carry no spread: vTrain's A100 rows are priced as before.
    assert slowest_chip_ratio(catalog.gpu("a100-80gb", lockstep_gpus=512)) == 1.0
