"""Availability-zone outages in the run model (sim/apps/runlength/zones.py): closed forms,
the bound under which ``shrink`` never loses to ``wait``, determinism, and the keys' errors.

Truths the Monte Carlo is checked against (every test plays its own hand-made inputs):

- ``wait``, checkpoint kept, no other failures: outages arrive at ``lambda = zones x rate``
  while the job trains; each costs the outage, a restart and the wall time since the last
  checkpoint, on average half a checkpoint cycle ``c`` (the arrival falls uniformly in the
  cycle). Training time exposed is the run ``T0`` plus the cycles redone, so the count is
  ``N = lambda T0 / (1 - lambda c / 2)`` and the run grows by ``N (D + restart + c / 2)``
  (the issue's ``rate x run years x hours`` plus the restarts and lost work);
- checkpoint lost: the run needs one outage-free stretch of ``T0``; the renewal form gives
  ``E[wall] = (1 / lambda + D + restart) (exp(lambda T0) - 1)`` (Daly, FGCS 22 (2006), eq. 11,
  with the whole run as one segment);
- ``shrink`` versus ``wait`` (same draws): at each outage shrink spends ``regrow`` more wall
  time (its save before growing back) and gains ``rho x (D - restart)`` of the whole
  layout's work in its window, so it is never worse, run by run, when
  ``rho x (D - restart) >= regrow``; with ``rho = ETTR_shrunk x step / step_shrunk`` and a
  shrunk step no slower than ``step x dp / dp_shrunk`` (the same batch on fewer replicas), a
  sufficient condition is ``(D - restart) x ETTR_shrunk x dp_shrunk / dp >= regrow``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.apps.runlength.montecarlo import RunInputs, simulate_runs
from sim.apps.runlength.zones import ZonePlan, shrunk_scenario, simulate_zone_runs
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

DAY = 86_400.0
YEAR = 365.25 * DAY
HOUR = 3600.0


def inputs(work_days: float = 100.0, per_day: float = 0.0, planned: bool = False) -> RunInputs:
    """A run of ``work_days`` of training, a 60 s save every hour, 10 min restarts."""
    return RunInputs(work_s=work_days * DAY, segment_s=HOUR, blocking_s=60.0,
                     durable_after_s=0.0, save_s=60.0, restart_s=600.0, replace_s=0.0,
                     repair_s=DAY, spares=0, rates_per_s=(per_day / DAY,),
                     needs_node=(False,), planned=(planned,))


def plan(per_year: float = 6.0, hours: float = 8.0, policy: str = "wait",
         survives: bool = True, **kw: float) -> ZonePlan:
    return ZonePlan(zones=2, rate_per_s=per_year / YEAR, duration_s=hours * HOUR,
                    policy=policy, checkpoint_survives=survives, **kw)  # type: ignore[arg-type]


def outage_free_wall(inp: RunInputs) -> float:
    return inp.work_s + math.ceil(inp.work_s / inp.segment_s) * inp.blocking_s


def test_wait_adds_outage_hours_in_closed_form() -> None:
    inp, z = inputs(), plan()
    runs = simulate_zone_runs(inp, z, 4000, seed=1)
    t0 = outage_free_wall(inp)
    lam = z.zones * z.rate_per_s
    c = inp.segment_s + inp.blocking_s
    n = lam * t0 / (1 - lam * c / 2)
    added = n * (z.duration_s + inp.restart_s + c / 2)
    extra = runs.wall_s - t0
    se = extra.std() / math.sqrt(extra.size)
    assert abs(extra.mean() - added) < 4 * se
    assert runs.zone_outages.mean() == pytest.approx(n, rel=4 * math.sqrt(n / 4000) / n)
    # The form: zones x rate x run-years x hours, plus restarts and lost work (~4%).
    assert extra.mean() == pytest.approx(2 * 6.0 * t0 / YEAR * z.duration_s, rel=0.08)
    # Every second added is an outage's: the run object's days lost are the whole difference.
    assert runs.zone_lost_s.mean() == pytest.approx(extra.mean(), rel=1e-9)


def test_lost_checkpoint_needs_an_outage_free_run() -> None:
    inp, z = inputs(work_days=10.0), plan(survives=False)
    runs = simulate_zone_runs(inp, z, 4000, seed=2)
    t0 = outage_free_wall(inp)
    lam = z.zones * z.rate_per_s
    expected = (1 / lam + z.duration_s + inp.restart_s) * math.expm1(lam * t0)
    se = runs.wall_s.std() / math.sqrt(runs.wall_s.size)
    assert abs(runs.wall_s.mean() - expected) < 4 * se
    kept = simulate_zone_runs(inp, plan(), 4000, seed=2)
    assert runs.wall_s.mean() > kept.wall_s.mean()


def test_zero_rate_is_the_run_without_outages() -> None:
    inp = inputs(work_days=30.0, per_day=2.0)
    runs = simulate_zone_runs(inp, plan(per_year=0.0), 500, seed=3)
    base = simulate_runs(inp, 500, seed=3)
    # Other draws (three a loop, not two), the same model: the means agree within noise.
    assert runs.wall_s.mean() == pytest.approx(base.wall_s.mean(),
                                               abs=4 * base.wall_s.std() / math.sqrt(500))
    assert runs.zone_outages.sum() == 0 and runs.zone_lost_s.sum() == 0


@pytest.mark.parametrize("per_day", [0.0, 2.0])
def test_shrink_never_loses_to_wait_at_the_bound(per_day: float) -> None:
    inp = inputs(work_days=60.0, per_day=per_day)
    regrow = 300.0
    window = 8 * HOUR - inp.restart_s
    at_bound = regrow / window          # rho x (D - restart) = regrow exactly
    wait = simulate_zone_runs(inp, plan(per_year=12.0), 1000, seed=4)
    for rho in (at_bound, 0.5, 1.0):
        shrink = simulate_zone_runs(inp, plan(per_year=12.0, policy="shrink", shrinks=True,
                                              progress_rate=rho, regrow_s=regrow), 1000, seed=4)
        assert np.all(shrink.wall_s <= wait.wall_s + 1e-6)
        assert np.array_equal(shrink.zone_outages > 0, wait.zone_outages > 0)
    # Below the bound shrink costs more than it gains: regrow - rho (D - restart) = 150 s
    # an outage (on average: a run that finishes earlier may dodge a later failure).
    slow = simulate_zone_runs(inp, plan(per_year=12.0, policy="shrink", shrinks=True,
                                        progress_rate=at_bound / 2, regrow_s=regrow),
                              1000, seed=4)
    assert slow.wall_s.mean() > wait.wall_s.mean()
    if per_day == 0:    # nothing else to dodge: run by run, 150 s an outage exactly
        assert np.allclose(slow.wall_s - wait.wall_s, 150.0 * wait.zone_outages)


def test_shrink_at_full_pace_costs_only_restarts_and_lost_work() -> None:
    # rho = 1: the window trains as fast as the whole layout; an outage costs two restarts,
    # the save before growing back and the work since the checkpoint, not its hours.
    inp = inputs()
    z = plan(per_year=12.0, policy="shrink", shrinks=True, progress_rate=1.0, regrow_s=60.0)
    runs = simulate_zone_runs(inp, z, 2000, seed=5)
    c = inp.segment_s + inp.blocking_s
    per_outage = runs.zone_lost_s.sum() / runs.zone_outages.sum()
    assert per_outage == pytest.approx(2 * inp.restart_s + 60.0 + c / 2, rel=0.05)


def test_same_seed_same_runs_other_seed_other_runs() -> None:
    inp = inputs(work_days=30.0, per_day=1.0)
    z = plan(per_year=12.0)
    a, b = (simulate_zone_runs(inp, z, 300, seed=7) for _ in range(2))
    assert np.array_equal(a.wall_s, b.wall_s) and np.array_equal(a.zone_lost_s, b.zone_lost_s)
    c = simulate_zone_runs(inp, z, 300, seed=8)
    assert not np.array_equal(a.wall_s, c.wall_s)


def test_a_run_that_would_never_finish_is_refused() -> None:
    with pytest.raises(ValueError, match="run.zone_outage: .*never finish"):
        simulate_zone_runs(inputs(work_days=3000.0), plan(per_year=300.0, survives=False),
                           10, seed=0)


# --------------------------------------------------------------------------- layouts and keys
def test_shrunk_layout_keeps_the_batch_on_the_surviving_zones() -> None:
    # 9 servers over 3 zones (3 each), tp 2: zone 0 down leaves 6 servers = 24 replicas;
    # a batch of 96 divides over 24 replicas of micro-batch 2 (2 micro-batches each).
    s = Scenario(model="llama3-8b", cluster={"nodes": 9, "azs": 3},
                 parallelism={"tp": 2}, training={"micro_batch_size": 2,
                                                  "global_batch_size": 96})
    small, dp = shrunk_scenario(s)
    assert (small.cluster.nodes, small.cluster.azs, dp) == (6, 2, 24)
    assert small.training.global_batch_size == 96 and small.dp == 24
    # A batch of 72 is 36 micro-batches: the most replicas dividing 36 whose GPUs (2 each)
    # fill whole 8-GPU servers are 12 (24, 20 and 16 do not divide 36): 3 servers.
    data = s.model_dump(mode="json", exclude_unset=True)
    data["training"]["global_batch_size"] = 72
    small, dp = shrunk_scenario(scenario_from_dict(data))
    assert (dp, small.cluster.nodes, small.training.global_batch_size) == (12, 3, 72)


def test_two_zones_in_two_regions_leave_one_region() -> None:
    s = Scenario(model="llama3-8b", cluster={"nodes": 4, "azs": 2, "regions": 2},
                 training={"global_batch_size": 64})
    small, _ = shrunk_scenario(s)
    assert (small.cluster.nodes, small.cluster.azs, small.cluster.regions) == (2, 1, 1)


def test_a_replica_larger_than_the_survivors_is_one_line() -> None:
    s = Scenario(model="llama3-8b", cluster={"nodes": 2, "azs": 2}, parallelism={"tp": 8, "pp": 2},
                 training={"global_batch_size": 16})
    with pytest.raises(ScenarioError) as err:
        shrunk_scenario(s)
    assert str(err.value).startswith("run.zone_outage.policy: shrink:")
    assert "\n" not in str(err.value)


RUN = {"checkpoint_interval_steps": 100}


def _scenario(azs: int, run: dict) -> dict:
    return {"model": "llama3-8b", "cluster": {"nodes": 2, "azs": azs},
            "training": {"tokens_total": 1e10}, "run": run}


def test_one_zone_with_an_outage_is_one_line_naming_the_key() -> None:
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(_scenario(1, {**RUN, "zone_outage": {"per_year": 1, "hours": 4}}),
                           origin="f.yaml")
    assert str(err.value) == ("f.yaml: run.zone_outage: needs a cluster over 2 or more zones "
                              "(cluster.azs is 1)")


@pytest.mark.parametrize(("outage", "where"), [
    ({"hours": 4}, "run.zone_outage.per_year"),
    ({"per_year": 1}, "run.zone_outage.hours"),
    ({"per_year": -1, "hours": 4}, "run.zone_outage.per_year"),
    ({"per_year": 1, "hours": 4, "policy": "move"}, "run.zone_outage.policy"),
])
def test_rate_and_duration_are_the_users(outage: dict, where: str) -> None:
    with pytest.raises(ScenarioError, match=f"^f.yaml: {where}"):
        scenario_from_dict(_scenario(2, {**RUN, "zone_outage": outage}), origin="f.yaml")


def test_a_parallel_file_system_must_say_whether_it_survives() -> None:
    run = {**RUN, "checkpoint": {"storage": "pfs", "gbytes_per_s": 100},
           "zone_outage": {"per_year": 1, "hours": 4}}
    with pytest.raises(ScenarioError, match="run.zone_outage.checkpoint_survives: needed"):
        scenario_from_dict(_scenario(2, run), origin="f.yaml")
    run["zone_outage"]["checkpoint_survives"] = True
    assert scenario_from_dict(_scenario(2, run)).run.zone_outage.checkpoint_survives
