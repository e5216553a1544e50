"""Checkpoint saves in a simulated run (``run.checkpoint.simulate``): which steps save, the
program that saves, and the fabric with its storage.

:func:`checkpoint_setup` reads the scenario's ``run:`` block; with ``simulate: true`` it
builds the saving program (:func:`sim.program.checkpoint_ops.with_checkpoint`, each rank's
share of the real sharded states) and the fabric with the storage target
(:mod:`sim.fabric.topology.storage`). :func:`sim.api.run_program` runs the saving program on
the checkpoint steps and the plain one on the others, on one engine, so an asynchronous
write still running shares links with the next steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.config.base import ScenarioError
from sim.config.run import Run
from sim.fabric.topology import CROSS_AZ, CROSS_REGION, Fabric, FabricSpec, build_graph
from sim.fabric.topology.storage import StorageTarget, attach_storage, local_storage
from sim.program.checkpoint_ops import Share, with_checkpoint, write_shares
from sim.program.ir import Program

__all__ = ["CheckpointSetup", "checkpoint_setup", "crossing_bytes"]


@dataclass
class CheckpointSetup:
    """The saves of a simulated run: the fabric with its storage (:func:`checkpoint_setup`),
    then the saving program (:meth:`prepare`, on the program as it will run, stragglers
    split out)."""

    fabric: Fabric
    storage: StorageTarget
    interval_steps: int
    asynchronous: bool
    program: Program | None = None
    """The step's program with a save after it (:meth:`prepare`)."""
    shares: dict[int, Share] = field(default_factory=dict)
    """Each rank class's per-member share of one checkpoint."""
    bytes_total: float = 0.0
    """Bytes one checkpoint writes (the shares over every rank)."""

    def prepare(self, program: Program, params: float, replicas: int,
                stage_write_share: bool = False) -> None:
        """Build the saving program from ``program``. ``params``: the model's parameters;
        ``replicas``: its data-parallel replicas (data x context parallel), over which a
        replicated state's writes are spread; ``stage_write_share``: an asynchronous save
        stages only the rank's share (:func:`~sim.program.checkpoint_ops.write_shares`)."""
        self.shares = write_shares(program.classes, params, replicas, stage_write_share)
        self.bytes_total = sum(self.shares[c.id].total * len(c.members)
                               for c in program.classes)
        self.program = with_checkpoint(program, self.shares, self.asynchronous)

    def saves_after(self, step: int) -> bool:
        """Whether step ``step`` (0-based in the simulated window) ends with a save: the
        window starts at a checkpoint step."""
        return step % self.interval_steps == 0

    def program_for(self, step: int, plain: Program) -> Program:
        assert self.program is not None, "CheckpointSetup.prepare first"
        return self.program if self.saves_after(step) else plain


def checkpoint_setup(r: Run | None, spec: FabricSpec, origin: str = "<scenario>"
                     ) -> CheckpointSetup | None:
    """The fabric and storage of the saves of the scenario's ``run:`` block ``r`` (None
    without ``run.checkpoint.simulate``).

    Raises ScenarioError (one line naming the file and ``run.checkpoint``) when the storage
    cannot be reached on this cluster."""
    if r is None or not r.checkpoint.simulate:
        return None
    ck = r.checkpoint
    graph = build_graph(spec)
    try:
        if ck.storage == "local_nvme":
            storage = local_storage(graph, spec, ck.gbytes_per_s)
        else:
            assert ck.gbytes_per_s is not None   # the schema requires it for these
            storage = attach_storage(graph, spec, ck.storage, ck.gbytes_per_s, ck.zone or 0)
    except ValueError as exc:
        raise ScenarioError(f"{origin}: {exc}") from None
    fabric = Fabric(graph, spec)
    storage.bind(fabric)
    return CheckpointSetup(fabric, storage, r.checkpoint_interval_steps, ck.async_)


def crossing_bytes(setup: CheckpointSetup, program: Program) -> tuple[float, float]:
    """Bytes one save puts on ``cross_az`` and on ``cross_region`` links (each crossing
    counted, as the network's per-class counters and the bill count them)."""
    kind = setup.fabric.kind
    az = region = 0.0
    for c in program.classes:
        share = setup.shares[c.id]
        for r in c.members:
            route = setup.storage.route(r, from_gpu=False)
            hops = kind[list(route)] if route else kind[:0]
            az += share.total * float((hops == CROSS_AZ).sum())
            region += share.total * float((hops == CROSS_REGION).sum())
    return az, region
