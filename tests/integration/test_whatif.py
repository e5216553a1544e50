"""What-ifs over faults and checkpoints (issue 15 item 5): ``compare`` and ``sweep`` over
``faults.*`` and ``run.*`` keys, the run object in their rows, and the goodput curve.

Truths the numbers are checked against:

- one GPU x% slower in a synchronous data-parallel job slows the step by about x% of its
  compute (every rank waits for it at each gradient all-reduce; the issue's closed form, and
  tests/integration/test_faults.py's 0.99 x 10% for this scenario);
- without interruptions a run's ETTR is useful time over useful time plus the saves,
  ``k x step / (k x step + C)`` per checkpoint segment of ``k`` steps;
- the optimal checkpoint interval is Young's sqrt(2 C MTBF) within 10% when C is much smaller
  than the MTBF (Young, CACM 17(9), 1974; Daly, FGCS 22 (2006): the first-order term);
- the renewal form's expected ETTR (the curve) agrees with the Monte Carlo's (an independent
  playing-out of the same failures, :mod:`sim.apps.runlength.montecarlo`).
"""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from sim.api import simulate
from sim.apps import compare as cmp
from sim.apps.runlength import run_length
from sim.apps.runlength.goodput import goodput_curve
from sim.apps.sweep import run_sweep, sweep_figure, write_plot
from sim.cli.commands import app
from sim.outputs.plot.goodput import goodput_figure, straggler, straggler_figure
from sim.scenario import load_scenario

DDP = "llama3.2-1b-ddp-8xh100"   # 1 node, 8 H100, DDP: ~0.25 s steps, simulated in ~50 ms
RUN = ["training.tokens_total=2e9", "run.checkpoint_interval_steps=100",
       "run.failures=llama3-16k-h100", "run.samples=400"]
NO_FAILURES = ["run.failures={bug: {rate_per_unit_per_day: 0, basis: job}}"]
SLOW = "[{rank: 3, factor: 1.1}]"


def _what_if(what_if: str, overrides: list[str]) -> dict:
    variants = cmp.what_if_variants(DDP, what_if, overrides)
    cmp.simulate_variants(variants)
    return cmp.compare_result(variants)


@pytest.fixture(scope="module")
def straggler_compare() -> dict:
    return _what_if(f"faults.slow_gpus=[],{SLOW}", RUN)


def test_list_valued_what_if_is_one_variant_per_list(straggler_compare) -> None:
    labels = [v["label"] for v in straggler_compare["variants"]]
    assert labels == ["faults.slow_gpus=[]", f"faults.slow_gpus={SLOW}"]
    assert all(v["error"] is None for v in straggler_compare["variants"])


def test_a_ten_percent_straggler_costs_ten_percent_of_compute(straggler_compare) -> None:
    healthy, slow = (v["summary"] for v in straggler_compare["variants"])
    added = slow["step_time_s"] - healthy["step_time_s"]
    # Closed form: 0.1 x compute (test_faults measures 0.99 of it on this scenario).
    assert added == pytest.approx(0.1 * healthy["compute_time_s"], rel=0.03)


def test_compare_carries_the_run_and_its_deltas(straggler_compare) -> None:
    healthy, slow = (v["summary"] for v in straggler_compare["variants"])
    d = straggler_compare["deltas"][0]
    for key in ("run.ettr", "run.expected_days", "run.expected_usd"):
        assert key in d
    # Same failures and checkpoints, a longer step: a longer run, at the same hourly price
    # (one server, no egress), so the dollars grow exactly as the days.
    assert d["run.expected_days"]["rel"] > 0.05
    assert d["run.expected_usd"]["rel"] == pytest.approx(d["run.expected_days"]["rel"],
                                                         rel=1e-9)
    table = cmp.comparison_table(straggler_compare)
    rows = list(table.columns[0]._cells)
    assert "goodput (ETTR)" in rows and "run days" in rows


def test_compare_without_run_block_has_no_run_rows_or_deltas() -> None:
    r = _what_if("faults.slow_gpus=[],[{rank: 3, factor: 1.2}]", [])
    assert not any(k.startswith("run.") for k in r["deltas"][0])
    rows = list(cmp.comparison_table(r).columns[0]._cells)
    assert "goodput (ETTR)" not in rows


def test_compare_over_the_checkpoint_interval() -> None:
    r = _what_if("run.checkpoint_interval_steps=1,100", RUN + NO_FAILURES)
    every, hundred = (v["summary"] for v in r["variants"])
    assert every["step_time_s"] == hundred["step_time_s"]     # the step does not change
    step = every["step_time_s"]
    for s, k in ((every, 1), (hundred, 100)):
        c = s["run"]["checkpoint_write_s"]
        # No interruptions: ETTR = k step / (k step + C) (the run ends with a save too).
        assert s["run"]["ettr"] == pytest.approx(k * step / (k * step + c), rel=1e-3)
    assert hundred["run"]["ettr"] > every["run"]["ettr"]


@pytest.fixture(scope="module")
def fault_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "rows.csv"
    result = run_sweep(DDP, ["faults.slow_gpus=[],[{rank: 0, factor: 1.5}]",
                             "run.checkpoint_interval_steps=10,1000",
                             "training.tokens_total=2e9",
                             "run.failures={bug: {rate_per_unit_per_day: 0, basis: job}}"],
                       workers=1, use_cache=False, out=out)
    return result, out


def test_sweep_over_a_straggler_and_the_interval(fault_sweep) -> None:
    result, out = fault_sweep
    assert [r["error"] for r in result.rows] == [None] * 4
    for r in result.rows:
        assert 0 < r["run.ettr"] <= 1 and r["run.expected_days"] > 0
    header = out.read_text().splitlines()[0].split(",")
    assert {"run.ettr", "run.expected_days", "run.expected_usd"} <= set(header)
    # No interruptions: the run is its steps plus one save per segment and one at the end,
    # n step + ceil(n / k) C, for the healthy and the slow step alike.
    for r in result.rows:
        n, k = r["run.steps_total"], r["run.checkpoint_interval_steps"]
        wall = n * r["step_time_s"] + math.ceil(n / k) * r["run.checkpoint_write_s"]
        assert r["run.expected_days"] * 86400 == pytest.approx(wall, rel=1e-9)


def test_sweep_plot_over_a_fault_factor_draws_the_runs_goodput(fault_sweep, tmp_path) -> None:
    result, _ = fault_sweep
    fig = sweep_figure(result.rows, result.keys, result.title)
    time_ax, _, ettr_ax = fig.axes[:3]
    assert time_ax.get_xlabel() == "faults.slow_gpus (factor)"
    assert ettr_ax.get_ylabel() == "run goodput (ETTR)"
    # One line per interval, through the healthy (1.0) and the slow (1.5) GPU.
    for line in ettr_ax.get_lines():
        assert list(line.get_xdata()) == [1.0, 1.5]
    by_k = {k: [r["run.ettr"] for r in result.rows if r["run.checkpoint_interval_steps"] == k]
            for k in (10, 1000)}
    assert sorted(list(line.get_ydata()) for line in ettr_ax.get_lines()) == \
        sorted(by_k.values())
    write_plot(tmp_path / "sweep.png", result.rows, result.keys)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_without_run_block_has_no_run_columns() -> None:
    result = run_sweep(DDP, ["cluster.nvlink_gbytes_per_s=300,450"], workers=1,
                       use_cache=False)
    assert not any(c.startswith("run.") for c in result.columns)


# --------------------------------------------------------------------------- the curve
def _run_of(scenario: str, overrides: list[str]):
    s = load_scenario(scenario, overrides)
    result = simulate(s, origin=s.name)
    result.summary["run"] = run_length(result)
    return result


@pytest.fixture(scope="module")
def fleet_run():
    """Llama 3 70B FSDP2 on 64 H100 for 1T tokens under Llama 3's fleet rates: checkpoints
    of a few seconds against an MTBF of about a day, Young/Daly's assumptions."""
    return _run_of("llama3-70b-fsdp2-64xh100",
                   ["run.checkpoint_interval_steps=400", "run.failures=llama3-16k-h100",
                    "run.samples=2000"])


def test_curve_optimum_is_the_run_objects(fleet_run) -> None:
    run = fleet_run.summary["run"]
    c = goodput_curve(fleet_run)
    assert c.optimal_steps == run["optimal_checkpoint_interval_steps"]
    assert c.interval_steps[c.ettr.argmax()] == c.optimal_steps
    assert c.chosen_steps == 400 and 400 in c.interval_steps
    # Both sides of the top are drawn, and the curve falls away from it.
    assert c.interval_steps[0] < c.optimal_steps < c.interval_steps[-1]
    assert c.ettr[0] < c.ettr.max() and c.ettr[-1] < c.ettr.max()


def test_curve_optimum_against_young_daly(fleet_run) -> None:
    run = fleet_run.summary["run"]
    c = goodput_curve(fleet_run)
    cost = run["checkpoint_blocking_s"]
    mtbf_s = run["mtbf_hours"] * 3600
    assert cost / mtbf_s < 1e-3          # Young/Daly's assumption holds
    young = math.sqrt(2 * cost * mtbf_s) / c.step_s
    assert c.young_daly_steps == pytest.approx(young, rel=1e-9)
    assert c.optimal_steps == pytest.approx(young, rel=0.10)


@pytest.mark.parametrize("interval", [30, 400, 3000])
def test_curve_matches_the_monte_carlo(interval: int) -> None:
    """The renewal form against the played-out runs (exact in expectation for synchronous
    saves, montecarlo.expected_segment_s): one GPU failure a day across the 64 GPUs, none
    planned (the curve counts unplanned interruptions only), no server replaced (so each
    interruption costs exactly the restart). Tolerance: a tenth of the 5-95% spread of
    one run's ETTR, several standard errors of the mean of 2,000 runs."""
    result = _run_of("llama3-70b-fsdp2-64xh100",
                     [f"run.checkpoint_interval_steps={interval}", "run.samples=2000",
                      "run.failures={gpu: {rate_per_unit_per_day: 0.015625, basis: gpu}}"])
    run = result.summary["run"]
    assert run["mtbf_hours"] == pytest.approx(24.0)
    c = goodput_curve(result)
    spread = run["ettr_p95"] - run["ettr_p5"]
    assert c.at(interval) == pytest.approx(run["ettr"], abs=spread / 10)


def test_curve_without_failures_is_the_checkpoint_overhead() -> None:
    s = load_scenario(DDP, RUN + NO_FAILURES)
    result = simulate(s, origin=s.name)
    result.summary["run"] = run_length(result)
    c = goodput_curve(result)
    assert c.young_daly_steps is None and c.mtbf_hours is None
    write = result.summary["run"]["checkpoint_write_s"]
    n = result.summary["run"]["steps_total"]
    for k, e in zip(c.interval_steps, c.ettr, strict=True):
        saves = math.ceil(n / k - 1e-9)
        assert e == pytest.approx(n * c.step_s / (n * c.step_s + saves * write), rel=1e-9)
    # No failures: one save at the end is best.
    assert c.optimal_steps == n


# --------------------------------------------------------------------------- the plots
def test_cli_out_writes_goodput_png_only_with_a_run_block(tmp_path) -> None:
    runner = CliRunner()
    with_run = runner.invoke(app, ["run", DDP, *sum((["--set", a] for a in RUN), []),
                                   "--out", str(tmp_path / "a")])
    assert with_run.exit_code == 0, with_run.output
    png = tmp_path / "a" / "goodput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    without = runner.invoke(app, ["run", DDP, "--out", str(tmp_path / "b")])
    assert without.exit_code == 0, without.output
    assert (tmp_path / "b" / "timeline.png").exists()
    assert not (tmp_path / "b" / "goodput.png").exists()


def test_goodput_figure_marks_optimum_young_daly_and_scenario(fleet_run) -> None:
    c = goodput_curve(fleet_run)
    fig = goodput_figure(c.interval_steps, c.ettr, optimal_steps=c.optimal_steps,
                         young_daly_steps=c.young_daly_steps, chosen_steps=c.chosen_steps,
                         step_s=c.step_s, title="t")
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert any(lab.startswith(f"optimum: {c.optimal_steps:,} steps") for lab in labels)
    assert any(lab.startswith("Young/Daly") for lab in labels)
    assert any(lab.startswith("scenario: 400 steps") for lab in labels)
    assert ax.get_xscale() == "log"


def test_straggler_figure(tmp_path, straggler_compare) -> None:
    healthy, slow = (v["summary"] for v in straggler_compare["variants"])
    factors = [1.0, 1.1]
    steps = [healthy["step_time_s"], slow["step_time_s"]]
    fig = straggler_figure(factors, steps, compute_s=healthy["compute_time_s"],
                           usd_per_day=healthy["cost"]["usd_per_day"])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    closed = lines["closed form: step₀ + (factor − 1) × compute"].get_ydata()
    assert closed[1] == pytest.approx(steps[1], rel=0.01)   # the simulation on the closed form
    straggler(tmp_path / "s.png", factors, steps, compute_s=healthy["compute_time_s"])
    assert (tmp_path / "s.png").stat().st_size > 0
