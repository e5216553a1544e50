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

Each kind of claim has its own small judge (:data:`JUDGES`), reading what they share (the
summary, the GPU, whether the setup can run) from one frozen context.

:func:`judge_ratio` gives the same verdicts for claims that compare two setups (ZeRO++ against
ZeRO-3, 100 Gb/s against 400 Gb/s): the claimed ratio against the simulated one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from sim.analysis.summary import Claim, Summary
from sim.catalog import GpuSpec
from sim.scenario import Claims, Scenario, ScenarioError

CONSISTENT_WITHIN = 0.10
GIB = float(2**30)
GB = 1e9                    # CONTRACT.md: 1 GB = 1e9 bytes
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86_400.0
# NVLink: a GPU -> NVSwitch -> GPU transfer crosses two NVLink edges of the fabric graph
# (sim/fabric/topology/graph.py build_graph links every GPU to its node's NVSwitch), and
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


def peak_of_kind(summary: Summary, kind: str) -> float:
    """The simulated peak memory (GiB) of the kind a claim quotes (:data:`MEMORY_KIND_KEY`);
    the allocated peak when a summary written by hand lacks that key.

    Examples
    --------
    >>> peak_of_kind({"peak_memory_gib": 50.0, "peak_reserved_gib": 52.0}, "reserved")
    52.0
    """
    peaks: Mapping[str, object] = summary
    value = peaks.get(MEMORY_KIND_KEY[kind], summary["peak_memory_gib"])
    assert isinstance(value, float | int)
    return float(value)


def verdict(metric: str, claimed: float, simulated: float,
            impossible: str | None = None, note: str | None = None) -> Claim:
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
                impossible: str | None = None) -> Claim:
    """Verdict on a claim that compares two setups (``claimed`` = the claimed ratio of a
    figure between them, ``simulated`` = the ratio of the two simulations' figures)."""
    return verdict(metric, claimed, simulated, impossible)


def flops_bound(tokens_per_s_per_gpu: float, flops_per_token: float, gpu: GpuSpec,
                precision: str) -> str | None:
    """Why a per-GPU token rate is impossible (its model FLOPs above the dense peak), or None.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.workload.model import ModelSpec
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
    (sim/fabric/topology/graph.py: zone gateways of a region joined pairwise). None with one zone.

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


@dataclass(frozen=True)
class _Judge:
    """What every claim's verdict reads: the run's summary, the GPU and its bounds, and
    whether the setup can run at all (see :func:`judge` for the arguments)."""

    summary: Summary
    gpu: GpuSpec
    precision: str
    flops_per_token: float
    model_state_bytes: float
    scenario: Scenario | None
    sim_mem: float
    """The simulated peak of the kind the memory claims quote (reserved unless they say
    otherwise)."""
    kind_note: str

    @classmethod
    def make(cls, claims: Claims, summary: Summary, gpu: GpuSpec, precision: str,
             flops_per_token: float, model_state_bytes: float,
             scenario: Scenario | None) -> _Judge:
        kind = getattr(claims, "peak_memory_kind", "reserved")
        return cls(summary, gpu, precision, flops_per_token, model_state_bytes, scenario,
                   peak_of_kind(summary, kind),
                   f"against the simulated {kind.replace('_', '-')} peak")

    @property
    def gpus(self) -> int:
        """GPUs in the job (the summary's value, as it is)."""
        return self.summary["gpus"]

    @property
    def step(self) -> float:
        """Simulated step time, seconds (the summary's value, as it is)."""
        return self.summary["step_time_s"]

    @property
    def mem_cap(self) -> float:
        return self.gpu.usable_memory_gib

    def states_text(self, unit: float = GIB, name: str = "GiB") -> str:
        text = f"{self.model_state_bytes / unit:.1f} {name} per GPU"
        params = self.summary.get("model_params")
        if params:
            # Bytes per parameter over the whole job: 16 for bf16 training with fp32 master
            # weights, gradients and Adam moments, however they are sharded.
            text += (f" ({self.model_state_bytes * self.gpus / params:.1f} bytes per "
                     f"parameter x {params / 1e9:.1f}e9 parameters / {self.gpus} GPUs)")
        return text

    def cannot_run(self) -> str | None:
        """A setup whose model states alone exceed the GPU cannot run at all, whatever it
        claims."""
        if self.model_state_bytes > self.gpu.usable_memory_bytes:
            return (f"the setup cannot run: parameters, gradients and optimizer states "
                    f"alone take {self.states_text()}, above the {self.gpu.name}'s "
                    f"{self.mem_cap:.1f} GiB")
        return None

    def oom_note(self) -> str | None:
        """The simulated run itself does not fit (and the setup could run)."""
        if self.summary.get("oom") and self.cannot_run() is None:
            smi = self.summary.get("peak_nvidia_smi_gib", self.summary["peak_memory_gib"])
            return (f"the simulated run does not fit ({smi:.1f} GiB "
                    f"at its peak, above the {self.gpu.name}'s {self.mem_cap:.1f} GiB)")
        return None

    def perf(self, metric: str, claimed: float, simulated: float,
             impossible: str | None = None) -> Claim:
        """Verdict on a performance figure: impossible too when the setup cannot run."""
        found = [r for r in (impossible, self.cannot_run()) if r]
        return verdict(metric, claimed, simulated, "; ".join(found) if found else None,
                       self.oom_note())

    def rate(self, tok_per_gpu: float) -> str | None:
        return flops_bound(tok_per_gpu, self.flops_per_token, self.gpu, self.precision)

    def memory(self, gib: float) -> str | None:
        if gib > self.mem_cap:
            return f"above the {self.gpu.name}'s {self.mem_cap:.1f} GiB of memory"
        if gib * GIB < self.model_state_bytes:
            return (f"parameters, gradients and optimizer states alone need "
                    f"{self.model_state_bytes / GIB:.1f} GiB per GPU with this sharding")
        return None

    def tokens_total(self, metric: str) -> float:
        hours = self.summary["cost"].get("run_hours")
        if hours is None:
            raise ScenarioError(f"claims.{metric}: needs training.tokens_total (the tokens of "
                                "the claimed run)")
        return float(hours) * SECONDS_PER_HOUR * self.summary["tokens_per_s"]

    def run_figure(self, metric: Literal["run_hours", "run_usd"]) -> float:
        """The simulated run's hours or dollars (:meth:`tokens_total` has checked that the
        summary has them)."""
        value = self.summary["cost"][metric]
        assert value is not None
        return value

    def zone_bound(self, bytes_per_day: float, what: str) -> str | None:
        cap = zone_link_bytes_per_s(self.scenario) if self.scenario is not None else None
        if cap is not None and bytes_per_day > cap * SECONDS_PER_DAY:
            return (f"{what} {bytes_per_day / 1e12:,.0f} TB a day across the zone boundary, "
                    f"above the {cap * SECONDS_PER_DAY / 1e12:,.0f} TB a day the links "
                    f"between the zones carry at line rate")
        return None


def _fraction(name: str, c: float) -> str | None:
    return f"{name} cannot exceed 1" if c > 1 else None


# ---------------------------------------------------------------------- one judge per claim
def _tokens_per_s_per_gpu(j: _Judge, c: float) -> Claim:
    return j.perf("tokens_per_s_per_gpu", c, j.summary["tokens_per_s_per_gpu"], j.rate(c))


def _tokens_per_s(j: _Judge, c: float) -> Claim:
    return j.perf("tokens_per_s", c, j.summary["tokens_per_s"], j.rate(c / j.gpus))


def _step_time_s(j: _Judge, c: float) -> Claim:
    return j.perf("step_time_s", c, j.step, j.rate(j.summary["tokens_per_step"] / c / j.gpus))


def _mfu(j: _Judge, c: float) -> Claim:
    return j.perf("mfu", c, j.summary["mfu"], _fraction("MFU", c))


def _peak_memory_gib(j: _Judge, c: float) -> Claim:
    return verdict("peak_memory_gib", c, j.sim_mem, j.memory(c), j.kind_note)


def _peak_memory_gb(j: _Judge, c: float) -> Claim:
    return verdict("peak_memory_gb", c, j.sim_mem * GIB / GB, j.memory(c * GB / GIB),
                   j.kind_note)


def _model_state_memory_gb(j: _Judge, c: float) -> Claim:
    low = None
    if c * GB < j.model_state_bytes:
        low = (f"the parameters, gradients and optimizer states of this setup take "
               f"{j.states_text(GB, 'GB')}")
    return verdict("model_state_memory_gb", c, j.model_state_bytes / GB, low)


def _exposed_comm_fraction(j: _Judge, c: float) -> Claim:
    return j.perf("exposed_comm_fraction", c, j.summary["exposed_comm_s"] / j.step,
                  _fraction("a share of the step", c))


def _bubble_fraction(j: _Judge, c: float) -> Claim:
    return j.perf("bubble_fraction", c, j.summary["bubble_fraction"],
                  _fraction("a share of the step", c))


def _run_hours(j: _Judge, c: float) -> Claim:
    tokens = j.tokens_total("run_hours")
    return j.perf("run_hours", c, j.run_figure("run_hours"),
                  j.rate(tokens / (c * SECONDS_PER_HOUR) / j.gpus))


def _run_usd(j: _Judge, c: float) -> Claim:
    tokens = j.tokens_total("run_usd")
    # The GPUs alone cost usd_per_hour: the claimed dollars buy at most c / usd_per_hour
    # hours, so the run must go at least this fast.
    hours = c / j.summary["cost"]["usd_per_hour"]
    return j.perf("run_usd", c, j.run_figure("run_usd"),
                  j.rate(tokens / (hours * SECONDS_PER_HOUR) / j.gpus))


def _cross_az_bytes_per_day(j: _Judge, c: float) -> Claim:
    return j.perf("cross_az_bytes_per_day", c,
                  j.summary["bytes"]["cross_az"] / j.step * SECONDS_PER_DAY,
                  j.zone_bound(c, "moving"))


def _egress_usd_per_day(j: _Judge, c: float) -> Claim:
    price = j.summary["cost"].get("egress_usd_per_gb")
    if price is None and j.scenario is not None:
        price = j.scenario.pricing.egress_usd_per_gb
    bound = j.zone_bound(c / price * GB, "buying") if price else None
    return j.perf("egress_usd_per_day", c,
                  j.summary["cost"]["egress_usd_per_step"] / j.step * SECONDS_PER_DAY, bound)


def _nvlink_gbytes_per_s(j: _Judge, c: float) -> Claim:
    line = j.gpu.nvlink_gbytes_per_s
    if j.scenario is not None and j.scenario.cluster.nvlink_gbytes_per_s is not None:
        line = j.scenario.cluster.nvlink_gbytes_per_s
    over = None
    if c > line:
        over = (f"above NVLink's line rate of {line:,.0f} GB/s per GPU per direction on "
                f"this {j.gpu.name} node")
    simulated = (j.summary["bytes"]["nvlink"] / NVLINK_HOPS_PER_TRANSFER / j.gpus / j.step
                 / GB)
    return j.perf("nvlink_gbytes_per_s", c, simulated, over)


JUDGES: tuple[tuple[str, Callable[[_Judge, float], Claim]], ...] = (
    ("tokens_per_s_per_gpu", _tokens_per_s_per_gpu),
    ("tokens_per_s", _tokens_per_s),
    ("step_time_s", _step_time_s),
    ("mfu", _mfu),
    ("peak_memory_gib", _peak_memory_gib),
    ("peak_memory_gb", _peak_memory_gb),
    ("model_state_memory_gb", _model_state_memory_gb),
    ("exposed_comm_fraction", _exposed_comm_fraction),
    ("bubble_fraction", _bubble_fraction),
    ("run_hours", _run_hours),
    ("run_usd", _run_usd),
    ("cross_az_bytes_per_day", _cross_az_bytes_per_day),
    ("egress_usd_per_day", _egress_usd_per_day),
    ("nvlink_gbytes_per_s", _nvlink_gbytes_per_s),
)
"""Each :class:`~sim.scenario.Claims` figure and its judge, in the order of CONTRACT.md's
summary keys, then the Claims fields added since: the order of :func:`judge`'s verdicts."""


def judge(claims: Claims, summary: Summary, gpu: GpuSpec, precision: str,
          flops_per_token: float, model_state_bytes: float,
          scenario: Scenario | None = None) -> list[Claim]:
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
    j = _Judge.make(claims, summary, gpu, precision, flops_per_token, model_state_bytes,
                    scenario)
    return [judge_one(j, c) for field, judge_one in JUDGES
            if (c := getattr(claims, field)) is not None]
