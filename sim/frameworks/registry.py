"""The framework registry: one entry per framework, the one place that lists them.

An entry (:class:`FrameworkEntry`) holds what the rest of fabricsim needs to know about a
framework: its options model (the ``framework:`` section of a scenario), its schedule
builder, the planner's search space over it, how it splits layers over pipeline stages, and
the few launcher or dtype facts the API and the CLI used to spell out by name. Readers:

* the scenario schema (:mod:`sim.scenario`): ``framework`` is the discriminated union of the
  entries' options models, pushed there by :func:`register_framework` (config imports no
  framework, so the edge runs from here to config);
* :func:`build_program` (``sim.api.simulate`` and the planner's builds);
* the planner (:mod:`sim.apps.plan`): enumeration, profiles, bounds and pipeline splits;
* :mod:`sim.api` (allocator default, claims' model-state memory) and :mod:`sim.cli.commands` (the
  dtype of gradient collectives in HTA traces).

Adding a framework is a new module (options model, builder, optionally a search space) and
one :func:`register_framework` line; ``docs/adding-a-framework.md`` walks through it and
``tests/integration/test_registry.py`` runs that walk-through.
"""

from __future__ import annotations

from sim import scenario as config
from sim.frameworks.common.base import JobContext
from sim.frameworks.common.entry import (
    FrameworkEntry,
    Options,
    SearchPoint,
    SearchSpace,
    StageSplit,
)
from sim.frameworks.common.power_clock import at_power_limit
from sim.frameworks.ddp.entry import ENTRY as DDP
from sim.frameworks.deepspeed.entry import ENTRY as DEEPSPEED
from sim.frameworks.fairscale.entry import ENTRY as FAIRSCALE
from sim.frameworks.fsdp2.entry import ENTRY as FSDP2
from sim.frameworks.megatron.entry import ENTRY as MEGATRON
from sim.program.ir import Program
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec

__all__ = ["FrameworkEntry", "Options", "SearchPoint", "SearchSpace", "StageSplit",
           "build_program", "framework", "frameworks", "names", "register_framework",
           "searchable", "unregister_framework"]

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


def searchable(model: ModelSpec | None = None) -> tuple[str, ...]:
    """Frameworks the planner searches (those with a search space), in registry order;
    with ``model``, only those whose builder models it (:meth:`FrameworkEntry.builds`: a
    mixture-of-experts model, Megatron only)."""
    return tuple(e.name for e in _ENTRIES.values() if e.search is not None
                 and (model is None or e.builds(model) is None))


def build_program(ctx: JobContext) -> Program:
    """The program of one training step for the scenario's framework."""
    name = ctx.scenario.framework.name
    entry = _ENTRIES.get(name)
    if entry is None:
        ctx.fail("framework.name", f"no schedule builder for {name!r}")
    assert entry is not None
    if ctx.scenario.cluster.sm_clock == "balanced":
        ctx = at_power_limit(ctx, entry.kernel_style(ctx) if entry.kernel_style
                             else Style("bf16"))
    program = entry.build(ctx)
    program.meta["attention_backend"] = ctx.compute.attention_backend
    program.meta["sm_clock_mhz"] = ctx.compute.sm_clock_mhz
    program.validate()
    return program


# --------------------------------------------------------------------------- the built-ins
# One line each: every built-in framework's entry is its package's entry.py (options.py,
# build.py, search.py beside it).
_BUILTINS = (DDP, FSDP2, MEGATRON, DEEPSPEED, FAIRSCALE)
for _entry in _BUILTINS:
    _ENTRIES[_entry.name] = _entry
_sync_schema()   # the built-ins' models are scenario.BUILTIN_FRAMEWORK_OPTIONS: no change
