"""Catalogues: GPUs and models as data files, each value with its source.

The YAML files beside this module are the data; this module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

import yaml

CATALOG_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model from ``gpus.yaml``."""

    key: str
    name: str
    arch: str
    sm_count: int
    peak_tflops: dict[str, float | None]
    memory_gib: float
    usable_memory_gib: float
    hbm_gbytes_per_s: float
    nvlink_gbytes_per_s: float
    pcie_gen: int
    pcie_gbytes_per_s: float
    reference_gpu_hour_usd: float
    matmul_efficiency: float
    sources: tuple[str, ...]
    tdp_w: float = 700.0
    """Default board power limit (datasheet max TDP), watts."""
    min_power_w: float = 200.0
    """Lowest power limit the driver accepts, watts."""
    static_w: float = 70.0
    """Draw that does not follow the SM clock (leakage, HBM, I/O), watts."""
    power_cap_w: float | None = None
    """The power cap in force (``cluster.gpu_power_w``); None = the TDP."""
    saturated_rate_factor: float = 1.0
    """Matrix throughput the part holds once its power limit binds (back-to-back GEMMs, as in
    training), over its burst throughput, relative to the same ratio on the H200 the compute
    model is fitted and checked on: 1 on Hopper. The burst figures (``matmul_efficiency``, the
    kernel reference tables) are what short benchmarks measure."""
    gemm_rate_factor: float = 1.0
    """GEMM throughput the part holds in a training node whose GPUs all run, over what the
    H200-fitted GEMM model gives it at its sustained matrix rate: 1 where unmeasured; the H100
    SXM's is fitted on NVIDIA's timings of a Megatron MoE layer on eight H100s
    (``tools/fit_h100_gemm_rate.py``). GEMMs, and Hopper's attention kernels that keep the
    tensor cores as busy (``sim.hardware.attention_cost.WGMMA_ATTENTION``); the other fused
    attention kernels keep the rates of their own measurements (``docs/calibration.md``)."""
    chip_rate_sigma: float = 0.0
    """Spread of that sustained rate between chips of the part, as a relative standard
    deviation (each die holds its own clock at the power limit); 0 where unmeasured."""
    sfu_exp_per_clock_sm: int = 16
    """Exponentials (``MUFU.EX2``) one SM's special-function units issue per clock: 16 on
    Hopper and Blackwell (FlashAttention-4, arXiv 2603.05451, sec. 3), twice that on Blackwell
    Ultra (NVIDIA technical blog "Making Softmax More Efficient with NVIDIA Blackwell Ultra",
    2026-02: "doubling SFU throughput over the standard NVIDIA Blackwell architecture").
    :mod:`sim.hardware.blackwell_attention` prices the softmax's exponentials at this rate."""
    lockstep_gpus: int = 1
    """GPUs of the job that wait on each other every step (the job's size): a synchronous
    step runs at its slowest chip's pace (:mod:`sim.hardware.power`)."""

    def power_cap_problem(self, cap_w: float) -> str | None:
        """Why the part cannot be capped at ``cap_w`` watts (below its minimum power limit,
        which ``nvidia-smi -pl`` refuses), or None when it can."""
        if cap_w < self.min_power_w:
            return (f"gpu_power_w {cap_w:g} W is below the {self.key}'s minimum power limit "
                    f"({self.min_power_w:g} W)")
        return None

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s of the matrix units for ``precision`` (bf16, fp16, fp8, fp32).

        fp32 training means TF32 tensor-core math, as PyTorch and Megatron run it on Ampere and
        later; a precision the GPU lacks (bf16 on Volta, fp8 before Hopper) falls back to the
        16-bit rate, which is what those frameworks do.
        """
        key = {"fp32": "tf32"}.get(precision, precision)
        value = self.peak_tflops.get(key)
        if value is None:
            value = self.peak_tflops.get("bf16") or self.peak_tflops["fp16"]
        assert value is not None
        return float(value) * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbytes_per_s * 1e9

    @property
    def usable_memory_bytes(self) -> float:
        return self.usable_memory_gib * 2**30


# libyaml's C parser where PyYAML was built with it (its wheels are): the same data as the pure
# Python SafeLoader, about ten times faster on the reference files (published_moe.yaml 0.47 s ->
# 0.045 s), which the validation suites and their tests read many times.
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(stream: str | bytes | IO[str]) -> Any:
    """``yaml.safe_load`` with libyaml's parser where PyYAML has it: the same data, faster.

    Examples
    --------
    >>> load_yaml("a: [1, 2]")
    {'a': [1, 2]}
    """
    return yaml.load(stream, Loader=_SAFE_LOADER)


@cache
def _load(name: str) -> dict[str, Any]:
    with open(CATALOG_DIR / name) as fh:
        data = load_yaml(fh)
    assert isinstance(data, dict)
    return data


def gpu(key: str, power_w: float | None = None, lockstep_gpus: int = 1) -> GpuSpec:
    """The catalogue entry of a GPU, optionally under a power cap of ``power_w`` watts
    (``cluster.gpu_power_w``; :mod:`sim.hardware.power` turns it into sustained clocks), in a
    job of ``lockstep_gpus`` GPUs that wait on each other.

    Examples
    --------
    >>> gpu("h100-sxm").peak_flops("bf16")
    989400000000000.0
    >>> gpu("h100-sxm", power_w=500).power_cap_w
    500.0
    """
    entry = dict(_load("gpus.yaml")[key])
    entry["sources"] = tuple(entry.get("sources", ()))
    cap = None if power_w is None else float(power_w)
    return GpuSpec(key=key, power_cap_w=cap, lockstep_gpus=int(lockstep_gpus), **entry)


def gpu_names() -> list[str]:
    return sorted(_load("gpus.yaml"))


def model_entry(key: str) -> dict[str, Any]:
    """The raw catalogue entry of a model (dimensions plus ``source``)."""
    return dict(_load("models.yaml")[key])


def model_names() -> list[str]:
    return sorted(_load("models.yaml"))


def calibration(name: str) -> dict[str, Any]:
    """A calibration data file from ``calibration/`` (JSON)."""
    import json

    with open(CATALOG_DIR / "calibration" / name) as fh:
        data = json.load(fh)
    assert isinstance(data, dict)
    return data


# --------------------------------------------------------------------------- pricing
@dataclass(frozen=True)
class InstancePrice:
    """One priced cloud instance from ``pricing.yaml``: on-demand price of the whole machine."""

    key: str
    cloud: str
    instance_type: str
    region: str
    gpu: str
    gpus: int
    usd_per_hour: float
    source: str
    source_date: str
    read_on: str

    @property
    def usd_per_gpu_hour(self) -> float:
        """The instance's hourly price shared over its GPUs (what one GPU-hour costs)."""
        return self.usd_per_hour / self.gpus


@dataclass(frozen=True)
class TransferPrice:
    """A cloud's price for data crossing one kind of boundary (zone, region)."""

    usd: float
    unit: str
    sides_billed: int
    source: str
    source_date: str
    read_on: str

    @property
    def usd_per_gb_crossed(self) -> float:
        """Dollars for one GB (1e9 bytes) crossing the boundary, both ends' charges included.

        Examples
        --------
        >>> round(cloud_prices("aws").cross_zone.usd_per_gb_crossed, 6)   # $0.01 out + $0.01 in
        0.02
        >>> round(cloud_prices("gcp").cross_zone.usd_per_gb_crossed, 6)   # $0.01 per GiB, sender
        0.009313
        """
        unit_bytes = {"GB": 1e9, "GiB": float(2**30)}[self.unit]
        return self.usd * self.sides_billed * 1e9 / unit_bytes


@dataclass(frozen=True)
class CloudPrices:
    """A cloud's transfer prices from ``pricing.yaml``; None where none could be sourced."""

    key: str
    name: str
    same_zone: TransferPrice | None
    cross_zone: TransferPrice | None
    cross_region: TransferPrice | None


def instance_price(key: str) -> InstancePrice:
    """The catalogue entry of a priced instance (KeyError if unknown).

    Examples
    --------
    >>> p = instance_price("aws-p5.48xlarge")
    >>> p.gpu, p.gpus, round(p.usd_per_gpu_hour, 2)
    ('h100-sxm', 8, 6.88)
    """
    entry = dict(_load("pricing.yaml")["instances"][key])
    return InstancePrice(key=key, **entry)


def instance_names() -> list[str]:
    return sorted(_load("pricing.yaml")["instances"])


def cloud_prices(key: str) -> CloudPrices:
    """A cloud's transfer prices (KeyError if unknown)."""
    entry = _load("pricing.yaml")["clouds"][key]
    transfer = entry.get("transfer", {})

    def price(kind: str) -> TransferPrice | None:
        raw = transfer.get(kind)
        return None if raw is None else TransferPrice(**raw)

    return CloudPrices(key=key, name=entry["name"], same_zone=price("same_zone"),
                       cross_zone=price("cross_zone"), cross_region=price("cross_region"))


def cloud_names() -> list[str]:
    return sorted(_load("pricing.yaml")["clouds"])


# --------------------------------------------------------------------------- failures
FAILURE_BASES = ("gpu", "host", "nic", "job")
"""Units a failure rate scales with (``failures.yaml``): per GPU, per server, per NIC link,
per job."""


@dataclass(frozen=True)
class FailureComponent:
    """One component of a failure catalogue: its rate per unit of its basis per day."""

    name: str
    rate_per_unit_per_day: float
    basis: str
    """One of :data:`FAILURE_BASES`."""
    needs_node: bool = False
    """The interruption takes a server out of the job (a spare replaces it)."""
    planned: bool = False
    """A stop on purpose, after a checkpoint: no work is lost."""


def failure_catalogue(name: str) -> tuple[FailureComponent, ...]:
    """The components of a failure catalogue of ``failures.yaml``, each count turned into a
    rate per unit of its basis per day over the observed units and days (KeyError if unknown).

    Examples
    --------
    >>> c = {x.name: x for x in failure_catalogue("llama3-16k-h100")}
    >>> round(c["faulty_gpu"].rate_per_unit_per_day * 16384 * 54)   # Llama 3, Table 5
    148
    """
    entry = _load("failures.yaml")[name]
    units = {"gpu": entry["gpus"], "host": entry["hosts"], "nic": entry["nics"], "job": 1}
    return tuple(
        FailureComponent(name=k, rate_per_unit_per_day=v["count"] / (units[v["basis"]]
                                                                      * entry["days"]),
                         basis=v["basis"], needs_node=bool(v.get("needs_node", False)),
                         planned=bool(v.get("planned", False)))
        for k, v in entry["components"].items())


def failure_catalogue_names() -> list[str]:
    return sorted(_load("failures.yaml"))
