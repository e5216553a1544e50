"""Cost of a step, a day and a run: GPU time at the hourly price, plus billed transfer.

Bytes are counted once per boundary they cross (the network counts one ``cross_az`` or
``cross_region`` hop per crossing; a route between regions crosses no zone link), which is
how clouds bill transfer: zone crossings at ``egress_usd_per_gb``, region crossings at
``region_egress_usd_per_gb``, each the price of one GB (1e9 bytes) crossing, both ends'
charges included (AWS bills $0.01/GB out of one zone and $0.01/GB into the other, so $0.02).

Where the prices come from (:func:`resolve_pricing`), first match wins:

- GPU-hour: ``pricing.gpu_hour_usd``; else the named ``pricing.instance``'s on-demand price
  over its GPUs (``sim/catalog/pricing.yaml``); else the GPU catalogue's reference price.
- Transfer: ``pricing.egress_usd_per_gb`` / ``region_egress_usd_per_gb`` when the scenario
  sets them; else the instance's (or ``pricing.cloud``'s) catalogue price; else the fields'
  defaults ($0.01 and $0.02).

A day is 24 hours of every GPU plus the transfer of as many steps as fit in 24 hours at the
simulated step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim import catalog
from sim.analysis.summary import Cost
from sim.catalog import GpuSpec
from sim.scenario import Pricing, Scenario, ScenarioError

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86_400.0   # 24 h
BYTES_PER_GB = 1e9           # CONTRACT.md: 1 GB = 1e9 bytes


@dataclass(frozen=True)
class ResolvedPricing:
    """The prices a scenario is charged at, after the catalogue and the defaults."""

    gpu_hour_usd: float
    """Per GPU-hour."""
    egress_usd_per_gb: float
    """Per GB crossing a zone boundary (both ends' charges)."""
    region_egress_usd_per_gb: float
    """Per GB crossing a region boundary."""
    instance: str | None
    """The catalogue instance the GPU price came from, if any."""
    cloud: str | None
    """The cloud whose transfer prices apply, if any."""


def _fail(origin: str | None, message: str) -> ScenarioError:
    return ScenarioError(f"{origin}: {message}" if origin else message)


def resolve_pricing(scenario: Scenario, gpu: GpuSpec | None = None,
                    origin: str | None = None) -> ResolvedPricing:
    """The scenario's prices, taking the catalogue's where the scenario gives none.

    Raises ScenarioError (one line naming ``pricing.instance`` or ``pricing.cloud``) for an
    unknown instance, an instance whose GPU is not ``cluster.gpu``, or an instance of another
    cloud than ``pricing.cloud``.

    Examples
    --------
    >>> from sim.scenario import Scenario
    >>> s = Scenario(model="llama3-8b", pricing={"instance": "aws-p5.48xlarge"})
    >>> p = resolve_pricing(s)
    >>> round(p.gpu_hour_usd, 2), round(p.egress_usd_per_gb, 4), p.cloud
    (6.88, 0.02, 'aws')
    """
    pricing: Pricing = scenario.pricing
    gpu = gpu if gpu is not None else catalog.gpu(scenario.cluster.gpu)
    cloud: str | None = pricing.cloud
    instance_gpu_hour: float | None = None
    if pricing.instance is not None:
        if pricing.instance not in catalog.instance_names():
            raise _fail(origin, f"pricing.instance: unknown instance {pricing.instance!r} "
                                f"(known: {', '.join(catalog.instance_names())})")
        inst = catalog.instance_price(pricing.instance)
        if inst.gpu != scenario.cluster.gpu:
            raise _fail(origin, f"pricing.instance: {inst.key} has {inst.gpu} GPUs but "
                                f"cluster.gpu is {scenario.cluster.gpu}")
        if cloud is not None and cloud != inst.cloud:
            raise _fail(origin, f"pricing.cloud: {cloud} but pricing.instance {inst.key} "
                                f"is on {inst.cloud}")
        cloud = inst.cloud
        instance_gpu_hour = inst.usd_per_gpu_hour

    if pricing.gpu_hour_usd is not None:
        gpu_hour = pricing.gpu_hour_usd
    elif instance_gpu_hour is not None:
        gpu_hour = instance_gpu_hour
    else:
        gpu_hour = gpu.reference_gpu_hour_usd

    # A transfer price the scenario states wins; pydantic records which fields were given.
    given = pricing.model_fields_set
    zone = pricing.egress_usd_per_gb
    region = pricing.region_egress_usd_per_gb
    if cloud is not None:
        prices = catalog.cloud_prices(cloud)
        if "egress_usd_per_gb" not in given and prices.cross_zone is not None:
            zone = prices.cross_zone.usd_per_gb_crossed
        if "region_egress_usd_per_gb" not in given and prices.cross_region is not None:
            region = prices.cross_region.usd_per_gb_crossed
    return ResolvedPricing(gpu_hour_usd=gpu_hour, egress_usd_per_gb=zone,
                           region_egress_usd_per_gb=region, instance=pricing.instance,
                           cloud=cloud)


def gpu_hour_usd(scenario: Scenario, gpu: GpuSpec) -> float:
    """The scenario's price per GPU-hour: its own, its instance's, or the GPU catalogue's."""
    return resolve_pricing(scenario, gpu).gpu_hour_usd


def cost_summary(scenario: Scenario, gpu: GpuSpec, step_time_s: float, tokens_per_step: float,
                 cross_az_bytes_per_step: float, cross_region_bytes_per_step: float = 0.0
                 ) -> Cost:
    """The ``cost`` object of the summary.

    Keys (CONTRACT.md ones first; the rest added by the FinOps work, never renamed):
    ``usd_per_hour`` (all GPUs), ``usd_per_step`` (GPU time + transfer),
    ``egress_usd_per_step``, ``usd_per_million_tokens``, ``run_hours``/``run_usd`` (null without
    ``training.tokens_total``), ``usd_per_day`` (24 h of GPUs + a day of steps' transfer),
    ``egress_gb_per_step`` (GB billed: zone plus region crossings), ``egress_gb_per_day``,
    ``egress_usd_per_day``, ``gpu_hour_usd``, ``egress_usd_per_gb`` (per GB crossing a zone
    boundary), ``region_egress_usd_per_gb`` (per GB crossing a region boundary) and
    ``instance`` (the catalogue instance, or null).

    Examples
    --------
    >>> from sim.scenario import Scenario
    >>> from sim import catalog
    >>> s = Scenario(model="llama3-8b", pricing={"gpu_hour_usd": 2.0, "egress_usd_per_gb": 0.01})
    >>> c = cost_summary(s, catalog.gpu("h100-sxm"), 3.6, 1e6, 5e9)
    >>> round(c["usd_per_hour"], 2), round(c["egress_usd_per_step"], 4), round(c["usd_per_step"], 4)
    (16.0, 0.05, 0.066)
    >>> round(c["usd_per_day"], 2)     # 16 $/h x 24 h + 24,000 steps x $0.05
    1584.0
    """
    prices = resolve_pricing(scenario, gpu)
    per_hour = prices.gpu_hour_usd * scenario.gpus
    zone_gb = cross_az_bytes_per_step / BYTES_PER_GB
    region_gb = cross_region_bytes_per_step / BYTES_PER_GB
    egress = zone_gb * prices.egress_usd_per_gb + region_gb * prices.region_egress_usd_per_gb
    per_step = per_hour * step_time_s / SECONDS_PER_HOUR + egress
    total = scenario.training.tokens_total
    run_hours = run_usd = None
    if total is not None and step_time_s > 0:
        steps = total / tokens_per_step
        run_hours = steps * step_time_s / SECONDS_PER_HOUR
        run_usd = steps * per_step
    steps_per_day = SECONDS_PER_DAY / step_time_s if step_time_s > 0 else 0.0
    egress_usd_per_day = egress * steps_per_day
    return {
        "usd_per_hour": per_hour,
        "usd_per_step": per_step,
        "egress_usd_per_step": egress,
        "usd_per_million_tokens": per_step / tokens_per_step * 1e6,
        "run_hours": run_hours,
        "run_usd": run_usd,
        "usd_per_day": per_hour * SECONDS_PER_DAY / SECONDS_PER_HOUR + egress_usd_per_day,
        "egress_gb_per_step": zone_gb + region_gb,
        "egress_gb_per_day": (zone_gb + region_gb) * steps_per_day,
        "egress_usd_per_day": egress_usd_per_day,
        "gpu_hour_usd": prices.gpu_hour_usd,
        "egress_usd_per_gb": prices.egress_usd_per_gb,
        "region_egress_usd_per_gb": prices.region_egress_usd_per_gb,
        "instance": prices.instance,
    }
