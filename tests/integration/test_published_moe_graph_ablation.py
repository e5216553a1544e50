"""NVIDIA's eager-vs-CUDA-graph ablation of Qwen3-30B-A3B on two DGX H100 nodes (the two
``mbridge-pr3868-*`` rows of sim/catalog/reference/published_moe.yaml; Megatron-Bridge PR 3868).

Independent truth: the measured step with Transformer Engine's CUDA graphs over attention,
router and preprocessing was 42.00 s against 41.36 s eager, 1.5% slower: on this layout the
host does not pace the step, so removing its launches buys nothing. The simulation must agree
that the graphs change the step by less than a few percent (a host-bound model would show a
large gain here), whatever its absolute error.
"""

from __future__ import annotations

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of

IDS = ("mbridge-pr3868-qwen3-30b-a3b-16xh100-bf16-ep16-alltoall-eager",
       "mbridge-pr3868-qwen3-30b-a3b-16xh100-bf16-ep16-alltoall-te-graphs")


def test_te_scoped_graphs_buy_nothing_on_this_layout_as_measured() -> None:
    rows = {r["id"]: r for r in entries()}
    eager, graphs = (rows[i] for i in IDS)
    measured = (eager["measured"]["tokens_per_s_per_gpu"]
                / graphs["measured"]["tokens_per_s_per_gpu"])
    assert measured == pytest.approx(42.00 / 41.36, rel=1e-3)   # the two published steps
    t_eager, t_graphs = (simulate(scenario_of(r)).summary["step_time_s"] for r in (eager, graphs))
    assert abs(t_graphs / t_eager - 1) < 0.03
