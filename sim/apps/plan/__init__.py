"""``fabricsim plan``: search the frameworks and parallel layouts that fit a model on a cluster.

The model, the cluster, the sequence length, the global batch and the precision stay as the
scenario gives them; everything else a team chooses when it sets up a run is searched:

* the framework (Megatron-LM, FSDP2, DeepSpeed ZeRO 1/2/3, FairScale FSDP, DDP) and the
  options that change memory or communication (ZeRO stage, FSDP ``reshard_after_forward``,
  FSDP2's HSDP shard size); the rest at the frameworks' recipe values;
* tensor (inside a node), pipeline, context and data parallelism, Megatron's and torchtitan's
  interleaved pipeline chunks, the micro-batch size and activation recomputation;
* for a mixture-of-experts model, with the frameworks that build it only (the registry
  entries' ``model_features``: Megatron), the expert layout too: ``ep`` and expert tensor
  parallelism ``etp`` (the search space's ``expert_layouts``).

Each phase is cheap enough to decide what the next one spends time on:

1. **Enumerate** (:func:`enumerate_layouts`) every combination; each layout is a set of
   overrides of the scenario (:meth:`Layout.varied`, usable as ``--set KEY=VALUE``).
2. **Profile** (:func:`layer_profile`): one layer's forward, backward and recomputation per
   micro-batch, built once per framework x tensor/context split x micro-batch size x
   recomputation on a 2-layer copy of the model. It gives every layout a lower bound on its
   step time (:func:`profile_bound`: its busiest stage's layers x micro-batches, plus the
   pipeline ramp), and refuses at once the splits the framework refuses.
3. **Build** layouts best bound first (``JobContext`` + ``build_program``, no simulation;
   long pipelines as a shorter step, :func:`proxy_micro_batches`). A refusal (ScenarioError
   naming a key path) drops the layout, counted under that key. A built program gives the
   memory estimate (:func:`memory_estimate`) and a tighter lower bound, the earliest
   schedule of its ops (:func:`_earliest_schedule`). Layouts above the GPU's usable memory
   are dropped, and with them the layouts of the same family that need more (larger
   micro-batches, less recomputation).
4. **Simulate** (branch and bound): the fitting layouts in order of their bound, several at
   once, until the next bound is no better than the K-th best simulated result (nothing left
   can enter the top K) or the simulation budget is spent. The scenario as given is
   simulated too, for comparison.
5. **Report** the top K by step time or by dollars per million tokens, each with what makes
   it fast (exposed communication, pipeline bubble, recomputation, memory headroom); with
   ``--out``, plan.json and plan.csv (every layout, its status and reason) and pareto.png.

The phases live in one module each, every name re-exported here (tests and notebooks use
``sim.apps.plan.X``): :mod:`sim.apps.plan.layouts` (1: :class:`Layout`, the enumeration, a layout's
scenario), :mod:`sim.apps.plan.profile` (2), :mod:`sim.apps.plan.evaluate` (3 and 4 for one layout:
the
worker tasks), :mod:`sim.apps.plan.bound` (the lower bounds of a built program, with the engine's
host clock :mod:`sim.engine.host_clock`), :mod:`sim.apps.plan.memory` (the memory estimate and what
it
prunes), :mod:`sim.apps.plan.search` (:func:`search`: the profiles, then branch and bound) and
:mod:`sim.apps.plan.output` (5). :func:`plan_command` (``fabricsim plan``) is here, and finds
:func:`search` through this module.

See docs/planner.md for the measurements behind the bounds and the estimate.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

# Every name sim.apps.plan had before it was split, importable from here as before.
from sim.apps.executor import (  # noqa: F401
    BACKENDS,
    Backend,
    Outcome,
    Pool,
    Task,
    attempt,
    cpu_count,
    simulate_in_order,
    type_and_message,
)
from sim.apps.plan.bound import (  # noqa: F401
    CommBounds,
    LinkRates,
    _earliest_schedule,
    _host_nodes,
    _HostNodes,
    _Schedule,
    collective_lower_bound,
    per_micro_batch_bound,
)
from sim.apps.plan.evaluate import (  # noqa: F401
    Evaluation,
    Simulated,
    SimulateMany,
    _short_step,
    _simulate_base,
    _simulated,
    backend_simulations,
    evaluate_layout,
    proxy_micro_batches,
    simulate_layout,
)
from sim.apps.plan.layouts import (  # noqa: F401
    CP_MAX,
    MEGATRON_BEST_PRACTICE,
    PLAN_ORIGIN,
    VP_MAX,
    Layout,
    _divisors,
    _framework_layouts,
    _micro_batch_sizes,
    _Shape,
    _shape,
    _space,
    _vp_values,
    enumerate_layouts,
    layout_scenario,
    plan_frameworks,
    refusal_key,
    step_sequences,
)
from sim.apps.plan.memory import (  # noqa: F401
    RECOMPUTE_RANK,
    MemoryPruning,
    memory_estimate,
    memory_on_schedule,
    memory_program_order,
)
from sim.apps.plan.output import (  # noqa: F401
    GIB,
    _finite,
    _gib,
    _why_line,
    explain,
    layout_row,
    pareto_figure,
    pareto_front,
    plan_json,
    print_table,
    scenario_mapping,
    why,
    write_outputs,
)
from sim.apps.plan.profile import (  # noqa: F401
    _MATH_CATEGORIES,
    PROFILE_LAYERS,
    Profile,
    _layer_options,
    _profile_key,
    _profiles_task,
    layer_profile,
    profile_bound,
    stage_layer_split,
)
from sim.apps.plan.recompute import (  # noqa: F401
    FULL,
    LighterFits,
    covers,
    recomputed,
)
from sim.apps.plan.search import (  # noqa: F401
    DEFAULT_MAX_SIMULATIONS,
    DEFAULT_TOP,
    OBJECTIVES,
    Candidate,
    PlanResult,
    objective_value,
    search,
)
from sim.engine.host_clock import host_issues, issue_order, issue_time  # noqa: F401
from sim.frameworks import registry  # noqa: F401
from sim.frameworks.registry import SearchPoint, SearchSpace  # noqa: F401
from sim.scenario import (  # noqa: F401
    Scenario,
    ScenarioError,
    load_scenario,
    scenario_from_dict,
)
from sim.workload.moe import BEYOND_DENSE, ISSUE_OF


def plan_command(scenario: str, overrides: Sequence[str] = (), objective: str = "time",
                 top: int = DEFAULT_TOP, backend: str = "local", workers: int | None = None,
                 frameworks: Sequence[str] | None = None,
                 max_simulations: int = DEFAULT_MAX_SIMULATIONS,
                 time_limit_s: float | None = None, out: Path | None = None,
                 as_json: bool = False, simulate_many: SimulateMany | None = None,
                 quiet: bool = False, cache: Path | None = None,
                 overwrite: bool = False) -> int:
    """Everything ``fabricsim plan`` does; returns the exit status (0), or raises
    ScenarioError (one line; the CLI exits 2) on bad input before anything runs.

    Prints the top-K table (or, with ``as_json``, the CONTRACT's object) on stdout; with
    ``out``, writes plan.json, plan.csv and pareto.png there. ``backend`` ray or dask needs
    ``simulate_many`` (the CLI builds it from :mod:`sim.apps.sweep`'s backends); layouts are
    built locally either way. With ``cache`` (a folder), simulations go through the sweep's
    cache, so that a plan interrupted (Ctrl-C: exit status 130) and run again simulates
    only what is missing, and says how many it reused.
    """
    if backend not in BACKENDS:
        raise ScenarioError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if backend != "local" and simulate_many is None:
        raise ScenarioError(f"--backend {backend}: no {backend} connection was given to the "
                            "planner")
    if workers is not None and workers < 1:
        raise ScenarioError(f"--workers {workers}: expected at least 1")
    if time_limit_s is not None and time_limit_s <= 0:
        raise ScenarioError(f"--time-limit {time_limit_s}: expected a positive number of "
                            "seconds")
    if out is not None and out.exists() and not out.is_dir():
        raise ScenarioError(f"--out {out}: exists and is not a folder")
    base = load_scenario(scenario, list(overrides))
    kept, skipped = plan_frameworks(base, frameworks)
    if not kept:
        # Refused at once, not after every layout's build has refused it: no framework
        # asked for models the model (a mixture-of-experts model: Megatron only).
        key = next(iter(skipped.values()))
        raise ScenarioError(f"{scenario}: model.{key}: no framework fabricsim plan searches "
                            f"({', '.join(skipped)}) models {BEYOND_DENSE[key]} yet"
                            f"{ISSUE_OF.get(key, '')}")
    local = cpu_count()
    from contextlib import nullcontext

    from rich.console import Console

    err = Console(stderr=True)
    if skipped and not quiet:
        for fw, key in skipped.items():
            err.print(f"plan: {fw} skipped: it does not model {BEYOND_DENSE[key]} "
                      f"(model.{key})", highlight=False)
    live = not as_json and not quiet and err.is_terminal
    with err.status("plan: profiling layers") if live else nullcontext() as status:
        counts = {"build": 0, "simulate": 0, "profiles": 0}

        def progress(phase: str, done: int, total: int) -> None:
            counts[phase] = done
            if status is not None:
                status.update(f"plan: {total:,} layouts, {counts['build']:,} built, "
                              f"{counts['simulate']:,} simulated")

        report = progress if live else None
        try:
            if simulate_many is None:
                result = search(base, objective, top, tuple(kept),
                                workers or local, max_simulations, time_limit_s,
                                backend=backend, progress=report, cache=cache)
            else:
                # Builds on this machine's cores, simulations ``workers`` at a time on the
                # backend.
                result = search(base, objective, top, tuple(kept), local,
                                max_simulations, time_limit_s, simulate_many, backend,
                                report, simulation_batch=workers or local, cache=cache)
        except KeyboardInterrupt:
            kept_in = (f"; the simulations done are in the cache {cache}, run the same "
                       "command again to go on" if cache is not None else "")
            print(f"fabricsim: plan interrupted{kept_in}", file=sys.stderr)
            return 130
    if out is not None:
        write_outputs(result, out, overwrite)
    if as_json:
        print(json.dumps(plan_json(result), indent=2, default=str))
    elif not quiet:
        print_table(result)
        if out is not None:
            print(f"wrote plan.json, plan.csv, pareto.png and top-1.yaml ... in {out}")
    reused = sum(1 for c in result.candidates
                 if c.simulated is not None and c.simulated.cached)
    if cache is not None and reused and not quiet:
        print(f"plan: {reused} simulations reused from the cache {cache}", file=sys.stderr)
    return 0
