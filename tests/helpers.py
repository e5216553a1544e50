"""Small helpers several test modules share (not a test module itself)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import simpy
from conftest import make_scenario

from sim.fabric.network import NetworkObserver
from sim.fabric.topology import Fabric, FabricSpec, build_fabric
from sim.frameworks import JobContext, build_program
from sim.program.ir import Program
from sim.scenario import Scenario


def fabricsim_in_process(*args: str, cwd: Path | str | None = None
                         ) -> subprocess.CompletedProcess[str]:
    """``fabricsim ARGS`` run in this process, through the command's own entry point
    (:func:`sim.cli.commands.main`, whose handlers make the exit status and the one-line
    errors), returned as a finished subprocess would be: return code, stdout, stderr.

    For checks of a command that tests/integration/test_cli.py (``run``) or another test
    already runs as a true subprocess: those keep the start-up and the process's own streams
    under test; here the same code path costs no interpreter start (about 1.5 s each on
    2 cores)."""
    from sim.cli.commands import main

    out, err = io.StringIO(), io.StringIO()
    argv, here = sys.argv, os.getcwd()
    sys.argv = ["fabricsim", *args]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None
                                                                   else 1)
            else:
                raise AssertionError("fabricsim's main() returned instead of exiting")
    finally:
        sys.argv = argv
        os.chdir(here)
    return subprocess.CompletedProcess(["fabricsim", *args], code, out.getvalue(),
                                       err.getvalue())


def timed(env: simpy.Environment, gen: Any) -> float:
    """Run one process to its end; the simulated seconds it took."""
    t0 = env.now
    env.run(env.process(gen))
    return env.now - t0


def program(s: Scenario) -> Program:
    """The step program the scenario's framework builds (no simulation)."""
    return build_program(JobContext.from_scenario(s))


def dgx(nodes: int, **kw: Any) -> FabricSpec:
    """DGX H100-like nodes: 8 GPUs, NVLink 4 (450 GB/s), PCIe 5, 8 x 400 Gb/s NICs."""
    base: dict[str, Any] = dict(nodes=nodes, gpus_per_node=8, nvlink_gbytes_per_s=450,
                                pcie_gbytes_per_s=63, nics_per_node=8, nic_gbps=400)
    base.update(kw)
    return FabricSpec(**base)


def activations_left(cls: Any) -> float:
    """Activation bytes a rank class's ops allocate and never free (0 when every saved
    tensor is released by the step's end: conservation of the activations pool)."""
    held = 0.0
    for ops in cls.streams.values():
        for op in ops:
            held += sum(b for pool, b in op.alloc if pool == "activations")
            held -= sum(b for pool, b in op.free if pool == "activations")
    return held


def pipeline_idle_share(r: Any) -> float:
    """The summary's bubble as a share of the pipeline phase (forward, backward,
    recomputation) of the critical rank class, not of the whole step (which also holds the
    optimizer): what the closed form (p-1)/(m+p-1) describes."""
    step = r.summary["step_time_s"]
    crit = max(r.program.classes, key=lambda c: max(x.end for x in r.recorder.ops
                                                    if x.cls == c.id)).id
    pipeline_end = max(x.end for x in r.recorder.ops
                       if x.cls == crit and x.op.phase in ("fwd", "bwd", "recompute"))
    return float(r.summary["bubble_fraction"] * step / pipeline_end)


def nvlink_node(gpus: int = 2) -> Fabric:
    """One :func:`dgx` node without NICs: its GPUs joined by NVLink 4 only (the engine's
    interference and HBM-sharing tests)."""
    return build_fabric(dgx(1, gpus_per_node=gpus, nics_per_node=0))


# A deep, narrow-vocabulary model so the layers dominate each pipeline stage (the closed forms
# of the Megatron tests assume identical stages).
DEEP = {"layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 16384, "vocab": 1024,
        "mlp": "gelu", "tied_embeddings": False}


def megatron_scenario(par: dict, gbs: int, mbs: int = 1, framework: dict | None = None,
                      ac: str = "none", nvlink: float = 45000, nodes: int = 1, gpn: int = 8,
                      model: dict | None = None, seq: int = 2048,
                      precision: str = "bf16") -> Scenario:
    """Megatron-LM on H100 nodes (DEEP by default), through the one factory
    (:func:`conftest.make_scenario`): the builder the Megatron test modules share."""
    return make_scenario({
        "model": model or DEEP,
        "cluster": {"gpu": "h100-sxm", "nodes": nodes, "gpus_per_node": gpn,
                    "nvlink_gbytes_per_s": nvlink, "nics_per_node": 8 if nodes > 1 else 0,
                    "nic_gbps": 400},
        "framework": framework or {"name": "megatron"},
        "parallelism": par,
        "training": {"seq_len": seq, "micro_batch_size": mbs, "global_batch_size": gbs,
                     "activation_checkpointing": ac, "precision": precision}})


# Two small nodes (2 x H100 each) in two availability zones, FSDP2: its all-gathers and
# reduce-scatters cross the zone boundary. The cost and plot tests add their own prices.
TWO_ZONES: dict[str, Any] = {
    "name": "tiny-2az",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2,
                "azs": 2},
    "framework": "fsdp2",
    "training": {"seq_len": 1024, "micro_batch_size": 1},
}


# Llama 3.2 1B under DDP on one GPU, no NICs: the smallest whole run a per-GPU change (a power
# cap, a part) shows in. Modules set ``cluster__gpu`` and their own name.
ONE_GPU_1B: dict[str, Any] = {
    "name": "1gpu", "model": "llama3.2-1b",
    "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 1, "nics_per_node": 0},
    "framework": {"name": "ddp"},
    "training": {"seq_len": 2048, "micro_batch_size": 2}}


# Llama 3.2 1B and nothing else: every other key takes the schema's default (unlike conftest's
# BASE, which sets them), for tests of what a cluster section alone resolves to.
MINIMAL_1B: dict[str, Any] = {"model": "llama3.2-1b"}


def megatron_pipeline(stages: int, micro_batches: int, layers: int,
                      nodes: int = 1) -> Scenario:
    """Megatron-LM 1F1B, one GPU per stage, a narrow model (hidden 1,024, 1,024-token
    vocabulary) so the run stays fast: the pipeline the metrics and plot tests read."""
    return make_scenario({
        "name": f"pp{stages}",
        "model": {"layers": layers, "hidden": 1024, "heads": 8, "ffn_hidden": 4096,
                  "vocab": 1024, "mlp": "gelu", "tied_embeddings": False},
        "cluster": {"gpu": "h100-sxm", "nodes": nodes, "gpus_per_node": stages // nodes,
                    "nics_per_node": 8 if nodes > 1 else 0, "nic_gbps": 400},
        "framework": {"name": "megatron"},
        "parallelism": {"tp": 1, "pp": stages, "dp": 1},
        "training": {"seq_len": 2048, "micro_batch_size": 1,
                     "global_batch_size": micro_batches}})


class RatesLog(NetworkObserver):
    """Every rate solve (time, class rates, link rates) and transfer end a FlowNetwork
    reports, as bytes: two runs that must agree to the last bit compare their ``seen``."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def on_rates(self, t, class_rates, link_rates) -> None:
        self.seen.append(np.array([t, *class_rates, *link_rates]).tobytes())

    def on_transfer_end(self, t, tag, nbytes) -> None:
        self.seen.append(repr((t, tag, nbytes)).encode())


def with_overrides(d: dict, over: dict[str, Any]) -> dict:
    """``d`` with each ``"section.key": value`` of ``over`` set in its section (a copy per
    section touched; ``d`` itself is not changed)."""
    out = dict(d)
    for key, value in over.items():
        section, _, leaf = key.partition(".")
        out[section] = {**out[section], leaf: value}
    return out
