"""NCCL's all-to-all inside an NVLink 5 domain against measured nccl-tests size sweeps.

Truth: ``sim/catalog/reference/nccl.yaml``, the ``*-alltoall-sweep`` entries (OCI's GB300
NVL72 tables at 4, 8 and 64 GPUs, NCCL 2.28.7; uccl's HGX B300 table at 8 GPUs, NCCL
2.29.7). ``alltoall.P2P_NVLINK_CALL_S`` and ``P2P_NVLINK_SHARE`` are fitted on the 8-GPU GB300
sweep (``role: fit``) and checked here on the others (``role: validate``), from another lab,
another system (HGX) and other GPU counts. Without them every sweep is 10-69% fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim.apps.nccltests import Bench
from sim.fabric.collectives import alltoall

REFERENCE = Path(__file__).resolve().parents[3] / "sim" / "catalog" / "reference" / "nccl.yaml"
SWEEPS = {e["id"]: e for e in yaml.safe_load(REFERENCE.read_text())
          if e["id"].endswith("-alltoall-sweep")}
# How each sweep was measured: the shipped topology and its GPU count.
SETUPS = {"gb300-8gpu-mnnvl-alltoall-sweep": ("gb300-nvl72", 8),
          "gb300-4gpu-alltoall-sweep": ("gb300-nvl72", 4),
          "gb300-64gpu-alltoall-sweep": ("gb300-nvl72", 64),
          "b300-8gpu-alltoall-sweep": ("dgx-b300", 8)}


def _errors(sweep: str) -> list[float]:
    topology, gpus = SETUPS[sweep]
    bench = Bench.build(topology, gpus)
    return [bench.run("all_to_all", p["bytes"])["busbw_gbytes_per_s"] / p["busbw_GBps"] - 1
            for p in SWEEPS[sweep]["points"]]


def test_every_sweep_has_a_setup_and_one_is_the_fit() -> None:
    assert set(SWEEPS) == set(SETUPS)
    assert [k for k, e in SWEEPS.items() if e["role"] == "fit"] == \
        ["gb300-8gpu-mnnvl-alltoall-sweep"]


@pytest.mark.parametrize("sweep", sorted(SETUPS))
def test_sweep_within_its_tolerance(sweep: str) -> None:
    # The fit's own sweep: every point within 6% (it is 5.2% at most). The validation sweeps:
    # a mean within 10% and every point within 20% (the 64-GPU sweep's 64 MB point, 1 MB a
    # peer, sits at the edge of the step below it: +18%; the B300's worst is +12%).
    errs = _errors(sweep)
    if SWEEPS[sweep]["role"] == "fit":
        assert max(abs(e) for e in errs) < 0.06
    else:
        assert sum(abs(e) for e in errs) / len(errs) < 0.10
        assert max(abs(e) for e in errs) < 0.20


def test_without_the_call_time_and_share_every_sweep_is_far_too_fast(monkeypatch) -> None:
    # NCCL's ring share of NVLink and its p2p latency alone: 10-69% fast, 22-50% on average.
    monkeypatch.setattr(alltoall, "P2P_NVLINK_CALL_S", 0.0)
    monkeypatch.setattr(alltoall, "P2P_NVLINK_SHARE", {})
    for sweep in SETUPS:
        errs = _errors(sweep)
        assert min(errs) > 0.05
        assert sum(errs) / len(errs) > 0.2


def test_hopper_keeps_the_ring_share() -> None:
    # Only the call time applies on Hopper: 8 H100s still reach the maintainers' 370 GB/s
    # plateau (nccl.yaml h100-8gpu-alltoall, within the suite's 10%), where a 16.4 us call
    # time is 0.3% of an 8 GiB call.
    assert alltoall.nccl_nvlink_share("hopper") == 1.0
    row = Bench.build("dgx-h100", 8).run("all_to_all", 8 * 2**30)
    assert row["busbw_gbytes_per_s"] == pytest.approx(370, rel=0.02)
