"""A communication kernel launched beside a running compute kernel on Hopper
(``Op.launch_behind_compute``, :mod:`sim.engine.launch_wait`).

Independent truth: the lent H200's measurement (a copy kernel of 16-32 CTAs launched on a
second stream beside looping GEMMs never ran beside one, ``h200-overlap.json``) as a closed
form at the engine's granularity: a marked collective ready at time ``t`` beside a compute op
that started at ``t0`` and takes ``D`` starts at ``t0 + D``. Other architectures and unmarked
collectives start when ready (the engine's rule before)."""

from __future__ import annotations

import pytest
import simpy

from sim.engine.core import Engine
from sim.engine.launch_wait import RunningCompute
from sim.engine.recorder import Recorder
from sim.fabric.topology import FabricSpec, build_fabric
from sim.program.ir import Op, Program, RankClass


def _op(name: str, stream: str, duration: float, kernels: int = 1) -> Op:
    return Op(name, "compute", stream, "fwd", duration=duration, kernels=kernels)


def test_beside_lists_the_running_compute_of_other_streams() -> None:
    env = simpy.Environment()
    rc = RunningCompute(enabled=True)
    gemms = _op("experts", "compute", 1.0, kernels=4)
    rc.started(0, gemms)
    a2a = Op("dispatch", "collective", "moe_a2a", "comm")
    done = rc.beside(0, a2a, env)
    assert len(done) == 1 and not done[0].triggered
    assert rc.beside(0, a2a, env) == done                     # one event, asked twice
    assert rc.beside(1, a2a, env) == []                       # another rank class
    same_stream = Op("dispatch", "collective", "compute", "comm")
    assert rc.beside(0, same_stream, env) == []               # in order on its own stream
    rc.ended(0, gemms)
    assert done[0].triggered
    assert rc.beside(0, a2a, env) == []


def test_disabled_off_hopper() -> None:
    rc = RunningCompute(enabled=False)
    rc.started(0, _op("gemm", "compute", 1.0))
    assert rc.beside(0, Op("ar", "collective", "dp", "comm"), simpy.Environment()) == []


def _engine(arch: str, rec: Recorder) -> Engine:
    return Engine(build_fabric(FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=450,
                                          pcie_gbytes_per_s=63, nics_per_node=0,
                                          nic_gbps=400)), arch, rec)


def _program(marked: bool) -> Program:
    """A 1 ms op of four kernels on the compute stream; a 0.3 ms op on a side stream, after
    which an all-to-all becomes ready on a third stream (at 0.3 ms, while the 1 ms op
    runs)."""
    cls = RankClass(0, (0, 1))
    p = Program([cls], 2, 0, 0, 0)
    p.add(cls, _op("gemms", "compute", 1e-3, kernels=4))
    side = p.add(cls, _op("router", "side", 0.3e-3))
    a2a = Op("dispatch", "collective", "moe_a2a", "comm", collective="all_to_all",
             group=(0, 1), nbytes=1e3, key="a2a", deps=[side],
             launch_behind_compute=marked)
    p.add(cls, a2a)
    return p


@pytest.mark.parametrize(("arch", "marked", "start"), [
    ("hopper", True, 1.0e-3),       # waits for the running compute
    ("hopper", False, 0.3e-3),      # unmarked: starts when ready
    ("blackwell", True, 1.0e-3),    # persistent GEMMs there too: waits
    ("ampere", True, 0.3e-3),       # nothing says so there: starts when ready
])
def test_engine_starts_a_marked_collective_after_the_running_compute(
        arch: str, marked: bool, start: float) -> None:
    rec = Recorder()
    _engine(arch, rec).run_step(_program(marked))
    spans = {r.op.name: r for r in rec.ops}
    assert spans["dispatch"].ready == pytest.approx(0.3e-3)
    assert spans["dispatch"].start == pytest.approx(start)
