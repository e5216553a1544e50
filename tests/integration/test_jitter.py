"""Step-to-step compute variation (``faults.jitter``, sim/engine/jitter.py) over many steps.

Truths: with ``sigma: 0`` the run is the one without the key, bit for bit; the maximum of ``n``
normal draws drawn by inverse transform (one uniform) has the mean of ``n`` draws taken one by
one (numpy's own normals); a synchronous step whose compute is multiplied by the largest of its
ranks' log-normal factors has mean ``exposed + compute x E[max_n exp(sigma Z)]``, here against
that expectation by quadrature (``n = 1``: ``exp(sigma^2 / 2)``, the log-normal mean).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from sim.analysis.metrics import step_spans
from sim.api import simulate
from sim.engine.jitter import StepJitter, expected_max_factor, max_normal
from sim.scenario import ScenarioError, load_scenario

DDP = "llama3.2-1b-ddp-8xh100"   # one rank class of 8 GPUs, 98% of the step compute
STEPS = 60


def _steps(overrides: list[str], steps: int = STEPS) -> tuple[dict, np.ndarray]:
    r = simulate(load_scenario(DDP, overrides), steps)
    return r.summary, np.array([b - a for a, b in step_spans(r.recorder.ops)])


@functools.cache
def _jittered(sigma: float) -> np.ndarray:
    """The STEPS step times at ``sigma`` (default seed): simulated once for the module, as
    the mean and the tails tests read the same runs (read-only)."""
    _, t = _steps([f"faults.jitter={{sigma: {sigma}}}"])
    t.flags.writeable = False
    return t


def _without_wall(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "sim"}


def test_sigma_zero_is_no_jitter() -> None:
    plain, t0 = _steps([], 3)
    zero, t1 = _steps(["faults.jitter={sigma: 0}"], 3)
    assert _without_wall(zero) == _without_wall(plain)
    assert list(t1) == list(t0)


def test_same_seed_same_steps_other_seed_other_steps() -> None:
    _, a = _steps(["faults.jitter={sigma: 0.1, seed: 3}"], 5)
    _, b = _steps(["faults.jitter={sigma: 0.1, seed: 3}"], 5)
    _, c = _steps(["faults.jitter={sigma: 0.1, seed: 4}"], 5)
    assert list(a) == list(b)
    assert list(a) != list(c)
    # Step s draws the same whatever the number of steps run.
    _, longer = _steps(["faults.jitter={sigma: 0.1, seed: 3}"], 7)
    assert list(longer[:5]) == list(a)


def test_max_of_n_by_inverse_transform_matches_drawing_n() -> None:
    rng = np.random.default_rng(1)
    n, trials = 100, 20_000
    direct = rng.standard_normal((trials, n)).max(axis=1)
    inverse = np.array([max_normal(u, n) for u in rng.random(trials)])
    se = direct.std() / math.sqrt(trials)
    assert inverse.mean() == pytest.approx(direct.mean(), abs=4 * math.sqrt(2) * se)
    assert inverse.std() == pytest.approx(direct.std(), rel=0.03)
    # The expected largest of 100 standard normals, 2.50759 (Harter, "Expected values of
    # normal order statistics", Biometrika 48 (1961), table 1).
    assert inverse.mean() == pytest.approx(2.50759, abs=0.02)


def test_factors_are_one_per_class_and_step() -> None:
    j = StepJitter(0.2, seed=0)
    f = j.factors(0, [(1, 8), (0, 1)])
    assert set(f) == {0, 1} and all(x > 0 for x in f.values())
    assert StepJitter(0.0).factors(5, [(0, 8)]) == {0: 1.0}


@pytest.mark.parametrize("sigma", [0.05, 0.2])
def test_mean_step_grows_as_the_slowest_ranks_factor(sigma: float) -> None:
    base, _ = _steps([], 1)
    t = _jittered(sigma)
    expected = base["step_time_s"] + base["compute_time_s"] * (
        expected_max_factor(sigma, 8) - 1)
    se = t.std(ddof=1) / math.sqrt(len(t))
    assert t.mean() == pytest.approx(expected, abs=4 * se)
    assert t.mean() > base["step_time_s"]


def test_tails_widen_with_sigma() -> None:
    low, high = _jittered(0.05), _jittered(0.2)
    p99 = [np.percentile(x, 99) / np.median(x) for x in (low, high)]
    assert 1 < p99[0] < p99[1]


def test_jitter_is_a_fault_and_sigma_zero_is_none() -> None:
    # Faults.empty decides what is refused where faults are not modelled (a multi-job file).
    assert not load_scenario(DDP, ["faults.jitter={sigma: 0.1}"]).faults.empty
    assert load_scenario(DDP, ["faults.jitter={sigma: 0}"]).faults.empty


def test_bad_jitter_is_one_line_naming_the_key() -> None:
    with pytest.raises(ScenarioError, match=r"faults\.jitter\.sigma"):
        load_scenario(DDP, ["faults.jitter={sigma: -1}"])
    with pytest.raises(ScenarioError, match=r"faults\.jitter\.distribution"):
        load_scenario(DDP, ["faults.jitter={sigma: 0.1, distribution: cauchy}"])


def test_summary_reports_the_steps_spread_only_with_jitter() -> None:
    summary, t = _steps(["faults.jitter={sigma: 0.2}"], 20)
    spread = summary["step_times"]
    assert spread["steps"] == 20
    assert spread["min_s"] == t.min() and spread["max_s"] == t.max()
    assert spread["min_s"] <= spread["p50_s"] <= spread["p90_s"] <= spread["p99_s"] <= \
        spread["max_s"]
    assert summary["step_time_s"] == pytest.approx(t.mean(), rel=1e-12)
    plain, _ = _steps([], 2)
    assert "step_times" not in plain
