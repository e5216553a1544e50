"""Side-stream kernels (``Op.side_kernel``): a compute op on another stream that takes the
GPU's SMs in turn with the compute stream's instead of running beside them (Megatron-Core's
combined 1F1B puts the unpermutation and the residual add on its communication stream).

Independent truth: conservation. One GPU executing two kernels that each fill its SMs takes
the sum of their times, whatever the streams; unflagged side-stream compute (the engine's
default, unchanged) still overlaps."""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.engine.recorder import Recorder
from sim.fabric.topology import FabricSpec, build_fabric
from sim.program.ir import Op, Program, RankClass


def _engine(rec: Recorder) -> Engine:
    return Engine(build_fabric(FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
                                          pcie_gbytes_per_s=63, nics_per_node=0,
                                          nic_gbps=400)), "hopper", rec)


def _program(side: bool) -> Program:
    cls = RankClass(0, (0, 1))
    p = Program([cls], 2, 0, 0, 0)
    p.add(cls, Op("gemm", "compute", "compute", "fwd", duration=2.0))
    p.add(cls, Op("unpermute", "compute", "comm", "fwd", duration=0.5, side_kernel=side))
    p.add(cls, Op("gemm 2", "compute", "compute", "fwd", duration=1.0))
    return p


def test_side_kernels_run_in_turn_with_the_compute_streams() -> None:
    rec = Recorder()
    # Sum of the three (2 + 0.5 + 1): the unpermute waits for the first GEMM's SMs, the
    # second GEMM (ready when the first ends, after the unpermute's request) for it.
    assert _engine(rec).run_step(_program(True)) == pytest.approx(3.5)
    spans = {r.op.name: (r.start, r.end) for r in rec.ops}
    assert spans == {"gemm": (0.0, 2.0), "unpermute": (2.0, 2.5), "gemm 2": (2.5, 3.5)}


def test_unflagged_side_stream_compute_still_overlaps() -> None:
    assert _engine(Recorder()).run_step(_program(False)) == pytest.approx(3.0)
