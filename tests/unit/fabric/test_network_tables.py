"""FlowNetwork's preallocated flow tables move no bit (issue 13, performance.md item 6).

An ended flow stays in the tables as a dead row (rate 0, infinite bytes left, group -1,
incidences on a link past the last) until dead rows outnumber live ones. The reference is
the same network compacting at every end, which is what the tables did before (every sum over
flows saw the live flows alone, in the order they started): both must give the same rates,
times and byte counts to the last bit, through starts, ends, growth of the tables and cap
scales; and so must the large-fabric way of keeping link rates and bytes (busy links only).
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import simpy
from helpers import RatesLog
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric import network, network_tables
from sim.fabric.network import FlowNetwork, NetworkObserver

_N_LINKS = 8

_flow = st.tuples(
    st.lists(st.integers(0, _N_LINKS - 1), min_size=1, max_size=4, unique=True),
    st.floats(1.0, 1e4), st.integers(1, 3), st.floats(0.0, 3.0),
    st.one_of(st.just(math.inf), st.floats(0.5, 50.0)), st.sampled_from([None, "a", "b"]))
_scale = st.tuples(st.floats(0.0, 4.0), st.sampled_from(["a", "b"]), st.floats(0.05, 1.0))


def _run(flows, scales, groups_of: int, keep_dead: int, slack: int = 0) -> list[bytes]:
    env = simpy.Environment()
    log = RatesLog()
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
    with mock.patch.object(network_tables, "_KEEP_DEAD", keep_dead), \
            mock.patch.object(network_tables, "_DEAD_SLACK", slack):
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
    assert _run(flows, scales, groups_of, keep_dead=2, slack=network_tables._DEAD_SLACK) == eager
    # The large-fabric bookkeeping (rates and bytes kept on the busy links only) as well.
    with mock.patch.object(network, "_SPARSE_LINKS", 0):
        assert _run(flows, scales, groups_of, keep_dead=2) == eager


@settings(max_examples=60, deadline=None)
@given(st.lists(_flow, min_size=1, max_size=16), st.integers(1, 3))
def test_component_from_the_started_flows_is_the_component(flows, groups_of) -> None:
    # A start's component search begins from the started flows (they are in it); it must
    # find exactly the flows the plain search from the dirty links finds.
    plain = FlowNetwork._component
    compared = []

    def both(net, links):
        seed = net._seed
        net._seed = 0
        want = plain(net, links)
        net._seed = seed
        got = plain(net, links)
        assert net._seed == 0 and not net._link_mask.any()
        compared.append(seed)
        assert got.tolist() == want.tolist()
        if net._alone:
            # Told alone: the component is the started group, the last rows, and no more.
            assert net._alone == seed
            assert np.flatnonzero(got).tolist() == list(range(net._n - seed, net._n))
        return got

    with mock.patch.object(FlowNetwork, "_component", both), \
            mock.patch.object(FlowNetwork, "_known_component", _unknown):
        _run(flows, [], groups_of, keep_dead=2)
    assert any(compared)


@settings(max_examples=60, deadline=None)
@given(st.lists(_flow, min_size=1, max_size=16), st.lists(_scale, max_size=3),
       st.integers(1, 3))
def test_a_group_alone_on_its_links_solves_as_any_component(flows, scales, groups_of) -> None:
    # The shortcut for a started group that shares no link (slices of the tables instead of
    # masks over them) against the general incremental solve: the same bits.
    plain = FlowNetwork._component
    used = []

    def general(net, links):
        comp = plain(net, links)
        used.append(net._alone)
        net._alone = 0
        return comp

    fast = _run(flows, scales, groups_of, keep_dead=2)
    with mock.patch.object(FlowNetwork, "_component", general), \
            mock.patch.object(FlowNetwork, "_known_component", _unknown):
        assert _run(flows, scales, groups_of, keep_dead=2) == fast


def _unknown(net) -> int:
    # FlowNetwork._known_component with nothing known: every solve searches its component.
    net._seed_alone, net._gone_alone, net._alone = False, None, 0
    return -1


@settings(max_examples=80, deadline=None)
@given(st.lists(_flow, min_size=1, max_size=16), st.lists(_scale, max_size=3),
       st.integers(1, 3))
def test_known_components_and_remembered_rates_move_no_bit(flows, scales, groups_of) -> None:
    # A group started on links nobody uses is its own component, an ended group that leaves
    # its links empty leaves none, and a group alone on its links gets the rates max_min_rates
    # gave it before on the same links and caps: skipping the search and the solve in those
    # cases must give what searching and solving every time gives, to the last bit.
    taken = []
    known = FlowNetwork._known_component

    def watch(net) -> int:
        n = known(net)
        taken.append(n)
        return n

    with mock.patch.object(FlowNetwork, "_known_component", watch):
        fast = _run(flows, scales, groups_of, keep_dead=2)
    assert any(n >= 0 for n in taken)
    with mock.patch.object(FlowNetwork, "_known_component", _unknown), \
            mock.patch.object(FlowNetwork, "_alone_solve",
                              lambda net, links, owner, idx: network.max_min_rates(
                                  links, owner, len(idx), net.capacity, net._cap[idx])):
        assert _run(flows, scales, groups_of, keep_dead=2) == fast


def test_tables_grow_and_compact_keeping_start_order() -> None:
    # 40 one-link flows of growing size on 40 links, started together: the tables (room for
    # 8 flows, 32 incidences at first) double to hold them; as the smallest end first, dead
    # rows pile up at the front until they outnumber the live ones by _DEAD_SLACK, then go,
    # and the live flows keep the order they started in (their sizes stay ascending).
    env = simpy.Environment()
    net = FlowNetwork(env, np.full(40, 10.0), np.zeros(40, dtype=np.int64), 1)
    net.start_flows([((k,), 10.0 * (k + 1), 1, math.inf) for k in range(40)])
    slack = network_tables._DEAD_SLACK
    assert net._flows.shape[1] >= 40 and net._inc.shape[1] >= 40
    seen = []

    class Watch(NetworkObserver):
        def on_rates(self, t, class_rates, link_rates) -> None:
            alive = net._group >= 0
            sizes = net._size[alive]
            seen.append((net._n, net.active_flows))
            assert int(alive.sum()) == net.active_flows
            assert net._n <= 2 * net.active_flows + slack or net.active_flows == 0
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


def test_the_shortcut_is_taken_and_gives_the_closed_form() -> None:
    # Links 0..7 of 10..45 B/s: a flow of 100 B on link 0 (10 B/s) from t=0, then at t=1 a
    # group of two flows on links 5 and 6+7 (35 and 40 B/s), sharing nothing with it: the
    # group's solve is the shortcut's (alone, beside a live flow), and each flow runs at its
    # bottleneck: 10, 35 and 40 B/s. Its links had no users, so the shortcut knows it is
    # alone without a component search.
    known = FlowNetwork._known_component
    alone = []

    def watch(net):
        n = known(net)
        alone.append((net._alone, net.active_flows))
        return n

    env = simpy.Environment()
    net = FlowNetwork(env, np.linspace(10.0, 45.0, _N_LINKS), np.zeros(_N_LINKS, dtype=int), 1)
    ends = {}

    def later():
        yield env.timeout(1.0)
        yield net.start_flows([((5,), 70.0, 1, math.inf), ((6, 7), 80.0, 1, math.inf)])
        ends["group"] = env.now

    with mock.patch.object(FlowNetwork, "_known_component", watch):
        first = net.start_flow((0,), 100.0)
        first.callbacks.append(lambda _e: ends.setdefault("first", env.now))
        env.process(later())
        env.run()
    assert (2, 3) in alone
    assert ends == {"first": 10.0, "group": 3.0}
    assert net.link_bytes.tolist() == [100.0, 0, 0, 0, 0, 70.0, 80.0, 80.0]


def test_a_full_solve_beside_dead_rows_copies_no_table() -> None:
    # 40 flows of growing size on one 40 B/s link (one component, every flow in it): each
    # end re-solves all the live flows. The solve picks the live rows out instead of
    # compacting the tables at every end (two zones' all-to-alls on one zone link copied
    # every table at every end); compaction waits until the dead rows outnumber the live
    # ones. Max-min on one link: each live flow at 40 / live B/s, so flow k (10 (k+1) bytes)
    # ends at sum over j <= k of 10 (40 - j) / 40 s.
    env = simpy.Environment()
    net = FlowNetwork(env, np.full(2, 40.0), np.zeros(2, dtype=np.int64), 1)
    net.start_flows([((0,), 10.0 * (k + 1), 1, math.inf) for k in range(40)])
    compactions, rates = [], []
    compact = FlowNetwork._compact

    def counted(self) -> None:
        compactions.append(self.active_flows)
        compact(self)

    class Watch(NetworkObserver):
        def on_rates(self, t, class_rates, link_rates) -> None:
            if net.active_flows:
                alive = net._group >= 0
                rates.append((set(net._rate[alive].tolist()), net.active_flows))

    net.observer = Watch()
    with mock.patch.object(FlowNetwork, "_compact", counted):
        env.run()
    # One rate for all (on the solver's rate grid, within a part in 1e9 of the closed form).
    assert all(len(r) == 1 and math.isclose(r.pop(), 40.0 / live, rel_tol=1e-9)
               for r, live in rates)
    assert len(rates) == 39   # every end after the start (watched from then on)
    # Compacted only when dead rows outnumbered live ones by the slack: a handful, not 39.
    assert 0 < len(compactions) <= 3
    assert math.isclose(env.now, sum(10.0 * (40 - j) / 40.0 for j in range(40)), rel_tol=1e-6)
