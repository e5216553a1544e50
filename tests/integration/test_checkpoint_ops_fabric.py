"""Checkpoint saves as ops on the fabric (``run.checkpoint.simulate``), against closed forms.

A small DDP job on two 8-GPU servers (tests/conftest.py's model): each save writes every
rank's share of the sharded states to NVMe or over the network to a storage endpoint; the
oracles are the bytes of :func:`checkpoint_bytes` (conservation), the fair share of the
narrowest link of the write's routes (the flows are equal, so max-min gives each the
bottleneck link's capacity over the flows crossing it), and the synchronous/asynchronous
split of torch DCP and Megatron dist-ckpt (the step blocks for the whole write, or for the
device-to-host copy only).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import make_scenario

from sim.api import RunResult, run_program, simulate
from sim.apps.runlength import run_length
from sim.engine.core import Engine
from sim.fabric.collectives.runner import transport_capacity
from sim.frameworks import JobContext, build_program
from sim.program.checkpoint_ops import checkpoint_bytes, write_shares

CLUSTER = {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 8, "nics_per_node": 8,
           "nic_gbps": 400}


def scenario(storage: str = "pfs", rate: float | None = 20.0, asynchronous: bool = False,
             interval: int = 2, zone: int | None = None, **over: Any):
    ck: dict[str, Any] = {"storage": storage, "async": asynchronous, "simulate": True}
    if rate is not None:
        ck["gbytes_per_s"] = rate
    if zone is not None:
        ck["zone"] = zone
    return make_scenario(**{
        "cluster": CLUSTER, "training.tokens_total": 1e9, "training.global_batch_size": 16,
        "run": {"checkpoint_interval_steps": interval, "checkpoint": ck, "samples": 50},
        **over})


class _Keep(Engine):
    """An engine that leaves itself where the test can read its network's link counters."""

    last: Engine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Keep.last = self


def run(s, steps: int) -> tuple[RunResult, Engine]:
    ctx = JobContext.from_scenario(s)
    result = run_program(ctx, build_program(ctx), steps, engine_class=_Keep)
    assert _Keep.last is not None
    return result, _Keep.last


def fair_share_s(result: RunResult, routes: list[tuple[int, ...]], share: float) -> float:
    """Seconds for equal flows of ``share`` bytes on ``routes``: each gets the narrowest
    link's capacity (as the transports achieve it) over the flows crossing that link, after
    the longest route's latency."""
    cap = transport_capacity(result.fabric, "hopper")
    on = Counter(i for rt in routes for i in rt)
    latency = max(result.fabric.path_latency(rt) for rt in routes)
    return latency + share / min(cap[i] / n for i, n in on.items())


def test_bytes_written_are_the_sharded_states_once_per_save() -> None:
    s = scenario()
    result, engine = run(s, 3)           # saves after steps 1 and 3 (interval 2)
    ck = result.summary["checkpoint"]
    total = checkpoint_bytes(result.program.classes, result.context.model.total_params,
                             s.dp).total
    assert ck["saves"] == 2
    assert ck["gb_per_save"] * 1e9 == pytest.approx(total, rel=1e-12)
    # Every byte reaches the storage endpoint, once per save.
    fab = result.fabric
    into = [i for i, (a, b) in enumerate(fab.endpoints) if b[0] == "storage"]
    assert engine.net.link_bytes[into].sum() == pytest.approx(2 * total, rel=1e-9)
    # The shares add up to the deduplicated total: DDP replicates everything, so each of
    # the 16 ranks writes 1/16 (fully-parallel save).
    shares = write_shares(result.program.classes, result.context.model.total_params, s.dp)
    per_rank = [shares[c.id].total for c in result.program.classes for _ in c.members]
    assert sum(per_rank) == pytest.approx(total, rel=1e-12)
    assert max(per_rank) == pytest.approx(total / 16, rel=1e-12)


def test_sync_save_blocks_for_bytes_over_the_storage_rate() -> None:
    # The file system (20 GB/s for the job) is far narrower than 16 NICs: the write takes
    # bytes / 20 GB/s, and the step waits for it all.
    result, _ = run(scenario(rate=20.0), 1)
    ck = result.summary["checkpoint"]
    assert ck["blocking_s"] == pytest.approx(ck["gb_per_save"] / 20.0, rel=1e-3)
    assert ck["d2h_s"] == 0.0
    assert result.summary["step_time_s"] == pytest.approx(ck["clean_step_s"] + ck["blocking_s"])


def test_sync_save_to_nvme_runs_at_the_path_bottleneck() -> None:
    result, _ = run(scenario(storage="local_nvme", rate=None), 1)
    ck = result.summary["checkpoint"]
    fab = result.fabric
    share = ck["gb_per_save"] * 1e9 / 16
    routes = [fab.route_to_host(r) + fab.route_nvme(r // 8, "write") for r in range(16)]
    assert ck["blocking_s"] == pytest.approx(fair_share_s(result, routes, share), rel=1e-3)


def test_async_save_blocks_only_for_the_device_to_host_copy() -> None:
    result, _ = run(scenario(rate=20.0, asynchronous=True), 2)
    ck = result.summary["checkpoint"]
    fab = result.fabric
    # torch DCP's async_save stages the rank's whole local state dict (DDP: the whole
    # model and optimizer on every rank), though each rank writes only 1/16 of it.
    (c,) = result.program.classes
    local = c.initial_memory["parameters"] + c.initial_memory["optimizer"]
    assert local == pytest.approx(ck["gb_per_save"] * 1e9, rel=1e-9)
    d2h = fair_share_s(result, [fab.route_to_host(r) for r in range(16)], local)
    assert ck["blocking_s"] == pytest.approx(d2h, rel=1e-3)
    assert ck["blocking_s"] == pytest.approx(ck["d2h_s"], rel=1e-9)
    # The write itself, in the background, still takes bytes / 20 GB/s after the copy.
    assert ck["write_s"] == pytest.approx(ck["d2h_s"] + ck["gb_per_save"] / 20.0, rel=1e-2)
    sync, _ = run(scenario(rate=20.0), 1)
    assert ck["blocking_s"] < sync.summary["checkpoint"]["blocking_s"]


def test_megatron_async_save_stages_only_its_own_share() -> None:
    # dist-ckpt's async writer copies its own write buckets: with the distributed optimizer
    # over 16 replicas, the bf16 weights are spread over them too.
    s = scenario(rate=20.0, asynchronous=True,
                 framework={"name": "megatron", "distributed_optimizer": True})
    result, _ = run(s, 1)
    ck = result.summary["checkpoint"]
    fab = result.fabric
    share = ck["gb_per_save"] * 1e9 / 16
    d2h = fair_share_s(result, [fab.route_to_host(r) for r in range(16)], share)
    assert ck["d2h_s"] == pytest.approx(d2h, rel=1e-3)


def _step_lengths(result: RunResult) -> list[float]:
    from sim.analysis.metrics import step_spans

    return [b - a for a, b in step_spans(result.recorder.ops)]


def test_async_write_on_the_nics_slows_the_next_steps_data_parallel_traffic() -> None:
    # One 100 Gb/s NIC per server: the background write (storage fast, the NIC the
    # bottleneck) shares it with the next step's gradient all-reduce between the servers.
    one_nic = {**CLUSTER, "nics_per_node": 1, "nic_gbps": 100}
    saving = scenario(rate=1e5, asynchronous=True, interval=10, cluster=one_nic)
    plain = scenario(rate=1e5, asynchronous=True, interval=10, cluster=one_nic,
                     **{"run.checkpoint.simulate": False})
    with_save, _ = run(saving, 3)
    without, _ = run(plain, 3)
    assert "checkpoint" not in without.summary
    a, b = _step_lengths(with_save), _step_lengths(without)
    # The steps after the save: never faster, and the one the write overlaps slower.
    assert all(x >= y - 1e-12 for x, y in zip(a[1:], b[1:], strict=True))
    assert a[1] > b[1] * 1.01
    ck = with_save.summary["checkpoint"]
    assert ck["contention_s_per_save"] == pytest.approx(sum(a[1:]) - sum(b[1:]), rel=1e-6)
    # The run model charges the save its copy plus that contention.
    r = run_length(with_save)
    assert r["checkpoint_simulated"]
    assert r["checkpoint_blocking_s"] >= ck["blocking_s"] + ck["contention_s_per_save"] - 1e-12


def test_object_store_in_another_zone_is_on_the_zone_link_and_billed() -> None:
    s = scenario(storage="object_store", rate=5.0, zone=1,
                 pricing={"gpu_hour_usd": 2.0, "egress_usd_per_gb": 0.02})
    result = simulate(s, steps=2)     # one save, after the first step
    summ = result.summary
    ck = summ["checkpoint"]
    assert ck["cross_az_gb_per_save"] == pytest.approx(ck["gb_per_save"], rel=1e-12)
    # Per step, as the summary counts bytes: one save over the window's two steps.
    assert summ["bytes"]["cross_az"] == pytest.approx(ck["gb_per_save"] * 1e9 / 2, rel=1e-6)
    assert summ["cost"]["egress_usd_per_step"] == pytest.approx(
        ck["gb_per_save"] / 2 * 0.02, rel=1e-6)
    r = run_length(result)
    assert r["checkpoint_egress_usd_per_save"] == pytest.approx(ck["gb_per_save"] * 0.02)
    # Object storage's rate is per server: 2 servers x 5 GB/s, slower than the 100 Gb/s
    # zone link (12.5 GB/s at the transport's efficiency), so the servers' rate binds.
    assert ck["write_s"] == pytest.approx(ck["gb_per_save"] / 10.0, rel=1e-2)
    # In the job's own zone nothing crosses.
    home = simulate(scenario(storage="object_store", rate=5.0), steps=2).summary
    assert home["checkpoint"]["cross_az_gb_per_save"] == 0.0
    assert home["bytes"]["cross_az"] == 0.0


def test_saves_are_deterministic_and_off_by_default() -> None:
    s = scenario(rate=20.0, asynchronous=True)
    a = simulate(s, steps=3).summary
    b = simulate(s, steps=3).summary
    assert a["checkpoint"] == b["checkpoint"] and a["step_time_s"] == b["step_time_s"]
    off = scenario(rate=20.0, asynchronous=True, **{"run.checkpoint.simulate": False})
    plain = make_scenario(cluster=CLUSTER, **{"training.global_batch_size": 16})
    x, y = simulate(off, steps=3).summary, simulate(plain, steps=3).summary
    assert "checkpoint" not in x
    assert x["step_time_s"] == y["step_time_s"] and x["bytes"] == y["bytes"]
    assert np.isfinite(a["checkpoint"]["write_s"])


@pytest.mark.parametrize("over", [
    {"framework": {"name": "megatron", "distributed_optimizer": True},
     "parallelism": {"tp": 2, "pp": 2}},
    {"framework": {"name": "fsdp2"}},
    {"framework": {"name": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"}},
])
def test_shares_add_up_to_the_deduplicated_states(over: dict[str, Any]) -> None:
    s = make_scenario(**{"cluster": CLUSTER, "training.global_batch_size": 16, **over})
    ctx = JobContext.from_scenario(s)
    program = build_program(ctx)
    params = ctx.model.total_params
    replicas = s.dp * s.parallelism.cp
    shares = write_shares(program.classes, params, replicas)
    total = checkpoint_bytes(program.classes, params, replicas).total
    assert sum(shares[c.id].total * len(c.members) for c in program.classes) == \
        pytest.approx(total, rel=1e-9)
    # What is on the GPU is never more than the rank holds.
    for c in program.classes:
        held = c.initial_memory.get("parameters", 0.0) + c.initial_memory.get("optimizer", 0.0)
        assert shares[c.id].gpu_bytes <= held * (1 + 1e-12)


def test_a_straggler_is_in_the_saving_step_too() -> None:
    # faults.slow_gpus splits the slow rank into a class of its own after the program is
    # built; the save goes on the program as it runs, so the clean step is the slowed one.
    slow = {"faults": {"slow_gpus": [{"rank": 3, "factor": 1.5}]}}
    saving = simulate(scenario(rate=20.0, **slow), steps=1).summary
    alone = simulate(scenario(rate=20.0, **{**slow, "run.checkpoint.simulate": False}),
                     steps=1).summary
    assert saving["checkpoint"]["clean_step_s"] == pytest.approx(alone["step_time_s"],
                                                                 rel=1e-12)
    assert saving["sim"]["ranks_simulated"] == alone["sim"]["ranks_simulated"] == 2


def test_the_next_async_save_waits_for_the_previous_write() -> None:
    # A save every step to a slow file system (1 GB/s): the write outlasts the next step,
    # so the next save's staging copy starts only when it has ended.
    result, _ = run(scenario(rate=1.0, asynchronous=True, interval=1), 2)
    rec = result.recorder
    write0 = max(r.end for r in rec.background_ops
                 if r.step == 0 and r.op.name == "checkpoint write")
    stage1 = min(r.start for r in rec.ops if r.step == 1 and r.op.name == "checkpoint stage d2h")
    train1 = max(r.end for r in rec.ops if r.step == 1 and r.op.category != "checkpoint")
    assert write0 > train1              # the write outlasted the next step's training
    assert stage1 == pytest.approx(write0, abs=1e-9)
    ck = result.summary["checkpoint"]
    assert ck["saves"] == 2 and ck["write_ends_in_window"]
