"""The host clock (:mod:`sim.engine.host_clock`): one rule, run by the engine and the planner's
bound.

On a program of compute ops alone nothing is shared (no NCCL kernel slows a GEMM, no flow
shares a link), so the planner's earliest schedule is exactly what the engine simulates: the
two must agree op by op, and with a closed form where there is one. Times are multiples of
2**-10 s, so every sum is exact in binary floating point and equality is exact.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.apps import plan
from sim.engine import host_clock
from sim.engine.core import Engine
from sim.engine.host_clock import LAUNCH_QUEUE_KERNELS, host_issues, issue_order, issue_time
from sim.engine.recorder import Recorder
from sim.fabric.topology import FabricSpec, build_fabric
from sim.program.ir import Op, Program, RankClass

TICK = 2.0**-10
# No collective runs in these programs: the bound never reads the link rates.
RATES = plan.LinkRates(gpus_per_node=2, nvlink=450e9, node_network=0.0)


def compute(name: str, d: float, **kw: object) -> Op:
    kind = kw.pop("kind", "compute")
    return Op(name=name, kind=kind, stream=str(kw.pop("stream", "compute")), phase="fwd",  # type: ignore[arg-type]
              duration=d, **kw)  # type: ignore[arg-type]


def engine_and_bound(p: Program) -> tuple[dict[str, float], float, dict[str, float], float]:
    """Start of every op and the step, simulated by the engine and in the planner's bound."""
    rec = Recorder()
    spec = FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
                      pcie_gbytes_per_s=63, nics_per_node=0, nic_gbps=400)
    step = Engine(build_fabric(spec), "hopper", rec).run_step(p)
    sched = plan._earliest_schedule(p, RATES)
    assert sched is not None
    simulated = {r.op.name: r.start for r in rec.ops}
    bound = {op.name: sched.start[op.index] for op in p.ops}
    return simulated, step, bound, sched.makespan


def one_class() -> tuple[RankClass, Program]:
    cls = RankClass(0, (0, 1))
    return cls, Program([cls], 2, 0, 0, 0)


def test_a_host_bound_stream_takes_the_cpu_time() -> None:
    # 64 kernels of 1 tick on the GPU, 4 ticks of Python each: the host issues op i at
    # (i + 1) * 4 ticks and the step ends one GPU tick after the last issue.
    cls, p = one_class()
    for i in range(64):
        p.add(cls, compute(f"k{i}", TICK, cpu_s=4 * TICK))
    simulated, step, bound, makespan = engine_and_bound(p)
    assert simulated == bound == {f"k{i}": (i + 1) * 4 * TICK for i in range(64)}
    assert step == makespan == 64 * 4 * TICK + TICK


@pytest.mark.parametrize("sync", [False, True])
def test_the_host_waits_after_a_host_sync_op(sync: bool) -> None:
    # "long" (1 s on the GPU) is issued at 1 tick; the next op, on another stream, is issued
    # 1 tick after the host is free: at 2 ticks, or at 1 s + 2 ticks when the host waited
    # for "long" (a torch.cuda.synchronize after it).
    cls, p = one_class()
    p.add(cls, compute("long", 1.0, cpu_s=TICK, host_sync=sync))
    p.add(cls, compute("next", TICK, cpu_s=TICK, stream="side"))
    simulated, step, bound, makespan = engine_and_bound(p)
    assert simulated == bound
    assert simulated["next"] == (1.0 + 2 * TICK if sync else 2 * TICK)
    assert step == makespan == (1.0 + 3 * TICK if sync else 1.0 + TICK)


@pytest.mark.parametrize("tiny", [3, 4])
def test_a_full_launch_queue_holds_the_host_in_both(tiny: int) -> None:
    # One long kernel, then ops of a quarter of the queue's kernels each behind it: the
    # fourth would leave 1 + 4 * 256 > 1,024 launches pending, so the host waits for the
    # long kernel before issuing it, and only then spends the probe's CPU tick.
    cls, p = one_class()
    p.add(cls, compute("long", 1.0))
    for i in range(tiny):
        p.add(cls, compute(f"tiny {i}", 0.0, kernels=LAUNCH_QUEUE_KERNELS // 4))
    p.add(cls, compute("probe", 0.0, stream="side", cpu_s=TICK))
    simulated, _, bound, _ = engine_and_bound(p)
    assert simulated == bound
    assert simulated["probe"] == (1.0 if tiny == 4 else 0.0) + TICK


def test_host_issues_frees_the_oldest_launches_first() -> None:
    cls, p = one_class()
    a = p.add(cls, compute("a", 1.0, kernels=500))
    b = p.add(cls, compute("b", 1.0, kernels=500, host_sync=True))
    adam = p.add(cls, compute("adam", 1.0, kernels=5000, stream="cpu", kind="host"))  # host work
    c = p.add(cls, compute("c", 1.0, kernels=1000))
    d = p.add(cls, compute("d", 1.0, kernels=LAUNCH_QUEUE_KERNELS - 1000))
    e = p.add(cls, compute("e", 1.0, kernels=1))
    issued = list(host_issues(issue_order(cls)))
    assert [op for op, _, _ in issued] == [a, b, adam, c, d, e]
    # Only the op right after the sync waits for it; CPU work launches no kernel; c needs
    # both a and b gone (500 + 500 + 1,000 > 1,024, then 500 + 1,000 still is); d fills the
    # queue to exactly 1,024, which is allowed, and e, one more, waits for c.
    assert [sync for _, sync, _ in issued] == [None, None, b, None, None, None]
    assert [launches for _, _, launches in issued] == [(), (), (), (a, b), (), (c,)]


def test_issue_time_order_of_waits() -> None:
    # The sync is waited for before the CPU time is spent, the launch queue after.
    assert issue_time(1.0, 3.0, 0.5, -float("inf")) == 3.5
    assert issue_time(1.0, -float("inf"), 0.5, 3.0) == 3.0
    assert issue_time(1.0, 2.0, 0.5, 2.25) == 2.5


def test_changing_the_rule_moves_the_engine_and_the_bound_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # With an 8-launch queue, 10 tiny kernels behind a long one fill it in both: the rule
    # has one home, so neither can drift from the other.
    monkeypatch.setattr(host_clock, "LAUNCH_QUEUE_KERNELS", 8)
    cls, p = one_class()
    p.add(cls, compute("long", 1.0))
    for i in range(10):
        p.add(cls, compute(f"tiny {i}", 0.0))
    p.add(cls, compute("probe", 0.0, stream="side"))
    simulated, _, bound, _ = engine_and_bound(p)
    assert simulated["probe"] == bound["probe"] == 1.0


_OP = st.tuples(st.integers(0, 8), st.integers(0, 4), st.integers(1, 400), st.booleans(),
                st.sampled_from(["compute", "comm", "side", "cpu"]), st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(_OP, min_size=1, max_size=40))
def test_engine_and_bound_agree_on_compute_programs(ops: list[tuple[int, ...]]) -> None:
    # Random programs of compute ops (durations and CPU times in ticks, up to 400 kernels
    # each so the launch queue fills, host syncs, a dependency on an earlier op): every op
    # starts at the same time in the engine and in the bound.
    cls, p = one_class()
    added: list[Op] = []
    for i, (d, cpu, kernels, sync, stream, back) in enumerate(ops):
        deps = [added[-back]] if back and back <= len(added) else []
        added.append(p.add(cls, compute(f"op{i}", d * TICK, cpu_s=cpu * TICK, stream=stream,
                                        kernels=kernels, host_sync=sync, deps=deps)))
    simulated, step, bound, makespan = engine_and_bound(p)
    assert simulated == bound
    assert step == makespan
