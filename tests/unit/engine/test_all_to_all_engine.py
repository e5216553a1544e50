"""The engine runs an all-to-all's ``peer_bytes`` (uneven splits) as per-peer sends."""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.fabric.collectives import nccl
from sim.fabric.topology import FabricSpec, build_fabric
from sim.program.ir import Op, Program, RankClass

MIB = float(1 << 20)
NVLINK = 450e9 * nccl.NVLINK_EFFICIENCY["hopper"]   # an H100 NVLink port as NCCL gets it


def step(peer_bytes: tuple[tuple[float, ...], ...], nbytes: float) -> float:
    fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=4, nvlink_gbytes_per_s=450,
                                  pcie_gbytes_per_s=63, nics_per_node=0, nic_gbps=400))
    cls = RankClass(0, (0, 1, 2, 3))
    p = Program([cls], 4, 0, 0, 0)
    p.add(cls, Op(name="dispatch", kind="collective", stream="comm", phase="comm",
                  collective="all_to_all", group=(0, 1, 2, 3), nbytes=nbytes,
                  peer_bytes=peer_bytes, key="a2a"))
    return Engine(fab, "hopper").run_step(p)


def test_uneven_splits_pace_the_step_by_the_busiest_rank() -> None:
    # Rank 0 sends 4 x 64 MiB to each of 3 peers, the others 64 MiB: the op takes rank 0's
    # 12 x 64 MiB over its NVLink port, 9 x 64 MiB more than the even split of 64 MiB per
    # peer (same launch and latency in both).
    part = 64 * MIB
    even = tuple(tuple(0.0 if i == j else part for j in range(4)) for i in range(4))
    heavy = tuple(tuple(0.0 if i == j else (4 * part if i == 0 else part) for j in range(4))
                  for i in range(4))
    t_even, t_heavy = step(even, 4 * part), step(heavy, 4 * part)
    assert t_heavy - t_even == pytest.approx(9 * part / NVLINK, rel=1e-6)
    # The empty matrix is nccl-tests' even split of nbytes: the same step as `even`.
    assert step((), 4 * part) == pytest.approx(t_even, rel=1e-9)
