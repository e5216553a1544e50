"""A checkpoint's bytes and times, from the simulated job.

Bytes: :func:`sim.program.checkpoint_ops.checkpoint_bytes` (the one home of the rule: the
rank classes' sharded states, each distinct tensor written once), re-exported here. Times:
the closed form of :func:`checkpoint_times` (kept for checks and for runs whose saves are not
simulated; ``run.checkpoint.simulate`` puts the save on the timeline,
:mod:`sim.analysis.checkpoint_figures`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.program.checkpoint_ops import (
    OPTIMIZER_ELEMENT_BYTES,
    PARAM_ELEMENT_BYTES,
    CheckpointBytes,
    checkpoint_bytes,
)

__all__ = ["OPTIMIZER_ELEMENT_BYTES", "PARAM_ELEMENT_BYTES", "CheckpointBytes",
           "CheckpointTimes", "checkpoint_bytes", "checkpoint_times"]


@dataclass(frozen=True)
class CheckpointTimes:
    write_s: float
    """The whole checkpoint written to storage."""
    copy_s: float
    """Each GPU's share copied to host memory over PCIe (what an async save blocks on)."""
    write_gbytes_per_s: float
    """The job's aggregate write rate."""


def checkpoint_times(bytes_total: float, storage: str, gbytes_per_s: float, nodes: int,
                     gpus: int, pcie_gbytes_per_s: float) -> CheckpointTimes:
    """Write and device-to-host copy times. local_nvme and object_store rates are per
    server (every server writes its share at once); pfs is the file system's aggregate.
    Shares are balanced (fully-parallel save); the network between the servers and the
    storage is assumed not to be the narrower pipe.

    Examples
    --------
    >>> t = checkpoint_times(8e12, "local_nvme", 4.0, 1000, 8000, 50.0)
    >>> t.write_s, t.copy_s                    # 8 TB at 4 TB/s; 1 GB per GPU at 50 GB/s
    (2.0, 0.02)
    """
    rate = gbytes_per_s * (nodes if storage in ("local_nvme", "object_store") else 1)
    return CheckpointTimes(write_s=bytes_total / (rate * 1e9),
                           copy_s=bytes_total / gpus / (pcie_gbytes_per_s * 1e9),
                           write_gbytes_per_s=rate)
