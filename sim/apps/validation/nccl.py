"""The ``nccl`` suite: simulated nccl-tests bus bandwidth against published points
(``sim/catalog/reference/nccl.yaml``).

Each reference entry says what was measured (fabric, GPUs, nodes, algorithm); ``SETUPS``
below says how to reproduce it: which shipped topology, how many GPUs, which operation and
algorithm, and at which message size a single figure was read (nccl-tests' large-message
plateau, 8 GiB, unless the entry gives sizes). No measured value enters the simulation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.apps.nccltests import Bench
from sim.catalog import load_yaml

REFERENCE = Path(__file__).resolve().parents[2] / "catalog" / "reference" / "nccl.yaml"
PLATEAU = 8 * 2**30

# id -> (topology, gpus, op, algo, per_nic): how each published point was measured.
SETUPS: dict[str, list[tuple[str, int, str, str, bool]]] = {
    "dgx-h100-8gpu-allreduce-curve": [("dgx-h100", 8, "all_reduce", "auto", False)],
    "h100-8gpu-ring": [("dgx-h100", 8, "all_reduce", "ring", False),
                       ("dgx-h100", 8, "all_gather", "ring", False)],
    "h100-8gpu-nvls": [("dgx-h100", 8, "all_reduce", "nvls", False)],
    # 2 nodes, ring, figure per NIC (8 NICs per node); the note's 4-node case too.
    "ndr400-per-nic": [("dgx-h100", 16, "all_reduce", "ring", True),
                       ("dgx-h100", 32, "all_reduce", "ring", True)],
    # "multi-node": 4 DGX A100.
    "dgx-a100-multinode": [("dgx-a100", 32, "all_reduce", "ring", False)],
    # ring, 3 or more nodes, per NIC.
    "hdr200-per-nic": [("dgx-a100", 24, "all_reduce", "ring", True)],
    # alltoall_perf (no algorithm choice: per-peer send/recv on PXN routes).
    "h100-8gpu-alltoall": [("dgx-h100", 8, "all_to_all", "auto", False)],
    "h100-4gpu-alltoall-measured": [("dgx-h100", 4, "all_to_all", "auto", False)],
    "ndr400-alltoall-2node": [("dgx-h100", 16, "all_to_all", "auto", False)],
    "ndr400-alltoall-4node": [("dgx-h100", 32, "all_to_all", "auto", False)],
    "cx7-alltoall-6node": [("dgx-h100", 48, "all_to_all", "auto", False)],
}


def nccl_cases() -> list[dict[str, Any]]:
    entries = load_yaml(REFERENCE.read_text())
    cases: list[dict[str, Any]] = []
    for entry in entries:
        for topology, gpus, op, algo, per_nic in SETUPS.get(entry["id"], []):
            bench = Bench.build(topology, gpus, algo)
            nics = bench.fabric.spec.nics_per_node if per_nic else 1
            if "points" in entry:
                targets = [(p["bytes"], p["busbw_GBps"]) for p in entry["points"]]
            elif "busbw_per_nic_GBps" in entry:
                v = entry["busbw_per_nic_GBps"]
                # A published range counts as its middle.
                targets = [(PLATEAU, sum(v) / len(v) if isinstance(v, list) else v)]
            else:
                v = entry["busbw_GBps"]
                targets = [(PLATEAU, sum(v) / len(v) if isinstance(v, list) else v)]
            for nbytes, measured in targets:
                row = bench.run(op, nbytes)
                simulated = row["busbw_gbytes_per_s"] / nics
                cases.append({
                    "suite": "nccl",
                    "id": f"{entry['id']}/{gpus}gpu/{op}/{algo}/{nbytes}",
                    "metric": "busbw_gbytes_per_s" + ("_per_nic" if per_nic else ""),
                    "measured": float(measured),
                    "simulated": simulated,
                    "error": (simulated - measured) / measured,
                    "algorithm": row["algorithm"],
                    "protocol": row["protocol"],
                })
    return cases
