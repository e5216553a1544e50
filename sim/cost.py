"""Cost of a step and of a run: GPU time at the hourly price, plus billed transfer.

Bytes are counted once per boundary they cross (the network counts one ``cross_az`` or
``cross_region`` hop per crossing; a route between regions crosses no zone link), which is
how clouds bill transfer: zone crossings at ``pricing.egress_usd_per_gb``, region crossings
at ``pricing.region_egress_usd_per_gb`` (1 GB = 1e9 bytes).
"""

from __future__ import annotations

from sim.catalog import GpuSpec
from sim.scenario import Scenario


def gpu_hour_usd(scenario: Scenario, gpu: GpuSpec) -> float:
    """The scenario's price per GPU-hour, or the catalogue's reference price."""
    price = scenario.pricing.gpu_hour_usd
    return gpu.reference_gpu_hour_usd if price is None else price


def cost_summary(scenario: Scenario, gpu: GpuSpec, step_time_s: float, tokens_per_step: float,
                 cross_az_bytes_per_step: float, cross_region_bytes_per_step: float = 0.0
                 ) -> dict[str, float | None]:
    """The ``cost`` object of the summary.

    Examples
    --------
    >>> from sim.scenario import Scenario
    >>> from sim import catalog
    >>> s = Scenario(model="llama3-8b", pricing={"gpu_hour_usd": 2.0, "egress_usd_per_gb": 0.01})
    >>> c = cost_summary(s, catalog.gpu("h100-sxm"), 3.6, 1e6, 5e9)
    >>> round(c["usd_per_hour"], 2), round(c["egress_usd_per_step"], 4), round(c["usd_per_step"], 4)
    (16.0, 0.05, 0.066)
    """
    per_hour = gpu_hour_usd(scenario, gpu) * scenario.gpus
    egress = (cross_az_bytes_per_step / 1e9 * scenario.pricing.egress_usd_per_gb
              + cross_region_bytes_per_step / 1e9 * scenario.pricing.region_egress_usd_per_gb)
    per_step = per_hour * step_time_s / 3600.0 + egress
    total = scenario.training.tokens_total
    run_hours = run_usd = None
    if total is not None and step_time_s > 0:
        steps = total / tokens_per_step
        run_hours = steps * step_time_s / 3600.0
        run_usd = steps * per_step
    return {
        "usd_per_hour": per_hour,
        "usd_per_step": per_step,
        "egress_usd_per_step": egress,
        "usd_per_million_tokens": per_step / tokens_per_step * 1e6,
        "run_hours": run_hours,
        "run_usd": run_usd,
    }
