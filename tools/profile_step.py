"""Profile one simulated step: where the wall seconds go (issue 13, item 1).

Runs :func:`sim.api.simulate` once under pyinstrument's sampling profiler and reports

* wall time, ops finished, rate solves, simpy events scheduled and events per second;
* the time split by phase: the three phases of :func:`sim.api.simulate` (build, run,
  collect), the run split further by the innermost module a sample is in (simpy's event
  loop, the max-min rate solve of ``sim/fabric/network.py``, the collective runner, the engine's
  per-op code, recording, ...);
* the top functions by time spent in them and the library code they call (numpy included),
  and by inclusive time;
* a flame graph (SVG, icicle layout: callers above callees, width = time) and pyinstrument's
  text tree, small enough to keep in the repository (frames under ``--min-share`` dropped).

Usage (from the repository root, pyinstrument installed: ``pip install -e '.[test]'``)::

    python tools/profile_step.py megatron-1k               # a preset (see PRESETS)
    python tools/profile_step.py llama3-70b-fsdp2-64xh100 --set cluster.nodes=16
    python tools/profile_step.py meta-405b-16k --out docs/profiles/meta-405b-16k

The profiler costs some speed (a sampling interval of ``--interval`` seconds keeps it small);
the wall time printed is the profiled one. Without pyinstrument (``--no-profile``) it prints
the counts and the wall time only.
"""

from __future__ import annotations

import argparse
import gc
import html
import json
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The cases of issue 13, as (shipped scenario, overrides); the same as the cases of
# tests/integration/test_benchmark.py.
PRESETS: dict[str, tuple[str, list[str]]] = {
    # Issue 4's bar and issue 13's: Llama 3 70B, TP8 x PP8 x DP16 on 1,024 H100, 64
    # micro-batches per replica (tests/integration/test_benchmark.py).
    "megatron-1k": ("llama3-70b-megatron-tp8pp4-64xh100",
                    ["cluster.nodes=128", "parallelism.pp=8", "parallelism.vp=1",
                     "training.global_batch_size=1024"]),
    # Llama 3.1 405B as Meta trained it on 16,384 H100 (Llama 3 paper, Dubey et al. 2024,
    # table 4: TP8 x CP1 x PP16 x DP128, 8,192-token sequences, 16M-token batch = 2,048
    # sequences; interleaved schedule, no activation checkpointing, TP comm overlap).
    "meta-405b-16k": ("llama3-405b-megatron-tp8pp8-256xh100",
                      ["name=meta-llama3.1-405b-16384xh100", "claims=null",
                       "cluster.nodes=2048", "parallelism.pp=16", "parallelism.vp=4",
                       "parallelism.dp=128", "framework.tp_comm_overlap=true",
                       "training.seq_len=8192", "training.global_batch_size=2048",
                       "training.activation_checkpointing=none"]),
    # Megatron-LM's 1T model (Narayanan et al. 2021, "Efficient Large-Scale Language Model
    # Training on GPU Clusters Using Megatron-LM", table 1): 128 layers, hidden 25,600, 160
    # heads, TP8 x PP64 x DP6 on 3,072 A100 (DGX A100, 8 x 200 Gb/s HDR), batch 3,072,
    # 2,048-token sequences, full recomputation; 163 TFLOP/s per GPU published. 1,051,200
    # ops: issue 13's "published run at 3,072 GPUs in under 2 minutes".
    "megatron-1t-3k": ("llama3-70b-megatron-tp8pp4-64xh100",
                       ["name=megatron-lm-1t-3072xa100", "training.tokens_total=null",
                        "model={layers: 128, hidden: 25600, heads: 160, kv_heads: 160, "
                        "ffn_hidden: 102400, vocab: 51200, mlp: gelu}",
                        "cluster={gpu: a100-80gb, nodes: 384, gpus_per_node: 8, "
                        "nics_per_node: 8, nic_gbps: 200}",
                        "framework={name: megatron, implementation: local}",
                        "parallelism={tp: 8, pp: 64, dp: 6}",
                        "training.seq_len=2048", "training.global_batch_size=3072",
                        "training.precision=fp16", "training.activation_checkpointing=full"]),
}

for _k, _nodes in (("1k", 128), ("4k", 512), ("16k", 2048)):
    # One 4,096-token sequence per GPU (FSDP2, DeepSpeed ZeRO-3); Megatron 70B TP8 x PP8 with
    # 64 micro-batches per replica.
    _per_gpu = [f"cluster.nodes={_nodes}", f"training.global_batch_size={_nodes * 8}"]
    PRESETS[f"fsdp2-{_k}"] = ("llama3-70b-fsdp2-64xh100", _per_gpu)
    PRESETS[f"zero3-{_k}"] = ("llama3-70b-deepspeed-zero3-64xh100", _per_gpu)
    PRESETS.setdefault(f"megatron-{_k}", (
        "llama3-70b-megatron-tp8pp4-64xh100",
        [f"cluster.nodes={_nodes}", "parallelism.pp=8", "parallelism.vp=1",
         # 64 micro-batches x DP (GPUs / 64) = one sequence per GPU
         f"training.global_batch_size={_nodes * 8}"]))

# The phase of a sample: the function :func:`sim.api.simulate` called that it is under.
_PHASE_OF_CALL = {
    "resolve_pricing": "build: pricing",
    "from_scenario": "build: job context (model, compute)",
    "build_program": "build: program (framework builder)",
    "build_fabric": "build: fabric (topology, routes)",
    "fabric_spec": "build: fabric (topology, routes)",
    "overheads": "build: memory overheads",
    "run_step": "run: engine",
    "summarise": "collect: summary / metrics",
}
# Inside the engine run: the innermost frame in one of these places names the component. A
# place is a module's file name or a package folder under sim/ (or simpy), so the split still
# holds when modules move into subpackages (e.g. sim/fabric/network.py).
_RUN_COMPONENTS: list[tuple[str, str]] = [
    ("network.py", "rate solve + flow bookkeeping (network.py)"),
    ("maxmin.py", "rate solve + flow bookkeeping (network.py)"),
    ("recorder.py", "recording (recorder.py, allocator.py)"),
    ("allocator.py", "recording (recorder.py, allocator.py)"),
    ("collectives/", "collective runner, plan building (collectives/)"),
    ("hbm_share.py", "interference (hbm_share.py, interference.py)"),
    ("interference.py", "interference (hbm_share.py, interference.py)"),
    ("host_clock.py", "host clock (host_clock.py)"),
    ("topology/", "fabric lookups (topology/)"),
    ("engine.py", "engine per-op code (engine.py)"),
    ("engine/", "engine per-op code (engine.py)"),
    ("simpy/", "simpy event loop"),
]


def _in_sim(path: str) -> str | None:
    """``path`` below the package folder (``sim/...``, ``simpy/...``), or None."""
    p = path.replace("\\", "/")
    for root in ("/sim/", "/simpy/"):
        i = p.rfind(root)
        if i >= 0:
            return p[i + 1:]
    return None


def _component(path: str) -> str | None:
    rel = _in_sim(path)
    if rel is None:
        return None
    parts = rel.split("/")
    for marker, component in _RUN_COMPONENTS:
        if marker.endswith("/") and marker[:-1] in parts[:-1]:
            return component
        if parts[-1] == marker:
            return component
    return None


@dataclass
class Node:
    """One frame of the aggregated call tree (the flame graph's boxes)."""

    name: str
    time: float = 0.0
    children: dict[str, Node] = field(default_factory=dict)


def _parse(frame_info: str) -> tuple[str, str, str]:
    """(function, file, line) of one pyinstrument frame identifier."""
    ident = frame_info.split("\x01")[0]
    parts = ident.split("\x00")
    return (parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "")


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/sim/", "/tools/", "/lib/python3"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:] if marker in ("/sim/", "/tools/") else path[i + len(marker):]
    return path


def _label(func: str, path: str) -> str:
    return f"{func} ({_short(path)})"


def _phase(stack: list[tuple[str, str, str]]) -> str:
    """The phase of one sample, its stack ordered root first."""
    for i, (func, path, _) in enumerate(stack):
        rel = _in_sim(path)
        if func == "simulate" and rel is not None and "api" in rel:
            # run_program (the run and collect half of simulate, sim/api.py) is a step in
            # between: the phase is what it calls.
            if i + 1 < len(stack) and stack[i + 1][0] == "run_program":
                i += 1
            if i + 1 == len(stack):
                return "other (simulate itself)"
            call = stack[i + 1][0]
            phase = _PHASE_OF_CALL.get(call, f"other ({call})")
            if phase != "run: engine":
                return phase
            for _fn, path2, _ in reversed(stack[i + 1:]):
                component = _component(path2)
                if component is not None:
                    return f"run: {component}"
            return "run: other"
    return "outside simulate (loading, profiler)"


def _own(stack: list[tuple[str, str, str]]) -> str:
    """The innermost frame of the project or simpy: where a sample's time is actionable."""
    for func, path, _ in reversed(stack):
        if _in_sim(path) is not None:
            return _label(func, path)
    func, path, _ = stack[-1]
    return _label(func, path)


def analyse(records: Iterable[tuple[list[str], float]], min_share: float
            ) -> dict[str, Any]:
    """Phase split, top functions and the aggregated call tree of pyinstrument's samples."""
    phases: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    inclusive: dict[str, float] = defaultdict(float)
    root = Node("all")
    total = 0.0
    for frames, t in records:
        stack = [_parse(f) for f in frames]
        if not stack:
            continue
        total += t
        phases[_phase(stack)] += t
        own[_own(stack)] += t
        for lab in {_label(f, p) for f, p, _ in stack}:
            inclusive[lab] += t
        node = root
        node.time += t
        for func, path, _ in stack:
            lab = _label(func, path)
            node = node.children.setdefault(lab, Node(lab))
            node.time += t

    def top(d: dict[str, float], n: int) -> list[tuple[str, float]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[:n]

    return {"total_s": total, "phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
            "top_own": top(own, 15), "top_inclusive": top(inclusive, 25), "tree": root,
            "min_share": min_share}


def flame_svg(root: Node, min_share: float, title: str, width: int = 1400) -> str:
    """An icicle flame graph of ``root`` (boxes under ``min_share`` of the total dropped)."""
    row = 17
    total = root.time or 1.0
    boxes: list[str] = []
    depth_max = 0

    def colour(name: str) -> str:
        for key, c in (("sim/network", "#e4572e"), ("simpy/", "#4e79a7"),
                       ("sim/recorder", "#59a14f"), ("sim/allocator", "#59a14f"),
                       ("sim/collectives", "#f28e2b"), ("sim/engine", "#edc948"),
                       ("sim/frameworks", "#b07aa1"), ("sim/topology", "#76b7b2"),
                       ("numpy", "#ff9da7"), ("sim/", "#bab0ac")):
            if key in name:
                return c
        return "#dddddd"

    def walk(node: Node, x: float, depth: int) -> None:
        nonlocal depth_max
        w = node.time / total * width
        depth_max = max(depth_max, depth)
        share = node.time / total
        tip = f"{html.escape(node.name)}: {node.time:.2f} s ({share:.1%})"
        label = node.name if w > 60 else ""
        max_chars = int(w / 6.5)
        if label and len(label) > max_chars:
            label = label[:max(0, max_chars - 2)] + ".."
        # Escaped after cutting: a cut must not split an entity (&lt;).
        label = html.escape(label)
        boxes.append(f'<g><title>{tip}</title><rect x="{x:.1f}" y="{depth * row + 24}" '
                     f'width="{max(w - 0.5, 0.5):.1f}" height="{row - 1}" '
                     f'fill="{colour(node.name)}"/>'
                     + (f'<text x="{x + 2:.1f}" y="{depth * row + 36}">{label}</text>'
                        if label else "") + "</g>")
        cx = x
        for child in sorted(node.children.values(), key=lambda c: -c.time):
            if child.time / total >= min_share:
                walk(child, cx, depth + 1)
            cx += child.time / total * width

    walk(root, 0.0, 0)
    height = (depth_max + 1) * row + 32
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="monospace" font-size="11">\n'
            f'<text x="4" y="16" font-size="13">{html.escape(title)} (hover a box for its '
            f'time; boxes under {min_share:.1%} dropped)</text>\n' + "\n".join(boxes)
            + "\n</svg>\n")


def _instrument(freeze: bool = False) -> list[Any]:
    """Keep the engine :func:`sim.api.simulate` builds, to read its counters afterwards;
    ``freeze``: move everything built so far (program, fabric) to the collector's permanent
    generation when the run starts (``gc.freeze``), so its passes no longer traverse it."""
    import sim.api

    Engine: Any = sim.api.Engine  # the class simulate builds, wherever its module lives
    engines: list[Any] = []

    class CountingEngine(Engine):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

        def run_step(self, program: Any) -> float:
            if freeze:
                gc.freeze()
            return super().run_step(program)

    sim.api.Engine = CountingEngine  # type: ignore[misc]
    return engines


class GcTimer:
    """Wall seconds and passes of Python's cyclic garbage collector (``gc.callbacks``): its
    time lands on whatever frame allocated when it ran, so the profile cannot show it."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.passes[g] += 1


def program_stats(program: Any) -> dict[str, Any]:
    """Ops by kind, and how many compute ops sit inside chains no other stream can observe:
    a compute op whose successor on its stream is compute, depends on nothing off that
    stream, and that no op other than that successor depends on (item 2's merge, an upper
    bound: the host clock and interference can still split a chain at run time)."""
    kinds: dict[str, int] = defaultdict(int)
    dependents: dict[int, int] = defaultdict(int)
    for op in program.ops:
        kinds[op.kind] += 1
        for d in op.deps:
            dependents[d.index] += 1
    mergeable = 0
    for cls in program.classes:
        for ops in cls.streams.values():
            for a, b in zip(ops, ops[1:], strict=False):
                if (a.kind == "compute" and b.kind == "compute" and a.host_transfer is None
                        and b.host_transfer is None and a.stream != "cpu"
                        and all(d is a or d.stream == b.stream and d.index < a.index
                                for d in b.deps)
                        and dependents[a.index] <= (1 if a in b.deps else 0)
                        and not b.host_sync and not a.host_sync):
                    mergeable += 1
    return {"ops_by_kind": dict(kinds), "compute_ops_mergeable_into_predecessor": mergeable}


class Counters:
    """Light counters hooked into the flow network and simpy (``--count``): simpy events by
    type, flows and incidences per started group, active flows and component sizes per
    solve. They cost some speed; the wall time of such a run is not the bare one."""

    def __init__(self) -> None:
        self.events: dict[str, int] = defaultdict(int)
        self.groups = 0
        self.flows_started = 0
        self.incidences_started = 0
        self.solves = 0
        self.active_flows = 0
        self.active_incidences = 0
        self.component_flows = 0
        self.full_solves = 0
        self.max_active_flows = 0

    def install(self, engine_cls: type) -> None:
        import numpy as np
        import simpy

        # The flow network class the engine builds, wherever its module lives.
        FlowNetwork = sys.modules[engine_cls.__module__].FlowNetwork

        c = self
        schedule = simpy.Environment.schedule

        def counting_schedule(env: Any, event: Any, *a: Any, **k: Any) -> None:
            c.events[type(event).__name__] += 1
            schedule(env, event, *a, **k)

        self._restore = [(simpy.Environment, "schedule", schedule),
                         (FlowNetwork, "start_group", FlowNetwork.start_group),
                         (FlowNetwork, "_component", FlowNetwork._component)]
        simpy.Environment.schedule = counting_schedule  # type: ignore[method-assign,assignment]
        start_group = FlowNetwork.start_group

        def counting_start(net: Any, flat: Any, lengths: Any, *a: Any, **k: Any) -> Any:
            c.groups += 1
            c.flows_started += len(lengths)
            c.incidences_started += int(np.sum(lengths))
            return start_group(net, flat, lengths, *a, **k)

        FlowNetwork.start_group = counting_start  # type: ignore[method-assign]
        component = FlowNetwork._component

        def counting_component(net: Any, links: Any) -> Any:
            comp = component(net, links)
            # Live flows and incidences: the tables keep ended flows as dead rows for a while.
            n = net.active_flows
            c.solves += 1
            c.active_flows += n
            c.active_incidences += int(np.count_nonzero(net._inc_link < len(net.capacity)))
            k = int(comp.sum())
            c.component_flows += k
            c.full_solves += int(k == n)
            c.max_active_flows = max(c.max_active_flows, n)
            return comp

        FlowNetwork._component = counting_component  # type: ignore[method-assign]

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced."""
        for owner, name, original in getattr(self, "_restore", []):
            setattr(owner, name, original)

    def figures(self) -> dict[str, Any]:
        s = max(self.solves, 1)
        g = max(self.groups, 1)
        return {"simpy_events_by_type": dict(sorted(self.events.items(),
                                                    key=lambda kv: -kv[1])),
                "flow_groups": self.groups, "flows_per_group": round(self.flows_started / g, 1),
                "incidences_per_group": round(self.incidences_started / g, 1),
                "solves_with_flows": self.solves,
                "mean_active_flows": round(self.active_flows / s, 1),
                "max_active_flows": self.max_active_flows,
                "mean_active_incidences": round(self.active_incidences / s, 1),
                "mean_component_flows": round(self.component_flows / s, 1),
                "full_solves": self.full_solves}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", help=f"a preset ({', '.join(PRESETS)}), shipped name or path")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="key.path=value override (repeatable), after the preset's")
    ap.add_argument("--out", help="write OUT.svg (flame graph), OUT.txt (pyinstrument's "
                    "tree) and OUT.json (the figures)")
    ap.add_argument("--interval", type=float, default=0.005,
                    help="sampling interval in seconds (default 0.005)")
    ap.add_argument("--min-share", type=float, default=0.004,
                    help="drop flame-graph boxes under this share of the total")
    ap.add_argument("--no-profile", action="store_true", help="time and count only")
    ap.add_argument("--count", action="store_true",
                    help="also count simpy events by type, flows per group and active flows "
                    "per solve (slower; implies --no-profile)")
    ap.add_argument("--gc", choices=("on", "off", "freeze"), default="on",
                    help="the cyclic garbage collector around the step: on (as shipped: "
                    "simulate itself pauses it while it builds, runs and collects, "
                    "sim.engine.gc_pause.paused_gc; after a large run it hands the run's objects "
                    "to the oldest generation, so no young pass over them remains), off "
                    "(disabled throughout), freeze (gc.freeze() once the program and fabric "
                    "are built); the simulated numbers do not depend on it")
    args = ap.parse_args(argv)
    if args.count:
        args.no_profile = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import sim.api
    from sim.scenario import load_scenario

    base, overrides = PRESETS.get(args.scenario, (args.scenario, []))
    t_load = time.perf_counter()
    scenario = load_scenario(base, [*overrides, *args.sets])
    t_load = time.perf_counter() - t_load
    engine_cls = sim.api.Engine
    engines = _instrument(freeze=args.gc == "freeze")
    counters = Counters() if args.count else None
    if counters is not None:
        counters.install(engine_cls)
    profiler = None
    if not args.no_profile:
        from pyinstrument import Profiler
        profiler = Profiler(interval=args.interval)
        profiler.start()
    gc_timer = GcTimer()
    gc.callbacks.append(gc_timer)
    if args.gc == "off":
        gc.disable()
    t0, c0 = time.perf_counter(), time.process_time()
    result = sim.api.simulate(scenario)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gc.enable()
    if profiler is not None:
        profiler.stop()
    gc.callbacks.remove(gc_timer)
    gc.unfreeze()
    sim.api.Engine = engine_cls  # type: ignore[misc]
    if counters is not None:
        counters.uninstall()
    eng = engines[-1]
    ops = eng.events_processed
    solves = eng.net.solves
    simpy_events = next(eng.env._eid)  # every event simpy scheduled (its heap counter)
    figures: dict[str, Any] = {
        "scenario": args.scenario, "base": base, "overrides": [*overrides, *args.sets],
        "gpus": scenario.gpus, "rank_classes": len(result.program.classes),
        "program_ops": len(result.program.ops), "links": len(eng.net.capacity),
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_s": round(t_load, 2),
        "profiled": profiler is not None,
        "gc": args.gc,
        "ops_finished": ops, "rate_solves": solves, "flow_groups": eng.net._next_group,
        "simpy_events": simpy_events,
        "summary_events": result.summary["sim"]["events"],
        "events_per_s": round(result.summary["sim"]["events"] / wall),
        "simpy_events_per_s": round(simpy_events / wall),
        "step_time_s": result.summary["step_time_s"],
        "gc_s_by_generation": [round(x, 2) for x in gc_timer.seconds],
        "gc_passes_by_generation": gc_timer.passes,
        **program_stats(result.program),
    }
    if counters is not None:
        figures["counters"] = counters.figures()
    figures["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(f"{args.scenario}: {scenario.gpus:,} GPUs, {figures['rank_classes']} rank classes, "
          f"{figures['program_ops']:,} ops, {figures['links']:,} links")
    print(f"wall {wall:.2f} s{' (profiled)' if profiler else ''}, CPU {cpu:.2f} s (this "
          f"process: steadier on a shared machine); {ops:,} ops finished, "
          f"{solves:,} rate solves, {figures['flow_groups']:,} flow groups, "
          f"{simpy_events:,} simpy events; {figures['events_per_s']:,} events/s "
          f"(ops + solves), step {figures['step_time_s']:.3f} s simulated")
    print(f"peak resident memory {figures['max_rss_mib']:,} MiB; "
          f"garbage collector: {sum(gc_timer.seconds):.2f} s in "
          f"{sum(gc_timer.passes):,} passes (generation 2: {gc_timer.seconds[2]:.2f} s, "
          f"{gc_timer.passes[2]} passes)")
    print(f"ops by kind: {figures['ops_by_kind']}; compute ops mergeable into their "
          f"predecessor: {figures['compute_ops_mergeable_into_predecessor']:,}")
    if counters is not None:
        print(f"counters: {json.dumps(figures['counters'])}")
    a: dict[str, Any] | None = None
    session = None
    if profiler is not None:
        session = profiler.last_session
        assert session is not None
        a = analyse(session.frame_records, args.min_share)
        figures["phases_s"] = {k: round(v, 2) for k, v in a["phases"].items()}
        figures["top_own_s"] = [(k, round(v, 2)) for k, v in a["top_own"]]
        figures["top_inclusive_s"] = [(k, round(v, 2)) for k, v in a["top_inclusive"]]
    if args.out:
        # Written before the long tables are printed (a closed pipe must not lose them).
        def path(suffix: str) -> Path:
            return Path(f"{args.out}{suffix}")  # names may hold dots (llama3.2-1b)

        path(".json").parent.mkdir(parents=True, exist_ok=True)
        path(".json").write_text(json.dumps(figures, indent=1) + "\n")
        if profiler is not None and a is not None and session is not None:
            title = (f"{args.scenario}: {scenario.gpus:,} GPUs, {wall:.1f} s wall (profiled), "
                     f"{ops:,} ops, {solves:,} rate solves")
            path(".svg").write_text(flame_svg(a["tree"], args.min_share, title))
            from pyinstrument.renderers import ConsoleRenderer
            path(".txt").write_text(ConsoleRenderer(unicode=False, color=False,
                                                    show_all=False).render(session))
    if a is not None:
        print_tables(a)
    return 0


def print_tables(a: dict[str, Any]) -> None:
    """The phase split and the top functions of :func:`analyse`'s result."""
    tot = a["total_s"] or 1.0
    for title, rows in ((f"phases (of {tot:.1f} s sampled)", a["phases"].items()),
                        ("top functions by own time (with the numpy/library calls beneath "
                         "them)", a["top_own"]),
                        ("top functions by inclusive time", a["top_inclusive"])):
        print(f"\n{title}:")
        for k, v in rows:
            print(f"  {v:8.2f} s {v / tot:6.1%}  {k}")


if __name__ == "__main__":
    sys.exit(main())
