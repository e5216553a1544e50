"""The ``run:`` block: a whole training run, not one step (CONTRACT.md, "Additions (2026-12)").

Part of the config layer. With a ``run:`` block (and ``training.tokens_total``), ``fabricsim
run`` adds a ``run`` object to the summary: :mod:`sim.apps.runlength` plays the whole run,
interruptions, restarts and checkpoints, from the simulated step time and checkpoint bytes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from sim import catalog
from sim.config import bounds as B
from sim.config.base import StrictModel
from sim.config.zone_outage import ZoneOutage


class Checkpoint(StrictModel):
    """Where and how checkpoints are written."""

    storage: Literal["local_nvme", "pfs", "object_store"] = "local_nvme"
    """local_nvme: each server writes its share to its own drives; pfs: a parallel file
    system shared by the job; object_store: S3-like storage, each server uploading its share."""
    gbytes_per_s: float | None = Field(default=None, gt=0)
    """Write rate in GB/s (1e9 bytes). local_nvme and object_store: per server (the job writes
    at servers x this); pfs: the file system's aggregate rate for the whole job. Default for
    local_nvme: the server's NVMe write rate (``cluster.nvme_write_gbytes_per_s``, else the
    host catalogue's); pfs and object_store have no default (they vary by orders of
    magnitude between installations)."""
    async_: bool = Field(default=False, alias="async")
    """Asynchronous save (torch.distributed.checkpoint.async_save, Megatron dist-ckpt
    ``--async-save``): the step blocks only for the device-to-host copy; the write runs in the
    background and the next save waits for it."""
    simulate: bool = False
    """Put the saves on the simulated timeline (:mod:`sim.program.checkpoint_ops`): ``fabricsim
    run --steps N`` saves after steps 1, 1 + interval, 1 + 2 x interval, ... of the window (it
    starts at a checkpoint step), as device-to-host copies and writes flowing over PCIe, the
    NICs and the network to the storage, sharing links with the steps' traffic; the summary's
    ``checkpoint`` object and the run model use the measured times. False: the closed form
    only, nothing on the timeline."""
    zone: int | None = Field(default=None, ge=0, lt=B.MAX_ZONES)
    """pfs and object_store with ``simulate``: the zone of the storage endpoint (default 0, the
    job's first zone). A zone without GPUs of the job (``zone >= cluster.azs``) is reached
    over metered zone links (or region links, when ``zone % cluster.regions`` is another
    region), whose bytes the summary counts and bills."""

    @model_validator(mode="after")
    def _rate_known(self) -> Checkpoint:
        if self.gbytes_per_s is None and self.storage != "local_nvme":
            raise ValueError(f"run.checkpoint.gbytes_per_s: needed for storage "
                             f"{self.storage} (its write rate, GB/s)")
        if self.zone is not None and self.storage == "local_nvme":
            raise ValueError("run.checkpoint.zone: only for pfs or object_store (local_nvme "
                             "writes to each server's own drives)")
        return self


class FailureRate(StrictModel):
    """One component's failure rate, scaling with a unit of the cluster."""

    rate_per_unit_per_day: float = Field(ge=0)
    """Interruptions per unit of ``basis`` per day."""
    basis: Literal["gpu", "host", "nic", "job"]
    """What the rate scales with: per GPU, per server, per NIC link, or per job."""
    needs_node: bool = False
    """The interruption takes a server out of the job (a hot spare replaces it)."""
    planned: bool = False
    """A stop on purpose after saving a checkpoint: no work lost."""


class Run(StrictModel):
    """A whole run: checkpoints, failures, restarts and spares (``sim.apps.runlength``)."""

    checkpoint_interval_steps: int = Field(gt=0)
    """Optimizer steps between checkpoints."""
    checkpoint: Checkpoint = Checkpoint()
    failures: str | dict[str, FailureRate] = "llama3-16k-h100"
    """A catalogue name (``sim/catalog/failures.yaml``: ``llama3-16k-h100``), or a mapping
    component -> ``{rate_per_unit_per_day, basis: gpu|host|nic|job, needs_node, planned}``."""
    restart_minutes: float = Field(default=10.0, ge=0)
    """Minutes from an interruption to training again: detection, rescheduling, process
    start and checkpoint load (lost work since the last checkpoint comes on top). Default 10:
    an assumption for an automated restart, not a published figure; state your own."""
    spares: int = Field(default=0, ge=0)
    """Hot spare servers: an interruption that takes a server out swaps a free spare in at
    no extra wait; the broken server returns as a spare after ``repair_hours``."""
    replace_minutes: float = Field(default=0.0, ge=0)
    """Extra wait for a replacement server when no hot spare is free (0: one is always at
    hand, so spares change nothing)."""
    repair_hours: float = Field(default=24.0, gt=0)
    """Hours a replaced server takes to come back as a spare (an assumption, state your own)."""
    seed: int = 0
    """Seed of the Monte Carlo (a numpy Generator): same seed, same numbers."""
    samples: int = Field(default=1000, gt=0, le=1_000_000)
    """Whole runs simulated."""
    zone_outage: ZoneOutage | None = None
    """Availability-zone outages (:class:`sim.config.zone_outage.ZoneOutage`); only for a
    cluster over 2 or more zones (``cluster.azs``)."""

    @model_validator(mode="after")
    def _zone_checkpoint(self) -> Run:
        z = self.zone_outage
        if z is not None and z.checkpoint_survives is None and self.checkpoint.storage == "pfs":
            raise ValueError("run.zone_outage.checkpoint_survives: needed with storage pfs "
                             "(whether the file system outlives a zone)")
        return self

    @field_validator("failures", mode="before")
    @classmethod
    def _failures(cls, v: Any) -> Any:
        if isinstance(v, str):
            names = catalog.failure_catalogue_names()
            if v not in names:
                raise ValueError(f"run.failures: unknown catalogue {v!r} "
                                 f"(known: {', '.join(names)})")
            return v
        if not isinstance(v, dict) or not v:
            raise ValueError("run.failures: a catalogue name or a mapping component -> "
                             "{rate_per_unit_per_day, basis}")
        out = {}
        for name, rate in v.items():
            try:
                out[name] = FailureRate.model_validate(rate)
            except ValidationError as err:
                e = err.errors()[0]
                where = ".".join(str(x) for x in ("run", "failures", name, *e["loc"]))
                what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
                raise ValueError(f"{where}: {what}") from None
        return out
