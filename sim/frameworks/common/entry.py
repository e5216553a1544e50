"""What a framework is to the rest of fabricsim: a :class:`FrameworkEntry` (options model,
builder, planner search space, pipeline split, launcher facts) and the :class:`SearchSpace`
the planner searches. Each built-in framework's entry is its package's ``entry.py``;
:mod:`sim.frameworks.registry` holds the list."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from sim.frameworks.common.base import Builder, JobContext
from sim.frameworks.common.search import (
    Options,
    Recomputation,
    SearchPoint,
    default_recomputation,
    no_expert_layouts,
    no_host_twin,
    no_memory_lever,
)
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec

__all__ = ["FrameworkEntry", "Options", "Recomputation", "SearchPoint", "SearchSpace",
           "StageSplit"]

StageSplit = Callable[[int, int, int, Mapping[str, Any]], list[list[int]]]
"""``(layers, pp, vp, options) -> layers of each of the pp x vp chunks`` (chunk v on stage
v % pp); raises ValueError when the framework cannot split them so."""


def _every_chunk_has_a_layer(layers: int, pp: int, vp: int) -> bool:
    return layers // (pp * vp) >= 1


@dataclass(frozen=True)
class SearchSpace:
    """What ``fabricsim plan`` searches for a framework (see ``docs/planner.md``)."""

    options: Callable[[SearchPoint], Iterable[Options]]
    """The option sets to try at one parallel layout; each is merged with :attr:`recipe`."""
    recipe: Options = ()
    """Options every layout gets, at the values the framework's own recipes use."""
    data_parallel_only: bool = False
    """Modelled with tp = pp = cp = 1 and without selective recomputation: only those
    layouts are enumerated."""
    chunks_split: Callable[[int, int, int], bool] = _every_chunk_has_a_layer
    """``(layers, pp, vp) -> bool``: whether ``pp x vp`` pipeline chunks are worth building
    (with interleaving, vp > 1)."""
    sequence_parallel: bool = False
    """Layouts with tp > 1 set ``parallelism.sequence_parallel`` (Megatron's flag)."""
    layer_profile: bool = False
    """A per-layer profile bounds each layout's step time before it is built (the builder
    tags each layer's compute ops with their layer)."""
    layer_options: tuple[str, ...] = ()
    """Options that change a layer's own ops (the layer profile is built with them)."""
    split_options: tuple[str, ...] = ()
    """Options that split the layers over one pipeline shape (``pp x vp``): a scenario's
    values hold for its own shape only, so layouts of another shape drop them (and take what
    :attr:`options` sets)."""
    short_step_with_pipeline: bool = True
    """The peak memory stops growing after 2 x pp micro-batches with pipeline parallelism,
    so the planner may build a shorter step (``sim.apps.plan.evaluate.proxy_micro_batches``)."""
    expert_layouts: Callable[[SearchPoint], Iterable[tuple[int, int]]] = no_expert_layouts
    """``(ep, etp)`` pairs to try at one parallel layout of a mixture-of-experts model (never
    called for a dense one)."""
    recomputation: Callable[[SearchPoint, Options], Iterable[Recomputation]] = \
        default_recomputation
    """The recomputation settings to try at one parallel layout with these options (the
    recipe's merged in), least recomputation first; not called for a
    :attr:`data_parallel_only` space (none and full only)."""
    weight_casts_per_step: bool = False
    """With fp8, weight casts are shared by the micro-batches of a step, so a
    one-micro-batch profile is no lower bound (the profile then only refuses)."""
    memory_lever: Callable[[SearchPoint, Options], Options | None] = no_memory_lever
    """The options of the same layout (at this search point) that keep less state
    (Megatron's bf16 Adam moments for a mixture-of-experts layout, Megatron-FSDP for a dense
    one without pipeline parallelism), tried only where the layout does not fit; None:
    none."""
    host_twin: Callable[[Options], Options | None] = no_host_twin
    """For options that only save host time (Megatron's CUDA graphs): the options of the
    eager twin also enumerated, so that the planner simulates them only where their lower
    bound beats the twin's; None: not such options."""


@dataclass(frozen=True)
class FrameworkEntry:
    """Everything fabricsim knows about one framework, by ``framework.name``."""

    name: str
    options: type[BaseModel]
    """The pydantic model of the scenario's ``framework:`` section; its ``name`` field is
    ``Literal[<name>]`` (the union's discriminator)."""
    build: Builder
    """``JobContext -> Program``: one training step's ops, streams and dependencies."""
    search: SearchSpace | None = None
    """The planner's search space; None: ``fabricsim plan`` does not search it."""
    stage_split: StageSplit | None = None
    """How layers are split over pipeline chunks; None: one stage holds every layer."""
    expandable_segments: bool = False
    """The framework's launcher turns on the caching allocator's expandable segments (the
    default of ``allocator.expandable_segments``)."""
    step_gradient_bytes_per_param: float = 0.0
    """Gradient bytes per parameter that exist during the step but are not in the
    program's initial memory (counted in the model-state memory claims are judged on)."""
    async_checkpoint_stages_write_share: bool = False
    """What an asynchronous checkpoint save copies to host memory before training resumes
    (``run.checkpoint``, :mod:`sim.program.checkpoint_ops`). False: the rank's whole local
    state, as torch.distributed.checkpoint's ``async_save`` stages its state dict
    (torch/distributed/checkpoint/staging.py: ``_create_cpu_state_dict`` and
    ``_copy_state_dict`` of every tensor, replicated or not). True: only the tensors the rank
    itself writes, as Megatron-Core dist-ckpt's async writer does (``FileSystemWriterAsync.
    prepare_write_data`` copies its own write buckets, after the fully-parallel save has
    spread replicated tensors over the data-parallel ranks)."""
    kernel_style: Callable[[JobContext], Style] | None = None
    """The kernels the builder runs the model's blocks with (eager Hugging Face, fused,
    compiled...): the mix that sets the step's SM clock under the power limit
    (:mod:`sim.frameworks.common.power_clock`). None: ``Style("bf16")``, a plain module's."""
    model_features: frozenset[str] = frozenset()
    """Model features beyond a dense block (:data:`sim.workload.moe.BEYOND_DENSE` keys) the
    builder models: :class:`~sim.frameworks.common.base.JobContext` refuses any other
    model by this field, and the planner skips this framework for it (:meth:`builds`)."""

    def builds(self, model: ModelSpec) -> str | None:
        """The scenario key (``experts``, ...) of the first feature of ``model`` this
        framework's builder does not model, or None if it builds the model."""
        return model.beyond_dense(self.model_features)

    def chunks(self, layers: int, pp: int, vp: int, opts: Mapping[str, Any]
               ) -> list[list[int]] | None:
        """Layers of each pipeline chunk, or None if the framework cannot split them so."""
        if self.stage_split is None:
            return [list(range(layers))]
        try:
            return self.stage_split(layers, pp, vp, opts)
        except ValueError:
            return None
