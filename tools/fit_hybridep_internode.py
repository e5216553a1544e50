"""Fit ``INTERNODE_CALL_S`` (``sim/fabric/collectives/hybridep_kernel.py``): the fixed time of a
Hybrid-EP dispatch or combine across NVLink domains, beyond the bytes its flows move.

Data: Hybrid-EP's own H100 benchmark (``sim/catalog/reference/hybridep_benchmark.yaml``: EP 16,
32 and 64 over two to eight DGX H100 nodes, dispatch and combine, kernel time), six rows. Each
row is simulated alone (:func:`benchmark_times`, which the tests use too) with the constant
set to 0; the measured time minus the simulated one is nearly the same at every EP size (0.25-0.47
ms), where a factor on the time would have to fall from 1.37 to 1.05: the constant is their
mean (the least-squares offset), rounded to ``--round`` seconds. The ``published-moe`` rows of
16 H100s with Hybrid-EP (Megatron-Bridge's Qwen3-30B-A3B runs) check it; none is fitted.

Usage (from the repository root; seconds)::

    python tools/fit_hybridep_internode.py
"""

from __future__ import annotations

import argparse
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.engine.core import Engine  # noqa: E402
from sim.fabric.collectives import hybridep_kernel  # noqa: E402
from sim.fabric.topology import FabricSpec, build_fabric  # noqa: E402
from sim.frameworks.megatron.moe_hybridep import HybridEPLayout, HybridEPPlan  # noqa: E402
from sim.program.ir import Op, Program, RankClass  # noqa: E402

REFERENCE = (Path(__file__).resolve().parents[1] / "sim" / "catalog" / "reference"
             / "hybridep_benchmark.yaml")
WHICH = ("dispatch_fwd", "combine_fwd")
"""The table's two columns, as :class:`HybridEPPlan` names the calls."""


@cache
def reference() -> dict[str, Any]:
    """The benchmark table (``hybridep_benchmark.yaml``)."""
    with REFERENCE.open() as f:
        data: dict[str, Any] = yaml.safe_load(f)
    return data


def plan_of(ranks: int, domain: int, sms: int, experts: int | None = None,
            tokens: float | None = None, hidden: int | None = None) -> HybridEPPlan:
    """The Hybrid-EP plan of the README's setting over ``ranks`` ranks in NVLink domains of
    ``domain`` (``experts`` routed experts: 8 a rank unless given)."""
    ref = reference()
    experts = experts or ref["local_experts"] * ranks
    lay = HybridEPLayout(tuple(range(ranks)), domain, experts, ref["topk"], ranks, 1,
                         domain=domain)
    return HybridEPPlan(lay, float(tokens or ref["tokens"]), hidden or ref["hidden"], False,
                        sms)


def run_alone(ops: list[Op], ranks: int, nodes: int, per_node: int, nvlink_gbytes_per_s: float,
              arch: str, nics: int = 0) -> float:
    """Seconds the engine takes for ``ops`` on one rank class of ``ranks`` GPUs, ``nodes``
    nodes of ``per_node`` (``nics`` 400 Gb/s NICs a node), nothing else running."""
    fab = build_fabric(FabricSpec(nodes=nodes, gpus_per_node=per_node,
                                  nvlink_gbytes_per_s=nvlink_gbytes_per_s,
                                  pcie_gbytes_per_s=63, nics_per_node=nics, nic_gbps=400))
    cls = RankClass(0, tuple(range(ranks)))
    p = Program([cls], ranks, 0, 0, 0)
    for op in ops:
        p.add(cls, op)
    return Engine(fab, arch).run_step(p)


def call_time(plan: HybridEPPlan, which: str, nvlink_gbytes_per_s: float, arch: str
              ) -> float:
    """Seconds one Hybrid-EP call (``which``) of ``plan`` takes alone on its fabric."""
    ranks, domain = len(plan.layout.ranks), plan.domain
    op = Op(name=which, kind="collective", stream="comm", phase="comm",
            collective="all_to_all", group=tuple(range(ranks)), nbytes=plan.nbytes(which),
            peer_bytes=plan.peer_bytes(which), key="a2a", sm_ctas=plan.num_sms,
            fused_kernel="hybridep")
    nodes = ranks // domain
    return run_alone([op], ranks, nodes, domain, nvlink_gbytes_per_s, arch,
                     nics=domain if nodes > 1 else 0)


def benchmark_times(ranks: int, which: str) -> tuple[float, float]:
    """(simulated, measured) seconds of the H100 row of ``ranks`` ranks, column ``which``:
    the measured time is the README's bytes (tokens x expected destination nodes x hidden x 2)
    over its GB/s."""
    ref = reference()
    plan = plan_of(ranks, ref["gpus_per_node"], ref["sms"])
    gbps = ref["h100"][ranks][WHICH.index(which)]
    nbytes = plan.layout.expected_nodes() * ref["tokens"] * ref["hidden"] * 2.0
    return call_time(plan, which, 450, "hopper"), nbytes / (gbps * 1e9)


def offsets() -> list[tuple[int, str, float, float]]:
    """(ranks, call, simulated s without the fixed time, measured s) of every row."""
    saved = hybridep_kernel.INTERNODE_CALL_S
    hybridep_kernel.INTERNODE_CALL_S = 0.0
    try:
        return [(r, w, *benchmark_times(r, w)) for r in sorted(reference()["h100"])
                for w in WHICH]
    finally:
        hybridep_kernel.INTERNODE_CALL_S = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", type=float, default=1e-5, help="rounding of the result (s)")
    args = ap.parse_args()
    rows = offsets()
    for ranks, which, sim, meas in rows:
        print(f"EP {ranks:3d} {which:13s} simulated {sim * 1e3:6.3f} ms, measured "
              f"{meas * 1e3:6.3f} ms: +{(meas - sim) * 1e3:.3f} ms (x{meas / sim:.3f})")
    mean = sum(m - s for _, _, s, m in rows) / len(rows)
    fitted = round(mean / args.round) * args.round
    print(f"INTERNODE_CALL_S = {fitted:.6g}  (mean offset {mean * 1e3:.4f} ms over {len(rows)} "
          f"rows; in the code now: {hybridep_kernel.INTERNODE_CALL_S:.6g})")


if __name__ == "__main__":
    main()
