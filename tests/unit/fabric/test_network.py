"""The flow network against textbook max-min cases, closed forms and conservation laws."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric.collectives.chain import ring_bytes_per_rank
from sim.fabric.network import FlowNetwork, NetworkObserver, max_min_rates


def test_two_flows_on_one_link_get_half_each() -> None:
    rates = max_min_rates(np.array([0, 0]), np.array([0, 1]), 2, np.array([10.0]))
    assert rates.tolist() == [5.0, 5.0]


def test_flow_limited_elsewhere_leaves_the_rest_to_the_other() -> None:
    # Flow 0 crosses links 0 (100) and 1 (30); flow 1 only link 0: 30 and 70 (Bertsekas &
    # Gallager's classic example of max-min fairness).
    rates = max_min_rates(np.array([0, 1, 0]), np.array([0, 0, 1]), 2, np.array([100.0, 30.0]))
    assert rates == pytest.approx([30.0, 70.0])


def test_per_flow_cap_is_honoured_and_frees_capacity() -> None:
    rates = max_min_rates(np.array([0, 0]), np.array([0, 1]), 2, np.array([100.0]),
                          np.array([20.0, np.inf]))
    assert rates == pytest.approx([20.0, 80.0])


def test_parking_lot() -> None:
    # Three links of capacity 1 in a row; one long flow over all, one short flow per link:
    # every flow gets 1/2 (max-min), not the long flow 1/3.
    flat = np.array([0, 1, 2, 0, 1, 2])
    owner = np.array([0, 0, 0, 1, 2, 3])
    rates = max_min_rates(flat, owner, 4, np.ones(3))
    assert rates == pytest.approx([0.5, 0.5, 0.5, 0.5])


def test_completion_times_follow_rate_changes() -> None:
    # Link of 100 B/s; flows of 100 B and 300 B start together: both run at 50 until the
    # small one ends at t=2, then the big one runs alone at 100 for its last 200 B: ends at 4.
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([100.0]), np.array([0]), 1)
    ends: dict[str, float] = {}
    for name, size in (("small", 100.0), ("big", 300.0)):
        ev = net.start_flow((0,), size)
        ev.callbacks.append(lambda _e, n=name: ends.__setitem__(n, env.now))
    env.run()
    assert ends["small"] == pytest.approx(2.0)
    assert ends["big"] == pytest.approx(4.0)


def test_late_flow_slows_the_running_one() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([10.0]), np.array([0]), 1)
    first = net.start_flow((0,), 100.0)   # alone: would end at 10 s

    def later():
        yield env.timeout(5.0)            # 50 B left, now shared: 50/5 = 10 s more
        yield net.start_flow((0,), 50.0)

    env.process(later())
    env.run(first)
    assert env.now == pytest.approx(15.0)


def test_count_multiplies_bytes_not_sharing() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([10.0, 10.0]), np.array([0, 1]), 2)
    net.start_flow((0, 1), 20.0, count=8)
    env.run()
    assert env.now == pytest.approx(2.0)               # the representative flow alone
    assert net.class_bytes.tolist() == pytest.approx([160.0, 160.0])


def test_ring_volumes() -> None:
    # nccl-tests bus bandwidth factors: all-reduce 2(n-1)/n, all-gather (n-1)/n.
    assert ring_bytes_per_rank("all_reduce", 800.0, 8) == pytest.approx(1400.0)
    assert ring_bytes_per_rank("all_gather", 800.0, 8) == pytest.approx(700.0)
    assert ring_bytes_per_rank("reduce_scatter", 800.0, 1) == 0.0


class _Checker(NetworkObserver):
    def __init__(self, net_ref: list[FlowNetwork]) -> None:
        self.net_ref = net_ref
        self.max_excess = 0.0

    def on_rates(self, t, class_rates, link_rates) -> None:
        net = self.net_ref[0]
        self.max_excess = max(self.max_excess, float((link_rates / net.capacity).max()) - 1.0)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(st.floats(1.0, 100.0), min_size=1, max_size=6),
    flows=st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
                  st.floats(1.0, 1000.0), st.integers(1, 4), st.floats(0.0, 5.0)),
        min_size=1, max_size=12),
)
def test_conservation_and_capacity(caps, flows) -> None:
    n_links = len(caps)
    env = simpy.Environment()
    holder: list[FlowNetwork] = []
    checker = _Checker(holder)
    net = FlowNetwork(env, np.array(caps), np.arange(n_links) % 2, 2, checker)
    holder.append(net)
    expected = np.zeros(2)
    delivered = []

    def start(links, size, count, delay):
        yield env.timeout(delay)
        t0 = env.now
        yield net.start_flow(links, size, count)
        delivered.append((size, links, env.now - t0))

    for links, size, count, delay in flows:
        links = [x % n_links for x in links]
        links = list(dict.fromkeys(links))
        for x in links:
            expected[x % 2] += size * count
        env.process(start(links, size, count, delay))
    env.run()
    # Bytes sent = bytes received, per class, each hop counted.
    assert net.class_bytes == pytest.approx(expected, rel=1e-6)
    # No link ever above its capacity.
    assert checker.max_excess <= 1e-9
    # No flow faster than its bottleneck link allows.
    for size, links, dt in delivered:
        assert dt >= size / min(caps[x] for x in links) * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(st.floats(1.0, 100.0), min_size=1, max_size=8),
    paths=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
                   min_size=1, max_size=15),
)
def test_max_min_optimality(caps, paths) -> None:
    # Each flow has a saturated link on which no other flow gets more (the bottleneck
    # characterisation of max-min fairness).
    n = len(caps)
    paths = [sorted({p % n for p in path}) for path in paths]
    flat = np.array([x for p in paths for x in p])
    owner = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    cap = np.array(caps)
    rates = max_min_rates(flat, owner, len(paths), cap)
    load = np.bincount(flat, weights=rates[owner], minlength=n)
    assert (load <= cap * (1 + 1e-9)).all()
    for f, path in enumerate(paths):
        ok = False
        for link in path:
            if load[link] >= cap[link] * (1 - 1e-7):
                users = [g for g, p in enumerate(paths) if link in p]
                if rates[f] >= max(rates[g] for g in users) * (1 - 1e-7):
                    ok = True
        assert ok, f"flow {f} has no bottleneck"


def test_determinism() -> None:
    def run() -> tuple[float, list[float]]:
        env = simpy.Environment()
        net = FlowNetwork(env, np.array([7.0, 3.0, 5.0]), np.array([0, 1, 0]), 2)
        for i in range(10):
            net.start_flow(((i % 3), (i + 1) % 3), 10.0 + i)
        env.run()
        return env.now, net.class_bytes.tolist()

    assert run() == run()
