"""The ``faults:`` block: heterogeneity inside one step (CONTRACT.md, "Additions (2026-12)").

Part of the config layer. A slow GPU (a straggler: thermal or power throttling, a degraded
HBM stack) runs its kernels ``factor`` times longer; a slow NIC link (a cable or transceiver
at a fraction of its rate) carries ``1 / factor`` of its capacity in both directions; a failed
NIC link is gone, and its GPUs' network traffic moves to the node's remaining NICs, as NCCL
does when a NIC is down. :func:`check_faults` checks the ranks, nodes and NICs against the
cluster (the block alone cannot see it); :func:`sim.api.simulate` calls it.

Examples
--------
>>> f = Faults(slow_gpus=[{"rank": 3, "factor": 1.1}], failed_links=[{"node": 1, "nic": 0}])
>>> f.slow_gpus[0].factor, f.failed_links[0].nic, f.empty
(1.1, 0, False)
>>> Faults().empty
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from sim.config.base import ScenarioError, StrictModel


class SlowGpu(StrictModel):
    """One GPU whose kernels run slower than its peers'."""

    rank: int = Field(ge=0)
    """Global rank of the GPU (``node * gpus_per_node + local``)."""
    factor: float = Field(ge=1.0)
    """Its compute kernels take ``factor`` times as long (1.1: 10% slower)."""


class SlowNode(StrictModel):
    """A whole server whose GPUs all run slower (power capping, a hot rack, a slow host)."""

    node: int = Field(ge=0)
    """Server index (its GPUs are ranks ``node * gpus_per_node`` onwards)."""
    factor: float = Field(ge=1.0)
    """Every GPU's compute kernels on it take ``factor`` times as long."""


class SlowLink(StrictModel):
    """One NIC's network link running below its line rate (both directions)."""

    node: int = Field(ge=0)
    """Server of the NIC."""
    nic: int = Field(ge=0)
    """NIC index on that server (its rail), ``0 <= nic < cluster.nics_per_node``."""
    factor: float = Field(ge=1.0)
    """The link carries ``1 / factor`` of its capacity (2: half rate)."""


class FailedLink(StrictModel):
    """One NIC's network link that is down for the whole step."""

    node: int = Field(ge=0)
    """Server of the NIC."""
    nic: int = Field(ge=0)
    """NIC index on that server, ``0 <= nic < cluster.nics_per_node``."""


class Jitter(StrictModel):
    """Step-to-step variation of every GPU's compute (``faults.jitter``): each rank's compute
    kernels in a step take ``X`` times their time, ``X`` drawn afresh per rank and step.

    ``lognormal``: ``X = exp(sigma Z)``, ``Z`` standard normal: positive, right-skewed, median
    1, mean ``exp(sigma^2 / 2)``; its coefficient of variation ``sqrt(exp(sigma^2) - 1)`` is
    about ``sigma`` for small ``sigma``, so a measured per-GPU step-time CV of 2% is
    ``sigma: 0.02``. The distribution is a modelling choice (multiplicative noise that cannot
    go negative), not a fit to a published trace; give your own ``sigma``. A synchronous job
    waits for its slowest rank: a simulated rank class runs each step at the largest of its
    ranks' draws (:mod:`sim.engine.jitter`), so tails grow with the rank count.
    """

    distribution: Literal["lognormal"] = "lognormal"
    sigma: float = Field(ge=0.0, le=2.0)
    """Standard deviation of ``log X`` (0: no variation, the step as without the key)."""
    seed: int = 0
    """Seed of the draws: same seed, same steps."""


class Faults(StrictModel):
    """Faults inside a step: slow GPUs, slow NIC links and failed NIC links."""

    slow_gpus: list[SlowGpu] = Field(default_factory=list)
    """Straggler GPUs: ``[{rank, factor}]``; each gets a rank class of its own."""
    slow_nodes: list[SlowNode] = Field(default_factory=list)
    """Slow servers: ``[{node, factor}]``, every GPU of the node slowed alike (they share one
    new rank class per class they came from). A rank also in ``slow_gpus``: factors multiply."""
    slow_links: list[SlowLink] = Field(default_factory=list)
    """Degraded NIC links: ``[{node, nic, factor}]``. A flapping link that is down a share
    ``d`` of the time averages to ``factor = 1 / (1 - d)``."""
    failed_links: list[FailedLink] = Field(default_factory=list)
    """Failed NIC links: ``[{node, nic}]``; their traffic falls back to the node's other NICs."""
    seed: int = 0
    """Salt of the one random choice here: which of the equally near remaining NICs takes a
    failed NIC's traffic. Same seed, same numbers."""
    jitter: Jitter | None = None
    """Step-to-step variation of the GPUs' compute (:class:`Jitter`), for runs of many steps
    (``--steps N``): stragglers that change from step to step."""

    @model_validator(mode="after")
    def _no_duplicates(self) -> Faults:
        ranks = [g.rank for g in self.slow_gpus]
        if len(set(ranks)) != len(ranks):
            raise ValueError("faults.slow_gpus: a rank is listed twice")
        nodes = [x.node for x in self.slow_nodes]
        if len(set(nodes)) != len(nodes):
            raise ValueError("faults.slow_nodes: a node is listed twice")
        for key, items in (("slow_links", self.slow_links), ("failed_links", self.failed_links)):
            nics = [(x.node, x.nic) for x in items]
            if len(set(nics)) != len(nics):
                raise ValueError(f"faults.{key}: a (node, nic) is listed twice")
        both = {(x.node, x.nic) for x in self.slow_links} & {
            (x.node, x.nic) for x in self.failed_links}
        if both:
            node, nic = sorted(both)[0]
            raise ValueError(f"faults.failed_links: node {node} nic {nic} is also a slow link")
        return self

    @property
    def empty(self) -> bool:
        """No fault at all: the run is exactly the one without the block (a jitter of
        ``sigma: 0`` included)."""
        return not (self.slow_gpus or self.slow_nodes or self.slow_links or self.failed_links
                    or (self.jitter is not None and self.jitter.sigma > 0))

    def gpu_factors(self, gpus_per_node: int) -> dict[int, float]:
        """Each slowed rank's compute factor: ``slow_gpus`` and ``slow_nodes`` together.

        Examples
        --------
        >>> f = Faults(slow_gpus=[{"rank": 5, "factor": 2}],
        ...            slow_nodes=[{"node": 1, "factor": 1.5}])
        >>> f.gpu_factors(4)
        {5: 3.0, 4: 1.5, 6: 1.5, 7: 1.5}
        """
        out = {g.rank: g.factor for g in self.slow_gpus}
        for x in self.slow_nodes:
            for r in range(x.node * gpus_per_node, (x.node + 1) * gpus_per_node):
                out[r] = out.get(r, 1.0) * x.factor
        return out


def check_faults(faults: Faults | None, nodes: int, gpus_per_node: int, nics_per_node: int,
                 origin: str = "<scenario>") -> None:
    """Raise :class:`ScenarioError` (one line naming the key) when a fault names a rank, node or
    NIC the cluster does not have, or fails every NIC of a multi-node server.

    Examples
    --------
    >>> check_faults(Faults(slow_gpus=[{"rank": 16, "factor": 2}]), 2, 8, 8, "s.yaml")
    Traceback (most recent call last):
    ...
    sim.config.base.ScenarioError: s.yaml: faults.slow_gpus[0].rank: 16 is not a rank of the 16 GPUs
    """
    if faults is None:
        return
    n = nodes * gpus_per_node
    for i, g in enumerate(faults.slow_gpus):
        if g.rank >= n:
            raise ScenarioError(f"{origin}: faults.slow_gpus[{i}].rank: {g.rank} is not a rank "
                                f"of the {n} GPUs")
    links: tuple[tuple[str, Sequence[SlowLink | FailedLink]], ...] = (
        ("slow_links", faults.slow_links), ("failed_links", faults.failed_links))
    for i, sn in enumerate(faults.slow_nodes):
        if sn.node >= nodes:
            raise ScenarioError(f"{origin}: faults.slow_nodes[{i}].node: {sn.node} is not one of "
                                f"the {nodes} servers")
    for key, items in links:
        for i, x in enumerate(items):
            if x.node >= nodes:
                raise ScenarioError(f"{origin}: faults.{key}[{i}].node: {x.node} is not one of "
                                    f"the {nodes} servers")
            if x.nic >= nics_per_node:
                raise ScenarioError(f"{origin}: faults.{key}[{i}].nic: {x.nic} is not one of "
                                    f"the {nics_per_node} NICs per server")
    down: dict[int, int] = {}
    for x in faults.failed_links:
        down[x.node] = down.get(x.node, 0) + 1
        if down[x.node] == nics_per_node and nodes > 1:
            raise ScenarioError(f"{origin}: faults.failed_links: every NIC of node {x.node} "
                                "failed; it cannot reach the other servers")
