"""The SMs NCCL's all-to-all holds from the compute beside it
(:func:`sim.hardware.interference.alltoall_ctas`).

Independent truths: NCCL's channel layout (an all-to-all is grouped ``ncclSend``/``ncclRecv``
whose rounds start on moving channel bases, ``ncclP2pChannelBaseForRound``, over the
communicator's ``p2pnChannels``: "32 p2p channels" in NCCL_DEBUG=INFO on DGX H100), and the
interference model's closed form: a GEMM beside ``c`` held SMs runs ``sm / (sm - c)`` slower.
"""

from __future__ import annotations

import pytest

from sim.engine.core import Engine
from sim.engine.recorder import Recorder
from sim.fabric.topology import FabricSpec, build_fabric
from sim.hardware.interference import alltoall_ctas
from sim.program.ir import Op, Program, RankClass

MIB = float(1 << 20)


def test_a_large_all_to_all_runs_on_every_p2p_channel() -> None:
    # EP 32 over 4 nodes: 31 peers of at least one channel each, capped at 32.
    assert alltoall_ctas("hopper", [(4 * MIB, False)] * 31) == 32
    # 8 GPUs of a node, 16 MiB to each peer: each send fills its NVLink channels.
    assert alltoall_ctas("hopper", [(16 * MIB, True)] * 7) == 32
    # Latency-bound (64 KiB a peer, one minimum part): one channel a peer.
    assert alltoall_ctas("hopper", [(64 << 10, True)] * 7) == 7


def test_a_gemm_beside_the_all_to_all_loses_its_channels_sms() -> None:
    fab = build_fabric(FabricSpec(nodes=1, gpus_per_node=8, nvlink_gbytes_per_s=450,
                                  pcie_gbytes_per_s=63, nics_per_node=0, nic_gbps=400))
    cls = RankClass(0, tuple(range(8)))
    p = Program([cls], 8, 0, 0, 0)
    p.add(cls, Op(name="a2a", kind="collective", stream="comm", phase="comm",
                  collective="all_to_all", group=tuple(range(8)), nbytes=8 * 512 * MIB,
                  key="a2a"))
    # A tensor-core op (category backward, no FLOP count: matrix share 1), far shorter than
    # the 4 GiB all-to-all, so the whole of it runs beside the 32 CTAs.
    p.add(cls, Op(name="gemm", kind="compute", stream="compute", phase="bwd", duration=1e-3,
                  category="backward"))
    rec = Recorder()
    eng = Engine(fab, "hopper", rec)
    eng.run_step(p)
    gemm = next(r for r in rec.ops if r.op.name == "gemm")
    sm = eng.sm_count
    assert gemm.end - gemm.start == pytest.approx(1e-3 * sm / (sm - 32), rel=1e-6)
