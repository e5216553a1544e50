"""Fit ``P2P_NVLINK_CALL_S`` and ``P2P_NVLINK_SHARE["blackwell"]``
(``sim/fabric/collectives/alltoall.py``): the fixed time of NCCL's all-to-all inside one NVLink
domain beyond its p2p latency, and the share of NCCL's ring NVLink rate it moves bytes at.

Data: the one sweep ``sim/catalog/reference/nccl.yaml`` marks ``role: fit``, nccl-tests
``alltoall_perf`` on 8 GB300 GPUs over two trays of an NVL72 rack (OCI, NCCL 2.28.7), 16 MB to
1 GB. Each trial pair is simulated on the shipped ``gb300-nvl72`` topology through
``fabricsim collective``'s bench; the pair minimises the squared relative error of the call's
time. The other sweeps (``role: validate``) check the result
(``tests/unit/fabric/test_nvlink_alltoall_sweeps.py``); none is fitted.

Usage (from the repository root)::

    python tools/fit_nvlink_alltoall.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.apps.nccltests import Bench  # noqa: E402
from sim.fabric.collectives import alltoall  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1] / "sim" / "catalog" / "reference" / "nccl.yaml"


def main() -> None:
    fit = next(e for e in yaml.safe_load(REFERENCE.read_text()) if e.get("role") == "fit")
    bench = Bench.build("gb300-nvl72", fit["gpus"])
    points = [(p["bytes"], p["bytes"] / (p["algbw_GBps"] * 1e9)) for p in fit["points"]]

    def residuals(x: list[float]) -> list[float]:
        alltoall.P2P_NVLINK_CALL_S = x[0] * 1e-6
        alltoall.P2P_NVLINK_SHARE = {"blackwell": x[1]}
        return [bench.run("all_to_all", b)["time_s"] / t - 1 for b, t in points]

    r = least_squares(residuals, [10.0, 0.9], bounds=([0.0, 0.3], [200.0, 1.0]))
    call_us, share = r.x
    worst = max(abs(e) for e in residuals(list(r.x)))
    print(f"P2P_NVLINK_CALL_S = {call_us:.1f}e-6   P2P_NVLINK_SHARE['blackwell'] = {share:.3f}"
          f"   (worst time error on the fit sweep {100 * worst:.1f}%)")


if __name__ == "__main__":
    main()
