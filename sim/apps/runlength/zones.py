"""Availability-zone outages over a whole run (``run.zone_outage``), for a job over 2+ zones.

The model, on top of :mod:`.montecarlo`'s (whose component failures it keeps as they are):

- Each of the cluster's ``Z`` zones goes down as a Poisson process of ``per_year`` outages a
  year, each lasting ``hours`` (a fixed duration). With exponential gaps the whole job sees
  outages at ``Z x per_year``, raced against the component failures in the same loop.
- The job stops at once (an unplanned interruption): the work since the last durable
  checkpoint is lost. If the checkpoint cannot be loaded (``checkpoint_survives`` false: a
  dist-ckpt or DCP save on the servers' own drives, each shard written once, so it is whole
  only with every zone's drives, and cloud instance-store drives keep nothing once their
  instance stops) the run starts over from step 0.
- ``wait``: the job stays down for the outage, then restarts (``restart_minutes``).
- ``shrink``: the job restarts at once on the surviving zones with fewer data-parallel
  replicas and the same global batch (more gradient accumulation; dist-ckpt and DCP load a
  checkpoint into another data-parallel size, as torchtitan's and Megatron's elastic restarts
  do). Its step time is *simulated* for that layout (:func:`shrunk_scenario` through
  :func:`sim.api.simulate`), its checkpoints are written by fewer servers, and its failure
  rates scale with its GPUs, servers and NICs. It trains until the zone returns, then saves
  (a synchronous write, no work lost) and restarts on the whole cluster: restart costs at both
  transitions. Its progress in that window is its expected goodput (the renewal form,
  :func:`sim.apps.runlength.montecarlo.expected_ettr`, the same failures at the shrunk
  layout's rates) times the window: failures inside the window are taken at their mean, not
  drawn. An outage no longer than a restart leaves no window: ``shrink`` then waits.
- Not drawn: a second outage or a failure while the job is down or shrunk (at one outage a
  year of 8 hours, a second zone is down at the same time with probability ~1e-3); the GPUs
  are billed through the outage (capacity reserved for a run is).

Same seed, same numbers; the draws do not depend on the policy (common random numbers), so
``wait`` and ``shrink`` meet the same outages at the same points of their runs.

When shrinking pays: at each outage ``shrink`` spends the save before growing back
(``regrow_s``) more than ``wait`` and gains ``progress_rate x (D - restart)`` of the whole
layout's work, so it is never worse, run by run, when that gain is at least the save
(tests/unit/apps/test_zone_outages.py). A shrunk step no slower than the whole layout's times
its replica ratio (``dp / dp_shrunk``: the same batch on fewer replicas, communication no
worse) makes ``(D - restart) x ETTR_shrunk x dp_shrunk / dp >= regrow_s`` sufficient. A
shrunk layout may step *faster* than the whole one (a narrow link between the zones), and the
outage's ``zone_outage_days_lost`` is then negative. The best checkpoint interval
(``optimal_checkpoint_interval_steps``) still weighs the component failures only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.api import RunResult, fabric_spec, simulate
from sim.apps.runlength.checkpoint import checkpoint_times
from sim.apps.runlength.montecarlo import (
    MAX_INTERRUPTIONS,
    RunInputs,
    Runs,
    RunState,
    checkpoints_needed,
    component_failure,
    expected_ettr,
)
from sim.apps.runlength.rates import SECONDS_PER_DAY, job_rates
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

if TYPE_CHECKING:
    from sim.apps.runlength import RunPlan

__all__ = ["ZonePlan", "ZoneRuns", "shrunk_egress_usd", "shrunk_scenario", "simulate_zone_runs",
           "zone_fields", "zone_plan"]

SECONDS_PER_YEAR = 365.25 * SECONDS_PER_DAY
SHRUNK_ORIGIN = "run.zone_outage"


@dataclass(frozen=True)
class ZonePlan:
    """The outages to play and, for ``shrink``, the surviving layout's pace."""

    zones: int
    rate_per_s: float
    """Outages per zone per second."""
    duration_s: float
    policy: str
    checkpoint_survives: bool
    shrinks: bool = False
    """``shrink`` with an outage longer than a restart (else the job waits)."""
    progress_rate: float = 0.0
    """Useful work of the whole layout (its seconds) per wall second of the shrunk job:
    its expected goodput x step time / shrunk step time."""
    regrow_s: float = 0.0
    """The shrunk job's save before growing back (its synchronous checkpoint write)."""
    shrunk_step_s: float | None = None
    shrunk_dp: int | None = None
    shrunk_nodes: int | None = None
    shrunk_egress_usd_per_s: float = 0.0
    """Billed transfer per second trained shrunk (its steps' egress over its save cycle)."""


@dataclass(frozen=True)
class ZoneRuns(Runs):
    """:class:`Runs` with the outages each run met and the time they cost it."""

    zone_outages: np.ndarray
    zone_lost_s: np.ndarray
    """Per run: work lost, stops, and the shrunk layout's slower progress (whole-layout
    seconds not trained), summed over its outages."""
    shrunk_s: np.ndarray
    """Per run: wall time trained on the surviving zones."""


def shrunk_scenario(s: Scenario) -> tuple[Scenario, int]:
    """The job on the zones that survive losing zone 0 (the largest: node ``n`` is in zone
    ``n % azs``, or the first block: zone 0 holds the most either way), and its data-parallel
    size.

    The most replicas of ``tp x pp x cp`` GPUs that fill whole surviving servers and divide
    the global batch into whole micro-batches per replica (the same sequences per step);
    rank-level faults and claims describe the full layout and are dropped.

    Examples
    --------
    >>> s = Scenario(model="llama3-8b", cluster={"nodes": 4, "azs": 2},
    ...              training={"global_batch_size": 64})
    >>> small, dp = shrunk_scenario(s)
    >>> small.cluster.nodes, small.cluster.azs, dp, small.training.global_batch_size
    (2, 1, 16, 64)
    """
    c, p, t = s.cluster, s.parallelism, s.training
    survivors = c.nodes - math.ceil(c.nodes / c.azs)
    fixed = p.tp * p.pp * p.cp
    sequences = t.global_batch_size or t.micro_batch_size * s.dp
    dp = next((d for d in range(survivors * c.gpus_per_node // fixed, 0, -1)
               if d * fixed % c.gpus_per_node == 0 and sequences % (t.micro_batch_size * d) == 0),
              0)
    if dp == 0:
        raise ScenarioError(f"{SHRUNK_ORIGIN}.policy: shrink: the {survivors} servers left "
                            f"hold no whole replicas of tp*pp*cp = {fixed} GPUs that divide "
                            f"the global batch of {sequences}")
    data = s.model_dump(mode="json", exclude_unset=True, by_alias=True)
    for key in ("claims", "faults"):
        data.pop(key, None)
    if data.get("run"):
        data["run"].pop("zone_outage", None)
    # The surviving zones renumbered from 0 (their servers still round robin over them, and
    # the zones over the regions).
    data["cluster"].update(nodes=dp * fixed // c.gpus_per_node, azs=c.azs - 1,
                           regions=min(c.regions, c.azs - 1))
    if p.dp is not None:
        data["parallelism"]["dp"] = dp
    data.setdefault("training", {})["global_batch_size"] = sequences
    data["name"] = f"{s.name} [zone 0 down]"
    try:
        return scenario_from_dict(data, origin=SHRUNK_ORIGIN), dp
    except ScenarioError as exc:
        raise ScenarioError(f"{SHRUNK_ORIGIN}.policy: shrink: the surviving layout "
                            f"({dp} replicas) is refused: {exc}") from None


def zone_plan(result: RunResult, plan: RunPlan, checkpoint_bytes: float) -> ZonePlan:
    """The outages of ``result``'s scenario, with the shrunk layout simulated for ``shrink``."""
    s = result.scenario
    r = s.run
    assert r is not None and r.zone_outage is not None
    z = r.zone_outage
    survives = z.checkpoint_survives
    if survives is None:    # pfs needs it given (sim.config.run)
        survives = r.checkpoint.storage == "object_store"
    base = ZonePlan(zones=s.cluster.azs, rate_per_s=z.per_year / SECONDS_PER_YEAR,
                    duration_s=z.hours * 3600, policy=z.policy, checkpoint_survives=survives)
    if z.policy != "shrink":
        return base
    small, dp = shrunk_scenario(s)
    try:
        summary = simulate(small, 1, origin=SHRUNK_ORIGIN).summary
        step_s = summary["step_time_s"]
    except ScenarioError as exc:
        raise ScenarioError(f"{SHRUNK_ORIGIN}.policy: shrink: the surviving layout "
                            f"({dp} replicas) is refused: {exc}") from None
    spec = fabric_spec(small)
    times = checkpoint_times(checkpoint_bytes, r.checkpoint.storage,
                             r.checkpoint.gbytes_per_s or spec.nvme_write_gbytes_per_s,
                             small.cluster.nodes, small.gpus, spec.pcie_gbytes_per_s)
    sp = replace(plan, step_s=step_s, write_s=times.write_s, copy_s=times.copy_s,
                 rates=job_rates(small))
    k = plan.interval_steps
    ettr = float(expected_ettr(np.asarray(k * step_s), sp.blocking_s(k),
                               times.write_s if sp.asynchronous else 0.0,
                               sp.rates.unplanned_per_day / SECONDS_PER_DAY, plan.restart_s))
    cycle_s = step_s + float(sp.blocking_s(k)) / k
    return replace(base, shrinks=base.duration_s > plan.restart_s,
                   progress_rate=ettr * plan.step_s / step_s, regrow_s=times.write_s,
                   shrunk_step_s=step_s, shrunk_dp=dp, shrunk_nodes=small.cluster.nodes,
                   shrunk_egress_usd_per_s=summary["cost"]["egress_usd_per_step"] / cycle_s)


def _check_finishes(inp: RunInputs, lam: float, z: ZonePlan) -> None:
    """Refuse a run that would practically never finish (as :func:`simulate_runs` does)."""
    lam_z = z.zones * z.rate_per_s
    cycle = inp.segment_s + inp.blocking_s
    segments = math.ceil(inp.work_s / inp.segment_s) if inp.work_s > 0 else 0
    if z.checkpoint_survives:
        expected = segments * math.expm1(min((lam + lam_z) * (cycle + inp.durable_after_s),
                                              700.0))
        span = f"a checkpoint every {cycle / 60:.3g} min"
    else:   # every outage starts the run over: it needs one outage-free run
        expected = math.expm1(min(lam_z * segments * cycle, 700.0))
        span = f"a run of {segments * cycle / SECONDS_PER_DAY:.3g} days"
    if expected > MAX_INTERRUPTIONS:
        raise ValueError(f"run.zone_outage: about {expected:.2g} restarts against {span}: the "
                         "run would practically never finish")


def simulate_zone_runs(inp: RunInputs, z: ZonePlan, samples: int, seed: int) -> ZoneRuns:
    """Play ``samples`` whole runs with component failures and zone outages (module
    docstring); :func:`sim.apps.runlength.montecarlo.simulate_runs`'s loop with the outages
    raced against the failures."""
    rates = np.asarray(inp.rates_per_s, dtype=float)
    lam = float(rates.sum())
    lam_z = z.zones * z.rate_per_s
    _check_finishes(inp, lam, z)
    rng = np.random.default_rng(seed)
    st = RunState.start(samples, inp.spares)
    zone_count = np.zeros(samples, dtype=np.int64)
    zone_lost = np.zeros(samples)
    shrunk = np.zeros(samples)
    active = np.ones(samples, dtype=bool)
    cum = np.cumsum(rates) / lam if lam > 0 else rates
    needs = np.asarray(inp.needs_node, dtype=bool)
    planned = np.asarray(inp.planned, dtype=bool)
    never = np.full(samples, np.inf)
    while active.any():
        remaining = inp.work_s - st.w
        finish_s = (remaining + checkpoints_needed(remaining, inp.segment_s) * inp.blocking_s
                    + inp.durable_after_s)
        # Three draws per run per iteration whatever the rates and policy (common numbers).
        gap_c = rng.standard_exponential(samples) / lam if lam > 0 else never
        gap_z = rng.standard_exponential(samples) / lam_z if lam_z > 0 else never
        comp = np.minimum(np.searchsorted(cum, rng.random(samples), side="right"),
                          len(rates) - 1)
        gap = np.minimum(gap_c, gap_z)
        done = active & (gap >= finish_s)
        st.t[done] += finish_s[done]
        active &= ~done
        outage = active & (gap_z < gap_c)
        hit = active & ~outage
        # A component failure, as simulate_runs plays it.
        durable = component_failure(inp, st, hit, gap, planned[comp], hit & needs[comp])
        if outage.any():
            _outage(inp, z, outage, gap, durable, st.w, st.t, st.down, zone_lost, shrunk,
                    active)
            zone_count[outage] += 1
    return ZoneRuns(wall_s=st.t, interruptions=st.count, down_s=st.down, waits_s=st.waits,
                    unplanned=st.unplanned, zone_outages=zone_count, zone_lost_s=zone_lost,
                    shrunk_s=shrunk)


def _outage(inp: RunInputs, z: ZonePlan, hit: np.ndarray, gap: np.ndarray, durable: np.ndarray,
            w: np.ndarray, t: np.ndarray, down: np.ndarray, lost: np.ndarray,
            shrunk: np.ndarray, active: np.ndarray) -> None:
    """Apply a zone outage to the runs ``hit`` (in place): lose the work since the durable
    checkpoint (or all of it), then wait, or train shrunk until the zone returns."""
    # Wall time to train again: since the last durable checkpoint (its cycle's end), and,
    # without a checkpoint to load, every cycle before it.
    per_work = (inp.segment_s + inp.blocking_s) / inp.segment_s
    redo = gap[hit] - durable[hit] * per_work
    if z.checkpoint_survives:
        w[hit] = np.minimum(w[hit] + durable[hit], inp.work_s)
    else:
        redo += w[hit] * per_work
        w[hit] = 0.0
    lost[hit] += redo
    if not z.shrinks:
        stop = z.duration_s + inp.restart_s
        t[hit] += gap[hit] + stop
        down[hit] += stop
        lost[hit] += stop
        return
    # Shrunk from a restart after the outage starts until the zone returns.
    window = z.duration_s - inp.restart_s
    need = inp.work_s - w[hit]
    gain = z.progress_rate * window
    ends = gain >= need
    idx = np.flatnonzero(hit)
    fin, cont = idx[ends], idx[~ends]
    # The run ends shrunk: the rest of its work at the shrunk pace.
    shrunk_s = need[ends] / z.progress_rate
    t[fin] += gap[fin] + inp.restart_s + shrunk_s
    down[fin] += inp.restart_s
    lost[fin] += inp.restart_s + shrunk_s - need[ends]
    shrunk[fin] += shrunk_s
    w[fin] = inp.work_s
    active[fin] = False
    # Back to the whole cluster: save on the shrunk layout, restart.
    stops = 2 * inp.restart_s + z.regrow_s
    w[cont] += gain
    t[cont] += gap[cont] + z.duration_s + z.regrow_s + inp.restart_s
    down[cont] += stops
    lost[cont] += z.duration_s + z.regrow_s + inp.restart_s - gain
    shrunk[cont] += window


def shrunk_egress_usd(z: ZonePlan | None, runs: ZoneRuns | None) -> float:
    """Billed transfer of the steps trained shrunk, per run on average (the whole layout's
    is billed over its own training time, :attr:`RunOutcome.busy_s`)."""
    if z is None or runs is None:
        return 0.0
    return float(runs.shrunk_s.mean()) * z.shrunk_egress_usd_per_s


def zone_fields(z: ZonePlan, runs: ZoneRuns | None) -> dict[str, Any]:
    """The run object's zone-outage keys (:class:`sim.analysis.summary.RunLength`);
    ``runs`` None: none were drawn (a rate of 0)."""
    return {
        "zone_outage_policy": z.policy,
        "zone_outages_expected": 0.0 if runs is None else float(runs.zone_outages.mean()),
        "zone_outage_days_lost": 0.0 if runs is None
        else float(runs.zone_lost_s.mean()) / SECONDS_PER_DAY,
        "zone_outage_checkpoint_survives": z.checkpoint_survives,
        "shrunk_step_time_s": z.shrunk_step_s,
        "shrunk_dp": z.shrunk_dp,
        "shrunk_nodes": z.shrunk_nodes,
    }
