"""A simulated nccl-tests run: one collective per message size on an otherwise idle fabric.

Definitions follow nccl-tests (``src/*.cu``): ``algbw = size / time``; ``busbw = algbw x
factor`` with factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
all-to-all, 1 for broadcast and sendrecv. ``size`` is nccl-tests' size column: the buffer of
an all-reduce, the whole gathered (or scattered) buffer of all-gather and reduce-scatter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import simpy

from sim import catalog
from sim.apps import budget
from sim.config.faults import check_faults
from sim.fabric.collectives.runner import CollectiveRunner, NcclSettings, transport_capacity
from sim.fabric.network import FlowNetwork
from sim.fabric.topology import LINK_KINDS, Fabric, build_fabric
from sim.fabric.topology.link_faults import apply_link_faults
from sim.scenario import ScenarioError, scenario_from_dict

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 (binary units, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ScenarioError(f"--sizes: cannot read {text!r} (use e.g. 8, 64K, 1M, 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_sizes(spec: str) -> list[int]:
    """``A:B`` -> A, 2A, 4A, ... up to B (nccl-tests -b A -e B -f 2); a single size alone."""
    if ":" not in spec:
        return [parse_size(spec)]
    a, b = (parse_size(x) for x in spec.split(":", 1))
    if a <= 0 or b < a:
        raise ScenarioError(f"--sizes: {spec!r} must go from a positive size up")
    out = []
    s = a
    while s <= b:
        out.append(s)
        s *= 2
    return out


@dataclass
class Bench:
    """A fabric for a topology with enough nodes for ``gpus`` ranks."""

    fabric: Fabric
    arch: str
    transport: str
    settings: NcclSettings
    gpus: int

    @classmethod
    def build(cls, topology: str, gpus: int, algo: str = "auto", proto: str = "auto",
              overrides: dict[str, Any] | None = None) -> Bench:
        from sim.api import fabric_spec, nccl_settings

        probe = scenario_from_dict({"model": "llama3.2-1b",
                                    "cluster": {"topology": topology, "nodes": 1}},
                                   origin=f"topology {topology}")
        # An override of gpus_per_node sizes the cluster too (one GPU per node: PAT's case).
        per_node = int((overrides or {}).get("cluster.gpus_per_node",
                                             probe.cluster.gpus_per_node))
        nodes = max(1, math.ceil(gpus / per_node))
        data: dict[str, Any] = {"model": "llama3.2-1b",
                                "cluster": {"topology": topology, "nodes": nodes},
                                "nccl": {"algo": algo, "proto": proto}}
        for key, value in (overrides or {}).items():
            section, _, field = key.partition(".")
            data.setdefault(section, {})[field] = value
        s = scenario_from_dict(data, origin=f"topology {topology}")
        gpu = catalog.gpu(s.cluster.gpu)
        fabric = build_fabric(fabric_spec(s))
        if s.faults is not None:   # slow and failed NIC links (faults.slow_gpus: no compute)
            check_faults(s.faults, s.cluster.nodes, s.cluster.gpus_per_node,
                         s.cluster.nics_per_node, f"topology {topology}")
            apply_link_faults(fabric, [(x.node, x.nic, x.factor) for x in s.faults.slow_links],
                              [(x.node, x.nic) for x in s.faults.failed_links], s.faults.seed)
        return cls(fabric, gpu.arch, s.cluster.nic_transport, nccl_settings(s), gpus)

    def run(self, op: str, nbytes: float) -> dict[str, Any]:
        """One collective on an idle fabric: time, algbw, busbw, the algorithm and protocol
        NCCL's tuning picks and its own predicted time (``nccl_model_s``,
        ncclTopoGetAlgoTime)."""
        env = simpy.Environment()
        net = FlowNetwork(env, transport_capacity(self.fabric, self.arch, self.transport),
                          self.fabric.kind, len(LINK_KINDS))
        runner = CollectiveRunner(env, net, self.fabric, self.arch, self.settings)
        group = tuple(range(self.gpus))
        env.run(env.process(runner.run_collective(op, group, nbytes)))
        t = env.now
        choice = runner.chosen[-1] if runner.chosen else None
        algbw = nbytes / t / 1e9 if t > 0 else 0.0
        return {"bytes": int(nbytes), "time_s": t, "algbw_gbytes_per_s": algbw,
                "busbw_gbytes_per_s": algbw * bus_factor(op, self.gpus),
                "algorithm": choice.algorithm if choice else "none",
                "protocol": choice.protocol if choice else "none",
                "nccl_model_s": choice.predicted_s if choice else 0.0}


def collective_table(topology: str, op: str, gpus: int, sizes: list[int], algo: str = "auto",
                     proto: str = "auto", overrides: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The ``fabricsim collective --json`` object; ``overrides`` sets ``cluster.*`` or
    ``nccl.*`` keys over the topology's (``{"cluster.azs": 2}``)."""
    if op not in OPS:
        raise ScenarioError(f"--op: {op!r} is not one of {', '.join(OPS)}")
    if gpus < 2:
        raise ScenarioError("--gpus: a collective needs at least 2 GPUs")
    # The fabric must fit in memory (a million GPUs does not).
    too_big = budget.fabric_refusal(gpus, budget.physical_memory(), "--gpus")
    if too_big:
        raise ScenarioError(too_big)
    bench = Bench.build(topology, gpus, algo, proto, overrides)
    return {"topology": topology, "op": op, "gpus": gpus,
            "rows": [bench.run(op, s) for s in sizes]}
