"""torchtitan's MoE path against Nous Research's DeepEP README (``published-moe`` rows
``torchtitan-deepep-qwen3-30b-a3b-*``; sim/catalog/reference/published_moe.yaml;
docs/calibration.md, fifty-first session): Qwen3-30B-A3B on 8 to 128 DGX B200 under FSDP2 with
EP 8, as torchtitan ran it, and torchtitan's own all-to-all at 8 GPUs.

Each row's measurement is a figure of the same README, so the ratios between them are
measurements too. What the simulation reproduces is checked; the three things it does not
(the scaling loss, the all-to-all baseline, the memory) are strict xfails with their values.
"""

from __future__ import annotations

from functools import cache

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of

ROW = "torchtitan-deepep-qwen3-30b-a3b-{}xb200-bf16-ep8"
SIZES = (8, 16, 32, 64, 128)
GIB = 2**30


@cache
def _run(rid: str) -> tuple[float, float, float]:
    """(measured, simulated) tokens/s/GPU and the simulated peak reserved GiB of one row."""
    e = {r["id"]: r for r in entries()}[rid]
    s = simulate(scenario_of(e)).summary
    return e["measured"]["tokens_per_s_per_gpu"], s["tokens_per_s_per_gpu"], s["peak_reserved_gib"]


def test_per_gpu_throughput_falls_as_nodes_are_added_as_measured() -> None:
    # Measured 14,796 > 14,380 > 14,276 > 14,107 > 13,856: each doubling adds FSDP traffic
    # across more nodes (the experts' shards over efsdp = GPUs / 8) and nothing else.
    runs = [_run(ROW.format(n)) for n in SIZES]
    measured = [m for m, _, _ in runs]
    simulated = [s for _, s, _ in runs]
    assert measured == sorted(measured, reverse=True)
    assert simulated == sorted(simulated, reverse=True)


@pytest.mark.xfail(strict=True, reason="the scaling loss: 8 -> 128 GPUs lose 6.4% measured, "
                   "1.0% simulated (FSDP traffic overlapped, its interference with compute "
                   "small: docs/calibration.md, fifty-first session)")
def test_the_loss_from_8_to_128_gpus_as_measured() -> None:
    (m8, s8, _), (m128, s128, _) = _run(ROW.format(8)), _run(ROW.format(128))
    assert 1 - s128 / s8 == pytest.approx(1 - m128 / m8, rel=0.5)


@pytest.mark.xfail(strict=True, reason="torchtitan's own all-to-all at 57de08382: measured "
                   "DeepEP 1.49x faster, simulated 1.12x (that commit combines with atomic "
                   "scatter_adds; the model prices v0.2.2's index_put and fp32 bmm)")
def test_deepep_over_torchtitans_all_to_all_as_measured() -> None:
    (m_deepep, s_deepep, _) = _run(ROW.format(8))
    (m_a2a, s_a2a, _) = _run(ROW.format(8) + "-standard-a2a")
    assert s_deepep / s_a2a == pytest.approx(m_deepep / m_a2a, rel=0.15)


@pytest.mark.xfail(strict=True, reason="memory: the README's maximum reserved is 167.93 GiB "
                   "on 8 GPUs, the simulated peak reserved 84 GiB (the states agree; ~111 GiB "
                   "of the rest measured against ~27 simulated, not explained)")
def test_peak_reserved_memory_on_one_node_as_measured() -> None:
    _, _, reserved = _run(ROW.format(8))
    assert reserved == pytest.approx(167.93, rel=0.25)


def test_the_sharded_states_account_for_the_memory_fall_as_measured() -> None:
    # Measured max reserved 167.93 GiB on 8 GPUs, 114.78 on 128: the parameters, gradients
    # and AdamW moments go from 1/8 to 1/128 of the model (dense and experts alike under
    # FSDP x EP), 53.2 GiB. The simulation's fall is the same states' fall.
    (_, _, r8), (_, _, r128) = _run(ROW.format(8)), _run(ROW.format(128))
    assert r8 - r128 == pytest.approx(167.93 - 114.78, rel=0.05)
