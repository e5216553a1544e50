"""Rank meshes (:mod:`sim.program.mesh`) against independent truth: the frameworks' own worked
examples (Megatron-Core, DeepSpeed), and numpy's row-major array, which is what
``torch.distributed.init_device_mesh`` lays ranks out as (``torch.arange(world).view(shape)``)
and what DeepSpeed's ``ProcessTopology`` enumerates (``itertools.product`` over the axes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.program.mesh import RankMesh

# Megatron-Core's default order, innermost first (megatron/core/parallel_state.py).
MEGATRON = "tp-cp-ep-dp-pp"
TITAN = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_megatron_order_reproduces_parallel_states_worked_example() -> None:
    # megatron/core/parallel_state.py, initialize_model_parallel's docstring: 16 GPUs g0..g15,
    # tp=2, pp=4 (so dp=2) "will create 8 tensor model-parallel groups, 4 pipeline
    # model-parallel groups and 8 data-parallel groups", listed in this order.
    m = RankMesh.from_order(MEGATRON, {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 4})
    assert m.world == 16
    assert m.groups(["dp"]) == ((0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14),
                                (13, 15))
    assert m.groups(["tp"]) == tuple((2 * i, 2 * i + 1) for i in range(8))
    assert m.groups(["pp"]) == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    # Dimensions of size 1 (cp, ep here) may be left out of coordinates.
    assert m.rank(tp=1, dp=1, pp=3) == 15 == m.rank(tp=1, cp=0, ep=0, dp=1, pp=3)


def test_deepspeed_process_topology_docstring_examples() -> None:
    # deepspeed/runtime/pipe/topology.py, ProcessTopology's docstrings.
    xy = RankMesh(("x", "y"), (2, 3))
    assert xy.rank(x=0, y=1) == 1                      # get_rank
    assert xy.size("y") == 3                           # get_dim
    assert xy.coords(1) == {"x": 0, "y": 1}            # get_coord
    assert xy.members(x=0) == (0, 1, 2)                # get_axis_list(axis='x', idx=0)
    assert xy.members(y=0) == (0, 3)                   # get_axis_list(axis='y', idx=0)
    pdm = RankMesh(("pipe", "data", "model"), (2, 2, 2))
    assert pdm.groups(["pipe"]) == ((0, 4), (1, 5), (2, 6), (3, 7))   # get_axis_comm_lists
    assert pdm.members(pipe=0, data=1) == (2, 3)                       # filter_match


def test_torchtitan_order_puts_tp_innermost_and_pp_outermost() -> None:
    # torchtitan/distributed/parallel_dims.py: init_device_mesh over
    # [pp, dp_replicate, dp_shard, cp, tp]: tensor-parallel peers are adjacent ranks (inside a
    # node), each pipeline stage a contiguous block of world / pp ranks.
    m = RankMesh(TITAN, (2, 2, 2, 2, 4))
    assert m.world == 64
    assert all(g == tuple(range(g[0], g[0] + 4)) for g in m.groups(["tp"]))
    assert [m.members(pp=s) for s in range(2)] == [tuple(range(32)), tuple(range(32, 64))]
    # FSDP's dp_shard x cp flattened: shard index outer, cp inner (stride tp).
    assert m.groups(["dp_shard", "cp"], pp=0, dp_replicate=0, tp=0) == ((0, 4, 8, 12),)
    assert m.peer_pairs("pp", 0, 1)[:2] == ((0, 32), (1, 33))


dims_and_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=5).map(
    lambda sizes: RankMesh(tuple(f"d{i}" for i in range(len(sizes))), tuple(sizes)))


@settings(max_examples=150, deadline=None)
@given(dims_and_sizes, st.data())
def test_rank_coordinates_round_trip_as_numpy_row_major(m: RankMesh, data: st.DataObject
                                                        ) -> None:
    rank = data.draw(st.integers(0, m.world - 1))
    c = m.coords(rank)
    assert m.rank(**c) == rank
    assert tuple(c.values()) == tuple(int(i) for i in np.unravel_index(rank, m.sizes))
    assert list(c) == list(m.names)


@settings(max_examples=150, deadline=None)
@given(dims_and_sizes, st.data())
def test_groups_are_numpys_moved_axes_and_partition_the_ranks(m: RankMesh,
                                                              data: st.DataObject) -> None:
    along = data.draw(st.lists(st.sampled_from(m.names), min_size=1, unique=True))
    groups = m.groups(along)
    # torch's DeviceMesh of the same shape: move the group's axes last (in the order named)
    # and read rows; the rows come in the remaining axes' row-major order.
    grid = np.arange(m.world).reshape(m.sizes)
    axes = [m.names.index(d) for d in along]
    expect = np.moveaxis(grid, axes, range(-len(axes), 0)).reshape(-1, m.size(*along))
    assert groups == tuple(tuple(int(r) for r in row) for row in expect)
    # a partition: every rank once, world / size groups of size ranks each
    assert sorted(r for g in groups for r in g) == list(range(m.world))
    assert len(groups) == m.world // m.size(*along)
    rank = data.draw(st.integers(0, m.world - 1))
    assert rank in m.group_of(rank, along) and m.group_of(rank, along) in groups
    # inside a group only the ``along`` coordinates move
    for g in groups:
        rest = [{d: i for d, i in m.coords(r).items() if d not in along} for r in g]
        assert all(x == rest[0] for x in rest)


@settings(max_examples=100, deadline=None)
@given(dims_and_sizes, st.data())
def test_over_reorders_the_groups_only(m: RankMesh, data: st.DataObject) -> None:
    along = data.draw(st.lists(st.sampled_from(m.names), min_size=1, unique=True))
    rest = [d for d in m.names if d not in along]
    over = data.draw(st.permutations(rest))
    assert sorted(m.groups(along, over=over)) == sorted(m.groups(along))
    ring = m.ring_pairs(along, over=over)
    # one ring step per rank: a permutation of the ranks that stays inside each group
    assert sorted(a for a, _ in ring) == list(range(m.world)) == sorted(b for _, b in ring)
    assert all(b in m.group_of(a, along) for a, b in ring)


@settings(max_examples=100, deadline=None)
@given(dims_and_sizes, st.data())
def test_peer_pairs_move_one_coordinate(m: RankMesh, data: st.DataObject) -> None:
    dim = data.draw(st.sampled_from(m.names))
    a, b = (data.draw(st.integers(0, m.size(dim) - 1)) for _ in range(2))
    pairs = m.peer_pairs(dim, a, b)
    assert len(pairs) == m.world // m.size(dim)
    for x, y in pairs:
        cx, cy = m.coords(x), m.coords(y)
        assert (cx[dim], cy[dim]) == (a, b)
        assert {d: i for d, i in cx.items() if d != dim} == \
            {d: i for d, i in cy.items() if d != dim}


def test_from_order_is_the_reverse_of_row_major() -> None:
    m = RankMesh.from_order("a-b-c", {"a": 2, "b": 3, "c": 5})
    assert m.names == ("c", "b", "a") and m.sizes == (5, 3, 2)
    assert m.rank(a=1, b=0, c=0) == 1 and m.rank(a=0, b=1, c=0) == 2
    assert m.rank(a=0, b=0, c=1) == 6 == math.prod((2, 3))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: RankMesh(("a", "b"), (2,)), "2 dimension names for 1 sizes"),
    (lambda: RankMesh(("a", "a"), (2, 2)), "repeat"),
    (lambda: RankMesh(("a",), (0,)), "at least 1"),
    (lambda: RankMesh.from_order("tp-dp", {"tp": 2}), "other dimensions"),
    (lambda: RankMesh(("a", "b"), (2, 2)).rank(a=1), r"no coordinate given for \['b'\]"),
    (lambda: RankMesh(("a",), (2,)).rank(a=2), "outside 0..1"),
    (lambda: RankMesh(("a",), (2,)).groups(["z"]), "no dimension 'z'"),
    (lambda: RankMesh(("a", "b"), (2, 2)).groups(["a"], a=0), "both fixed and varied"),
    (lambda: RankMesh(("a", "b"), (2, 2)).groups(["a"], over=["a"]), "only the dimensions"),
    (lambda: RankMesh(("a",), (2,)).coords(2), "outside a mesh of 2"),
])
def test_bad_input_names_the_problem(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
