"""The IR's own checks (:meth:`sim.program.ir.Program.validate`): what a builder can get wrong
is refused when the program is built, not found later as a wrong number."""

from __future__ import annotations

import pytest

from sim.program.ir import CPU_STREAM, Op, Program, RankClass


def _program(*ops: Op) -> Program:
    cls = RankClass(id=0, members=(0,))
    p = Program(classes=[cls], n_ranks=1, tokens_per_step=1.0, model_flops_per_step=0.0,
                hw_flops_per_step=0.0)
    for op in ops:
        p.add(cls, op)
    return p


def test_host_work_is_a_kind_on_the_cpu_stream():
    # The CPU's own work (an optimizer step on host tensors) is kind "host" on CPU_STREAM.
    _program(Op("adam on cpu", "host", CPU_STREAM, "optimizer", duration=1.0)).validate()


@pytest.mark.parametrize("kind, stream", [("host", "compute"), ("compute", CPU_STREAM)])
def test_host_kind_and_cpu_stream_go_together(kind: str, stream: str):
    # A host op on a GPU stream would queue behind kernels; a kernel on the CPU stream would
    # take no share of the GPU: either is a builder's mistake.
    bad = _program(Op("x", kind, stream, "optimizer", duration=1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host work"):
        bad.validate()


def test_a_collective_needs_its_group_and_key():
    bad = _program(Op("ar", "collective", "comm", "comm", collective="all_reduce", nbytes=1.0))
    with pytest.raises(ValueError, match="group and a key"):
        bad.validate()


def test_peer_bytes_is_an_all_to_alls_square_matrix():
    # Uneven all-to-all splits (issue 14): one row per member, one column per peer.
    ok = Op("a2a", "collective", "ep", "comm", collective="all_to_all", group=(0, 1),
            key="a2a", nbytes=3.0, peer_bytes=((0.0, 1.0), (2.0, 0.0)))
    bad = Op("a2a", "collective", "ep", "comm", collective="all_to_all", group=(0, 1),
             key="a2a", nbytes=3.0, peer_bytes=((0.0, 1.0, 2.0),))
    p = Program(classes=[RankClass(id=0, members=(0, 1))], n_ranks=2, tokens_per_step=1.0,
                model_flops_per_step=0.0, hw_flops_per_step=0.0)
    p.add(p.classes[0], ok)
    p.validate()
    p.add(p.classes[0], bad)
    with pytest.raises(ValueError, match="square matrix"):
        p.validate()
