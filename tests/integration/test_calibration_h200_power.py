"""The step's SM clock under the power limit against the lent H200's readings (issue 11).

``sim/catalog/calibration/h200-step-power.json`` (``tools/measure_step_power.py``, one
machine): a GEMM alternating with a copy or an idle spin at set duties, each kind of kernel
held alone, and whole training steps with NVML's mean SM clock over them;
``h200-step-power-b.json`` the kinds and eight more steps on a second machine. The constants of
:mod:`sim.hardware.power` are fitted on the copy-partner sweep and the kinds held alone
(``test_power_constants_are_the_fit_of_the_sweep`` recomputes them); the idle-partner points
and the whole steps were not used, and check them here.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import pytest
from test_calibration_h200_steps import scenario_of

from sim import catalog
from sim.frameworks.common.base import JobContext
from sim.frameworks.registry import build_program
from sim.hardware import power
from sim.hardware.compute import ComputeModel
from sim.scenario import Scenario

DATA = catalog.calibration("h200-step-power.json")
SECOND = catalog.calibration("h200-step-power-b.json")
THIRD = catalog.calibration("h200-step-power-c.json")
SWEEP = [r for r in DATA["duty"] if "target_duty" in r]
COPY = [r for r in SWEEP if r["partner"] == "copy"]
SPIN = [r for r in SWEEP if r["partner"] == "sleep"]
ALONE = {r["regime"]: r for r in DATA["duty"] if "regime" in r}
KINDS = {r["kind"]: r for r in SECOND["kinds"]}
THIRD_KINDS = {r["kind"]: r for r in THIRD["kinds"]}
H200 = catalog.gpu("h200")
assert DATA["meta"]["gpu"] == SECOND["meta"]["gpu"] == "NVIDIA H200"


def test_power_constants_are_the_fit_of_the_sweep() -> None:
    """GEMM power: least squares of mean power = duty x P_gemm(f) + (1 - duty) x P_copy over
    the copy-partner points; memory-bound power: the kinds held alone (one-in-one-out
    kernels, and the others); attention's share: its two passes' draw over a GEMM's at their
    clocks; the masked call's, its draw over the causal call's on the same chip."""
    copy_w = ALONE["copy held alone"]["power_w"]
    rows = [(r["duty"], r["sm_mhz"] / 1e3, r["power_w"]) for r in COPY if r["sm_mhz"] < 1975]
    a = np.array([[d, d * (f - 1.5)] for d, f, _ in rows])
    y = np.array([w - (1 - d) * copy_w for d, _, w in rows])
    at_1500, per_ghz = np.linalg.lstsq(a, y, rcond=None)[0]
    assert power.GEMM_POWER_W_AT_1500_MHZ == pytest.approx(at_1500, abs=0.1)
    assert power.GEMM_POWER_W_PER_GHZ == pytest.approx(per_ghz, abs=0.1)
    copies = [copy_w, KINDS["bf16 to fp32 cast [16384, 8192]"]["power_w"]]
    assert power.COPY_POWER_W == pytest.approx(statistics.fmean(copies), abs=1.0)
    others = [KINDS[k]["power_w"] for k in ("fp32 mul by a broadcast [4, 4096, 1]",
                                            "fp32 row mean of squares [4, 4096, 2048]")]
    assert power.MEMORY_BOUND_POWER_W == pytest.approx(statistics.fmean(others), abs=1.0)
    assert power.IDLE_POWER_W == pytest.approx(ALONE["idle"]["power_w"], abs=1.0)

    def share(kinds: dict[str, Any], name: str) -> float:
        row = kinds[name]
        return float(row["power_w"] / (at_1500 + per_ghz * (row["sm_mhz"] / 1e3 - 1.5)))

    causal = [share(KINDS, k) for k in KINDS if k.startswith("sdpa causal")]
    assert power.ATTENTION_POWER_SHARE == pytest.approx(statistics.fmean(causal), abs=0.005)
    passes = [("forward", "sdpa {} forward [4, 32, 4096, 64]"),
              ("backward", "sdpa {} backward [4, 32, 4096, 64]")]
    ratio = sum(THIRD_KINDS[p.format("masked")]["s"] * share(THIRD_KINDS, p.format("masked"))
                / share(THIRD_KINDS, p.format("causal")) for _, p in passes) / sum(
        THIRD_KINDS[p.format("masked")]["s"] for _, p in passes)
    assert power.MASKED_ATTENTION_POWER_SHARE == pytest.approx(
        power.ATTENTION_POWER_SHARE * ratio, abs=0.005)


def test_gemm_rate_follows_the_clock_to_its_burst_rate() -> None:
    """Each shape's rate over its held rate against its clock over the held clock: the
    exponent and the saturation clock reproduce every sweep point within 3%."""
    for shape in {(r["M"], r["K"], r["N"]) for r in COPY}:
        rows = [r for r in COPY if (r["M"], r["K"], r["N"]) == shape]
        held = next(r for r in rows if r["target_duty"] == 1.0)
        for r in rows:
            speed = power.gemm_clock_speed(r["sm_mhz"], held["sm_mhz"])
            assert speed == pytest.approx(r["tflops"] / held["tflops"], rel=0.03)


def _idle_partner_clock(duty: float, clock_mhz: float) -> float:
    """The balanced clock of a sweep point whose partner idles: its GEMM time carried back
    to the reference clock, the spin's time as it ran."""
    mix = power.StepMix(duty * power.gemm_clock_speed(clock_mhz), 0.0, 0.0, idle_s=1 - duty)
    clock = power.balanced_sm_clock_mhz(H200, mix)
    assert clock is not None
    return clock


@pytest.mark.parametrize("row", SPIN, ids=lambda r: f"{r['M']}-{r['target_duty']}")
def test_idle_partner_clock(row: dict[str, Any]) -> None:
    """Not fitted: a GEMM beside an idle spin (``torch.cuda._sleep``), drawing the idle
    power between GEMMs. The 1B shape's clocks come out within 3.5% (1,712 / 1,965 / 1,980
    MHz against 1,717 / 1,906 / 1,980); the 8B shape draws more per clock than the fit's
    line through both shapes (held at 1,480 MHz where the 1B one holds 1,530), so the
    balance gives it 7% too high a clock (1,725 / 1,967 against 1,607 / 1,834): the GEMM
    power is one line for every shape, a known limit."""
    tolerance = 0.035 if row["M"] == 16384 else 0.08
    assert _idle_partner_clock(row["duty"], row["sm_mhz"]) == pytest.approx(
        row["sm_mhz"], rel=tolerance)


def balanced(run: dict[str, Any]) -> Scenario:
    """The measured run as a scenario priced at its balanced clock."""
    s = scenario_of(run)
    return s.model_copy(update={"cluster": s.cluster.model_copy(update={"sm_clock": "balanced"})})


def _step_clocks() -> list[tuple[str, str, float, float]]:
    out = []
    for machine, data in (("a", DATA), ("b", SECOND), ("c", THIRD)):
        for run in data["steps"]["runs"]:
            program = build_program(JobContext.from_scenario(balanced(run)))
            out.append((machine, run["name"], program.meta["sm_clock_mhz"],
                        run["power"]["sm_mhz"]))
    return out


STEP_CLOCKS = _step_clocks()


@pytest.mark.parametrize("machine,name,model,measured", STEP_CLOCKS,
                         ids=[f"{m}-{n}" for m, n, _, _ in STEP_CLOCKS])
def test_step_clock_within_10_percent(machine: str, name: str, model: float,
                                      measured: float) -> None:
    """Not fitted: every measured step's mean SM clock (1,506-1,796 MHz) against the
    balance of its priced kernels. Chips differ: the second and third machines held 4-9%
    and 0-5% lower clocks than the model at the same mix (and ran the same steps 2-3% and
    1-2% slower than the first, whose sweep the power line is fitted on)."""
    assert model == pytest.approx(measured, rel=0.10)


def test_compiled_and_eager_clocks_on_one_chip() -> None:
    """The third machine ran the 1B model eager and compiled on one chip: the same clock
    (1,725 and 1,723 MHz): compile's fewer memory-bound kernels are offset by its masked
    attention's lower draw. The balance keeps them within 4% of each other."""
    clocks = {n: model for m, n, model, _ in STEP_CLOCKS if m == "c"}
    assert clocks["1b-compile"] == pytest.approx(clocks["1b-plain"], rel=0.04)


def test_step_clocks_on_the_fitted_machine_within_4_percent() -> None:
    errors = [model / measured - 1 for m, _, model, measured in STEP_CLOCKS if m == "a"]
    assert max(abs(e) for e in errors) <= 0.04


def test_gemm_at_the_balanced_clock_is_faster_than_held() -> None:
    """Physics the balance must keep: a step with memory-bound work beside its GEMMs runs
    them above the held clock, never below; one of only GEMMs holds the held clock."""
    only = power.balanced_sm_clock_mhz(H200, power.StepMix(1.0, 0.0, 0.0))
    mixed = power.balanced_sm_clock_mhz(H200, power.StepMix(0.6, 0.1, 0.3))
    assert only is not None and mixed is not None
    assert math.isclose(only, 1520, abs_tol=20)
    assert mixed > only
    cm = ComputeModel(H200)
    at = ComputeModel(H200, sm_clock_mhz=mixed)
    assert at.gemm_time(16384, 2048, 8192) < cm.gemm_time(16384, 2048, 8192)


def test_held_clock_is_the_default_and_reports_none() -> None:
    """``cluster.sm_clock`` defaults to ``held``: the kernel tables' clocks, no balance."""
    run = DATA["steps"]["runs"][0]
    held = build_program(JobContext.from_scenario(scenario_of(run)))
    assert held.meta["sm_clock_mhz"] is None
    fast = build_program(JobContext.from_scenario(balanced(run)))
    assert fast.meta["sm_clock_mhz"] > power.GEMM_REFERENCE_MHZ


def test_a_cap_is_solved_in_the_balance_not_taken_twice() -> None:
    """Under ``balanced`` a cap (``cluster.gpu_power_w``) is the limit the balance meets,
    and the part is then priced uncapped at that clock: a GEMM-only step at 500 W lands on
    the held line's 1,194 MHz, pricing a GEMM as the held cap ratio does (within the 0.3%
    between the fit's reference clock, 1,525 MHz, and the line's 700 W clock, 1,520)."""
    run = DATA["steps"]["runs"][0]
    s = balanced(run)
    capped = s.model_copy(update={"cluster": s.cluster.model_copy(update={"gpu_power_w": 500})})
    free = build_program(JobContext.from_scenario(s)).meta["sm_clock_mhz"]
    at_cap = build_program(JobContext.from_scenario(capped)).meta["sm_clock_mhz"]
    assert 1194 < at_cap < free
    clock = power.balanced_sm_clock_mhz(catalog.gpu("h200", power_w=500),
                                        power.StepMix(1.0, 0.0, 0.0))
    assert clock == pytest.approx(power.held_gemm_clock_mhz(500))
    held = ComputeModel(catalog.gpu("h200", power_w=500))
    solved = ComputeModel(H200, sm_clock_mhz=clock)
    assert solved.gemm_time(16384, 16384, 16384) == pytest.approx(
        held.gemm_time(16384, 16384, 16384), rel=0.01)
