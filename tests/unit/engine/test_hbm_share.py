"""Collectives slowed by the compute beside them (sim/engine/hbm_share.py, FlowNetwork.scale_caps).

Independent truth: the HBM-share closed form worked by hand (a collective keeps ctas/sm of
HBM over a memory-bound phase, all it needs over tensor-core math), conservation of the bytes
each link class carries (contention moves time, never bytes), max-min's own invariants under
mid-flight cap changes (no flow above its links or its cap), and the range Rashidi et al.
measured (ISCA 2021, arXiv 2007.00156: freeing HBM and SMs for collectives raises their
network bandwidth 1.44x on average, 2.67x at most) as a check, not a fit.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from helpers import nvlink_node
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.core import Engine
from sim.engine.recorder import Recorder
from sim.engine.time_grid import QUANTUM_S
from sim.fabric.network import FlowNetwork
from sim.hardware.interference import HBM_BYTES_PER_WIRE_BYTE, comm_load, comm_rate_share
from sim.program.ir import Op, Program, RankClass

H100_MATRIX = 989.4e12 * 0.803     # engine default: H100 SXM dense bf16 x catalogue share
HBM = 3.35e12                      # engine default: H100 SXM HBM3
SMS = 132
# The collective's delays and each change of its flows' rates end on the engine's time grid,
# up to a quantum late each: a handful of them.
GRID = 8 * QUANTUM_S


def _compute(name: str, d: float, matrix: float, **kw) -> Op:
    return Op(name=name, kind="compute", stream=kw.pop("stream", "compute"), phase="fwd",
              duration=d, flops=d * H100_MATRIX * matrix, **kw)


def _allreduce(nbytes: float, group=(0, 1), **kw) -> Op:
    return Op(name="ar", kind="collective", stream="comm", phase="comm",
              collective="all_reduce", group=group, nbytes=nbytes, key="ar", **kw)


def _run(p: Program, gpus: int = 2) -> tuple[dict[str, tuple[float, float]], Engine]:
    rec = Recorder()
    eng = Engine(nvlink_node(gpus), "hopper", rec)
    eng.run_step(p)
    return {r.op.name: (r.start, r.end) for r in rec.ops}, eng


def _program(nbytes: float, beside: float | None, length: float = 1.0,
             members=(0, 1), groups=None) -> Program:
    """An all-reduce with (``beside`` not None) a compute op of that matrix share on the
    other stream, issued first so that it runs over the whole collective."""
    cls = RankClass(0, tuple(members))
    p = Program([cls], len(members), 0, 0, 0)
    if beside is not None:
        p.add(cls, _compute("op", length, beside))
    kw = {"groups": groups} if groups else {}
    p.add(cls, _allreduce(nbytes, group=tuple(members) if not groups else (), **kw))
    return p


def _plan(nbytes: float, group=(0, 1)):
    """What the runner runs: the wait before the flows, the CTAs and the HBM demand."""
    eng = Engine(nvlink_node(max(group) + 1), "hopper")
    plan, est, predicted = eng.collectives.select("all_reduce", tuple(group), nbytes)
    wait = est.latency_s + est.fill_s + plan.chain_latency_s
    load = comm_load("hopper", "all_reduce", nbytes, nbytes * plan.volume, predicted,
                     plan.nccl_channels or plan.channels, plan.algorithm)
    return wait, load


def test_rule_closed_forms() -> None:
    # 32 CTAs on 132 SMs keep 32/132 of 3.35 TB/s = 812 GB/s of HBM in a memory-bound phase.
    share = HBM * 32 / SMS
    assert comm_rate_share(SMS, HBM, 1.0, 32, 1.5e12) == pytest.approx(share / 1.5e12)
    assert comm_rate_share(SMS, HBM, 0.4, 32, 1.5e12) == pytest.approx(
        0.6 + 0.4 * share / 1.5e12)
    # A demand the share covers (a network collective: 4 HBM bytes x 50 GB/s) is unslowed,
    # and so is anything beside pure tensor-core math or nothing at all.
    assert comm_rate_share(SMS, HBM, 1.0, 32, 4 * 50e9) == 1.0
    assert comm_rate_share(SMS, HBM, 0.0, 32, 1.5e12) == 1.0
    assert comm_rate_share(SMS, HBM, 1.0, 32, 0.0) == 1.0
    # The wire-to-HBM factor is the interference module's (one rule, one home).
    assert HBM_BYTES_PER_WIRE_BYTE["all_reduce"] == 4.0


def test_collective_beside_memory_bound_kernel_takes_the_hbm_share_closed_form() -> None:
    # A 4 GB all-reduce between two GPUs of a node beside a 1 s elementwise kernel (matrix
    # share 0): the flows run at share x their rate alone for the whole transfer, so the
    # transfer part of the collective (after NCCL's latency and fill) takes 1/share longer.
    nbytes = 4e9
    wait, load = _plan(nbytes)
    share = comm_rate_share(SMS, HBM, 1.0, load.ctas, load.hbm_bytes_per_s)
    assert 0.3 < share < 0.9
    alone, _ = _run(_program(nbytes, None))
    slowed, _ = _run(_program(nbytes, 0.0))
    t_alone = alone["ar"][1] - alone["ar"][0]
    t_slowed = slowed["ar"][1] - slowed["ar"][0]
    assert slowed["op"][1] > slowed["ar"][1]      # the kernel covers the whole collective
    assert t_slowed - wait == pytest.approx((t_alone - wait) / share, rel=1e-9, abs=GRID)


def test_collective_beside_a_gemm_keeps_its_rate() -> None:
    nbytes = 4e9
    alone, _ = _run(_program(nbytes, None))
    beside, _ = _run(_program(nbytes, 1.0))
    assert beside["ar"][1] - beside["ar"][0] == pytest.approx(
        alone["ar"][1] - alone["ar"][0], rel=1e-12)


def test_kernel_ending_mid_collective_gives_the_rate_back() -> None:
    # The elementwise kernel (5 ms alone) ends at T inside the transfer: bytes move at
    # share x r until T, then at r. With r from the unslowed run:
    # end = T + (B - share r (T - w)) / r, the time alone plus (T - w)(1 - share).
    nbytes = 4e9
    wait, load = _plan(nbytes)
    share = comm_rate_share(SMS, HBM, 1.0, load.ctas, load.hbm_bytes_per_s)
    alone, _ = _run(_program(nbytes, None))
    t_alone = alone["ar"][1] - alone["ar"][0]
    mixed, _ = _run(_program(nbytes, 0.0, length=5e-3))
    # The kernel itself is slowed by the collective (NCCL's HBM draw and SMs): take its end,
    # which falls inside the slowed transfer.
    t_end = mixed["op"][1]
    assert wait < t_end < wait + (t_alone - wait) / share
    assert mixed["ar"][1] == pytest.approx(t_alone + (t_end - wait) * (1 - share), rel=1e-9)


def test_bytes_per_link_class_are_conserved() -> None:
    # Contention changes when bytes move, never how many: every link class carries the same
    # bytes with and without the kernel beside.
    nbytes = 4e9
    _, e0 = _run(_program(nbytes, None))
    _, e1 = _run(_program(nbytes, 0.0))
    assert e1.net.class_bytes == pytest.approx(e0.net.class_bytes, rel=1e-9)
    assert e1.net.class_bytes.sum() > 0


def test_folded_class_slows_every_copy_and_keeps_its_bytes() -> None:
    # One rank class stands for two tensor-parallel pairs of a 4-GPU node; its collective
    # runs as one group's flows with count 2. The kernel beside slows both copies alike (the
    # same 1/share on the transfer) and the bytes are still those of both pairs.
    nbytes = 4e9
    wait, load = _plan(nbytes)
    share = comm_rate_share(SMS, HBM, 1.0, load.ctas, load.hbm_bytes_per_s)
    groups = ((0, 1), (2, 3))
    a, e0 = _run(_program(nbytes, None, members=(0, 1, 2, 3), groups=groups), 4)
    b, e1 = _run(_program(nbytes, 0.0, members=(0, 1, 2, 3), groups=groups), 4)
    assert (b["ar"][1] - b["ar"][0]) - wait == pytest.approx(
        ((a["ar"][1] - a["ar"][0]) - wait) / share, rel=1e-9, abs=GRID)
    assert e1.net.class_bytes == pytest.approx(e0.net.class_bytes, rel=1e-9)
    single, e2 = _run(_program(nbytes, None), 2)
    assert e0.net.class_bytes.sum() == pytest.approx(2 * e2.net.class_bytes.sum(), rel=1e-9)


def test_deterministic() -> None:
    runs = [_run(_program(4e9, 0.3, length=3e-3))[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_slowdowns_sit_in_the_range_rashidi_et_al_measured() -> None:
    # Rashidi et al. (ISCA 2021): giving collectives their own memory bandwidth and compute
    # raises the network bandwidth they achieve beside DL compute by 1.44x on average, up to
    # 2.67x. Our collectives beside layers that are 20-60% memory-bound (norms, activations,
    # optimizer steps between GEMMs) on A100 and H100, with intra-node (NVLink, ~370 GB/s
    # wire x 4 HBM bytes) and inter-node (50 GB/s x 4) demands, slow by at most 2.67x and
    # never speed up; the network collective is not slowed at all.
    cases = [1 / comm_rate_share(sm, hbm, m, ctas, d)
             for sm, hbm, ctas in ((108, 2.039e12, 24), (132, 3.35e12, 32))
             for m in (0.2, 0.4, 0.6) for d in (4 * 370e9, 4 * 50e9)]
    assert all(1.0 <= c <= 2.67 for c in cases)
    assert max(cases) > 1.1
    assert 1 / comm_rate_share(132, 3.35e12, 0.6, 32, 4 * 50e9) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
                          st.floats(1.0, 100.0), st.sampled_from([np.inf, 5.0, 30.0])),
                min_size=1, max_size=6),
       st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(0, 5), st.floats(-0.5, 1.5)),
                max_size=8))
def test_scaled_caps_never_raise_a_flow_above_its_links(flows, changes) -> None:
    # Random flows over five links, each its own tagged group; random cap scales set and
    # lifted mid-flight (some outside [0, 1]). After every solve no flow runs above its own
    # cap, its slowest link or scale x that, and no link carries more than its capacity;
    # every flow still finishes and delivers its bytes.
    capacity = np.array([10.0, 20.0, 40.0, 15.0, 25.0])
    env = simpy.Environment()
    net = FlowNetwork(env, capacity, np.zeros(5, dtype=np.int64), 1)
    scales: dict[int, float] = {}

    def check() -> None:
        assert (net._rate <= net._cap0 * (1 + 1e-9)).all()
        assert (net.link_load <= capacity * (1 + 1e-9)).all()
        for i in range(len(net._size)):
            if net._group[i] < 0:
                continue  # an ended flow the network keeps as a dead row for a while
            links = net._inc_link[net._inc_flow == i]
            tag = next(t for t, g in net._tag_groups.items() if net._group[i] in g)
            alone = min(net._cap0[i], capacity[links].min())
            assert net._rate[i] <= alone * min(1.0, scales.get(tag, 1.0)) * (1 + 1e-9)

    done = [net.start_flow(tuple(links), size, cap=cap, tag=k)
            for k, (links, size, cap) in enumerate(flows)]
    check()

    def driver():
        for dt, k, s in changes:
            yield env.timeout(dt)
            s = min(1.0, max(1e-6, s))
            scales[k] = s
            net.scale_caps(k, s)
            check()
    env.process(driver())
    env.run()
    assert all(ev.processed for ev in done)
    assert net.class_bytes[0] == pytest.approx(
        sum(size * len(links) for links, size, _ in flows), rel=1e-6)


def test_the_slowest_gpu_paces_the_whole_collective() -> None:
    # Two rank classes, one GPU each; only GPU 0 runs the elementwise kernel. NCCL's ring
    # steps are lock-step, so the whole all-reduce runs at GPU 0's share: the same time as
    # when both GPUs run it.
    nbytes = 4e9
    wait, load = _plan(nbytes)
    share = comm_rate_share(SMS, HBM, 1.0, load.ctas, load.hbm_bytes_per_s)
    times = []
    for both in (False, True):
        a, b = RankClass(0, (0,)), RankClass(1, (1,))
        p = Program([a, b], 2, 0, 0, 0)
        for cls in (a, b) if both else (a,):
            p.add(cls, _compute("op", 1.0, 0.0))
        for cls in (a, b):
            p.add(cls, _allreduce(nbytes))
        d, _ = _run(p)
        times.append(d["ar"][1] - d["ar"][0])
    alone, _ = _run(_program(nbytes, None))
    assert times[0] == pytest.approx(times[1], rel=1e-12)
    assert times[0] - wait == pytest.approx((alone["ar"][1] - alone["ar"][0] - wait) / share,
                                            rel=1e-9, abs=GRID)


def test_scale_caps_closed_form_and_later_groups() -> None:
    # One 100 B/s link. Flow "a" (300 B) alone at 100; at t = 1 its tag is scaled to 0.2
    # and flow "b" (tag scaled before it starts) joins: a runs at 20 (0.2 x its rate alone),
    # b at 0.5 x 100 = 50. At t = 2 a's scale is lifted: max-min gives 50/50.
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([100.0]), np.array([0]), 1)
    ends: dict[str, float] = {}
    ev = net.start_flow((0,), 300.0, tag="a")
    ev.callbacks.append(lambda _e: ends.__setitem__("a", env.now))

    def later():
        yield env.timeout(1.0)
        net.scale_caps("a", 0.2)
        net.scale_caps("b", 0.5)
        eb = net.start_flow((0,), 200.0, tag="b")
        eb.callbacks.append(lambda _e: ends.__setitem__("b", env.now))
        assert sorted(net._rate[net._group >= 0].tolist()) == pytest.approx([20.0, 50.0])
        yield env.timeout(1.0)
        net.scale_caps("a", 1.0)
        assert sorted(net._rate[net._group >= 0].tolist()) == pytest.approx([50.0, 50.0])
    env.process(later())
    env.run()
    # a: 100 by t=1, 20 by t=2, then 180 left at 50 -> ... b: 50 by t=2, 150 left at 50.
    # b ends at t=5 (150/50); a then has 180 - 150 = 30 left alone at 100: t = 5.3.
    assert ends["b"] == pytest.approx(5.0)
    assert ends["a"] == pytest.approx(5.3)
