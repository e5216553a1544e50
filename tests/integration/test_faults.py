"""Faults inside a step (``faults:``): slow GPUs, slow and failed NIC links, against closed forms.

* A synchronous data-parallel step waits for its slowest rank at every gradient collective, so
  one rank whose kernels take ``factor`` times as long lengthens the step by about
  ``(factor - 1) x`` its compute time (less what the collectives it delays still overlap).
* A ring all-reduce on two servers is bound by its slowest ring link (NCCL's ring moves
  ``2 (n-1)/n x bytes`` over every ring link in lockstep: ncclTopoTuneModel's ring bandwidth is
  the minimum over the ring), so one NIC at half rate on it about doubles the bandwidth-bound
  time of a large all-reduce.
* A failed NIC carries nothing and its bytes leave through the node's other NICs: the bytes
  that leave the servers are the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import simpy
from helpers import fabricsim_in_process

from sim.api import simulate
from sim.apps.nccltests import Bench
from sim.fabric.collectives.runner import CollectiveRunner, transport_capacity
from sim.fabric.network import FlowNetwork
from sim.fabric.topology import LINK_KINDS, NETWORK
from sim.fabric.topology.link_faults import apply_link_faults, nic_links
from sim.scenario import ScenarioError, load_scenario

DDP = "llama3.2-1b-ddp-8xh100"
FSDP2 = "llama3-8b-fsdp2-16xh100"


def _run(name: str, *overrides: str):  # type: ignore[no-untyped-def]
    return simulate(load_scenario(name, list(overrides)))


@pytest.fixture(scope="module")
def ddp_base():  # type: ignore[no-untyped-def]
    return _run(DDP)


@pytest.fixture(scope="module")
def fsdp2_base():  # type: ignore[no-untyped-def]
    return _run(FSDP2)


@pytest.mark.parametrize("factor", [1.1, 1.3])
def test_one_slow_rank_slows_a_ddp_step_by_its_extra_compute(ddp_base, factor: float) -> None:
    slow = _run(DDP, f"faults.slow_gpus=[{{rank: 3, factor: {factor}}}]")
    base_t = ddp_base.summary["step_time_s"]
    compute = ddp_base.summary["compute_time_s"]
    extra = slow.summary["step_time_s"] - base_t
    # Closed form: (factor - 1) x compute; within 10% (the straggler's late gradient buckets
    # shift the all-reduces that overlapped its backward; measured 0.99).
    assert extra == pytest.approx((factor - 1) * compute, rel=0.1)
    # The other seven ranks wait for it: their all-reduces start well after they were ready.
    fast_cls = next(c for c in slow.program.classes if 3 not in c.members)
    waited = max(r.start - r.ready for r in slow.recorder.ops
                 if r.cls == fast_cls.id and r.op.kind == "collective")
    assert waited > 0.5 * (factor - 1) * compute
    # ... and the straggler itself does not wait at its last collective.
    slow_cls = next(c for c in slow.program.classes if c.members == (3,))
    last = max((r for r in slow.recorder.ops if r.cls == slow_cls.id
                and r.op.kind == "collective"), key=lambda r: r.end)
    assert last.start - last.ready < 1e-6


def test_only_the_slow_ranks_class_splits(ddp_base) -> None:
    slow = _run(DDP, "faults.slow_gpus=[{rank: 5, factor: 1.2}]")
    before = [c.members for c in ddp_base.program.classes]
    after = [c.members for c in slow.program.classes]
    assert len(after) == len(before) + 1
    assert (5,) in after and sorted(r for m in after for r in m) == list(range(8))
    assert slow.summary["sim"]["ranks_simulated"] == ddp_base.summary["sim"]["ranks_simulated"] + 1
    # Memory is still reported for every class, the straggler's equal to its peers'.
    peaks = {m["ranks"]: m["peak_gib"] for m in slow.summary["memory_by_rank_class"]}
    assert peaks[1] == pytest.approx(peaks[7], rel=1e-6)
    # Same bytes moved: the split changes who waits, not what is sent.
    assert slow.summary["bytes"] == pytest.approx(ddp_base.summary["bytes"], rel=1e-9)


def test_slow_rank_in_fsdp2_on_two_servers(fsdp2_base) -> None:
    base = fsdp2_base
    slow = _run(FSDP2, "faults.slow_gpus=[{rank: 9, factor: 1.1}]")
    extra = slow.summary["step_time_s"] - base.summary["step_time_s"]
    assert extra == pytest.approx(0.1 * base.summary["compute_time_s"], rel=0.2)
    assert len(slow.program.classes) == len(base.program.classes) + 1


TINY = str(Path(__file__).resolve().parent / "golden" / "scenarios" / "tiny.yaml")
LAYOUTS = {
    "ddp": (),
    "fsdp2": ("framework.name=fsdp2",),
    "deepspeed-zero3": ("framework.name=deepspeed",),
    "megatron-tp2-pp2": ("framework.name=megatron", "parallelism.tp=2", "parallelism.pp=2"),
    "megatron-tp2-pp2-vp2-dist-opt": ("framework.name=megatron", "parallelism.tp=2",
                                      "parallelism.pp=2", "parallelism.vp=2",
                                      "framework.distributed_optimizer=true",
                                      "framework.overlap_grad_reduce=true"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_at_full_speed_is_the_same_step(layout: str) -> None:
    # Splitting a rank out at factor 1 must change no time and no byte (its copy does exactly
    # what its class did, and the rendezvous joins the two), and it adds one class only.
    base = _run(TINY, *LAYOUTS[layout])
    split = _run(TINY, *LAYOUTS[layout], "faults.slow_gpus=[{rank: 5, factor: 1.0}]")
    assert split.summary["step_time_s"] == pytest.approx(base.summary["step_time_s"],
                                                         rel=1e-9)
    assert split.summary["bytes"] == pytest.approx(base.summary["bytes"], rel=1e-9)
    assert len(split.program.classes) == len(base.program.classes) + 1
    alone = next(c for c in split.program.classes if c.members == (5,))
    was = next(c for c in base.program.classes if 5 in c.members)
    assert {n: len(o) for n, o in alone.streams.items()} == {
        n: len(o) for n, o in was.streams.items()}
    # Slower at 1.5: the step grows, bounded by the straggler's whole extra compute.
    slow = _run(TINY, *LAYOUTS[layout], "faults.slow_gpus=[{rank: 5, factor: 1.5}]")
    extra = slow.summary["step_time_s"] - base.summary["step_time_s"]
    busy = sum(r.end - r.start for r in base.recorder.ops
               if r.cls == was.id and r.op.kind == "compute")
    assert 0 < extra <= 0.5 * busy * 1.05


def test_a_throttled_server_is_one_class_and_the_slowest_rank_sets_the_step() -> None:
    # Node 1's 8 GPUs at a 10% power-capped clock: one new class, not eight (they run alike);
    # the step is as slow as with one of them alone (a synchronous job waits for its slowest).
    node = ", ".join(f"{{rank: {r}, factor: 1.1}}" for r in range(8, 16))
    one = _run(FSDP2, "faults.slow_gpus=[{rank: 9, factor: 1.1}]")
    whole = _run(FSDP2, f"faults.slow_gpus=[{node}]")
    assert len(whole.program.classes) == len(one.program.classes)
    assert tuple(range(8, 16)) in [c.members for c in whole.program.classes]
    assert whole.summary["step_time_s"] == pytest.approx(one.summary["step_time_s"], rel=0.02)
    # faults.slow_nodes says the same in one entry.
    by_node = _run(FSDP2, "faults.slow_nodes=[{node: 1, factor: 1.1}]")
    assert by_node.summary["step_time_s"] == whole.summary["step_time_s"]
    assert [c.members for c in by_node.program.classes] == [
        c.members for c in whole.program.classes]
    # Two factors in one class: two new classes; the slower one sets the step.
    two = _run(FSDP2, "faults.slow_gpus=[{rank: 2, factor: 1.05}, {rank: 9, factor: 1.1}]")
    assert len(two.program.classes) == len(one.program.classes) + 1
    assert two.summary["step_time_s"] == pytest.approx(one.summary["step_time_s"], rel=0.02)


def test_empty_faults_change_nothing(ddp_base) -> None:
    same = _run(DDP, "faults={}")
    a, b = dict(ddp_base.summary), dict(same.summary)
    a.pop("sim"), b.pop("sim")
    assert a == b


def test_deterministic() -> None:
    keys = ("faults={slow_gpus: [{rank: 9, factor: 1.2}], failed_links: [{node: 1, nic: 2}], "
            "slow_links: [{node: 0, nic: 5, factor: 3}], seed: 7}")
    a, b = _run(FSDP2, keys).summary, _run(FSDP2, keys).summary
    a.pop("sim"), b.pop("sim")
    assert a == b


# ----------------------------------------------------------------- links (nccl-tests style)
def _all_reduce(slow=(), failed=(), nbytes: float = 1 << 30):  # type: ignore[no-untyped-def]
    """A 16-GPU ring all-reduce on two DGX H100s (8 x 400 Gb/s NICs each) on an idle fabric:
    its time and the bytes each link carried."""
    bench = Bench.build("dgx-h100", 16, algo="ring")
    apply_link_faults(bench.fabric, slow, failed)
    env = simpy.Environment()
    net = FlowNetwork(env, transport_capacity(bench.fabric, bench.arch, bench.transport),
                      bench.fabric.kind, len(LINK_KINDS))
    runner = CollectiveRunner(env, net, bench.fabric, bench.arch, bench.settings)
    env.run(env.process(runner.run_collective("all_reduce", tuple(range(16)), nbytes)))
    return env.now, net.link_bytes.copy(), bench.fabric


def _leaving(fabric, link_bytes) -> float:  # type: ignore[no-untyped-def]
    """Bytes on the NIC -> leaf cables: what left the servers."""
    return float(sum(link_bytes[i] for i, (u, _) in enumerate(fabric.endpoints)
                     if u[0] == "nic" and fabric.kind[i] == NETWORK))


def test_half_rate_nic_doubles_a_bandwidth_bound_all_reduce() -> None:
    # Latency-free part: the difference of two large sizes cancels the fixed terms.
    big, small = float(1 << 31), float(1 << 29)
    t_big, _, _ = _all_reduce(nbytes=big)
    t_small, _, _ = _all_reduce(nbytes=small)
    s_big, _, _ = _all_reduce(slow=[(0, 3, 2.0)], nbytes=big)
    s_small, _, _ = _all_reduce(slow=[(0, 3, 2.0)], nbytes=small)
    ratio = (s_big - s_small) / (t_big - t_small)
    assert ratio == pytest.approx(2.0, rel=0.1)


def test_slow_link_capacity_divided_both_ways() -> None:
    bench = Bench.build("dgx-h100", 16)
    links = nic_links(bench.fabric, 1, 4)
    before = bench.fabric.capacity[links].copy()
    apply_link_faults(bench.fabric, [(1, 4, 4.0)])
    assert len(links) == 2
    np.testing.assert_allclose(bench.fabric.capacity[links], before / 4)


def test_failed_nic_traffic_moves_to_other_nics_bytes_conserved() -> None:
    t0, base, fab0 = _all_reduce()
    t1, failed, fab1 = _all_reduce(failed=[(0, 0)])
    dead = nic_links(fab1, 0, 0)
    assert failed[dead].sum() == 0 and base[dead].sum() > 0
    # The same bytes leave the servers, now through seven NICs of node 0.
    assert _leaving(fab1, failed) == pytest.approx(_leaving(fab0, base), rel=1e-9)
    # One NIC now carries two rings' traffic: the all-reduce is slower, at most twice (the
    # network-bound part doubles, NVLink and latency do not).
    assert t0 < t1 <= 2.0 * t0 * 1.05


def test_failed_link_in_a_training_step_conserves_what_leaves_the_servers(fsdp2_base) -> None:
    base = fsdp2_base
    failed = _run(FSDP2, "faults.failed_links=[{node: 0, nic: 0}]")
    nic = [i for i, (u, _) in enumerate(failed.fabric.endpoints)
           if u == ("nic", 0, 0) and failed.fabric.kind[i] == NETWORK]
    assert nic and failed.fabric.route(0, 8)[2] != nic[0]
    assert failed.summary["step_time_s"] >= base.summary["step_time_s"]
    assert failed.summary["bytes"]["nvlink"] == pytest.approx(base.summary["bytes"]["nvlink"])


# ----------------------------------------------------------------- bad input
BAD = [
    ("faults.slow_gpus=[{rank: 8, factor: 1.1}]", "faults.slow_gpus[0].rank"),
    ("faults.slow_gpus=[{rank: 1, factor: 0.5}]", "faults.slow_gpus[0].factor"),
    ("faults.slow_links=[{node: 1, nic: 0, factor: 2}]", "faults.slow_links[0].node"),
    ("faults.failed_links=[{node: 0, nic: 8}]", "faults.failed_links[0].nic"),
    ("faults.slow_gpu=[]", "faults.slow_gpu"),
    ("faults.slow_nodes=[{node: 1, factor: 1.1}]", "faults.slow_nodes[0].node"),
]


@pytest.mark.parametrize("keys, where", BAD)
def test_bad_keys_name_themselves_in_one_line(keys: str, where: str) -> None:
    with pytest.raises(ScenarioError) as err:
        _run(DDP, keys)
    assert where in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("keys, where", [BAD[0], BAD[1]])
def test_bad_keys_exit_2_with_one_line(keys: str, where: str) -> None:
    # One check of the cluster (sim.config.faults.check_faults), one of the schema's bounds.
    # In-process through the command's entry point, main() (tests/helpers.py); test_cli.py
    # runs bad input to `fabricsim run` as a true subprocess.
    out = fabricsim_in_process("run", DDP, "--set", keys, "--json")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0], out.stderr


def test_bad_keys_raise_scenario_error() -> None:
    with pytest.raises(ScenarioError, match="faults.slow_gpus"):
        _run(DDP, "faults.slow_gpus=[{rank: 2, factor: 1.1}, {rank: 2, factor: 1.2}]")
    with pytest.raises(ScenarioError, match="every NIC of node 1"):
        _run(FSDP2, "faults.failed_links=[" + ", ".join(
            f"{{node: 1, nic: {k}}}" for k in range(8)) + "]")


def test_a_single_server_may_lose_every_nic() -> None:
    # Found by fuzzing: one server's only NIC failed was an internal error ("every NIC
    # failed") while the check lets a lone server go without NICs: it sends nothing off-node,
    # so the step is the same with them down.
    one = ("cluster.nodes=1", "cluster.gpus_per_node=4", "cluster.nics_per_node=1",
           "training.global_batch_size=16")
    assert _run(FSDP2, *one, "faults.failed_links=[{node: 0, nic: 0}]").summary[
        "step_time_s"] == _run(FSDP2, *one).summary["step_time_s"]


def test_collective_command_takes_link_faults() -> None:
    # `fabricsim collective` (nccl-tests on the simulated fabric) with a NIC at half rate:
    # a 1 GiB ring all-reduce on 2 x 8 H100 is network-bound, so its time about doubles.
    # In-process (tests/helpers.py); test_nccltests.py runs the command as a subprocess.
    def row(*sets: str) -> dict:  # type: ignore[type-arg]
        args = ["collective", "dgx-h100", "--op", "all_reduce", "--gpus", "16",
                "--sizes", "1G", "--algo", "ring", "--json"]
        for s in sets:
            args += ["--set", s]
        out = fabricsim_in_process(*args)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["rows"][0]

    base = row()["time_s"]
    slow = row("faults.slow_links=[{node: 0, nic: 3, factor: 2}]")["time_s"]
    assert slow / base == pytest.approx(2.0, rel=0.1)


def test_seed_picks_among_equally_near_nics_deterministically() -> None:
    # 8 NICs on 8 PCIe switches (DGX H100): the 7 live NICs are equally near NIC 0's GPU
    # (through the host), so the seed picks; never the failed one, the same pick every time.
    from sim.fabric.topology.link_faults import substitute_nic

    fab = Bench.build("dgx-h100", 16).fabric
    picks = [substitute_nic(fab, 0, 0, {0}, seed) for seed in range(16)]
    assert picks == [substitute_nic(fab, 0, 0, {0}, seed) for seed in range(16)]
    assert 0 not in picks and len(set(picks)) > 1


def test_nccl_tuner_sees_the_slow_ring_channel() -> None:
    # NCCL's graph search gives all ring channels the speed every one of them sustains, so its
    # tuner prices a ring with one NIC at a quarter rate at 4x (tuning.cc busBw = nChannels x
    # bw); the simulated choice is then no slower than the forced ring (2 x 4 H100, 4 NICs).
    over = {"cluster.gpus_per_node": 4, "cluster.nics_per_node": 4,
            "faults.slow_links": [{"node": 1, "nic": 2, "factor": 4}]}
    ring = Bench.build("dgx-h100", 8, "ring", overrides=over).run("all_reduce", 1 << 30)
    auto = Bench.build("dgx-h100", 8, "auto", overrides=over).run("all_reduce", 1 << 30)
    assert ring["nccl_model_s"] == pytest.approx(ring["time_s"], rel=0.1)
    assert auto["time_s"] <= ring["time_s"]
