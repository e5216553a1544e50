"""Verdicts on published figures: consistent, off by N%, or physically impossible (and why).

Physics first, then the simulation:

- A rate (tokens/s, step time, run hours, run cost) is impossible when the model FLOPs it
  implies exceed the GPU's dense peak for the precision.
- Any performance figure is impossible for a setup that cannot run: when the parameters,
  gradients and optimizer states the scenario keeps on each GPU alone exceed the GPU's memory.
- A memory figure is impossible below those states or above the GPU's memory.
- A traffic figure is impossible above the line rate of the links that must carry it: NVLink
  per GPU per direction, the links between availability zones.
- A fraction of the step (MFU, exposed communication, pipeline bubble) cannot exceed 1.

Otherwise the claim is compared with the simulation: within 10% is consistent, else "off by
N%" with N = (claimed - simulated) / simulated. When the simulated run itself runs out of
memory the reason says so: the comparison is then with a run that would not fit.

:func:`judge_ratio` gives the same verdicts for claims that compare two setups (ZeRO++ against
ZeRO-3, 100 Gb/s against 400 Gb/s): the claimed ratio against the simulated one.
"""

from __future__ import annotations

import math
from typing import Any

from sim.catalog import GpuSpec
from sim.scenario import Claims, Scenario, ScenarioError

CONSISTENT_WITHIN = 0.10
GIB = float(2**30)
GB = 1e9                    # CONTRACT.md: 1 GB = 1e9 bytes
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86_400.0
# NVLink: a GPU -> NVSwitch -> GPU transfer crosses two NVLink edges of the fabric graph
# (sim/topology/fabric.py build_graph links every GPU to its node's NVSwitch), and
# bytes.nvlink counts every hop, so a GPU's own NVLink egress is half of those bytes.
NVLINK_HOPS_PER_TRANSFER = 2


def _num(x: float) -> str:
    """Four significant figures, thousands separated, no exponent below 1e15.

    >>> _num(12400.0), _num(8248.1), _num(0.31245), _num(409.6)
    ('12,400', '8,248', '0.3125', '409.6')
    """
    if x == 0 or abs(x) >= 1e15:
        return f"{x:.4g}"
    digits = max(0, 3 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


MEMORY_KIND_KEY = {"reserved": "peak_reserved_gib", "allocated": "peak_memory_gib",
                   "nvidia_smi": "peak_nvidia_smi_gib"}
"""The summary key of each kind of peak memory a claim may quote."""


def verdict(metric: str, claimed: float, simulated: float,
            impossible: str | None = None, note: str | None = None) -> dict[str, Any]:
    """One verdict: physically impossible (with ``impossible`` as the reason), consistent
    within 10% of ``simulated``, or off by N%. ``note`` is appended to a comparison's reason.

    Examples
    --------
    >>> verdict("mfu", 0.44, 0.40)["verdict"]
    'consistent'
    >>> verdict("mfu", 0.60, 0.40)["verdict"]
    'off by +50%'
    """
    if impossible:
        v, reason = "physically impossible", impossible
    else:
        err = (claimed - simulated) / simulated if simulated else float("inf")
        if abs(err) <= CONSISTENT_WITHIN:
            v, reason = "consistent", f"within {CONSISTENT_WITHIN:.0%} of the simulation"
        else:
            v = f"off by {err:+.0%}"
            reason = f"claimed {_num(claimed)} vs simulated {_num(simulated)}"
        if note:
            reason = f"{reason}; {note}"
    return {"metric": metric, "claimed": claimed, "simulated": simulated,
            "verdict": v, "reason": reason}


def judge_ratio(metric: str, claimed: float, simulated: float,
                impossible: str | None = None) -> dict[str, Any]:
    """Verdict on a claim that compares two setups (``claimed`` = the claimed ratio of a
    figure between them, ``simulated`` = the ratio of the two simulations' figures)."""
    return verdict(metric, claimed, simulated, impossible)


def flops_bound(tokens_per_s_per_gpu: float, flops_per_token: float, gpu: GpuSpec,
                precision: str) -> str | None:
    """Why a per-GPU token rate is impossible (its model FLOPs above the dense peak), or None.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.model import ModelSpec
    >>> f = ModelSpec.from_ref("llama3-70b").model_flops_per_token(4096)
    >>> flops_bound(2910, f, catalog.gpu("h100-sxm"), "bf16")[:41]
    'needs 1,260 TFLOP/s per GPU of model math'
    >>> flops_bound(900, f, catalog.gpu("h100-sxm"), "bf16") is None
    True
    """
    peak = gpu.peak_flops(precision)
    need = tokens_per_s_per_gpu * flops_per_token
    if need > peak:
        return (f"needs {need / 1e12:,.0f} TFLOP/s per GPU of model math "
                f"({flops_per_token / 1e9:,.1f} GFLOP per token), above the "
                f"{gpu.name}'s dense {precision} peak of {peak / 1e12:,.0f} TFLOP/s")
    return None


def zone_link_bytes_per_s(scenario: Scenario) -> float | None:
    """Most bytes per second that can cross availability-zone boundaries: every ordered pair
    of populated zones of one region has its own ``az_link_gbps`` link per direction
    (sim/topology/fabric.py: zone gateways of a region joined pairwise). None with one zone.

    Examples
    --------
    >>> s = Scenario(model="llama3-8b", cluster={"nodes": 8, "azs": 2, "az_link_gbps": 800})
    >>> zone_link_bytes_per_s(s) / 1e9      # 2 directions x 800 Gb/s / 8
    200.0
    """
    c = scenario.cluster
    zones = min(c.azs, c.nodes)
    pairs = sum(1 for a in range(zones) for b in range(zones)
                if a != b and a % c.regions == b % c.regions)
    return pairs * c.az_link_gbps * 1e9 / 8 if pairs else None


def judge(claims: Claims, summary: dict[str, Any], gpu: GpuSpec, precision: str,
          flops_per_token: float, model_state_bytes: float,
          scenario: Scenario | None = None) -> list[dict[str, Any]]:
    """One verdict per claimed figure.

    Parameters
    ----------
    claims : Claims
        The scenario's ``claims`` block.
    summary : dict
        The simulation's summary object (CONTRACT.md), without ``claims``.
    gpu : GpuSpec
        The scenario's GPU.
    precision : str
        ``training.precision``: whose dense peak bounds the throughput.
    flops_per_token : float
        Model FLOPs per trained token (6 x parameters + causal attention).
    model_state_bytes : float
        Parameters, gradients and optimizer states each GPU keeps under the scenario's
        sharding and offload.
    scenario : Scenario, optional
        The scenario, for the claims bounded by its fabric and prices (the zone links, the
        NVLink rate when the scenario overrides the GPU's); without it those bounds are
        skipped, except NVLink, which falls back to the GPU's datasheet rate.

    Returns
    -------
    list of dict
        ``{metric, claimed, simulated, verdict, reason}`` in the order of CONTRACT.md's
        summary keys, then the Claims fields added since.

    Raises
    ------
    ScenarioError
        A run-length claim (``run_hours``, ``run_usd``) without ``training.tokens_total``.
    """
    out: list[dict[str, Any]] = []
    gpus = summary["gpus"]
    step = summary["step_time_s"]
    mem_cap = gpu.usable_memory_gib
    params = summary.get("model_params")

    def states_text(unit: float = GIB, name: str = "GiB") -> str:
        text = f"{model_state_bytes / unit:.1f} {name} per GPU"
        if params:
            # Bytes per parameter over the whole job: 16 for bf16 training with fp32 master
            # weights, gradients and Adam moments, however they are sharded.
            text += (f" ({model_state_bytes * gpus / params:.1f} bytes per parameter x "
                     f"{params / 1e9:.1f}e9 parameters / {gpus} GPUs)")
        return text

    # A setup whose model states alone exceed the GPU cannot run at all, whatever it claims.
    cannot_run = None
    if model_state_bytes > gpu.usable_memory_bytes:
        cannot_run = (f"the setup cannot run: parameters, gradients and optimizer states "
                      f"alone take {states_text()}, above the {gpu.name}'s {mem_cap:.1f} GiB")
    oom_note = None
    if summary.get("oom") and cannot_run is None:
        smi = summary.get("peak_nvidia_smi_gib", summary["peak_memory_gib"])
        oom_note = (f"the simulated run does not fit ({smi:.1f} GiB "
                    f"at its peak, above the {gpu.name}'s {mem_cap:.1f} GiB)")

    def both(*reasons: str | None) -> str | None:
        found = [r for r in reasons if r]
        return "; ".join(found) if found else None

    def perf(metric: str, claimed: float, simulated: float,
             impossible: str | None = None) -> None:
        out.append(verdict(metric, claimed, simulated, both(impossible, cannot_run), oom_note))

    def rate(tok_per_gpu: float) -> str | None:
        return flops_bound(tok_per_gpu, flops_per_token, gpu, precision)

    def fraction(name: str, c: float) -> str | None:
        return f"{name} cannot exceed 1" if c > 1 else None

    def memory(gib: float) -> str | None:
        if gib > mem_cap:
            return f"above the {gpu.name}'s {mem_cap:.1f} GiB of memory"
        if gib * GIB < model_state_bytes:
            return (f"parameters, gradients and optimizer states alone need "
                    f"{model_state_bytes / GIB:.1f} GiB per GPU with this sharding")
        return None

    def tokens_total(metric: str) -> float:
        hours = summary["cost"].get("run_hours")
        if hours is None:
            raise ScenarioError(f"claims.{metric}: needs training.tokens_total (the tokens of "
                                "the claimed run)")
        return float(hours) * SECONDS_PER_HOUR * summary["tokens_per_s"]

    zone_cap = zone_link_bytes_per_s(scenario) if scenario is not None else None

    def zone_bound(bytes_per_day: float, what: str) -> str | None:
        if zone_cap is not None and bytes_per_day > zone_cap * SECONDS_PER_DAY:
            return (f"{what} {bytes_per_day / 1e12:,.0f} TB a day across the zone boundary, "
                    f"above the {zone_cap * SECONDS_PER_DAY / 1e12:,.0f} TB a day the links "
                    f"between the zones carry at line rate")
        return None

    if claims.tokens_per_s_per_gpu is not None:
        c = claims.tokens_per_s_per_gpu
        perf("tokens_per_s_per_gpu", c, summary["tokens_per_s_per_gpu"], rate(c))
    if claims.tokens_per_s is not None:
        c = claims.tokens_per_s
        perf("tokens_per_s", c, summary["tokens_per_s"], rate(c / gpus))
    if claims.step_time_s is not None:
        c = claims.step_time_s
        perf("step_time_s", c, step, rate(summary["tokens_per_step"] / c / gpus))
    if claims.mfu is not None:
        c = claims.mfu
        perf("mfu", c, summary["mfu"], fraction("MFU", c))
    # The simulated peak of the kind the claim quotes (reserved unless it says otherwise).
    kind = getattr(claims, "peak_memory_kind", "reserved")
    sim_mem = summary.get(MEMORY_KIND_KEY[kind], summary["peak_memory_gib"])
    kind_note = f"against the simulated {kind.replace('_', '-')} peak"
    if claims.peak_memory_gib is not None:
        c = claims.peak_memory_gib
        out.append(verdict("peak_memory_gib", c, sim_mem, memory(c), kind_note))
    if claims.peak_memory_gb is not None:
        c = claims.peak_memory_gb
        out.append(verdict("peak_memory_gb", c, sim_mem * GIB / GB, memory(c * GB / GIB),
                           kind_note))
    if claims.model_state_memory_gb is not None:
        c = claims.model_state_memory_gb
        low = None
        if c * GB < model_state_bytes:
            low = (f"the parameters, gradients and optimizer states of this setup take "
                   f"{states_text(GB, 'GB')}")
        out.append(verdict("model_state_memory_gb", c, model_state_bytes / GB, low))
    if claims.exposed_comm_fraction is not None:
        c = claims.exposed_comm_fraction
        perf("exposed_comm_fraction", c, summary["exposed_comm_s"] / step,
             fraction("a share of the step", c))
    if claims.bubble_fraction is not None:
        c = claims.bubble_fraction
        perf("bubble_fraction", c, summary["bubble_fraction"],
             fraction("a share of the step", c))
    if claims.run_hours is not None:
        c = claims.run_hours
        tokens = tokens_total("run_hours")
        perf("run_hours", c, summary["cost"]["run_hours"],
             rate(tokens / (c * SECONDS_PER_HOUR) / gpus))
    if claims.run_usd is not None:
        c = claims.run_usd
        tokens = tokens_total("run_usd")
        # The GPUs alone cost usd_per_hour: the claimed dollars buy at most c / usd_per_hour
        # hours, so the run must go at least this fast.
        hours = c / summary["cost"]["usd_per_hour"]
        perf("run_usd", c, summary["cost"]["run_usd"],
             rate(tokens / (hours * SECONDS_PER_HOUR) / gpus))
    if claims.cross_az_bytes_per_day is not None:
        c = claims.cross_az_bytes_per_day
        perf("cross_az_bytes_per_day", c, summary["bytes"]["cross_az"] / step * SECONDS_PER_DAY,
             zone_bound(c, "moving"))
    if claims.egress_usd_per_day is not None:
        c = claims.egress_usd_per_day
        price = summary["cost"].get("egress_usd_per_gb")
        if price is None and scenario is not None:
            price = scenario.pricing.egress_usd_per_gb
        bound = zone_bound(c / price * GB, "buying") if price else None
        perf("egress_usd_per_day", c,
             summary["cost"]["egress_usd_per_step"] / step * SECONDS_PER_DAY, bound)
    if claims.nvlink_gbytes_per_s is not None:
        c = claims.nvlink_gbytes_per_s
        line = gpu.nvlink_gbytes_per_s
        if scenario is not None and scenario.cluster.nvlink_gbytes_per_s is not None:
            line = scenario.cluster.nvlink_gbytes_per_s
        over = None
        if c > line:
            over = (f"above NVLink's line rate of {line:,.0f} GB/s per GPU per direction on "
                    f"this {gpu.name} node")
        simulated = (summary["bytes"]["nvlink"] / NVLINK_HOPS_PER_TRANSFER / gpus / step / GB)
        perf("nvlink_gbytes_per_s", c, simulated, over)
    return out
