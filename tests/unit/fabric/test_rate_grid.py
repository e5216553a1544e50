"""The rate grid (:data:`sim.fabric.maxmin.RATE_GRID_BITS`): the network's running totals do not
drift.

The network keeps each link's rate and each link class's rate as running totals, adding every
change of a flow's rate and taking it away when the flow ends. With rates anywhere on the real
line ``x + a - a`` need not be ``x``: the totals drift, and a steady pipeline's periods could
not repeat to the bit (issue 13 item 3). On the grid every rate is a multiple of one power of
two, so the totals are exact sums: after every change they equal a sum afresh, bit for bit, and
they are exactly zero once every flow has ended.
"""

from __future__ import annotations

import math

import numpy as np
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric.maxmin import RATE_GRID_BITS, max_min_rates, rate_quantum
from sim.fabric.network import FlowNetwork, NetworkObserver

_capacity = st.one_of(st.sampled_from([12.5e9, 50e9, 450e9, 3.3e9]),
                      st.floats(1e8, 1e12, allow_nan=False, allow_infinity=False))


@st.composite
def traffic(draw):
    n_links = draw(st.integers(2, 10))
    capacity = draw(st.lists(_capacity, min_size=n_links, max_size=n_links))
    n_flows = draw(st.integers(2, 16))
    flows = [(sorted(set(draw(st.lists(st.integers(0, n_links - 1), min_size=1, max_size=4)))),
              draw(st.floats(1e3, 1e9)), draw(st.floats(0.0, 0.05)),
              draw(st.integers(1, 4)))
             for _ in range(n_flows)]
    return capacity, flows


@settings(max_examples=80, deadline=None)
@given(traffic())
def test_running_totals_equal_sums_afresh_and_return_to_zero(t) -> None:
    capacity, flows = t
    env = simpy.Environment()
    cap = np.array(capacity)
    kinds = np.arange(len(capacity)) % 3
    net = FlowNetwork(env, cap, kinds, 3)
    checks: list[bool] = []

    class Check(NetworkObserver):
        def on_rates(self, now, class_rates, link_rates):
            live = net._group >= 0
            rates, count, hops = net._rate[live], net._count[live], net._hops[live]
            inc = live[net._inc_flow]
            afresh_links = np.zeros(len(cap))
            np.add.at(afresh_links, net._inc_link[inc], net._rate[net._inc_flow[inc]])
            checks.append(np.array_equal(link_rates, afresh_links)
                          and np.array_equal(class_rates, (rates * count) @ hops))

        def on_transfer_end(self, now, tag, nbytes):
            pass

    net.observer = Check()  # type: ignore[assignment]

    def starter(path, size, at, count):
        yield env.timeout(at)
        yield net.start_flow(path, size, count=count)

    for path, size, at, count in flows:
        env.process(starter(path, size, at, count))
    env.run()
    assert checks and all(checks)
    assert not net._link_rates.any() and not net._class_rates.any()


def test_every_rate_is_on_the_grid_and_no_link_goes_over() -> None:
    # Three flows share a 100 GB/s link, one also crosses a 30 GB/s one: 30, then 35 each.
    cap = np.array([100e9, 30e9])
    rates = max_min_rates(np.array([0, 1, 0, 0]), np.array([0, 0, 1, 2]), 3, cap)
    q = rate_quantum(cap)
    assert q == 2.0 ** (math.frexp(100e9)[1] - RATE_GRID_BITS)
    assert all((r / q).is_integer() for r in rates)
    assert rates[0] <= 30e9 and rates.sum() <= 100e9
    assert rates.tolist() == [30e9, 35e9, 35e9]   # 35e9 and 30e9 are multiples of 2^-3
