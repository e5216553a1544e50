"""``run.zone_outage``: a whole availability zone lost for hours, in a run over 2+ zones.

Part of the config layer (the ``run:`` block, :mod:`sim.config.run`); the model that plays it
is :mod:`sim.apps.runlength.zones`. No default rate: cloud providers publish no per-zone
outage frequency (their EC2 SLA promises 99.99% monthly *region* availability to
workloads spread over 2+ zones, an uptime commitment, not a rate), and the public incident
histories are too sparse for one number, so the rate and duration are the user's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config.base import StrictModel


class ZoneOutage(StrictModel):
    """Each availability zone goes down ``per_year`` times a year for ``hours`` hours."""

    per_year: float = Field(ge=0, le=365.25)
    """Outages per zone per year (a Poisson process per zone; no default: state your own)."""
    hours: float = Field(gt=0, le=8766)
    """How long each outage lasts, hours (no default: state your own)."""
    policy: Literal["wait", "shrink"] = "wait"
    """wait: the whole job stops until the zone returns, then restarts. shrink: the job
    restarts on the surviving zones with fewer data-parallel replicas (same global batch,
    more gradient accumulation) and grows back when the zone returns."""
    checkpoint_survives: bool | None = None
    """Whether the job can load its last checkpoint when it restarts during (shrink) or
    after (wait) the outage; if not, the run starts over from step 0. Default: true for
    ``object_store`` (S3 Standard stores objects across at least three zones of a region,
    AWS S3 User Guide, "Data protection in Amazon S3"); false for ``local_nvme`` (each server
    writes its own shards once, without copies on other servers, so a checkpoint is whole
    only with every zone's drives; and cloud instance-store drives keep no data once their
    instance stops, AWS EC2 User Guide, "Data persistence for instance store volumes"). A
    parallel file system may live in one zone or span several: give it for ``pfs``."""
