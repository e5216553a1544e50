"""The fast max-min solver against a plain progressive-filling reference, bit for bit.

``sim.fabric.maxmin.max_min_rates`` renumbers the used links and works on numpy arrays; the
reference below is the textbook loop (Bertsekas and Gallager, "Data Networks", sec. 6.5.2)
written one link and one flow at a time over *every* link of the fabric, with the same
saturation tolerance (relative 1e-9 of the link, floored at 1e-6 of the fabric's largest
capacity) and the same arithmetic, so the two must agree exactly.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric import maxmin, network
from sim.fabric.network import FlowNetwork, NetworkObserver, max_min_rates

_EPS = 1e-9


def reference_rates(paths: list[list[int]], capacity: list[float],
                    caps: list[float]) -> list[float]:
    """Progressive filling, one Python float at a time over all links."""
    n_links = len(capacity)
    remaining = [float(c) for c in capacity]
    cmax = max([1.0, *capacity])
    tol = [_EPS * max(c, cmax * 1e-6) for c in capacity]
    rates = [0.0] * len(paths)
    active = [bool(p) for p in paths]
    level = 0.0
    while any(active):
        users = [0] * n_links
        for f, p in enumerate(paths):
            if active[f]:
                for link in p:
                    users[link] += 1
        share = [remaining[k] / users[k] if users[k] else math.inf for k in range(n_links)]
        step = min(min(share), min(caps[f] - level for f in range(len(paths)) if active[f]))
        step = max(step, 0.0)
        level += step
        for k in range(n_links):
            remaining[k] -= step * users[k]
        frozen = [active[f] and (any(users[k] and remaining[k] <= tol[k] for k in p)
                                 or caps[f] <= level * (1 + _EPS))
                  for f, p in enumerate(paths)]
        if not any(frozen):
            tight = [users[k] > 0 and share[k] <= step * (1 + 1e-6) for k in range(n_links)]
            frozen = [active[f] and any(tight[k] for k in p) for f, p in enumerate(paths)]
        for f in range(len(paths)):
            if frozen[f]:
                rates[f] = level
                active[f] = False
    # The rate grid (sim.fabric.maxmin.RATE_GRID_BITS): down to a multiple of 2^-40 of the
    # power of two above the largest capacity, a rate under one step left alone.
    step_q = 2.0 ** (math.frexp(cmax)[1] - 40)
    return [math.floor(r / step_q) * step_q if r >= step_q else r for r in rates]


def live_tables(net: FlowNetwork) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The live flows' incidences (links, flows renumbered), caps and rates: the network's
    tables keep ended flows as dead rows (group -1) until they outnumber the live ones."""
    keep = net._group >= 0
    assert int(keep.sum()) == net.active_flows
    inc = keep[net._inc_flow]
    remap = np.cumsum(keep) - 1
    return net._inc_link[inc], remap[net._inc_flow[inc]], net._cap[keep], net._rate[keep]


# Capacities from a few distinct values (ties between links are the hard case) and a spread.
_capacity = st.one_of(st.sampled_from([1.0, 2.5, 10.0, 50e9, 400e9]),
                      st.floats(0.5, 1e12, allow_nan=False, allow_infinity=False))


@st.composite
def instances(draw):
    n_links = draw(st.integers(1, 12))
    capacity = draw(st.lists(_capacity, min_size=n_links, max_size=n_links))
    n_flows = draw(st.integers(1, 14))
    paths = [sorted(set(draw(st.lists(st.integers(0, n_links - 1), min_size=1,
                                      max_size=4)))) for _ in range(n_flows)]
    caps = [draw(st.one_of(st.just(math.inf), _capacity)) for _ in range(n_flows)]
    return paths, capacity, caps


@settings(max_examples=400, deadline=None)
@given(instances())
def test_solver_equals_reference_bit_for_bit(inst) -> None:
    paths, capacity, caps = inst
    flat = np.array([k for p in paths for k in p], dtype=np.int64)
    owner = np.array([f for f, p in enumerate(paths) for _ in p], dtype=np.int64)
    want = reference_rates(paths, capacity, caps)
    got = max_min_rates(flat, owner, len(paths), np.array(capacity), np.array(caps))
    assert got.tolist() == want
    # The renumbered path (large fabrics only, normally) forced on, too, with either way of
    # renumbering (walking the incidences, scanning a mask over the links).
    for scan in (0, 1 << 30):
        with mock.patch.object(maxmin, "_DENSE_LINKS", 0), \
                mock.patch.object(maxmin, "_RENUMBER_SCAN", scan):
            got = max_min_rates(flat, owner, len(paths), np.array(capacity), np.array(caps))
        assert got.tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=0, max_size=60), st.booleans())
def test_renumbering_is_np_unique(links, scan) -> None:
    # Both ways of renumbering give np.unique's ids and inverse exactly (ascending), or in the
    # walking way's own order the same links with a consistent inverse; the scratch mask is
    # left all False for the next caller.
    flat = np.array(links, dtype=np.int64)
    mask, pos = np.zeros(41, dtype=bool), np.full(41, -7, dtype=np.intp)
    with mock.patch.object(maxmin, "_RENUMBER_SCAN", 0 if scan else 1 << 30):
        ids, inv = maxmin._renumber(flat, (mask, pos))
        assert not mask.any()
        want_ids, want_inv = np.unique(flat, return_inverse=True)
        assert ids.tolist() == want_ids.tolist()
        assert inv.tolist() == want_inv.reshape(-1).tolist()
        ids, inv = maxmin._renumber(flat, (mask, pos), ascending=False)
        assert not mask.any()
        assert sorted(ids.tolist()) == want_ids.tolist()
        assert ids[inv].tolist() == links


@settings(max_examples=100, deadline=None)
@given(instances(), st.integers(0, 50))
def test_unused_links_do_not_change_the_rates(inst, spare) -> None:
    # Renumbering must not lose the tolerance's fabric-wide floor: a fabric with extra idle
    # links (one of them the largest) gives the reference's answer on the full link set.
    paths, capacity, caps = inst
    full = [*capacity, *([2e12] * spare)]
    flat = np.array([k for p in paths for k in p], dtype=np.int64)
    owner = np.array([f for f, p in enumerate(paths) for _ in p], dtype=np.int64)
    with mock.patch.object(maxmin, "_DENSE_LINKS", 0):
        got = max_min_rates(flat, owner, len(paths), np.array(full), np.array(caps))
    assert got.tolist() == reference_rates(paths, full, caps)


@settings(max_examples=60, deadline=None)
@given(instances(), st.lists(st.floats(1.0, 1e4), min_size=14, max_size=14),
       st.lists(st.floats(0.0, 3.0), min_size=14, max_size=14))
def test_network_rates_are_max_min_after_every_event(inst, sizes, starts) -> None:
    # The incremental solve (only the component of the changed links) must leave every flow
    # at the rate a from-scratch solve of the live flows gives, after every start and end, up
    # to the saturation tolerance: a joint solve may call a link saturated when it has less
    # than 1e-9 of the largest capacity left and freeze its flows a little early (a link of
    # 1 beside a 0.99999-capped flow elsewhere and a 5e10 link), a separate one does not.
    paths, capacity, caps = inst
    env = simpy.Environment()
    cap = np.array(capacity)
    net = FlowNetwork(env, cap, np.zeros(len(capacity), dtype=np.int64), 1)
    checks = []

    class Check(NetworkObserver):
        def on_rates(self, t, class_rates, link_rates):
            if not net.active_flows:
                return
            links, owner, caps_now, rates = live_tables(net)
            ref = max_min_rates(links, owner, net.active_flows, cap, caps_now)
            atol = len(paths) * 1e-9 * float(cap.max())
            checks.append(np.allclose(rates, ref, rtol=1e-12, atol=atol))

        def on_transfer_end(self, t, tag, nbytes):
            pass

    net.observer = Check()  # type: ignore[assignment]

    def starter(path, size, c, at):
        yield env.timeout(at)
        yield net.start_flow(path, size, cap=c)

    for f, p in enumerate(paths):
        env.process(starter(p, sizes[f], caps[f], starts[f]))
    env.run()
    assert checks and all(checks)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=6),
       st.lists(_capacity, min_size=4, max_size=4), st.one_of(st.just(math.inf), _capacity))
def test_one_flow_even_through_a_link_twice(path, capacity, cap) -> None:
    # The one-flow shortcut must fall back when a path repeats a link (it shares it with
    # itself: half the link each time through).
    got = max_min_rates(np.array(path), np.zeros(len(path), dtype=np.int64), 1,
                        np.array(capacity), np.array([cap]))
    assert got.tolist() == reference_rates([path], capacity, [cap])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 399), min_size=1, max_size=4, unique=True),
                          st.floats(1.0, 1e4), st.floats(0.0, 3.0)), min_size=1, max_size=12))
def test_bytes_per_link_are_conserved_on_a_mostly_idle_fabric(flows) -> None:
    # 400 links, a few busy, and the touched-links-only update forced on (it normally starts
    # at 20,000 links): the network updates rates and integrates bytes on the busy links
    # only. Each link must still carry exactly the bytes of the flows that cross it, and its
    # rate must always be the sum of its flows' rates.
    with mock.patch.object(network, "_SPARSE_LINKS", 0):
        _run_on_idle_fabric(flows)


def _run_on_idle_fabric(flows) -> None:
    env = simpy.Environment()
    cap = np.linspace(10.0, 50.0, 400)
    net = FlowNetwork(env, cap, np.zeros(400, dtype=np.int64), 1)
    expected = np.zeros(400)
    worst = [0.0]

    class Check(NetworkObserver):
        def on_rates(self, t, class_rates, link_rates):
            links, owner, _, rates = live_tables(net)
            fresh = np.bincount(links, weights=rates[owner], minlength=400)
            worst[0] = max(worst[0], float(np.abs(link_rates - fresh).max()))

        def on_transfer_end(self, t, tag, nbytes):
            pass

    net.observer = Check()  # type: ignore[assignment]

    def starter(path, size, at):
        yield env.timeout(at)
        yield net.start_flow(path, size)

    for path, size, at in flows:
        expected[path] += size
        env.process(starter(path, size, at))
    env.run()
    assert net.link_bytes == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert worst[0] <= 1e-9 * 50.0


def test_tolerance_floor_comes_from_the_whole_fabric() -> None:
    # Two flows on a 1 B/s link, one capped at 0.49999: after the first round 2e-5 is left,
    # under the tolerance floor 1e-9 x 1e-6 x 1e11 = 1e-4 set by an idle 1e11 link elsewhere,
    # so the link counts as saturated and both freeze at 0.49999 (without the idle link the
    # floor is 1e-9 and the second flow would get 0.50001).
    flat, owner = np.array([0, 0]), np.array([0, 1])
    caps = np.array([0.49999, math.inf])
    for dense in (0, 1 << 30):
        with mock.patch.object(maxmin, "_DENSE_LINKS", dense):
            rates = max_min_rates(flat, owner, 2, np.array([1.0, 1e11]), caps)
            alone = max_min_rates(flat, owner, 2, np.array([1.0]), caps)
        # Both at 0.49999, on the rate grid of a 1e11 fabric (steps of 2^37 / 2^40 = 1/8):
        # 0.375, where 0.50001 would be 0.5.
        assert rates.tolist() == [0.375, 0.375]
        assert alone.tolist() == pytest.approx([0.49999, 0.50001], rel=1e-12, abs=2.0 ** -39)
    assert reference_rates([[0], [0]], [1.0, 1e11], caps.tolist()) == [0.375, 0.375]
