"""FlowNetwork's preallocated flow tables move no bit (issue 13, performance.md item 6).

An ended flow stays in the tables as a dead row (rate 0, infinite bytes left, group -1,
incidences on a link past the last) until dead rows outnumber live ones. The reference is
the same network compacting at every end, which is what the tables did before (every sum over
flows saw the live flows alone, in the order they started): both must give the same rates,
times and byte counts to the last bit, through starts, ends, growth of the tables and cap
scales.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric import network
from sim.fabric.network import FlowNetwork, NetworkObserver

_N_LINKS = 8

_flow = st.tuples(
    st.lists(st.integers(0, _N_LINKS - 1), min_size=1, max_size=4, unique=True),
    st.floats(1.0, 1e4), st.integers(1, 3), st.floats(0.0, 3.0),
    st.one_of(st.just(math.inf), st.floats(0.5, 50.0)), st.sampled_from([None, "a", "b"]))
_scale = st.tuples(st.floats(0.0, 4.0), st.sampled_from(["a", "b"]), st.floats(0.05, 1.0))


class _Log(NetworkObserver):
    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def on_rates(self, t, class_rates, link_rates) -> None:
        self.seen.append(np.array([t, *class_rates, *link_rates]).tobytes())

    def on_transfer_end(self, t, tag, nbytes) -> None:
        self.seen.append(repr((t, tag, nbytes)).encode())


def _run(flows, scales, groups_of: int, keep_dead: int) -> list[bytes]:
    env = simpy.Environment()
    log = _Log()
    cap = np.linspace(10.0, 45.0, _N_LINKS)
    net = FlowNetwork(env, cap, np.arange(_N_LINKS) % 3, 3, log)

    def starter(batch, at):
        yield env.timeout(at)
        yield net.start_flows([(p, size, count, c) for p, size, count, _, c, _ in batch],
                              tag=batch[0][5])

    def scaler(at, tag, scale):
        yield env.timeout(at)
        net.scale_caps(tag, scale)

    for i in range(0, len(flows), groups_of):
        batch = flows[i:i + groups_of]
        env.process(starter(batch, batch[0][3]))
    for at, tag, scale in scales:
        env.process(scaler(at, tag, scale))
    with mock.patch.object(network, "_KEEP_DEAD", keep_dead):
        env.run()
    assert net.active_flows == 0
    log.seen.append(np.concatenate([[env.now], net.class_bytes, net.link_bytes]).tobytes())
    return log.seen


@settings(max_examples=80, deadline=None)
@given(st.lists(_flow, min_size=1, max_size=16), st.lists(_scale, max_size=4),
       st.integers(1, 3))
def test_dead_rows_move_no_bit(flows, scales, groups_of) -> None:
    eager = _run(flows, scales, groups_of, keep_dead=1)
    assert _run(flows, scales, groups_of, keep_dead=1 << 30) == eager
    assert _run(flows, scales, groups_of, keep_dead=2) == eager


def test_tables_grow_and_compact_keeping_start_order() -> None:
    # 40 one-link flows of growing size on 40 links, started together: the tables (room for
    # 8 flows, 32 incidences at first) double to hold them; as the smallest end first, dead
    # rows pile up at the front until they outnumber the live ones, then go, and the live
    # flows keep the order they started in (their sizes stay ascending).
    env = simpy.Environment()
    net = FlowNetwork(env, np.full(40, 10.0), np.zeros(40, dtype=np.int64), 1)
    net.start_flows([((k,), 10.0 * (k + 1), 1, math.inf) for k in range(40)])
    assert net._flows.shape[1] >= 40 and net._inc.shape[1] >= 40
    seen = []

    class Watch(NetworkObserver):
        def on_rates(self, t, class_rates, link_rates) -> None:
            alive = net._group >= 0
            sizes = net._size[alive]
            seen.append((net._n, net.active_flows))
            assert int(alive.sum()) == net.active_flows
            assert net._n <= max(2 * net.active_flows, 1) or net.active_flows == 0
            assert (np.diff(sizes) > 0).all()
            # A dead flow's incidences lie on no real link.
            assert (net._inc_link[~alive[net._inc_flow]] == 40).all()

    net.observer = Watch()
    env.run()
    # Each flow ends at (k + 1) s on its own 10 B/s link.
    assert env.now == 40.0
    assert any(n > live > 0 for n, live in seen)   # dead rows were kept for a while
    assert seen[-1] == (0, 0)
    assert net.link_bytes.tolist() == [10.0 * (k + 1) for k in range(40)]
