"""The summary's ``host_bound_s``: the step's idle time that waits on the host issuing work
whose inputs are there (:func:`sim.analysis.metrics.host_bound_intervals`), checked on two
published layouts of one model whose measured rates differ by the host's part.

Qwen3-30B-A3B on one DGX-B200 at micro-batch 1, EP 8 (``published_moe.yaml``): 25.09's
scripts dropped tokens at capacity under whole-layer CUDA graphs, so the host replays a
graph a layer and never waits for the token counts (18,066 tokens/s/GPU measured); 26.02's
dropless alltoall dispatcher waits for the counts once a layer and then issues the experts'
calls one by one from Python (9,691 measured). The first step is GPU-paced, the second
host-paced: its idle time is the host's, and with one pipeline stage and no peer to wait for
nothing else idles.
"""

from __future__ import annotations

import pytest

from sim import api
from sim.apps.validation.published_moe import entries, scenario_of

TOKEN_DROP = "nemo-25.09-qwen3-30b-a3b-8xb200-fp8-ep8"
DROPLESS = "nemo-26.02-qwen3-30b-a3b-8xb200-mxfp8-ep8-alltoall"


@pytest.fixture(scope="module")
def runs() -> dict[str, api.RunResult]:
    by_id = {e["id"]: e for e in entries()}
    return {rid: api.simulate(scenario_of(by_id[rid])) for rid in (TOKEN_DROP, DROPLESS)}


def test_the_whole_layer_graph_step_is_not_host_bound(runs) -> None:
    s = runs[TOKEN_DROP].summary
    assert 0.0 <= s["host_bound_s"] < 0.01 * s["step_time_s"]


def test_the_dropless_step_idles_on_its_host_and_on_nothing_else(runs) -> None:
    s = runs[DROPLESS].summary
    step, host = s["step_time_s"], s["host_bound_s"]
    assert host > 0.25 * step
    # busy + exposed communication + host-bound <= the step (disjoint by definition) ...
    assert s["compute_time_s"] + s["exposed_comm_s"] + host <= step * (1 + 1e-12)
    # ... and here they are the whole step: one stage, no peer, so the idle is the host's.
    assert s["compute_time_s"] + s["exposed_comm_s"] + host == pytest.approx(step, rel=1e-6)


def test_a_spliced_step_holds_the_full_steps_host_waits(runs) -> None:
    from sim.frameworks import JobContext, build_program
    by_id = {e["id"]: e for e in entries()}
    ctx = JobContext.from_scenario(scenario_of(by_id[DROPLESS]))
    full = api.run_program(ctx, build_program(ctx), steady_splice=False)
    spliced = runs[DROPLESS]
    assert full.summary["host_bound_s"] == spliced.summary["host_bound_s"]
    assert [r.held for r in full.recorder.ops] == [r.held for r in spliced.recorder.ops]
