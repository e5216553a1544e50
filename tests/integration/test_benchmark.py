"""Simulator speed (``make bench``; excluded from ``make test`` by the benchmark marker).

Each case simulates one training step and prints its wall time, events (ops finished + rate
solves, ``summary["sim"]["events"]``) and events per second. The bars are what the cases
take today on 2 shared cores (docs/performance.md, measured with ``tools/profile_step.py``)
with headroom for a busy machine, so a slowdown fails. Where issue 13 sets a goal (a
16,384-GPU step in a minute, Megatron on 1,024 GPUs in 10 s) and today's figure misses it, the
case ends as XFAIL with the measured figure (``pytest.xfail``): reported, not failing.

The architecture's "Scale" section: a 1,024-GPU step of Llama 3 70B simulates in under 30 s.
The last test (not a benchmark, in ``make test``) checks the profiling tool behind
docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from sim.api import simulate
from sim.scenario import load_scenario

# Llama 3 70B, Megatron TP8 x PP8 x DP (1,024 GPUs: issue 4's and issue 13's case), 64
# micro-batches per replica: global batch 64 x DP.
_MEGATRON_70B = ["parallelism.pp=8", "parallelism.vp=1"]
# Llama 3.1 405B as Meta trained it on 16,384 H100 (Llama 3 paper, Dubey et al. 2024, table 4:
# TP8 x CP1 x PP16 x DP128, 8,192-token sequences, 16M-token batch = 2,048 sequences;
# interleaved schedule, no activation checkpointing). Same as tools/profile_step.py's
# meta-405b-16k preset.
_META_405B = ["name=meta-llama3.1-405b-16384xh100", "claims=null", "cluster.nodes=2048",
              "parallelism.pp=16", "parallelism.vp=4", "parallelism.dp=128",
              "framework.tp_comm_overlap=true", "training.seq_len=8192",
              "training.global_batch_size=2048", "training.activation_checkpointing=none"]


def _scaled(nodes: int) -> list[str]:
    """One 4,096-token sequence per GPU on ``nodes`` DGX H100 nodes (FSDP2, ZeRO-3)."""
    return [f"cluster.nodes={nodes}", f"training.global_batch_size={nodes * 8}"]


def _megatron(nodes: int) -> list[str]:
    dp = nodes * 8 // 64
    return [f"cluster.nodes={nodes}", *_MEGATRON_70B, f"training.global_batch_size={64 * dp}"]


# (id, shipped scenario, overrides, bar, goal), in seconds on 2 cores. Bars: about twice the
# wall time measured on 2 shared cores on 2026-12-01 (docs/performance.md gives each figure),
# or an older issue's bar where that is looser. Goals: issue 13's (Megatron on 1,024 GPUs in
# 10 s, a 16,384-GPU step in a minute); None where the issue sets none.
CASES: list[tuple[str, str, list[str], float, float | None]] = [
    # measured 13.7 s; issue 4's bar (30 s) and issue 13's goal (10 s)
    ("megatron-1k", "llama3-70b-megatron-tp8pp4-64xh100", _megatron(128), 30.0, 10.0),
    # measured 20.5 s
    ("megatron-4k", "llama3-70b-megatron-tp8pp4-64xh100", _megatron(512), 45.0, None),
    # measured 26.6 s; issue 13's judged case (goal 60 s)
    ("megatron-405b-16k", "llama3-405b-megatron-tp8pp8-256xh100", _META_405B, 60.0, 60.0),
    # measured 0.9 s (the architecture's "Scale" bar for this case: 30 s)
    ("fsdp2-1k", "llama3-70b-fsdp2-64xh100", _scaled(128), 5.0, None),
    # measured 3.3 s
    ("fsdp2-4k", "llama3-70b-fsdp2-64xh100", _scaled(512), 10.0, None),
    # measured 11.4 s
    ("fsdp2-16k", "llama3-70b-fsdp2-64xh100", _scaled(2048), 30.0, 60.0),
    # measured 2.4 s
    ("zero3-1k", "llama3-70b-deepspeed-zero3-64xh100", _scaled(128), 6.0, None),
    # measured 10.9 s
    ("zero3-4k", "llama3-70b-deepspeed-zero3-64xh100", _scaled(512), 25.0, None),
    # measured 42.6 s
    ("zero3-16k", "llama3-70b-deepspeed-zero3-64xh100", _scaled(2048), 90.0, 60.0),
    # Issue 14's bar: DeepSeek-V3 on 1,024 H100 (TP2 x PP16 x EP64, 128 micro-batches),
    # measured 18-20 s (2026-12-06); under Zipf routing (s = 1, every all-to-all skewed per
    # peer) 50-55 s, 14 min before skewed all-to-alls folded (docs/performance.md item 14).
    ("deepseek-v3-1k", "deepseek-v3-megatron-tp2pp16ep64-1024xh100", [], 40.0, 60.0),
    ("deepseek-v3-zipf-1k", "deepseek-v3-megatron-tp2pp16ep64-1024xh100",
     ["training.routing.distribution=zipf"], 110.0, 60.0),
    # With the shared experts on their own stream (NeMo's DeepSeek-V3 default): measured 55 s
    # (31 s without it, the same day), 145 s before all-to-alls folded again once the TP
    # collectives beside them ended (docs/performance.md item 17).
    ("deepseek-v3-shared-overlap-1k", "deepseek-v3-megatron-tp2pp16ep64-1024xh100",
     ["framework.moe_shared_expert_overlap=true"], 110.0, 60.0),
]


@pytest.mark.benchmark
@pytest.mark.parametrize(("name", "base", "overrides", "bar", "goal"), CASES,
                         ids=[c[0] for c in CASES])
def test_step_speed(name: str, base: str, overrides: list[str], bar: float,
                    goal: float | None) -> None:
    s = load_scenario(base, overrides)
    t0 = time.perf_counter()
    r = simulate(s)
    wall = time.perf_counter() - t0
    ev = r.summary["sim"]["events"]
    solves = ev - len(r.program.ops)
    print(f"\n{name}: {s.gpus:,} GPUs, {wall:.2f} s wall, {ev:,} events ({ev / wall:,.0f}/s), "
          f"{solves:,} rate solves, {len(r.program.classes)} rank classes, "
          f"step {r.summary['step_time_s']:.3f} s simulated")
    assert s.gpus == {"1k": 1024, "4k": 4096, "16k": 16384}[name.rsplit("-", 1)[1]]
    assert r.summary["step_time_s"] > 0 and solves > 0
    assert wall < bar, f"{name}: {wall:.1f} s, slower than today's bar of {bar:.0f} s"
    if goal is not None and wall >= goal:
        # Reported by `make bench` (XFAIL, with the figure), not failing, until met.
        pytest.xfail(f"issue 13 goal {goal:.0f} s not met yet: measured {wall:.1f} s")


@pytest.mark.benchmark
def test_planner_beats_the_shipped_70b_layouts_in_two_minutes() -> None:
    # Issue 7's bar: for Llama 3 70B on 64 H100 (8 nodes, 400 Gb/s), `plan --objective time`
    # returns a layout that fits and is no slower than the best shipped scenario for that
    # setup, after searching at least 500 layouts in under 2 minutes on 2 cores.
    from sim.apps.plan import search

    shipped = ["llama3-70b-fsdp2-64xh100", "llama3-70b-megatron-tp8pp4-64xh100",
               "llama3-70b-deepspeed-zero3-64xh100", "llama3-70b-fairscale-64xh100"]
    best_shipped = max(r.summary["tokens_per_s"] for r in
                       (simulate(load_scenario(n)) for n in shipped) if not r.summary["oom"])
    t0 = time.perf_counter()
    result = search(load_scenario("llama3-70b-fsdp2-64xh100"), "time", workers=2)
    wall = time.perf_counter() - t0
    winner = result.ranked()[0].summary
    assert winner is not None and not winner["oom"]
    print(f"\nplanner: {len(result.candidates):,} layouts in {wall:.1f} s "
          f"({len(result.candidates) / wall:,.1f} layouts/s); best "
          f"{winner['tokens_per_s_per_gpu']:,.0f} tok/s/GPU vs shipped "
          f"{best_shipped / 64:,.0f}")
    assert len(result.candidates) >= 500 and wall < 120
    assert winner["tokens_per_s"] >= best_shipped


def test_profile_tool_accounts_for_every_op_and_sample(tmp_path: Path) -> None:
    # Not a benchmark (runs in `make test`, about 2 s): tools/profile_step.py, which makes
    # docs/profiles/ and docs/performance.md's figures, still runs on the current package layout
    # and its split is complete. Its counts must add up by definition: every op of the
    # program finishes once in a one-step run, summary events = ops + rate solves, the phases
    # share out every sample, and the engine's time lands on named components (a module moved
    # out of the tool's list would show as "run: other").
    pytest.importorskip("pyinstrument")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fsdp2-8"
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(root / "tools" / "profile_step.py"),
                           "llama3-70b-fsdp2-8xh100", "--interval", "0.001", "--out", str(out)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fig = json.loads(out.with_name("fsdp2-8.json").read_text())
    assert fig["ops_finished"] == fig["program_ops"] > 0
    assert fig["summary_events"] == fig["ops_finished"] + fig["rate_solves"]
    phases = fig["phases_s"]
    total = sum(phases.values())
    run = sum(v for k, v in phases.items() if k.startswith("run:"))
    assert total > 0 and run > 0
    assert phases.get("run: other", 0.0) <= 0.05 * run, phases
    svg = out.with_name("fsdp2-8.svg")
    assert svg.stat().st_size < 1_000_000
    ElementTree.parse(svg)  # well-formed
