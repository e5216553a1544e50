"""Building and simulating one layout: the planner's worker tasks.

:func:`evaluate_layout` builds a layout's program (a shorter step for long pipelines,
:func:`proxy_micro_batches`) and gives its memory estimate and lower bound;
:func:`simulate_layout` simulates its step; :func:`backend_simulations` does that on a Ray or
Dask backend. Each runs in a worker process and returns a refusal or an error as data, never
raising. Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sim.analysis.summary import Summary
from sim.apps.executor import Backend, Outcome, Task, attempt, simulate_in_order, type_and_message
from sim.apps.plan.bound import LinkRates, _earliest_schedule, per_micro_batch_bound
from sim.apps.plan.layouts import PLAN_ORIGIN, Layout, _space, layout_scenario, refusal_key
from sim.apps.plan.memory import memory_estimate, memory_program_order
from sim.scenario import Scenario, ScenarioError


@dataclass(frozen=True)
class Evaluation:
    """What building one layout told: refused, or its memory estimate and time bound."""

    refused: str | None
    """Key path of the framework's refusal, or None."""
    message: str | None
    memory_bytes: float
    """Upper estimate of the busiest rank class's peak (:func:`memory_estimate`)."""
    states_bytes: float
    """The largest ``RankClass.initial_memory`` (parameters, gradients, optimizer states)."""
    lower_bound_s: float
    """Step time of the earliest schedule (:func:`_earliest_schedule`); inf if not computed
    (the layout does not fit)."""
    ops: int
    wall_s: float
    smi_bytes: float = 0.0
    """The largest estimate plus what ``nvidia-smi`` adds beside PyTorch's allocator on that
    GPU (the CUDA context and NCCL's buffers, :func:`sim.analysis.memory_overheads.overheads`,
    the same the simulation judges running out of memory by); 0 if refused."""
    host_s: float = 0.0
    """The largest rank class's host seconds issuing the step's ops (``Op.cpu_s``, scaled to
    the layout's micro-batches); what options that only save host time can take off the
    bound at most (:mod:`sim.apps.plan.levers`); 0 if not scheduled."""


def _short_step(layout: Layout) -> bool:
    """Whether the layout's memory peak stops growing after 2 x pp micro-batches: without
    pipeline parallelism always, with it when the search space says so
    (``short_step_with_pipeline``; checked in ``tests/integration/test_plan.py``)."""
    space = _space(layout.framework)
    return layout.pp == 1 or (space is not None and space.short_step_with_pipeline)


def proxy_micro_batches(micro_batches: int, pp: int) -> int:
    """Micro-batches of the shorter step the planner builds instead of the layout's own.

    A pipeline reaches its steady state within 2 x pp micro-batches: 1F1B keeps at most
    pp - s in flight on stage s, interleaved 1F1B at most (pp - s - 1) x 2 + (vp - 1) x pp
    + 1 chunk passes, under 2 x pp micro-batches' worth; data parallelism without a
    pipeline after its first micro-batch. Each micro-batch after that adds the same ops,
    so the peak memory of the short step is the long one's, and its step time grows by
    the same amount per micro-batch (:func:`per_micro_batch_bound`). The count keeps
    ``micro_batches mod pp`` (interleaving needs a multiple of pp; torch's Schedule1F1B at
    least pp) and at least three, so that a micro-batch with neither the first's nor the
    last's extra work exists.

    Not for FSDP2 with pipeline parallelism (:func:`_short_step`): there the simulated
    last stage's buffers keep growing with the micro-batch count (70B-like 8-layer model,
    pp 4: 3.8 GiB of buffers at 8 micro-batches, 7.1 at 16, 11.1 at 32), so the full step
    is built.

    Examples
    --------
    >>> proxy_micro_batches(32, 4), proxy_micro_batches(8, 4), proxy_micro_batches(64, 1)
    (8, 8, 3)
    """
    if micro_batches <= max(3 * pp, 3):
        return micro_batches
    return max(2 * pp + micro_batches % pp, 3)


def evaluate_layout(base: Scenario, layout: Layout, rates: LinkRates, usable_bytes: float,
                    micro_batches: int = 0) -> Evaluation:
    """Build the layout's program and estimate it (runs in a worker).

    With ``micro_batches`` (the layout's count) above :func:`proxy_micro_batches`, the
    shorter step is built: same memory, and the bound grows by
    :func:`per_micro_batch_bound` per micro-batch left out. A layout whose program-order
    replay already exceeds ``usable_bytes`` is not scheduled (it is pruned either way) and
    gets an infinite bound."""
    from sim.frameworks import JobContext, build_program

    t0 = time.perf_counter()
    built = micro_batches
    try:
        if micro_batches > 0 and _short_step(layout):
            built = proxy_micro_batches(micro_batches, layout.pp)
            scenario = layout_scenario(base, layout, global_batch=built * layout.dp
                                       * layout.micro_batch_size)
        else:
            scenario = layout_scenario(base, layout)
        program = build_program(JobContext.from_scenario(scenario, PLAN_ORIGIN))
    except ScenarioError as exc:
        key, message = refusal_key(exc)
        return Evaluation(key, message, 0.0, 0.0, math.inf, 0, time.perf_counter() - t0)
    states = max(sum(c.initial_memory.values()) for c in program.classes)
    order = memory_program_order(program)
    if max(order.values()) > usable_bytes:
        return Evaluation(None, None, max(order.values()), states, math.inf,
                          len(program.ops), time.perf_counter() - t0,
                          _with_overheads(scenario, program, order))
    sched = _earliest_schedule(program, rates)
    memory = memory_estimate(program, sched)
    bound = sched.makespan if sched is not None else 0.0
    if micro_batches > built:
        bound += (micro_batches - built) * per_micro_batch_bound(program, rates, built)
    host = max(sum(op.cpu_s for ops in c.streams.values() for op in ops)
               for c in program.classes) * max(micro_batches / max(built, 1), 1.0)
    return Evaluation(None, None, max(memory.values()), states, bound, len(program.ops),
                      time.perf_counter() - t0, _with_overheads(scenario, program, memory),
                      host)


def _with_overheads(scenario: Scenario, program: Any, memory: dict[int, float]) -> float:
    """The largest of each rank class's ``memory`` plus its GPU's CUDA context and NCCL
    buffers (:func:`sim.analysis.memory_overheads.overheads`, as the simulation adds them)."""
    from sim import catalog
    from sim.analysis.memory_overheads import overheads

    arch = catalog.gpu(scenario.cluster.gpu).arch
    per_node = scenario.cluster.gpus_per_node
    return max(memory[c.id] + overheads(program, c, arch, per_node).outside_allocator
               for c in program.classes)


@dataclass(frozen=True)
class Simulated:
    """One simulated step: its summary, or the error that stopped it."""

    summary: Summary | None
    error: str | None
    wall_s: float
    cached: bool = False
    """Served from the cache (a re-run of an interrupted plan), not simulated now."""


def simulate_layout(base: Scenario, layout: Layout, cache_dir: str | None = None
                    ) -> Simulated:
    """Simulate one training step of the layout (runs in a worker); an exception, building
    the layout's scenario included, is the layout's error, not the plan's. With
    ``cache_dir``, through the sweep's cache (:func:`cached_simulation`)."""
    return cached_simulation(lambda: layout_scenario(base, layout), cache_dir)


def _simulated(out: Outcome) -> Simulated:
    return Simulated(out.summary, out.error, out.wall_s)


def _simulate_base(base: Scenario, cache_dir: str | None = None) -> Simulated:
    # The scenario as given may be one its framework refuses: its error, not the plan's.
    return cached_simulation(lambda: base, cache_dir)


def cached_simulation(scenario: Callable[[], Scenario], cache_dir: str | None) -> Simulated:
    """Simulate one step of ``scenario()``; with ``cache_dir``, look it up in the sweep's
    cache first (:class:`~sim.apps.sweep.cache.SweepCache`: checked entries, written
    atomically, so the plan's worker processes share it safely) and store what is
    simulated, so that a plan interrupted and run again simulates only what is missing.
    Errors are not cached."""
    from sim.api import simulate
    from sim.apps.sweep.cache import SweepCache, cache_key

    cache = SweepCache(Path(cache_dir)) if cache_dir else None
    hit: list[tuple[Summary, float]] = []   # the cache's summary, as the simulation's

    def work() -> Summary:
        sc = scenario()
        key = cache_key(sc, 1) if cache is not None else ""
        if cache is not None:
            got = cache.get(key)
            if got is not None:
                hit.append((cast(Summary, got[0]), got[1]))
                return hit[0][0]
        t0 = time.perf_counter()
        summary = simulate(sc, origin=PLAN_ORIGIN).summary
        if cache is not None:
            cache.put(key, summary, time.perf_counter() - t0)
        return summary

    out = attempt(0, work, type_and_message)
    if hit:
        return Simulated(hit[0][0], None, hit[0][1], cached=True)
    return _simulated(out)


# --------------------------------------------------------------------------- backend hook
SimulateMany = Callable[[Scenario, list[Layout]], list[Simulated]]
"""A backend hook: simulate these layouts of the base scenario (anywhere), in order."""


def backend_simulations(be: Backend) -> SimulateMany:
    """The :data:`SimulateMany` hook on an open executor backend (``--backend ray|dask``):
    each batch of layouts runs there, one layout to a worker task, and comes back in order
    (a failed layout or a dead worker as that layout's error)."""
    def simulate_many(base: Scenario, layouts: list[Layout]) -> list[Simulated]:
        tasks = [Task(i, layout_scenario(base, x), x.varied()) for i, x in enumerate(layouts)]
        return [_simulated(o) for o in simulate_in_order(be, tasks, 1)]

    return simulate_many


def cached_many(simulate_many: SimulateMany, cache_dir: str) -> SimulateMany:
    """``simulate_many`` (a Ray or Dask hook) through the sweep's cache: layouts simulated
    before come from the cache, the rest go to the backend and their summaries are stored
    (by this process: the cluster's workers need no shared disk)."""
    from sim.apps.sweep.cache import SweepCache, cache_key

    cache = SweepCache(Path(cache_dir))

    def many(base: Scenario, layouts: list[Layout]) -> list[Simulated]:
        got: list[Simulated | None] = [None] * len(layouts)
        keys: dict[int, str] = {}
        for i, x in enumerate(layouts):
            try:
                keys[i] = cache_key(layout_scenario(base, x), 1)
            except Exception:   # noqa: BLE001 - the backend reports the layout's error
                continue
            hit = cache.get(keys[i])
            if hit is not None:
                got[i] = Simulated(cast(Summary, hit[0]), None, hit[1], cached=True)
        missing = [i for i, g in enumerate(got) if g is None]
        fresh = simulate_many(base, [layouts[i] for i in missing]) if missing else []
        for i, sim in zip(missing, fresh, strict=True):
            if sim.summary is not None and i in keys:
                cache.put(keys[i], sim.summary, sim.wall_s)
            got[i] = sim
        return [g for g in got if g is not None]

    return many
