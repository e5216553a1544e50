"""Hybrid-EP's own kernel benchmark as the simulator runs it: one dispatch or combine of the
README's setting (``sim/catalog/reference/hybridep_benchmark.yaml``) on an H100 fabric of
``ranks / 8`` nodes, timed alone by the engine, and the time the table's GB/s imply.

:data:`sim.fabric.collectives.hybridep_kernel.INTERNODE_CALL_S` is fitted on these rows
(``tools/fit_hybridep_internode.py``); ``tests/unit/engine/test_hybridep_published.py`` checks
them.

Examples
--------
>>> t, measured = benchmark_times(16, "dispatch_fwd")
>>> 1.4e-3 < measured < 1.6e-3 and t > 1.2e-3
True
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from sim.engine.core import Engine
from sim.fabric.topology import FabricSpec, build_fabric
from sim.frameworks.megatron.moe_hybridep import HybridEPLayout, HybridEPPlan
from sim.program.ir import Op, Program, RankClass

REFERENCE = (Path(__file__).resolve().parents[2] / "catalog" / "reference"
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
