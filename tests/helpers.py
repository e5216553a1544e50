"""Small helpers several test modules share (not a test module itself)."""

from __future__ import annotations

from typing import Any

import simpy

from sim.topology import FabricSpec


def timed(env: simpy.Environment, gen: Any) -> float:
    """Run one process to its end; the simulated seconds it took."""
    t0 = env.now
    env.run(env.process(gen))
    return env.now - t0


def dgx(nodes: int, **kw: Any) -> FabricSpec:
    """DGX H100-like nodes: 8 GPUs, NVLink 4 (450 GB/s), PCIe 5, 8 x 400 Gb/s NICs."""
    base: dict[str, Any] = dict(nodes=nodes, gpus_per_node=8, nvlink_gbytes_per_s=450,
                                pcie_gbytes_per_s=63, nics_per_node=8, nic_gbps=400)
    base.update(kw)
    return FabricSpec(**base)


def pipeline_idle_share(r: Any) -> float:
    """The summary's bubble as a share of the pipeline phase (forward, backward,
    recomputation) of the critical rank class, not of the whole step (which also holds the
    optimizer): what the closed form (p-1)/(m+p-1) describes."""
    step = r.summary["step_time_s"]
    crit = max(r.program.classes, key=lambda c: max(x.end for x in r.recorder.ops
                                                    if x.cls == c.id)).id
    pipeline_end = max(x.end for x in r.recorder.ops
                       if x.cls == crit and x.op.phase in ("fwd", "bwd", "recompute"))
    return float(r.summary["bubble_fraction"] * step / pipeline_end)
