"""A checkpoint save as ops of the program: bytes per rank from the sharded states, and the ops.

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

Each rank writes its share (:func:`write_shares`): its own states divided by their
replication R (the fully-parallel save's balanced split of a replicated tensor over its
replicas), plus an even share of host-resident (offloaded) states.

Ops (:func:`with_checkpoint`): after a rank class's last op of the step (the optimizer),

* synchronous save (``torch.distributed.checkpoint.save``, Megatron ``save_checkpoint``
  without ``--async-save``): one ``gpu_storage_write`` copy per rank, GPU memory to the
  storage through host memory, streamed: torch DCP's file-system writer stages the next
  tensors to host memory on a side stream while it writes the previous ones
  (``_OverlappingCpuLoader``, torch/distributed/checkpoint/filesystem.py), so the save runs at
  the narrower of the PCIe path and the storage path. The step waits for it (the save's
  closing ``all_reduce`` of the write results returns when every rank has written).
* asynchronous save (``torch.distributed.checkpoint.async_save``, Megatron dist-ckpt
  ``--async-save``): the step blocks for the device-to-host copy into pinned host memory
  (``d2h``: torch DCP's stager copies the rank's whole local state, Megatron's async writer
  only its own share, :func:`write_shares`); a background writer
  (:attr:`Program.background_streams`) then writes host memory to the storage
  (``storage_write``) while the next steps run, on the same PCIe and network links as their
  traffic. The next save first waits for the
  previous write (torchtitan's ``CheckpointManager`` waits on the previous ``async_save``
  future before staging again; Megatron finalises the pending async request first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from sim.program.ir import Op, Program, RankClass

__all__ = ["CHECKPOINT_STREAM", "CHECKPOINT_WRITER_STREAM", "CheckpointBytes",
           "checkpoint_bytes", "is_checkpoint_op", "with_checkpoint", "write_shares"]

PARAM_ELEMENT_BYTES = (2.0, 4.0)
"""bf16/fp16 model weights, or fp32 parameters (FSDP's sharded fp32 master, DDP)."""
OPTIMIZER_ELEMENT_BYTES = (8.0, 12.0)
"""AdamW's exp_avg and exp_avg_sq in fp32, plus the fp32 master weights beside 16-bit ones
(Megatron's DistributedOptimizer, DeepSpeed's ZeRO partitions)."""

CHECKPOINT_STREAM = "checkpoint"
"""The stream of a save's blocking part (the synchronous write, or the async staging copy)."""
CHECKPOINT_WRITER_STREAM = "checkpoint_writer"
"""The background stream of an asynchronous save's write."""
CHECKPOINT_CATEGORY = "checkpoint"
"""``Op.category`` of every checkpoint op (plots and :mod:`sim.analysis.checkpoint_figures`)."""


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


def _totals(classes: Iterable[RankClass]) -> tuple[float, float]:
    p_total = o_total = 0.0
    for c in classes:
        n = len(c.members)
        p_total += c.initial_memory.get("parameters", 0.0) * n
        o_total += c.initial_memory.get("optimizer", 0.0) * n
    return p_total, o_total


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
    p_total, o_total = _totals(classes)
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
class Share:
    """What each member rank of a class saves."""

    gpu_bytes: float
    """From GPU memory (its deduplicated share of the states it holds)."""
    host_bytes: float
    """From host memory (its even share of offloaded states)."""
    stage_bytes: float
    """What an asynchronous save copies from GPU to host memory first: its GPU share, or
    its whole GPU-resident state (torch DCP's stager copies every local tensor)."""

    @property
    def total(self) -> float:
        return self.gpu_bytes + self.host_bytes


def write_shares(classes: list[RankClass], params: float, replicas: int,
                 stage_write_share: bool = False) -> dict[int, Share]:
    """Each rank class's per-member share of one checkpoint (module docstring); the shares
    over every rank add up to :func:`checkpoint_bytes`' total. ``stage_write_share``: an
    asynchronous save stages only the rank's share (Megatron dist-ckpt), not its whole
    GPU-resident state (torch DCP).

    Examples
    --------
    >>> c = RankClass(0, (0, 1, 2, 3), initial_memory={"parameters": 2000.0,
    ...                                                 "optimizer": 3000.0})
    >>> write_shares([c], 1000, 4)[0].total      # 2000 / 4 replicas + 3000 (sharded)
    3500.0
    """
    ck = checkpoint_bytes(classes, params, replicas)
    p_total, o_total = _totals(classes)
    # The replication of each state: its total over the ranks / its distinct bytes.
    r_p = p_total / (ck.parameters_per_param * params) if p_total > 0 else 1.0
    r_o = o_total / (ck.optimizer_per_param * params) if o_total > 0 else 1.0
    on_gpu = p_total / r_p + o_total / r_o
    n = sum(len(c.members) for c in classes)
    host_each = max(ck.total - on_gpu, 0.0) / n
    out = {}
    for c in classes:
        p, o = c.initial_memory.get("parameters", 0.0), c.initial_memory.get("optimizer", 0.0)
        gpu = p / r_p + o / r_o
        out[c.id] = Share(gpu, host_each, gpu if stage_write_share else p + o)
    return out


def is_checkpoint_op(op: Op) -> bool:
    """Whether ``op`` is part of a checkpoint save (:func:`with_checkpoint`)."""
    return op.category == CHECKPOINT_CATEGORY


def _copy(name: str, stream: str, transfer: str, nbytes: float, deps: list[Op]) -> Op:
    return Op(name=name, kind="copy", stream=stream, phase="optimizer", nbytes=nbytes,
              host_transfer=transfer, deps=deps, category=CHECKPOINT_CATEGORY)  # type: ignore[arg-type]


def with_checkpoint(program: Program, shares: dict[int, Share], asynchronous: bool) -> Program:
    """``program`` with a checkpoint save after each rank class's step (module docstring).

    A new program: its rank classes are copies of ``program``'s (same ids and members) whose
    streams hold the same ops (same indices) and the save's, so one engine runs either on
    the steps it chooses; ``program`` itself is not changed.
    """
    out = Program(classes=[], n_ranks=program.n_ranks, tokens_per_step=program.tokens_per_step,
                  model_flops_per_step=program.model_flops_per_step,
                  hw_flops_per_step=program.hw_flops_per_step,
                  micro_batches=program.micro_batches, pipeline_stages=program.pipeline_stages,
                  meta=dict(program.meta),
                  background_streams=program.background_streams
                  | ({CHECKPOINT_WRITER_STREAM} if asynchronous else set()))
    out._ops = list(program.ops)
    for c in program.classes:
        out.classes.append(RankClass(c.id, c.members, {k: list(v) for k, v in c.streams.items()},
                                     dict(c.initial_memory), c.label, c.compute_factor))
    for c in out.classes:
        share = shares[c.id]
        # After the step's work on every stream of the class (the optimizer last).
        last = [ops[-1] for ops in c.streams.values() if ops]
        if not asynchronous:
            out.add(c, _copy("checkpoint save", CHECKPOINT_STREAM, "gpu_storage_write",
                             share.gpu_bytes, last))
            if share.host_bytes:
                out.add(c, _copy("checkpoint save (host states)", CHECKPOINT_STREAM,
                                 "storage_write", share.host_bytes, last))
            continue
        # The previous save's write done (the writer's queue is in order across steps).
        previous = out.add(c, _copy("checkpoint wait previous write", CHECKPOINT_WRITER_STREAM,
                                    "storage_write", 0.0, []))
        stage = out.add(c, _copy("checkpoint stage d2h", CHECKPOINT_STREAM, "d2h",
                                 share.stage_bytes, [*last, previous]))
        out.add(c, _copy("checkpoint write", CHECKPOINT_WRITER_STREAM, "storage_write",
                         share.total, [stage]))
    out.validate()
    return out
