"""Background streams (Program.background_streams): a step ends without them, and each runs
its ops after those earlier steps put on it (an asynchronous checkpoint's writer)."""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.engine.recorder import Recorder
from sim.fabric.topology import FabricSpec, build_fabric
from sim.program.ir import Op, Program, RankClass


def engine(rec: Recorder) -> Engine:
    return Engine(build_fabric(FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
                                          pcie_gbytes_per_s=63, nics_per_node=0,
                                          nic_gbps=400)), "hopper", rec)


def program() -> Program:
    cls = RankClass(0, (0, 1))
    p = Program([cls], 2, 0, 0, 0, background_streams=frozenset({"writer"}))
    a = p.add(cls, Op("train", "compute", "compute", "fwd", duration=1.0))
    p.add(cls, Op("write", "compute", "writer", "fwd", duration=2.5, deps=[a]))
    return p


def test_steps_end_without_the_background_and_its_queue_keeps_order() -> None:
    rec = Recorder()
    eng = engine(rec)
    p = program()
    assert [eng.run_step(p) for _ in range(3)] == [1.0, 1.0, 1.0]
    assert eng.drain_background() == pytest.approx(8.5)   # 1 + 3 x 2.5, one after another
    writes = sorted((r.step, r.start, r.end) for r in rec.background_ops)
    assert writes == [(0, 1.0, 3.5), (1, 3.5, 6.0), (2, 6.0, 8.5)]
    # Background ops bound no step: the step records hold only the training ops.
    assert [r.op.name for r in rec.ops] == ["train"] * 3


def test_without_background_streams_every_stream_bounds_the_step() -> None:
    p = program()
    p.background_streams = frozenset()
    eng = engine(Recorder())
    assert eng.run_step(p) == pytest.approx(3.5)
    assert eng.drain_background() == pytest.approx(3.5)
