"""The planner's search: layer profiles, then branch and bound over building and simulating.

:func:`search` enumerates the layouts (:mod:`sim.apps.plan.layouts`), bounds them by layer
profiles (:mod:`sim.apps.plan.profile`), builds them best bound first
(:mod:`sim.apps.plan.evaluate`)
dropping those that do not fit (:mod:`sim.apps.plan.memory`), and simulates the fitting ones best
bound first until nothing left can enter the top K (:class:`_BranchAndBound`). Part of
``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.analysis.summary import Summary
from sim.apps.executor import Pool
from sim.apps.plan.bound import LinkRates
from sim.apps.plan.evaluate import (
    Evaluation,
    Simulated,
    SimulateMany,
    _simulate_base,
    cached_many,
    evaluate_layout,
    simulate_layout,
)
from sim.apps.plan.layouts import Layout, _Shape, _shape, _space, enumerate_layouts
from sim.apps.plan.levers import Levers
from sim.apps.plan.memory import MemoryPruning
from sim.apps.plan.probes import _FamilyProbes
from sim.apps.plan.profile import _profile_key, _profiles_task, profile_bound
from sim.apps.plan.recompute import LighterFits
from sim.apps.plan.workers import _also, _batch_results, _Workers
from sim.frameworks.registry import SearchSpace
from sim.scenario import Scenario, ScenarioError

OBJECTIVES = ("time", "cost")
DEFAULT_TOP = 5
DEFAULT_MAX_SIMULATIONS = 16
"""Simulations at most, whatever the bounds say. Llama 3 70B on 64 H100: the 16 best bounds
are all Megatron layouts of 1.6-7 s each, 50 CPU-seconds; the search as a whole stays under
two minutes on two cores (docs/planner.md)."""


@dataclass
class Candidate:
    """One enumerated layout and what the search learnt about it."""

    index: int
    layout: Layout
    micro_batches: int
    bound0_s: float = 0.0
    """:func:`profile_bound` (0 where no profile applies)."""
    status: str = "pending"
    """refused | memory | bound | budget | simulated | oom | error"""
    reason: str = ""
    evaluation: Evaluation | None = None
    simulated: Simulated | None = None

    @property
    def family(self) -> tuple[Any, ...]:
        """Layouts that differ only in micro-batch size and recomputation (for a
        mixture-of-experts model the expert layout is part of it: ``(ep, etp)`` last)."""
        x = self.layout
        fam: tuple[Any, ...] = (x.framework, x.tp, x.pp, x.dp, x.cp, x.vp, x.options)
        return fam + ((x.ep, x.etp),) if x.moe else fam

    @property
    def lower_bound_s(self) -> float:
        """The best lower bound known: the built program's, else the profile's."""
        ev = self.evaluation
        if ev is not None and math.isfinite(ev.lower_bound_s):
            return max(ev.lower_bound_s, self.bound0_s)
        return self.bound0_s

    @property
    def summary(self) -> Summary | None:
        return self.simulated.summary if self.simulated is not None else None


@dataclass
class PlanResult:
    """Everything one search did."""

    base: Scenario
    objective: str
    top_k: int
    candidates: list[Candidate]
    wall_s: float
    workers: int
    backend: str
    stop: str
    """Why the search stopped: bound (nothing left could enter the top K), budget
    (``max_simulations`` reached), time (``time_limit_s``), exhausted (everything done)."""
    profiles: int = 0
    """Layer profiles built (:func:`layer_profile`)."""
    usd_per_second: float = 0.0
    """GPU price of the whole cluster per second (for bounds in dollars)."""
    baseline: Simulated | None = None
    """The scenario as given, simulated: what the top layouts are compared with."""

    def objective_of(self, summary: Summary) -> float:
        return objective_value(summary, self.objective)

    @property
    def built(self) -> list[Candidate]:
        return [c for c in self.candidates if c.evaluation is not None]

    @property
    def fitted(self) -> list[Candidate]:
        """Built layouts whose memory estimate fits (simulated out-of-memory ones excluded)."""
        return [c for c in self.candidates if c.evaluation is not None
                and c.evaluation.refused is None and c.status not in ("memory", "oom")]

    @property
    def simulated(self) -> list[Candidate]:
        return [c for c in self.candidates if c.simulated is not None]

    def ranked(self) -> list[Candidate]:
        """Simulated layouts that fit, best first by the objective (ties: fewer GPUs-idle
        reasons do not break them; the enumeration order does)."""
        ok = [(c, s) for c in self.candidates
              if c.status == "simulated" and (s := c.summary) is not None]
        ok.sort(key=lambda cs: (self.objective_of(cs[1]), cs[0].index))
        return [c for c, _ in ok]

    def pruned(self) -> dict[str, int]:
        """Layouts not simulated (or simulated and out of memory), counted by reason."""
        counts: Counter[str] = Counter()
        for c in self.candidates:
            if c.status in ("simulated",):
                continue
            counts[f"{c.status}: {c.reason}" if c.reason else c.status] += 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def objective_value(summary: Summary, objective: str) -> float:
    """Step time (s) or dollars per million tokens of a summary: lower is better."""
    if objective == "cost":
        return float(summary["cost"]["usd_per_million_tokens"])
    return float(summary["step_time_s"])



def search(base: Scenario, objective: str = "time", top: int = DEFAULT_TOP,
           frameworks: Sequence[str] | None = None, workers: int = 1,
           max_simulations: int = DEFAULT_MAX_SIMULATIONS, time_limit_s: float | None = None,
           simulate_many: SimulateMany | None = None, backend: str = "local",
           progress: Callable[[str, int, int], None] | None = None,
           simulation_batch: int | None = None, compare_baseline: bool = True,
           pin: Mapping[str, Any] | None = None, cache: Path | None = None) -> PlanResult:
    """Enumerate, build, bound and simulate layouts of ``base``; see :mod:`sim.apps.plan`.

    ``workers`` processes (joblib's loky) build and simulate; 1 runs everything here.
    ``simulate_many`` (a hook for Ray or Dask) simulates instead of the local processes:
    called from one thread with the next ``simulation_batch`` (default ``workers``) best
    layouts at a time, while the local processes keep building. ``progress(phase, done,
    total)`` is called after each build or simulation (``done`` of that phase so far, of
    ``total`` layouts). With ``compare_baseline`` the scenario as
    given is simulated too (:attr:`PlanResult.baseline`). ``pin`` keeps only the layouts
    that set these keys (:meth:`Layout.varied`, e.g. ``{"parallelism.tp": 1}``) to these
    values. With ``cache`` (a folder), simulations go through the sweep's cache
    (:func:`cached_simulation`): a plan run again simulates only what is missing.
    Raises ScenarioError on bad arguments.
    """
    _check_arguments(objective, top, max_simulations)
    t0 = time.perf_counter()
    layouts = enumerate_layouts(base, frameworks)
    if pin:
        layouts = [x for x in layouts
                   if all(k in (v := x.varied()) and v[k] == want for k, want in pin.items())]
        if not layouts:
            raise ScenarioError(f"pin {dict(pin)}: no layout of the search sets these keys "
                                "to these values")
    shape = _shape(base)
    rates = LinkRates.of(base)
    goal, usable = _Objective.of(base, shape, objective)
    cands = _candidates(layouts, shape.global_batch)
    runner = Pool(workers)
    with runner.killed_on_interrupt():
        sim_thread: Any = None
        cache_dir = str(cache) if cache is not None else None
        if simulate_many is not None and cache_dir is not None:
            simulate_many = cached_many(simulate_many, cache_dir)
        if simulate_many is not None:
            # One thread calls the hook, one batch at a time: the backend runs the batch's
            # layouts in parallel; local processes keep building meanwhile.
            sim_thread = ThreadPoolExecutor(max_workers=1)
        profiles = _profile_phase(base, cands, shape, rates, runner)
        if progress is not None:
            progress("profiles", profiles, profiles)
        # The scenario as given, for comparison, alongside the search.
        baseline_future = (runner.submit(_simulate_base, base, *_also(cache_dir))
                           if compare_baseline else None)
        pool = _Workers(runner, sim_thread, simulate_many, simulation_batch, progress, cache_dir)
        bb = _BranchAndBound(base, cands, rates, goal, MemoryPruning(usable), pool,
                             _Limits(top, max_simulations, time_limit_s, t0))
        try:
            bb.run()
        finally:
            if sim_thread is not None:
                sim_thread.shutdown(wait=True, cancel_futures=True)
        bb.close()
        baseline = baseline_future.result() if baseline_future is not None else None
        return PlanResult(base, objective, top, cands, time.perf_counter() - t0,
                          runner.workers, backend, bb.stop, profiles, goal.usd_per_s, baseline)


def _check_arguments(objective: str, top: int, max_simulations: int) -> None:
    """Raise ScenarioError (one line naming the option) on a bad search argument."""
    if objective not in OBJECTIVES:
        raise ScenarioError(f"--objective {objective}: expected time or cost")
    if top < 1:
        raise ScenarioError(f"--top {top}: expected at least 1")
    if max_simulations < 1:
        raise ScenarioError(f"--max-simulations {max_simulations}: expected at least 1")


@dataclass(frozen=True)
class _Objective:
    """The objective a lower bound in seconds is compared in."""

    name: str
    usd_per_s: float
    """GPU price of the whole cluster per second."""
    tokens: float
    """Tokens per step."""

    @classmethod
    def of(cls, base: Scenario, shape: _Shape, name: str) -> tuple[_Objective, float]:
        """The objective for ``base``, and its GPU's usable memory in bytes."""
        from sim import catalog
        from sim.analysis.cost import resolve_pricing

        gpu = catalog.gpu(base.cluster.gpu)
        usd_per_s = resolve_pricing(base, gpu).gpu_hour_usd * base.gpus / 3600.0
        return (cls(name, usd_per_s, float(shape.global_batch * shape.seq_len)),
                gpu.usable_memory_bytes)

    def of_seconds(self, seconds: float) -> float:
        # Dollars per million tokens at least: GPU time only (transfer costs >= 0).
        return seconds if self.name == "time" else seconds * self.usd_per_s / self.tokens * 1e6


def _candidates(layouts: list[Layout], global_batch: int) -> list[Candidate]:
    """One candidate per layout, with its micro-batches per step (0: the batch does not
    split into its micro-batches, which its builder refuses)."""
    cands = []
    for i, x in enumerate(layouts):
        per_step = x.micro_batch_size * x.dp
        m = global_batch // per_step if global_batch % per_step == 0 else 0
        cands.append(Candidate(i, x, m))
    return cands


def _search_space(c: Candidate) -> SearchSpace:
    """The candidate's framework's search space (enumerated, so it has one)."""
    found = _space(c.layout.framework)
    assert found is not None
    return found


def _profile_phase(base: Scenario, cands: list[Candidate], shape: _Shape, rates: LinkRates,
                   runner: Pool) -> int:
    """Phase 1: a layer profile per (framework, tp, cp, micro-batch, recomputation); each
    candidate gets its profile's bound (``bound0_s``) or its refusal. Returns the number of
    profiles built."""
    profiled = [c for c in cands if _search_space(c).layer_profile and c.micro_batches > 0]
    keys: dict[tuple[Any, ...], Layout] = {}
    for c in profiled:
        keys.setdefault(_profile_key(c.layout), c.layout)
    profiles = dict(zip(keys, runner.map_chunks(_profiles_task, list(keys.values()), base,
                                                 rates), strict=True))
    # Megatron's FP8 weight casts are shared by the micro-batches of a step
    # (MegatronLayout.weight_cast_share = 1/m): a one-micro-batch profile charges each
    # micro-batch all of it, which is no lower bound for a longer step. There the profile
    # only refuses; the bound comes from each layout's own build.
    amortised = base.training.precision == "fp8"
    for c in profiled:
        prof = profiles[_profile_key(c.layout)]
        if prof.refused is not None:
            c.status, c.reason = "refused", prof.refused
            continue
        if not (amortised and _search_space(c).weight_casts_per_step):
            c.bound0_s = profile_bound(c.layout, prof, shape.layers, c.micro_batches)
    return len(keys)


BUILD_SHARE_OF_TIME = 0.5
"""With a time limit, new builds start only within this share of it once a built layout
fits: the rest is kept for simulating the best built ones. Best first over loose bounds can
otherwise spend the whole limit building (a mixture-of-experts model: every layout whose
profile bound lies under the first fitting layout's bound is built before that one is
simulated) and recommend nothing."""


@dataclass(frozen=True)
class _Limits:
    """When the branch and bound stops starting work."""

    top: int
    max_simulations: int
    time_limit_s: float | None
    t0: float
    """``time.perf_counter()`` when the search began."""


class _BranchAndBound:
    """Phase 2: best first over (bound, stage): stage 0 builds a layout, stage 1 simulates
    it, until the next bound cannot enter the top K, the simulation budget or the time limit
    is spent, or nothing is left."""

    def __init__(self, base: Scenario, cands: list[Candidate], rates: LinkRates,
                 goal: _Objective, memory: MemoryPruning, workers: _Workers,
                 limits: _Limits) -> None:
        self.base, self.cands, self.rates = base, cands, rates
        self.goal, self.memory, self.workers, self.limits = goal, memory, workers, limits
        self.heap: list[tuple[float, int, int]] = [
            (goal.of_seconds(c.bound0_s), c.index, 0) for c in cands if c.status == "pending"]
        heapq.heapify(self.heap)
        self.best: list[float] = []       # objective values of fitting simulated layouts
        self.in_flight: dict[Any, tuple[str, list[int]]] = {}
        self.sims_started = 0
        self.completed: Counter[str] = Counter()
        self.stop = "exhausted"
        self.capacity = workers.runner.workers + 1
        self.probes = _FamilyProbes(cands)
        self.lighter = LighterFits()
        self.levers = Levers(cands, Candidate, base)
        self.force_host = False     # nothing in flight: host twins wait no longer
        self.fitting_built = 0      # built layouts queued for simulation
        self.builds_deferred = False  # unbuilt layouts left for the simulations' time

    def threshold(self) -> float:
        """The K-th best simulated objective: a bound at or above it cannot enter the top."""
        top = self.limits.top
        return sorted(self.best)[top - 1] if len(self.best) >= top else math.inf

    def run(self) -> None:
        """Start work and settle it until nothing is in flight and nothing can start."""
        while True:
            self.launch()
            self.force_host = False
            if not self.in_flight:
                if not self.levers.waiting:
                    break
                self.force_host = True
                self._release_host_twins()
                continue
            self.collect()

    def launch(self) -> None:
        """Start builds and simulations, best bound first, while there is room; past the
        build share of a time limit (:data:`BUILD_SHARE_OF_TIME`), simulations only."""
        deferred: list[tuple[float, int, int]] = []
        while self.heap and len(self.in_flight) < self.capacity:
            stop = self._stop_reason()
            if stop is not None:
                self.stop = stop
                break
            entry = heapq.heappop(self.heap)
            _, i, stage = entry
            if stage == 0 and self._builds_closed():
                deferred.append(entry)
                self.builds_deferred = True
                continue
            if stage == 1 and self.cands[i].status != "building":
                continue            # settled already (queued again, then simulated)
            if self._slower(self.cands[i], stage) or self._host_skip(i, stage):
                continue
            if stage == 0:
                self._start_build(self.cands[i])
            else:
                self._start_simulation(self.cands[i])
        for entry in deferred:
            heapq.heappush(self.heap, entry)

    def _builds_closed(self) -> bool:
        """Past :data:`BUILD_SHARE_OF_TIME` of the time limit with a built layout that fits:
        the rest of the time is the simulations'."""
        limits = self.limits
        return (limits.time_limit_s is not None and self.fitting_built > 0
                and time.perf_counter() - limits.t0 > limits.time_limit_s * BUILD_SHARE_OF_TIME)

    def _slower(self, c: Candidate, stage: int) -> bool:
        """Drop ``c`` (status ``bound``) if less recomputation of its layout fits
        (:class:`LighterFits`): before its build, or before its simulation."""
        if stage == 0 and c.status != "pending":
            return False            # built already, as its family's probe
        why = self.lighter.slower(c.family, c.layout, c.index)
        if why is not None:
            c.status, c.reason = "bound", why
        return why is not None

    def _host_skip(self, i: int, stage: int) -> bool:
        """Hold back a host twin (:class:`~sim.apps.plan.levers.Levers`) whose eager twin is
        unsettled, or drop it where it cannot fit or is no faster."""
        c = self.cands[i]
        if stage == 0 and c.status != "pending":
            return False            # built already, as its family's probe
        why = self.levers.host_verdict(c, stage, self.force_host)
        if why is not None and why[0] == "wait":
            self.levers.waiting.append((i, stage))
        elif why is not None:
            c.status, c.reason = why
        return why is not None

    def _release_host_twins(self) -> None:
        for j, stage in self.levers.waiting:
            c = self.cands[j]
            heapq.heappush(self.heap, (self.goal.of_seconds(
                c.lower_bound_s if stage else c.bound0_s), j, stage))
        self.levers.waiting.clear()

    def _lever(self, c: Candidate) -> None:
        """Queue the memory-lever twin of ``c``, which does not fit (:class:`Levers`)."""
        twin = self.levers.spawn(c)
        if twin is not None:
            self.probes.families[twin.family].append(twin.index)
            heapq.heappush(self.heap, (self.goal.of_seconds(twin.bound0_s), twin.index, 0))

    def _stop_reason(self) -> str | None:
        """Why no more work starts now (``budget``, ``bound``, ``time``), or None."""
        limits = self.limits
        if self.sims_started >= limits.max_simulations:
            return "budget"
        if self.heap[0][0] >= self.threshold():
            return "bound"
        if limits.time_limit_s is not None and \
                time.perf_counter() - limits.t0 > limits.time_limit_s:
            return "time"
        return None

    def _start_build(self, c: Candidate) -> None:
        """Build ``c`` (or its family's probe first), unless its family rules it out."""
        if c.status != "pending":
            return                  # built already, as its family's probe
        why = self.memory.dominated(c.family, c.layout)
        if why is not None:
            c.status, c.reason = "memory", why
            self._lever(c)
            return
        todo = self.probes.to_build(c)
        if todo is None:
            return
        todo.status = "building"
        fut = self.workers.runner.submit(evaluate_layout, self.base, todo.layout, self.rates,
                                         self.memory.usable, todo.micro_batches)
        self.in_flight[fut] = ("build", [todo.index])

    def _start_simulation(self, c: Candidate) -> None:
        """Simulate ``c`` locally, or with the next best fitting layouts on the hook."""
        w = self.workers
        c.status = "simulating"
        self.sims_started += 1
        batch = [c.index]
        if w.sim_thread is not None:
            # The next best simulations, as many as there are workers.
            heap = self.heap
            while (len(batch) < (w.simulation_batch or w.runner.workers)
                   and heap and heap[0][2] == 1
                   and heap[0][0] < self.threshold()
                   and self.sims_started < self.limits.max_simulations):
                j = heapq.heappop(heap)[1]
                if self.cands[j].status != "building" or self._slower(self.cands[j], 1) \
                        or self._host_skip(j, 1):
                    continue
                self.cands[j].status = "simulating"
                self.sims_started += 1
                batch.append(j)
            fut = w.sim_thread.submit(w.simulate_many, self.base,
                                      [self.cands[j].layout for j in batch])
        else:
            fut = w.runner.submit(simulate_layout, self.base, c.layout, *_also(w.cache_dir))
        self.in_flight[fut] = ("simulate", batch)

    def collect(self) -> None:
        """Wait for work in flight and settle what finished."""
        done = [f for f in self.in_flight if f.done()]
        if not done:
            finished, _ = wait(list(self.in_flight), return_when=FIRST_COMPLETED)
            done = list(finished)
        for fut in done:
            kind, indices = self.in_flight.pop(fut)
            if kind == "build":
                c = self.cands[indices[0]]
                self._settle_evaluation(c, fut.result())
                for j in self.probes.release(c.family):
                    heapq.heappush(self.heap, (self.goal.of_seconds(self.cands[j].bound0_s),
                                               j, 0))
            else:
                for j, sim in zip(indices, _batch_results(fut, indices), strict=True):
                    self._settle_simulation(self.cands[j], sim)
            self.completed[kind] += len(indices)
            self._release_host_twins()
            if self.workers.progress is not None:
                self.workers.progress(kind, self.completed[kind], len(self.cands))

    def _settle_evaluation(self, c: Candidate, ev: Evaluation) -> None:
        """A build came back: refused, does not fit, or queued for simulation."""
        c.evaluation = ev
        if ev.refused is not None:
            c.status, c.reason = "refused", ev.refused
            return
        # Mixture-of-experts layouts are judged with the CUDA context and NCCL's buffers
        # beside the estimate, as the simulation judges them: the light recomputation sets
        # pack them to within those ~1.5 GiB of the limit (Qwen3-30B-A3B on 8 H100: 78.1 GiB
        # estimated, 80.7 simulated). Dense layouts keep the estimate alone (their plans as
        # before).
        need = ev.smi_bytes if c.layout.moe and ev.smi_bytes else ev.memory_bytes
        reason = self.memory.verdict(c.family, c.layout, ev.states_bytes, need)
        if reason is not None:
            c.status, c.reason = "memory", reason
            self._lever(c)
        else:
            self.lighter.fits(c.family, c.layout, c.index)
            self.fitting_built += 1
            heapq.heappush(self.heap, (self.goal.of_seconds(c.lower_bound_s), c.index, 1))

    def _settle_simulation(self, c: Candidate, sim: Simulated) -> None:
        """A simulation came back: an error, out of memory, or a result that ranks."""
        c.simulated = sim
        if sim.summary is None:
            c.status, c.reason = "error", sim.error or ""
        elif sim.summary["oom"]:
            c.status, c.reason = "oom", "simulated peak above usable memory"
            self._requeue(self.lighter.retract(c.family, c.layout, c.index))
            self._lever(c)
        else:
            c.status = "simulated"
            self.best.append(objective_value(sim.summary, self.goal.name))

    def _requeue(self, indices: list[int]) -> None:
        """Put candidates ruled out by a layout that turned out not to fit back in the
        queue: to be simulated if they were built, else built."""
        for j in indices:
            c = self.cands[j]
            if c.status != "bound":
                continue            # queued again already
            if c.evaluation is not None:
                c.status, c.reason = "building", ""
                heapq.heappush(self.heap, (self.goal.of_seconds(c.lower_bound_s), j, 1))
            else:
                c.status, c.reason = "pending", ""
                heapq.heappush(self.heap, (self.goal.of_seconds(c.bound0_s), j, 0))

    def close(self) -> None:
        """Give what is left its status: never needed (its bound reaches the K-th best
        simulated result) or never reached (the simulation budget or the time limit ran
        out first)."""
        limit = self.threshold()
        if self.builds_deferred and self.stop == "exhausted":
            self.stop = "time"
        stop = self.stop
        for c in self.cands:
            if c.status in ("pending", "building", "simulating"):
                if self.goal.of_seconds(c.lower_bound_s) >= limit:
                    c.status, c.reason = "bound", "lower bound at or above the top-K threshold"
                elif c.status == "pending" and self.builds_deferred:
                    c.status, c.reason = "time", "time limit reached"
                else:
                    c.status = stop if stop in ("budget", "time") else "bound"
                    c.reason = ("simulation budget spent" if stop == "budget"
                                else "time limit reached" if stop == "time"
                                else "lower bound at or above the top-K threshold")
