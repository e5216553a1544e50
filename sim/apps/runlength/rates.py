"""Failure rates scaled from a catalogue (or the scenario's own) to the scenario's cluster."""

from __future__ import annotations

from dataclasses import dataclass

from sim import catalog
from sim.catalog import FailureComponent
from sim.scenario import Scenario

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class JobRates:
    """Each component's interruption rate for the whole job."""

    names: tuple[str, ...]
    per_day: tuple[float, ...]
    needs_node: tuple[bool, ...]
    planned: tuple[bool, ...]

    @property
    def per_s(self) -> tuple[float, ...]:
        return tuple(r / SECONDS_PER_DAY for r in self.per_day)

    @property
    def unplanned_per_day(self) -> float:
        return sum(r for r, p in zip(self.per_day, self.planned, strict=True) if not p)


def components(s: Scenario) -> tuple[FailureComponent, ...]:
    """The scenario's failure components: its catalogue's, or its own mapping's."""
    assert s.run is not None
    f = s.run.failures
    if isinstance(f, str):
        return catalog.failure_catalogue(f)
    return tuple(FailureComponent(name=k, rate_per_unit_per_day=v.rate_per_unit_per_day,
                                  basis=v.basis, needs_node=v.needs_node, planned=v.planned)
                 for k, v in f.items())


def job_rates(s: Scenario) -> JobRates:
    """Per-unit rates times the scenario's units: GPUs, servers (nodes), NIC links (nodes x
    NICs per node) and one job.

    Examples
    --------
    >>> from sim.scenario import Scenario
    >>> s = Scenario(model="llama3-8b", cluster={"nodes": 2048, "gpus_per_node": 8,
    ...              "nics_per_node": 8}, training={"tokens_total": 1e12},
    ...              run={"checkpoint_interval_steps": 100})
    >>> r = job_rates(s)
    >>> round((r.unplanned_per_day) * 54)           # Llama 3's 419 in 54 days
    419
    """
    c = s.cluster
    units = {"gpu": s.gpus, "host": c.nodes, "nic": c.nodes * c.nics_per_node, "job": 1}
    comps = components(s)
    return JobRates(names=tuple(x.name for x in comps),
                    per_day=tuple(x.rate_per_unit_per_day * units[x.basis] for x in comps),
                    needs_node=tuple(x.needs_node for x in comps),
                    planned=tuple(x.planned for x in comps))
