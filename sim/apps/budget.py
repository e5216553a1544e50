"""What a simulation would cost before it runs: refuse, with the estimate and how to shrink
it, a run that would not finish in an hour or would not fit in this machine's memory.

The estimate comes from the layout alone (no program is built: building is what an absurd
layout makes slow): a step's ops are at least :data:`OPS_PER_LAYER_MICRO_BATCH` per layer per
micro-batch (every builder emits each layer's forward and backward for each micro-batch,
across its rank classes: a pipeline's stages share the layers), and each op costs the engine
at least :data:`SECONDS_PER_OP`. Both are floors of measured figures, so the estimate is a
lower bound: what it refuses would certainly take longer; ``--force`` runs it anyway.

Measured on the project's 2-core machine (docs/performance.md, and six shipped scenarios
run again for this module, 2026-12-01): ops per layer per micro-batch 4.3 (Llama 3.2 1B, one GPU,
DDP), 13 (FSDP2, Llama 3 70B), 14 (BLOOM 176B, DeepSpeed 3D), 16 (Megatron 1T), 21-31
(Megatron 70B/405B, Mixtral), 102 (ZeRO-3); engine seconds per op 84 us (Megatron 70B on
1,024 H100, quiet machine) to 590 us (FSDP2 70B on 64 H100, loaded machine).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sim.scenario import Scenario, ScenarioError

HOUR_S = 3600.0
"""The longest run accepted without ``--force``."""

OPS_PER_LAYER_MICRO_BATCH = 4
"""Fewest ops a builder emits per layer per micro-batch (measured 4.3, module docstring)."""

SECONDS_PER_OP = 50e-6
"""Least engine wall time per op (fastest measured: 84 us; module docstring)."""

BYTES_PER_OP = 500
"""Least memory an op of a built program holds (a dataclass with its dependency list,
stream and allocation tuples): 630 bytes (Mixtral 8x7B, Megatron, 10,888 ops) and 920 bytes
(Llama 3 70B, FSDP2, 1,060 ops) held after ``build_program``, measured with tracemalloc."""

BYTES_PER_GPU = 25e3
"""Least memory the fabric graph and one collective over all its GPUs hold per GPU: 28 KB
(``fabricsim collective dgx-h100 --op all_reduce --gpus 65536``, peak resident 1.83 GB) and
37 KB (DDP of Llama 3.2 1B on 131,072 H100s, 4.87 GB), 2026-12-05. A tiny model over very many
GPUs is bound by this, not by its ops."""


@dataclass(frozen=True)
class Estimate:
    """A lower bound on a simulation's work."""

    layers: int
    micro_batches: int
    steps: int
    ops: int
    """Ops over all steps (at least)."""
    seconds: float
    """Engine wall seconds (at least)."""
    bytes: float
    """Memory of the built program (at least)."""
    gpus: int = 0
    """GPUs of the fabric the run builds."""

    @property
    def fabric_bytes(self) -> float:
        """Memory of the fabric and a collective over every GPU (at least)."""
        return self.gpus * BYTES_PER_GPU


def estimate(scenario: Scenario, steps: int = 1) -> Estimate | None:
    """The lower bound of ``scenario``'s simulation over ``steps`` steps, or None when the
    layout cannot be resolved (the simulation then reports why, as it always has)."""
    from sim.workload.model import ModelSpec

    t = scenario.training
    try:
        layers = ModelSpec.from_ref(scenario.model, t.seq_len).layers
    except Exception:   # noqa: BLE001 - an unknown or refused model is the build's to report
        return None
    per_step = t.micro_batch_size * scenario.dp
    global_batch = t.global_batch_size or per_step
    micro_batches = max(1, math.ceil(global_batch / max(1, per_step)))
    ops = layers * micro_batches * OPS_PER_LAYER_MICRO_BATCH * steps
    return Estimate(layers, micro_batches, steps, ops, ops * SECONDS_PER_OP,
                    (ops / steps) * BYTES_PER_OP, scenario.gpus)


def fabric_refusal(gpus: int, memory: float | None, key: str = "cluster.nodes") -> str | None:
    """Why a fabric of ``gpus`` GPUs cannot be built in this machine's memory, or None.

    Examples
    --------
    >>> fabric_refusal(65_536, 2.0**34) is None
    True
    >>> fabric_refusal(4_000_000, 2.0**34, "--gpus")
    '--gpus: a fabric of 4,000,000 GPUs needs 93.1 GiB or more, this machine has 16.0 GiB'
    """
    need = gpus * BYTES_PER_GPU
    if memory is None or need <= memory:
        return None
    return (f"{key}: a fabric of {gpus:,} GPUs needs {need / 2**30:,.1f} GiB or more, this "
            f"machine has {memory / 2**30:,.1f} GiB")


def physical_memory() -> float | None:
    """Bytes of memory in this machine, or None where the system does not say."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def refusal(est: Estimate, memory: float | None) -> str | None:
    """Why ``est`` is too big to run without ``--force`` (one line: the key to shrink, the
    estimate, how to shrink it), or None."""
    what = (f"at least {est.ops:,} ops to simulate ({est.layers} layers x "
            f"{est.micro_batches:,} micro-batches" + (f" x {est.steps} steps" if est.steps > 1
                                                      else "") + ")")
    # The largest factor is the one to shrink.
    key = "training.global_batch_size" if est.micro_batches >= est.layers else "model.layers"
    shrink = (f"shrink {key}" + (" or --steps" if est.steps > 1 else "")
              + ", or pass --force to run it anyway")
    if est.seconds > HOUR_S:
        return (f"{key}: {what}, {_duration(est.seconds)} or more; {shrink}")
    if memory is not None and est.bytes + est.fabric_bytes > memory:
        have = f"this machine has {memory / 2**30:,.1f} GiB"
        if est.fabric_bytes >= est.bytes:   # a small model over very many GPUs
            return (f"cluster.nodes: a fabric of {est.gpus:,} GPUs and its program need "
                    f"{(est.bytes + est.fabric_bytes) / 2**30:,.1f} GiB or more, {have}; "
                    "shrink cluster.nodes, or pass --force to run it anyway")
        return (f"{key}: {what}: the program alone needs {est.bytes / 2**30:,.1f} GiB or "
                f"more, {have}; {shrink}")
    return None


def check(scenario: Scenario, steps: int, origin: str) -> None:
    """Raise ScenarioError (one line naming the file and the key) when the simulation would
    not finish in an hour or would not fit in memory (:func:`refusal`)."""
    est = estimate(scenario, steps)
    if est is None:
        return
    why = refusal(est, physical_memory())
    if why:
        raise ScenarioError(f"{origin}: {why}")


def zone_note(scenario: Scenario) -> str | None:
    """A note, not a refusal, for the layout the fabric cannot fold: nodes alternating zones
    (``cluster.az_placement: round_robin``, the default, with ``cluster.azs`` above 1) put
    every expert-parallel group wider than a node across the zone link. There its all-to-alls
    share the link with every other group's, none runs alone on its links, so none folds
    (:mod:`sim.fabric.fold`) and each start and many ends solve all of them: the shipped
    DeepSeek-V3 on 1,024 H100 took 27 minutes a step (``docs/performance.md`` items
    14-16), more since NCCL's all-to-all runs at its measured network share (item 18),
    where ``blocks`` (each zone's nodes consecutive) keeps each group in one zone and
    simulates in seconds. An expert group spans ``etp x ep`` consecutive ranks (Megatron-Core's
    expert layout, ``etp`` innermost). None when nothing crosses.

    Examples
    --------
    >>> from sim.scenario import load_scenario
    >>> sc = load_scenario("deepseek-v3-megatron-tp2pp16ep64-1024xh100")
    >>> zone_note(sc) is None
    True
    >>> two = load_scenario("deepseek-v3-megatron-tp2pp16ep64-1024xh100", ["cluster.azs=2"])
    >>> zone_note(two).startswith("cluster.az_placement: round_robin puts each 64-rank")
    True
    """
    c, p = scenario.cluster, scenario.parallelism
    span = p.expert_tp * p.ep
    if c.azs <= 1 or c.az_placement != "round_robin" or p.ep <= 1 or span <= c.gpus_per_node:
        return None
    nodes = math.ceil(span / c.gpus_per_node)
    return (f"cluster.az_placement: round_robin puts each {p.ep}-rank expert-parallel group "
            f"({nodes} nodes) across the {c.azs} zones: their all-to-alls share the zone "
            "link, none folds, and the engine solves thousands of their flows at a time (the "
            "shipped DeepSeek-V3 on 1,024 GPUs: over half an hour a step); cluster.az_placement: "
            "blocks keeps each group in one zone (docs/performance.md, items 14-16)")


HOST_PACED_SHARE = 0.2
"""Share of the step the GPUs wait on the host (``host_bound_s``) from which
:func:`host_note` speaks: above it the step time follows the x86 host's per-op cost, a fitted
figure (``X86_TRAINING_HOST_FACTOR``); the published x86 MoE row the simulation finds most
host-paced (26.02's dropless Qwen3-30B on one DGX B200, 51%) comes within +9.1% with it, and
was 1.6x slower than simulated without it (README, Validation)."""


def host_note(scenario: Scenario, summary: Mapping[str, object]) -> str | None:
    """A note, not a refusal, for a mixture-of-experts step the simulation finds paced by an x86
    host: at least :data:`HOST_PACED_SHARE` of it the GPUs wait for the host to issue work
    whose inputs are there. Such a step time follows the x86 host's per-op cost, which is
    fitted (``sim.hardware.host.X86_TRAINING_HOST_FACTOR``, docs/calibration.md, fifty-seventh
    and fifty-eighth sessions): NVIDIA's published run of that kind (Qwen3-30B with Megatron's
    dropless alltoall dispatcher on one DGX B200, 51% host-bound simulated) comes within +9.1%
    with it and ran 1.6x slower than simulated without it; its H100 companions
    (pipeline-parallel, their host cost reaching the GPUs through the pipeline) still run
    1.7-2.1x slower. Which host calls hold them is not known (docs/calibration.md, forty-third
    and forty-fourth sessions), so such a step time may be a lower bound. Grace hosts (GB200,
    GB300) are priced from their own measured per-op cost and the rows the simulation finds
    host-paced on them are not optimistic, so the note is held to x86; the regime itself is not
    x86-only: Megatron-LM's GB200 DeepSeek-V3 log's all-to-all baseline without CUDA graphs ran
    1.7x slower than simulated while the simulation finds it only 14% host-bound, under this
    note's share (docs/calibration.md, forty-fifth session).
    None otherwise.

    Examples
    --------
    >>> from sim.scenario import load_scenario
    >>> sc = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100")
    >>> host_note(sc, {"step_time_s": 10.0, "host_bound_s": 3.5}).startswith("the simulated")
    True
    >>> host_note(sc, {"step_time_s": 10.0, "host_bound_s": 0.5}) is None
    True
    """
    from sim.hardware.host import HostSpec
    from sim.workload.model import ModelSpec

    step = float(summary.get("step_time_s", 0.0) or 0.0)      # type: ignore[arg-type]
    host = float(summary.get("host_bound_s", 0.0) or 0.0)     # type: ignore[arg-type]
    if (step <= 0 or host < HOST_PACED_SHARE * step
            or ModelSpec.from_ref(scenario.model).moe is None
            or HostSpec.from_scenario(scenario).cpu != "x86"):
        return None
    return (f"the simulated step is host-paced: {host / step:.0%} of it the GPUs wait for "
            "the host to issue ready work (host_bound_s), so the step time follows the x86 "
            "host's per-op cost, a figure fitted on published runs (README, Validation: the "
            "x86 host-bound regime; its H100 runs ran 1.7-2.1x slower than simulated); read "
            "it as a lower bound")


def _duration(seconds: float) -> str:
    """Hours, days or years, as a person reads them.

    Examples
    --------
    >>> _duration(7200), _duration(3 * 86400), _duration(1e9)
    ('2.0 h', '3.0 days', '32 years')
    """
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    if seconds < 365 * 86400:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds / (365 * 86400):,.0f} years"
