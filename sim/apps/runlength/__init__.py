"""A run, not a step: the whole training run's length, goodput and cost (``run:`` block).

:func:`run_length` takes a simulated step (:func:`sim.api.simulate`'s result) and the
scenario's ``run:`` block, and plays the whole run many times (:mod:`.montecarlo`): failures
per component scaled to the cluster (:mod:`.rates`), checkpoints whose bytes are the job's
own sharded states and whose times follow the storage (:mod:`.checkpoint`), restarts, lost
work and hot spares. Its object is the summary's ``run`` (CONTRACT.md's keys first):

- ``ettr``: effective training time ratio, useful training time / wall time (expected run);
- ``expected_days``, ``days_p5``, ``days_p95``: wall-clock days of the run (mean, 5th and
  95th percentile over the simulated runs);
- ``expected_usd``: the job's GPUs (and its hot spares' servers) at the summary's GPU-hour
  price for the expected wall time, plus the billed transfer of the steps actually run;
- ``checkpoint_interval_steps`` (the scenario's) and ``optimal_checkpoint_interval_steps``
  (the interval maximising the expected ETTR of the same model, searched over every interval);
- ``interruptions_expected``: interruptions per run (planned ones included);
- with ``run.zone_outage`` (:mod:`.zones`): ``zone_outages_expected``,
  ``zone_outage_days_lost`` and, for ``shrink``, the surviving layout's ``shrunk_*``; the
  outages are in the ETTR, days and dollars above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sim.analysis.summary import RunLength, Summary
from sim.api import RunResult, fabric_spec
from sim.apps.runlength.checkpoint import CheckpointTimes, checkpoint_bytes, checkpoint_times
from sim.apps.runlength.montecarlo import (
    RunInputs,
    expected_segment_s,
    simulate_runs,
    young_daly_s,
)
from sim.apps.runlength.rates import SECONDS_PER_DAY, JobRates, job_rates
from sim.apps.runlength.zones import (
    ZonePlan,
    ZoneRuns,
    shrunk_egress_usd,
    simulate_zone_runs,
    zone_fields,
    zone_plan,
)
from sim.scenario import ScenarioError

__all__ = ["RunPlan", "optimal_interval", "play", "run_ettr", "run_length", "run_plan"]

MAX_EXHAUSTIVE_INTERVALS = 2_000_000
"""Above this many candidate intervals the optimum is searched on a log grid."""


@dataclass(frozen=True)
class RunPlan:
    """A run to play: the simulated step and checkpoint, the failures, the run block's knobs."""

    step_s: float
    steps_total: int
    interval_steps: int
    write_s: float
    """One checkpoint written to storage."""
    copy_s: float
    """An async save's device-to-host copy."""
    asynchronous: bool
    rates: JobRates
    restart_s: float
    replace_s: float = 0.0
    repair_s: float = 86_400.0
    spares: int = 0
    samples: int = 1000
    seed: int = 0
    zones: ZonePlan | None = None
    """Availability-zone outages (``run.zone_outage``, :mod:`.zones`)."""

    def blocking_s(self, interval_steps: np.ndarray | int) -> np.ndarray:
        """Training stopped per save: the whole write (sync), or the copy plus any wait for
        the previous background write still running (async)."""
        k = np.asarray(interval_steps, dtype=float)
        if not self.asynchronous:
            return np.full_like(k, self.write_s)
        return self.copy_s + np.maximum(self.write_s - k * self.step_s, 0.0)

    def inputs(self) -> RunInputs:
        return RunInputs(
            work_s=self.steps_total * self.step_s,
            segment_s=min(self.interval_steps, self.steps_total) * self.step_s,
            blocking_s=float(self.blocking_s(self.interval_steps)),
            durable_after_s=self.write_s if self.asynchronous else 0.0,
            save_s=self.write_s, restart_s=self.restart_s, replace_s=self.replace_s,
            repair_s=self.repair_s, spares=self.spares, rates_per_s=self.rates.per_s,
            needs_node=self.rates.needs_node, planned=self.rates.planned)


@dataclass(frozen=True)
class RunOutcome:
    ettr: float
    ettr_p5: float
    ettr_p95: float
    wall_s: np.ndarray
    busy_s: float
    """Mean time training or saving (wall less stops), on the whole layout (not shrunk)."""
    interruptions: float
    optimal_interval_steps: int
    young_daly_steps: float | None
    mtbf_s: float | None
    """Mean time between unplanned interruptions."""
    downtime_s: float
    """Mean stop per unplanned interruption (restart plus replacement waits)."""
    zone_runs: ZoneRuns | None = None
    """The runs with their zone outages (``run.zone_outage``)."""


def optimal_interval(plan: RunPlan, downtime_s: float) -> int:
    """The interval (steps) with the highest expected ETTR, over every interval up to the
    whole run (:func:`run_ettr`; planned stops cost the same at any interval)."""
    n = plan.steps_total
    if n <= MAX_EXHAUSTIVE_INTERVALS:
        k = np.arange(1, n + 1, dtype=float)
    else:
        k = np.unique(np.round(np.geomspace(1, n, MAX_EXHAUSTIVE_INTERVALS)))
    ettr = run_ettr(plan, k, downtime_s)
    return int(k[int(np.argmax(ettr))])


def run_ettr(plan: RunPlan, interval_steps: np.ndarray, downtime_s: float) -> np.ndarray:
    """The whole run's expected ETTR at each checkpoint interval (steps), unplanned
    interruptions only (the renewal form, :func:`expected_segment_s`, segment by segment).

    ``downtime_s`` is the mean stop per unplanned interruption (restart plus replacement
    waits: the run object's ``downtime_minutes``). Its argmax over every interval is the run
    object's ``optimal_checkpoint_interval_steps``; :mod:`sim.apps.runlength.goodput` draws
    it against the interval."""
    n = plan.steps_total
    k = np.asarray(interval_steps, dtype=float)
    # Every interval's saves: one per full segment and a last, shorter one at the end.
    saves = np.ceil(n / k * (1 - 1e-12))
    last = n - (saves - 1) * k
    args = (plan.write_s if plan.asynchronous else 0.0,
            plan.rates.unplanned_per_day / SECONDS_PER_DAY, downtime_s)
    wall = ((saves - 1) * expected_segment_s(k * plan.step_s, plan.blocking_s(k), *args)
            + expected_segment_s(last * plan.step_s, plan.blocking_s(k), *args))
    return n * plan.step_s / wall


def play(plan: RunPlan) -> RunOutcome:
    """Play the plan's runs and find the best checkpoint interval."""
    inp = plan.inputs()
    runs = simulate_runs(inp, plan.samples, plan.seed) \
        if plan.zones is None or plan.zones.rate_per_s == 0 \
        else simulate_zone_runs(inp, plan.zones, plan.samples, plan.seed)
    per_run = inp.work_s / runs.wall_s
    lam_u = plan.rates.unplanned_per_day / SECONDS_PER_DAY
    downtime = plan.restart_s + (runs.waits_s / runs.unplanned if runs.unplanned else 0.0)
    mtbf = 1.0 / lam_u if lam_u > 0 else None
    yd = None
    if mtbf is not None:
        cost = float(plan.blocking_s(plan.interval_steps)) if plan.asynchronous else plan.write_s
        yd = young_daly_s(cost, mtbf) / plan.step_s
    return RunOutcome(
        ettr=inp.work_s / float(runs.wall_s.mean()),
        ettr_p5=float(np.percentile(per_run, 5)), ettr_p95=float(np.percentile(per_run, 95)),
        wall_s=runs.wall_s, busy_s=float((runs.wall_s - runs.down_s).mean())
        - (float(runs.shrunk_s.mean()) if isinstance(runs, ZoneRuns) else 0.0),
        interruptions=float(runs.interruptions.mean()),
        optimal_interval_steps=optimal_interval(plan, downtime), young_daly_steps=yd,
        mtbf_s=mtbf, downtime_s=downtime,
        zone_runs=runs if isinstance(runs, ZoneRuns) else None)


def run_plan(result: RunResult) -> RunPlan:
    """The run to play for a simulated step of a scenario with a ``run:`` block."""
    return _planned(result)[0]


def _planned(result: RunResult) -> tuple[RunPlan, float, CheckpointTimes]:
    s = result.scenario
    r = s.run
    tokens = s.training.tokens_total
    assert r is not None and tokens is not None    # the schema requires both together
    summ = result.summary
    step_s, per_step = summ["step_time_s"], summ["tokens_per_step"]
    spec = fabric_spec(s)
    ck = checkpoint_bytes(result.program.classes, result.context.model.total_params,
                          s.dp * s.parallelism.cp)
    rate = r.checkpoint.gbytes_per_s or spec.nvme_write_gbytes_per_s
    times = checkpoint_times(ck.total, r.checkpoint.storage, rate, s.cluster.nodes, s.gpus,
                             spec.pcie_gbytes_per_s)
    write_s, copy_s = times.write_s, times.copy_s
    sim = summ.get("checkpoint")
    if sim is not None:   # measured on the timeline (run.checkpoint.simulate)
        step_s = sim["clean_step_s"]
        # Synchronous: the step waits for the whole save. Asynchronous: the staging copy,
        # plus the training time the background write takes from the next steps.
        write_s = sim["blocking_s"] if not sim["asynchronous"] else sim["write_s"]
        copy_s = sim["blocking_s"] + sim["contention_s_per_save"]
    plan = RunPlan(step_s=step_s, steps_total=math.ceil(tokens / per_step * (1 - 1e-12)),
                   interval_steps=r.checkpoint_interval_steps, write_s=write_s,
                   copy_s=copy_s, asynchronous=r.checkpoint.async_, rates=job_rates(s),
                   restart_s=r.restart_minutes * 60, replace_s=r.replace_minutes * 60,
                   repair_s=r.repair_hours * 3600, spares=r.spares, samples=r.samples,
                   seed=r.seed)
    if r.zone_outage is not None:
        plan = replace(plan, zones=zone_plan(result, plan, ck.total))
    return plan, ck.total, times


def run_length(result: RunResult) -> RunLength:
    """The summary's ``run`` object for a simulated step of a scenario with a ``run:`` block.

    Raises ScenarioError (one line naming ``run``) when the run could never finish."""
    s = result.scenario
    r = s.run
    assert r is not None
    summ = result.summary
    plan, ck_bytes, times = _planned(result)
    try:
        out = play(plan)
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    cost = summ["cost"]
    hours = float(out.wall_s.mean()) / 3600
    spare_usd_per_hour = r.spares * s.cluster.gpus_per_node * cost["gpu_hour_usd"]
    step_s = plan.step_s
    cycle_s = step_s + float(plan.blocking_s(plan.interval_steps)) / plan.interval_steps
    egress_step, save_usd = _egress(summ)
    usd = hours * (cost["usd_per_hour"] + spare_usd_per_hour) \
        + (egress_step + save_usd / plan.interval_steps) * out.busy_s / cycle_s \
        + shrunk_egress_usd(plan.zones, out.zone_runs)
    days = out.wall_s / SECONDS_PER_DAY
    run: RunLength = {
        "ettr": out.ettr,
        "expected_days": float(days.mean()),
        "days_p5": float(np.percentile(days, 5)),
        "days_p95": float(np.percentile(days, 95)),
        "expected_usd": usd,
        "checkpoint_interval_steps": r.checkpoint_interval_steps,
        "optimal_checkpoint_interval_steps": out.optimal_interval_steps,
        "interruptions_expected": out.interruptions,
        "ettr_p5": out.ettr_p5,
        "ettr_p95": out.ettr_p95,
        "young_daly_interval_steps": out.young_daly_steps,
        "steps_total": plan.steps_total,
        "mtbf_hours": None if out.mtbf_s is None else out.mtbf_s / 3600,
        "downtime_minutes": out.downtime_s / 60,
        "checkpoint_gb": ck_bytes / 1e9,
        "checkpoint_write_s": plan.write_s,
        "checkpoint_blocking_s": float(plan.blocking_s(plan.interval_steps)),
        "checkpoint_write_gbytes_per_s": times.write_gbytes_per_s,
        "failures": r.failures if isinstance(r.failures, str) else "custom",
        "samples": r.samples,
        "checkpoint_simulated": "checkpoint" in summ,
        "checkpoint_closed_form_write_s": times.write_s,
        "checkpoint_closed_form_blocking_s": times.write_s if not plan.asynchronous
        else times.copy_s + max(times.write_s - plan.interval_steps * plan.step_s, 0.0),
        "checkpoint_egress_usd_per_save": save_usd,
    }
    if plan.zones is not None:
        run.update(zone_fields(plan.zones, out.zone_runs))  # type: ignore[typeddict-item]
    return run


def _egress(summ: Summary) -> tuple[float, float]:
    """Billed transfer per training step and per save. With simulated saves the summary's
    per-step egress spreads the window's saves over its steps: their crossings are taken out
    and billed per save instead."""
    cost = summ["cost"]
    sim = summ.get("checkpoint")
    if sim is None:
        return cost["egress_usd_per_step"], 0.0
    save = (sim["cross_az_gb_per_save"] * cost["egress_usd_per_gb"]
            + sim["cross_region_gb_per_save"] * cost["region_egress_usd_per_gb"])
    per_step = cost["egress_usd_per_step"] - save * sim["saves"] / sim["window_steps"]
    return max(per_step, 0.0), save
