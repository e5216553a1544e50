"""A checkpoint's bytes and times, from the simulated job.

Bytes: what each rank holds before the step (its rank class's ``initial_memory``
``parameters`` and ``optimizer``, the builders' real sharded states), summed over every rank,
then deduplicated: a checkpoint writes each distinct tensor once (Megatron-Core dist-ckpt's
fully-parallel save spreads the replicas' writes over the data-parallel ranks;
torch.distributed.checkpoint's planner, ``dedup_save_plans``, gives each replicated item to one
rank). Whether a state is replicated over the data-parallel ranks or sharded across them is the
framework's choice (ZeRO stage, distributed optimizer, FSDP), so it is read off the bytes: over
all ranks a state totals ``element bytes x parameters x R`` with R = 1 (sharded) or the
data-parallel replica count (replicated), and an element is 2 or 4 bytes for parameters
(16-bit model weights, or the fp32 parameter itself) and 8 or 12 for AdamW's states (two fp32
moments, plus an fp32 master copy when the weights are 16-bit). R is the choice that gives
the nearest element size; a 12-byte optimizer state says the weights are 16-bit, which breaks
the one tie (2 replicas of 2 bytes or 1 of 4). Expert weights replicated over an expert-data-
parallel group smaller than the data-parallel one are not told apart (MoE: an approximation).
Where the optimizer lives in host memory (offload) it is not in ``initial_memory``: it is
counted as AdamW's full state, 12 bytes per parameter with 16-bit weights, else 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sim.program.ir import RankClass

PARAM_ELEMENT_BYTES = (2.0, 4.0)
"""bf16/fp16 model weights, or fp32 parameters (FSDP's sharded fp32 master, DDP)."""
OPTIMIZER_ELEMENT_BYTES = (8.0, 12.0)
"""AdamW's exp_avg and exp_avg_sq in fp32, plus the fp32 master weights beside 16-bit ones
(Megatron's DistributedOptimizer, DeepSpeed's ZeRO partitions)."""


@dataclass(frozen=True)
class CheckpointBytes:
    total: float
    """Bytes one checkpoint writes (each distinct tensor once)."""
    parameters_per_param: float
    optimizer_per_param: float


def _per_param(total: float, params: float, replicas: int, sizes: Iterable[float],
               prefer: float | None = None) -> float:
    """Bytes per parameter of one distinct copy: ``total / params / R`` for the replication
    R in {1, replicas} whose element size is nearest one of ``sizes`` (ties: nearest
    ``prefer``)."""
    per = total / params
    best: tuple[float, float, float] | None = None
    for r in sorted({1, replicas}):
        b = per / r
        dist = min(abs(math.log(b / s)) for s in sizes)
        tie = abs(math.log(b / prefer)) if prefer else 0.0
        key = (round(dist, 9), tie, b)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]


def checkpoint_bytes(classes: Iterable[RankClass], params: float, replicas: int
                     ) -> CheckpointBytes:
    """One checkpoint's bytes from the rank classes' initial memory (module docstring).

    Examples
    --------
    >>> from sim.program.ir import RankClass
    >>> # Megatron with the distributed optimizer over 4 replicas: bf16 weights on every
    >>> # replica, 12 B/param of optimizer sharded 4 ways (1,000 parameters, one class).
    >>> c = RankClass(0, (0, 1, 2, 3), initial_memory={"parameters": 2000.0,
    ...                                                 "optimizer": 3000.0})
    >>> checkpoint_bytes([c], 1000, 4).total      # 2 + 12 bytes per parameter
    14000.0
    """
    p_total = o_total = 0.0
    for c in classes:
        n = len(c.members)
        p_total += c.initial_memory.get("parameters", 0.0) * n
        o_total += c.initial_memory.get("optimizer", 0.0) * n
    if p_total <= 0:
        # Everything on the host (FSDP CPU offload): 16-bit weights + AdamW's full state.
        return CheckpointBytes(14.0 * params, 2.0, 12.0)
    if o_total > 0:
        opt = _per_param(o_total, params, replicas, OPTIMIZER_ELEMENT_BYTES)
        par = _per_param(p_total, params, replicas, PARAM_ELEMENT_BYTES,
                         prefer=2.0 if opt > 10.0 else 4.0)
    else:
        par = _per_param(p_total, params, replicas, PARAM_ELEMENT_BYTES, prefer=2.0)
        opt = 12.0 if par < 3.0 else 8.0
    return CheckpointBytes((par + opt) * params, par, opt)


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
