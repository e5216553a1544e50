"""Ends that leave only slower flows re-solve nothing (``FlowNetwork._slower_than``).

Max-min fairness by progressive filling freezes every flow slower than the flows that end at
the same level, in the same steps, with or without them (their links saturate no earlier
without them), so when every live flow is slower than the slowest ending one the rates held
are the solve's answer and the network keeps them. Against runs that always solve: the same
end times and bytes (to the rate grid's rounding: rates held from a solve that took other,
independent flows too differ from a fresh solve of the component in the last bits, as any
two solves of different flow sets may) and the same solve count; folded or not, the same
bits (the decision counts folded classes as flows: ``test_network_fold``'s runs keep the
same rates either way, and the pair run here says so too).
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import simpy
from helpers import RatesLog
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric import fold, network, network_fold
from sim.fabric.network import FlowNetwork

_N_LINKS = 8

_flow = st.tuples(
    st.lists(st.integers(0, _N_LINKS - 1), min_size=1, max_size=3, unique=True),
    st.floats(1.0, 1e4), st.integers(1, 3), st.one_of(st.just(math.inf), st.floats(0.5, 50.0)))
_group = st.tuples(st.lists(_flow, min_size=1, max_size=8), st.floats(0.0, 5.0))


def _run(groups, keep: bool, folding: bool = False):
    """Start each group at its time; the log of every solve and end, the solve count, how
    many ends kept the rates (``keep=False``: every end solves) and the end time, class and
    link bytes."""
    env = simpy.Environment()
    log = RatesLog()
    cap = 10.0 + (np.arange(_N_LINKS) % 4) * 7.0
    net = FlowNetwork(env, cap, np.arange(_N_LINKS) % 3, 3, log)
    kept = [0]
    slower_than = FlowNetwork._slower_than

    def slower(self, rate):
        if not keep:
            return False
        hit = slower_than(self, rate)
        kept[0] += hit
        return hit

    def starter(flows, at):
        yield env.timeout(at)
        yield net.start_flows(flows)

    for flows, at in groups:
        env.process(starter(flows, at))
    with mock.patch.object(FlowNetwork, "_slower_than", slower), \
            mock.patch.object(network_fold, "FOLD_MIN_FLOWS", 1 if folding else 10**9), \
            mock.patch.object(fold, "FOLD_MIN_RATIO", 1):
        env.run()
    assert net.active_flows == 0
    totals = np.concatenate([[env.now], net.class_bytes, net.link_bytes])
    log.seen.append(totals.tobytes())
    return log.seen, net.solves, kept[0], totals


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    # The rate grid's step is 2^-40 of the largest capacity; a rate one step apart moves an
    # end by that share of its duration.
    return bool(np.allclose(a, b, rtol=1e-9, atol=1e-9))


def test_the_fast_flows_end_leaves_the_slow_one_its_rate() -> None:
    # f and g share link 0 (100 B/s); g also crosses link 1 (10 B/s), so g runs at 10 and f
    # at 90. f's 90 bytes end at t = 1; g, slower, keeps 10 B/s: its 50 bytes end at t = 5.
    env = simpy.Environment()
    log = RatesLog()
    net = FlowNetwork(env, np.array([100.0, 10.0]), np.array([0, 0]), 1, log)
    f = net.start_flow((0,), 90.0)
    g = net.start_flow((0, 1), 50.0)
    ends = {}
    f.callbacks.append(lambda _e: ends.setdefault("f", env.now))
    g.callbacks.append(lambda _e: ends.setdefault("g", env.now))
    with mock.patch.object(FlowNetwork, "_solve", wraps=net._solve) as solve, \
            mock.patch.object(FlowNetwork, "_keep_rates", wraps=net._keep_rates) as keep:
        env.run()
    # The two starts solved before; f's end keeps g's rate, and g's end leaves no flow.
    assert (solve.call_count, keep.call_count) == (0, 2)
    assert ends == {"f": 1.0, "g": 5.0}
    assert net.solves == 4


def test_a_tie_solves_again() -> None:
    # Two flows alone on one 100 B/s link run at 50 each; when the shorter ends the other is
    # not slower, so the solve runs and it rises to 100: 50 + 100 bytes end at 1 and 1.5 s.
    env = simpy.Environment()
    net = FlowNetwork(env, np.array([100.0]), np.array([0]), 1)
    a = net.start_flow((0,), 50.0)
    b = net.start_flow((0,), 100.0)
    ends = {}
    a.callbacks.append(lambda _e: ends.setdefault("a", env.now))
    b.callbacks.append(lambda _e: ends.setdefault("b", env.now))
    env.run()
    assert ends == {"a": 1.0, "b": 1.5}


@settings(max_examples=150, deadline=None)
@given(st.lists(_group, min_size=1, max_size=6))
def test_keeping_the_rates_ends_every_flow_when_solving_would(groups) -> None:
    _, solves, _, always = _run(groups, keep=False)
    _, kept_solves, _, kept = _run(groups, keep=True)
    assert kept_solves == solves and _close(kept, always)


@settings(max_examples=100, deadline=None)
@given(st.lists(_group, min_size=1, max_size=6))
def test_kept_rates_are_the_same_bits_folded_or_not(groups) -> None:
    plain = _run(groups, keep=True)[0]
    folded = _run(groups, keep=True, folding=True)[0]
    assert folded == plain


@settings(max_examples=40, deadline=None)
@given(st.lists(_group, min_size=1, max_size=6))
def test_keeping_the_rates_on_a_large_fabric(groups) -> None:
    # Fabrics over network._SPARSE_LINKS links keep link rates on the busy links only.
    with mock.patch.object(network, "_SPARSE_LINKS", 0):
        _, _, _, always = _run(groups, keep=False)
        sparse, _, _, kept = _run(groups, keep=True)
    assert _close(kept, always)
    # The busy set's bookkeeping is the dense pass's, kept rates or not: the same bits.
    assert sparse == _run(groups, keep=True)[0]


def test_random_runs_do_keep_rates() -> None:
    # The property tests above would pass vacuously if no end ever kept its rates: a fixed
    # mix of fast and slow flows keeps them at least once.
    groups = [([((0,), 90.0, 1, math.inf), ((0, 1), 50.0, 1, math.inf)], 0.0),
              ([((2, 3), 400.0, 2, 5.0), ((3,), 30.0, 1, math.inf)], 0.5)]
    always, _, none, _ = _run(groups, keep=False)
    kept, _, hits, _ = _run(groups, keep=True)
    assert none == 0 and hits >= 1 and kept == always
