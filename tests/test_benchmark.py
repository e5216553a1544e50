"""Simulator speed (``make bench``; excluded from ``make test`` by the benchmark marker).

The target from the architecture's "Scale" section: a 1,024-GPU step of Llama 3 70B with
FSDP2 simulates in under 30 s on 2 cores. Prints events per second.
"""

from __future__ import annotations

import time

import pytest

from sim.api import simulate
from sim.scenario import load_scenario


@pytest.mark.benchmark
@pytest.mark.parametrize("nodes", [16, 128])
def test_llama3_70b_fsdp2_scales(nodes: int) -> None:
    s = load_scenario("llama3-70b-fsdp2-64xh100",
                      [f"cluster.nodes={nodes}", f"training.global_batch_size={nodes * 8}"])
    t0 = time.perf_counter()
    r = simulate(s)
    wall = time.perf_counter() - t0
    ev = r.summary["sim"]["events"]
    flows = sum(1 for _ in r.recorder.rate_series)
    print(f"\n{nodes * 8} GPUs: {wall:.2f} s wall, {ev} events ({ev / wall:,.0f}/s), "
          f"{flows} rate solves, step {r.summary['step_time_s']:.3f} s simulated")
    assert wall < 30.0
