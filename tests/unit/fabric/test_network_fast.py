"""FlowNetwork's shortcuts for small tables and repeated link lists move no bit (issue 13;
:mod:`sim.fabric.network_fast`).

The reference is the same network with every shortcut off: the numpy forms of "which flows
end now" and "when does the next one end" at every table size, every link list renumbered
and every group's statics computed afresh at every start and end, and users counted with
``np.add.at`` / ``np.subtract.at`` whether or not a link repeats. Both must give the same
rates, times and byte counts to the last bit, on a fabric large enough (200 links, the busy
links kept apart) for a group's link update to take the renumbering branch.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import simpy
from helpers import RatesLog
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fabric import network, network_fast
from sim.fabric.network import FlowNetwork

_N_LINKS = 200

_flow = st.tuples(
    st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
    st.floats(1.0, 1e4), st.integers(1, 3), st.floats(0.0, 3.0),
    st.one_of(st.just(math.inf), st.floats(0.5, 50.0)), st.sampled_from([None, "a", "b"]),
    st.integers(0, 2))
_scale = st.tuples(st.floats(0.0, 4.0), st.sampled_from(["a", "b"]), st.floats(0.05, 1.0))


def _run(flows, scales, groups_of: int) -> list[bytes]:
    env = simpy.Environment()
    log = RatesLog()
    cap = np.linspace(10.0, 45.0, _N_LINKS)
    # The busy-link bookkeeping of large fabrics (chosen when the network is made: the patch
    # must cover the construction, not only the run).
    with mock.patch.object(network, "_SPARSE_LINKS", 0):
        net = FlowNetwork(env, cap, np.arange(_N_LINKS) % 3, 3, log)
    assert not net._dense

    def starter(batch, at):
        yield env.timeout(at)
        # A path of small link numbers spread over the fabric by a per-flow stride (0: the
        # first 12 links, where groups meet), so that a group touches far fewer links than
        # the fabric has.
        yield net.start_flows([([x * (1 + 16 * s) % _N_LINKS for x in p], size, count, c)
                               for p, size, count, _, c, _, s in batch], tag=batch[0][5])

    def scaler(at, tag, scale):
        yield env.timeout(at)
        net.scale_caps(tag, scale)

    for i in range(0, len(flows), groups_of):
        batch = flows[i:i + groups_of]
        env.process(starter(batch, batch[0][3]))
    for at, tag, scale in scales:
        env.process(scaler(at, tag, scale))
    env.run()
    assert net.active_flows == 0
    log.seen.append(np.concatenate([[env.now], net.class_bytes, net.link_bytes]).tobytes())
    return log.seen


def _repeats(get):
    # The cache's answer, told that links may repeat (np.add.at and np.subtract.at).
    def told(self, *args):
        return (*get(self, *args)[:-1], False)
    return told


@settings(max_examples=80, deadline=None)
@given(st.lists(_flow, min_size=1, max_size=20), st.lists(_scale, max_size=4),
       st.integers(1, 4))
def test_small_table_loops_and_remembered_link_lists_move_no_bit(flows, scales,
                                                                 groups_of) -> None:
    fast = _run(flows, scales, groups_of)
    with mock.patch.object(network_fast, "SMALL_ROWS", -1), \
            mock.patch.object(network_fast, "SMALL_ROWS_NEXT", -1), \
            mock.patch.object(network_fast, "_CACHE_MAX_INCIDENCES", -1), \
            mock.patch.object(network_fast.LinkSets, "get",
                              _repeats(network_fast.LinkSets.get)), \
            mock.patch.object(network_fast.GroupShapes, "get",
                              _repeats(network_fast.GroupShapes.get)):
        assert _run(flows, scales, groups_of) == fast
    # Every table through the Python loops, however large.
    with mock.patch.object(network_fast, "SMALL_ROWS", 1 << 30), \
            mock.patch.object(network_fast, "SMALL_ROWS_NEXT", 1 << 30):
        assert _run(flows, scales, groups_of) == fast


def test_loops_decide_as_the_numpy_forms() -> None:
    # Rows: one moving with 1e-15 s left at t = 2 (ends: within 1e-12 * 2), one whose bytes
    # are within 1e-9 of none (ends), one moving with 3 s left, a dead row (rate 0, bytes
    # inf) and a flow just started (rate 0): the next end is the 1e-15 s one's.
    remaining = [2e-15, 1e-10, 6.0, math.inf, 5.0]
    rate = [2.0, 1.0, 2.0, 0.0, 0.0]
    size = [10.0, 1000.0, 10.0, 10.0, 5.0]
    assert network_fast.ended_rows(remaining, rate, size) == [0, 1]
    assert network_fast.next_end(remaining, rate) == (1e-15, True)
    assert network_fast.next_end([math.inf, 5.0], [0.0, 0.0]) == (math.inf, False)


def test_a_large_read_only_group_is_shaped_once() -> None:
    # Past _CACHE_MAX_INCIDENCES a group is not hashed; its read-only arrays (the collective
    # runner's, the same objects each time the op repeats) are known by identity instead.
    n_links = 64
    shapes = network_fast.GroupShapes(np.linspace(1.0, 2.0, n_links), np.arange(n_links) % 3, 3)
    flows = network_fast._CACHE_MAX_INCIDENCES // 2 + 1
    flat = np.arange(2 * flows) % n_links
    lengths = np.full(flows, 2)
    flat.flags.writeable = lengths.flags.writeable = False
    with mock.patch.object(shapes, "_shape", wraps=shapes._shape) as shape:
        first = shapes.get(flat, lengths)
        again = shapes.get(flat, lengths)
        assert shape.call_count == 1 and again is first
        # The same content in other arrays, or writable ones, are shaped afresh.
        other = shapes.get(flat.copy(), lengths.copy())
        assert shape.call_count == 2
    for a, b in zip(first[:3], other[:3], strict=True):
        assert np.array_equal(a, b)
    assert first[3] == other[3] is False    # links repeat: 64 links, 2 x 2,049 incidences
