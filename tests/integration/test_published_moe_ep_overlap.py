"""What Megatron-Core's EP overlap (``overlap_moe_expert_parallel_comm``: the combined 1F1B
that runs one micro-batch's dispatch and combine beside another's compute) buys on two DGX
H100 nodes, measured by NVIDIA with everything else held (the ``mbridge-skill-*`` rows of
sim/catalog/reference/published_moe.yaml; Megatron-Bridge
skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md @ 7ded17dae).

Independent truth, the ratio of two published steps of one recipe: Qwen3-30B-A3B, EP16,
BF16, HybridEP: 24.7138 s without the overlap, 20.9920 s with it (1.177x); the
``alltoall`` dispatcher with permute fusion off: 41.25 s and 31.31 s (1.317x). The Nsight
profile beside the HybridEP pair says the overlap hid 36.55% of the communication time.
"""

from __future__ import annotations

from functools import cache

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of

PAIRS = {
    "hybridep": ("mbridge-skill-qwen3-30b-a3b-16xh100-bf16-ep16-hybridep-no-overlap",
                 "mbridge-skill-qwen3-30b-a3b-16xh100-bf16-ep16-hybridep-a2aoverlap",
                 24.7138 / 20.9920),
    "alltoall": ("mbridge-skill-qwen3-30b-a3b-16xh100-bf16-ep16-alltoall-unfused-permute-eager",
                 "mbridge-skill-qwen3-30b-a3b-16xh100-bf16-ep16-alltoall-unfused-permute-a2aoverlap",
                 41.25 / 31.31),
}


@cache
def _gain(off: str, on: str) -> tuple[float, float]:
    rows = {r["id"]: r for r in entries()}
    measured = (rows[on]["measured"]["tokens_per_s_per_gpu"]
                / rows[off]["measured"]["tokens_per_s_per_gpu"])
    t_off, t_on = (simulate(scenario_of(rows[i])).summary["step_time_s"] for i in (off, on))
    return measured, t_off / t_on


@pytest.mark.parametrize("dispatcher", sorted(PAIRS))
def test_the_overlap_gains_something_and_no_more_than_its_communication(dispatcher) -> None:
    off, on, steps = PAIRS[dispatcher]
    measured, simulated = _gain(off, on)
    assert measured == pytest.approx(steps, rel=2e-3)   # the rows are the published steps
    assert simulated > 1.05


def test_the_hybridep_overlap_gain_as_measured() -> None:
    """Since the engine makes an all-to-all launched beside running compute wait for it on
    Hopper (sim.engine.launch_wait): 1.20x simulated against 1.18x measured (1.43x before;
    1.23x with the x86 host factor of the fifty-eighth session).
    Not blind: that rule was chosen over a per-kernel wait on this pair's Nsight profile
    (communication beside compute 3.96 s measured, 4.75 s simulated; 7.07 s per kernel)."""
    off, on, _ = PAIRS["hybridep"]
    measured, simulated = _gain(off, on)
    assert simulated == pytest.approx(measured, rel=0.05)


@pytest.mark.xfail(strict=True, reason="the overlap's gain is over-predicted with NCCL's "
                   "all-to-all: 1.47x simulated against 1.32x measured (1.56x before the x86 "
                   "host factor); the simulated step is "
                   "bound by the all-to-alls, at NCCL's measured network rate since the "
                   "fifty-third session but not slowed beside compute, where the HybridEP "
                   "profile measured its communication 31% longer with the overlap "
                   "(docs/calibration.md, thirty-fourth, thirty-sixth and fifty-third "
                   "sessions: a what-if of that slowdown halves this row's error)")
def test_the_alltoall_overlap_gain_as_measured() -> None:
    off, on, _ = PAIRS["alltoall"]
    measured, simulated = _gain(off, on)
    assert simulated == pytest.approx(measured, rel=0.05)
