"""Catalogues: GPUs and models as data files, each value with its source.

The YAML files beside this module are the data; this module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

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


@cache
def _load(name: str) -> dict[str, Any]:
    with open(CATALOG_DIR / name) as fh:
        data = yaml.safe_load(fh)
    assert isinstance(data, dict)
    return data


def gpu(key: str) -> GpuSpec:
    """The catalogue entry of a GPU.

    Examples
    --------
    >>> gpu("h100-sxm").peak_flops("bf16")
    989400000000000.0
    """
    entry = dict(_load("gpus.yaml")[key])
    entry["sources"] = tuple(entry.get("sources", ()))
    return GpuSpec(key=key, **entry)


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
