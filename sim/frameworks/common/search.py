"""What every framework's planner search space is made of: the parallel layout a space adds
options to (:class:`SearchPoint`), options as ``(key, value)`` pairs, and the space that adds
none. Each framework's own space is its package's ``search.py``; the registry
(:mod:`sim.frameworks.registry`) points at them and the planner reads them only through it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Options = tuple[tuple[str, Any], ...]
"""Framework options as sorted ``(key, value)`` pairs (``framework.<key>``)."""
Recomputation = tuple[str, tuple[str, ...]]
"""``(training.activation_checkpointing, modules)``: the modules are what the framework
recomputes under ``selective`` (Megatron's ``recompute_modules``); ``()`` leaves the
framework's own selection."""


@dataclass(frozen=True)
class SearchPoint:
    """The parallel layout a search space adds its options to."""

    tp: int
    pp: int
    vp: int
    dp: int
    cp: int
    layers: int
    """Transformer layers of the model."""
    experts: int = 0
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    expert_width: int = 0
    """Inner width of one expert (``moe_ffn_hidden``); 0 for a dense model."""
    ep: int = 1
    """The expert-parallel size of the layout the options are asked for (1 for a dense
    model; each of :attr:`SearchSpace.expert_layouts`' for a mixture-of-experts one)."""
    mla: bool = False
    """The model has Multi-head Latent Attention (DeepSeek-V2/V3)."""
    shared_experts: int = 0
    """Shared experts per MoE layer."""
    mtp_layers: int = 0
    """Multi-token prediction modules."""
    etp: int = 1
    """The expert tensor-parallel size of that expert layout."""
    gpus_per_domain: int = 0
    """GPUs of one NVLink domain (a node, or an NVL72 rack); 0: not known."""
    arch: str = ""
    """The GPU's architecture (``hopper``, ``blackwell``, ...); "" not known."""
    fp8: bool = False
    """The scenario trains in FP8 (``training.precision: fp8``)."""
    dropless: bool = True
    """The MoE layers drop no token (no ``capacity_factor``)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def no_options(pt: SearchPoint) -> Iterable[Options]:
    """One layout per parallel point, with the recipe options only."""
    yield ()


def default_recomputation(pt: SearchPoint, options: Options) -> Iterable[Recomputation]:
    """No recomputation, the framework's selective recomputation, full recomputation."""
    for ac in ("none", "selective", "full"):
        yield ac, ()


def no_expert_layouts(pt: SearchPoint) -> Iterable[tuple[int, int]]:
    """No expert parallelism: a framework that does not search it."""
    yield (1, 0)


def no_memory_lever(pt: SearchPoint, options: Options) -> Options | None:
    """No memory lever: a framework whose planner search has none."""
    return None


def no_host_twin(options: Options) -> Options | None:
    """No options that only save host time."""
    return None
