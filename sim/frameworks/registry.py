"""The framework registry: one entry per framework, the one place that lists them.

An entry (:class:`FrameworkEntry`) holds what the rest of fabricsim needs to know about a
framework: its options model (the ``framework:`` section of a scenario), its schedule
builder, the planner's search space over it, how it splits layers over pipeline stages, and
the few launcher or dtype facts the API and the CLI used to spell out by name. Readers:

* the scenario schema (:mod:`sim.scenario`): ``framework`` is the discriminated union of the
  entries' options models, pushed there by :func:`register_framework` (config imports no
  framework, so the edge runs from here to config);
* :func:`build_program` (``sim.api.simulate`` and the planner's builds);
* the planner (:mod:`sim.plan`): enumeration, profiles, bounds and pipeline splits;
* :mod:`sim.api` (allocator default, claims' model-state memory) and :mod:`sim.cli` (the
  dtype of gradient collectives in HTA traces).

Adding a framework is a new module (options model, builder, optionally a search space) and
one :func:`register_framework` line; ``docs/adding-a-framework.md`` walks through it and
``tests/integration/test_registry.py`` runs that walk-through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from sim import scenario as config
from sim.frameworks import ddp, deepspeed, fairscale, fsdp2, megatron
from sim.frameworks import search_spaces as spaces
from sim.frameworks.base import Builder, JobContext
from sim.frameworks.search_spaces import Options, SearchPoint
from sim.program import Program

__all__ = ["FrameworkEntry", "Options", "SearchPoint", "SearchSpace", "StageSplit",
           "build_program", "framework", "frameworks", "names", "register_framework",
           "searchable", "unregister_framework"]

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
    short_step_with_pipeline: bool = True
    """The peak memory stops growing after 2 x pp micro-batches with pipeline parallelism,
    so the planner may build a shorter step (``sim.plan_evaluate.proxy_micro_batches``)."""
    weight_casts_per_step: bool = False
    """With fp8, weight casts are shared by the micro-batches of a step, so a
    one-micro-batch profile is no lower bound (the profile then only refuses)."""


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

    def chunks(self, layers: int, pp: int, vp: int, opts: Mapping[str, Any]
               ) -> list[list[int]] | None:
        """Layers of each pipeline chunk, or None if the framework cannot split them so."""
        if self.stage_split is None:
            return [list(range(layers))]
        try:
            return self.stage_split(layers, pp, vp, opts)
        except ValueError:
            return None


_ENTRIES: dict[str, FrameworkEntry] = {}


def register_framework(entry: FrameworkEntry) -> FrameworkEntry:
    """Add ``entry``; the scenario schema accepts ``framework.name: <entry.name>`` from now on.

    Raises ValueError if the name is taken or the options model answers to another name."""
    if entry.name in _ENTRIES:
        raise ValueError(f"framework {entry.name!r} is already registered")
    if config.options_name(entry.options) != entry.name:
        raise ValueError(f"{entry.options.__name__}.name is "
                         f"{config.options_name(entry.options)!r}, not {entry.name!r}")
    _ENTRIES[entry.name] = entry
    _sync_schema()
    return entry


def unregister_framework(name: str) -> None:
    """Remove a framework registered with :func:`register_framework` (tests, plugins)."""
    del _ENTRIES[name]
    _sync_schema()


def _sync_schema() -> None:
    config.set_framework_options(tuple(e.options for e in _ENTRIES.values()))


def framework(name: str) -> FrameworkEntry:
    """The entry of ``framework.name``; KeyError if none is registered."""
    return _ENTRIES[name]


def frameworks() -> tuple[FrameworkEntry, ...]:
    """Every registered framework, in registration order (the built-ins first)."""
    return tuple(_ENTRIES.values())


def names() -> tuple[str, ...]:
    return tuple(_ENTRIES)


def searchable() -> tuple[str, ...]:
    """Frameworks the planner searches (those with a search space), in registry order."""
    return tuple(e.name for e in _ENTRIES.values() if e.search is not None)


def build_program(ctx: JobContext) -> Program:
    """The program of one training step for the scenario's framework."""
    name = ctx.scenario.framework.name
    entry = _ENTRIES.get(name)
    if entry is None:
        ctx.fail("framework.name", f"no schedule builder for {name!r}")
    assert entry is not None
    program = entry.build(ctx)
    program.meta["attention_backend"] = ctx.compute.attention_backend
    program.validate()
    return program


# --------------------------------------------------------------------------- the built-ins
# One entry each; the options models live in sim/framework_options.py (they move into the
# framework packages with the restructure), the search spaces in search_spaces.py.
_BUILTINS = (
    FrameworkEntry(
        "ddp", config.DdpOptions, ddp.build_ddp,
        search=SearchSpace(spaces.no_options, recipe=spaces.DDP_BEST_PRACTICE,
                           data_parallel_only=True),
        # Without gradient_as_bucket_view the fp32 .grad tensors are allocated in backward
        # and freed by zero_grad(set_to_none=True) (ddp.py): no initial memory, but there.
        step_gradient_bytes_per_param=4.0),
    FrameworkEntry(
        "fsdp2", config.Fsdp2Options, fsdp2.build_fsdp2,
        search=SearchSpace(spaces.fsdp2_options, layer_profile=True,
                           short_step_with_pipeline=False),
        stage_split=spaces.torchtitan_stage_split,
        # torchtitan's run_train.sh exports PYTORCH_ALLOC_CONF="expandable_segments:True".
        expandable_segments=True),
    FrameworkEntry(
        "megatron", config.MegatronOptions, megatron.build_megatron,
        search=SearchSpace(spaces.megatron_options, recipe=spaces.MEGATRON_BEST_PRACTICE,
                           chunks_split=spaces.megatron_chunks_split, sequence_parallel=True,
                           layer_profile=True, layer_options=("tp_comm_overlap",),
                           weight_casts_per_step=True),
        stage_split=spaces.megatron_stage_split),
    FrameworkEntry(
        "deepspeed", config.DeepSpeedOptions, deepspeed.build_deepspeed,
        search=SearchSpace(spaces.deepspeed_options, recipe=spaces.DEEPSPEED_BEST_PRACTICE,
                           data_parallel_only=True)),
    FrameworkEntry(
        "fairscale", config.FairscaleOptions, fairscale.build_fairscale,
        search=SearchSpace(spaces.fairscale_options, data_parallel_only=True)),
)
for _entry in _BUILTINS:
    _ENTRIES[_entry.name] = _entry
_sync_schema()   # the built-ins' models are scenario.BUILTIN_FRAMEWORK_OPTIONS: no change
