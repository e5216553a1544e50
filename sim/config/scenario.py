"""The whole scenario (:class:`Scenario`), its ``framework:`` union, and its JSON Schema.

Part of the config layer (``sim.scenario`` re-exports these names). ``Scenario.framework`` is
the discriminated union (by ``name``) of the registered frameworks' options models: the
registry (:mod:`sim.frameworks.registry`) pushes it here with :func:`set_framework_options`.
Until then it is the union of the built-ins' models, which this module imports from their
packages' ``options.py`` (each imports only :mod:`sim.config.base`: the one edge from config
into a framework package, allowed by the ``config-at-bottom`` contract); nothing else of a
framework is imported here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo

from sim.config import bounds as B
from sim.config.base import StrictModel
from sim.config.cluster import Cluster
from sim.config.faults import Faults
from sim.config.run import Run
from sim.config.training import (
    Allocator,
    Claims,
    ModelDims,
    Nccl,
    Parallelism,
    Pricing,
    Training,
)
from sim.frameworks.ddp.options import DdpOptions
from sim.frameworks.deepspeed.options import DeepSpeedOptions
from sim.frameworks.fairscale.options import FairscaleOptions
from sim.frameworks.fsdp2.options import Fsdp2Options
from sim.frameworks.megatron.options import MegatronOptions

FrameworkOptions = Annotated[DdpOptions | Fsdp2Options | MegatronOptions | DeepSpeedOptions
                             | FairscaleOptions,
                             Field(discriminator="name")]
"""The built-in frameworks' options, for type checkers and for the schema before
:mod:`sim.frameworks.registry` is imported. The registry owns the list: its entries point at
these models (each in its package's ``options.py``), and registering
a framework adds its options model to ``Scenario.framework``
(:func:`sim.scenario.set_framework_options`)."""
BUILTIN_FRAMEWORK_OPTIONS: tuple[type[BaseModel], ...] = (
    DdpOptions, Fsdp2Options, MegatronOptions, DeepSpeedOptions, FairscaleOptions)


def options_name(model: type[BaseModel]) -> str:
    """The ``framework.name`` an options model answers to: its ``name: Literal[...]`` field.

    Examples
    --------
    >>> options_name(Fsdp2Options)
    'fsdp2'
    """
    field = model.model_fields.get("name")
    args = get_args(field.annotation) if field is not None else ()
    if field is None or get_origin(field.annotation) is not Literal or len(args) != 1 \
            or not isinstance(args[0], str):
        raise TypeError(f"{model.__name__}: a framework's options need a field "
                        "name: Literal['<framework name>']")
    return str(args[0])


class Scenario(StrictModel):
    """One training job on one cluster."""

    name: str = "scenario"
    """A label for reports."""
    model: str | ModelDims
    """A catalogue name (``llama3-70b``) or a mapping of dimensions."""
    cluster: Cluster = Cluster()
    framework: FrameworkOptions = Field(default_factory=lambda: DdpOptions(name="ddp"))
    nccl: Nccl = Nccl()
    allocator: Allocator = Allocator()
    """PyTorch's caching allocator (``sim.engine.allocator``)."""
    parallelism: Parallelism = Parallelism()
    training: Training = Training()
    pricing: Pricing = Pricing()
    claims: Claims | None = None
    run: Run | None = None
    """A whole run (checkpoints, failures, restarts); needs ``training.tokens_total``."""
    faults: Faults | None = None
    """Faults inside a step: slow GPUs, slow and failed NIC links (:mod:`sim.config.faults`)."""
    seed: int = Field(default=0, ge=0, le=B.MAX_SEED)
    """Seed for every random choice (ECMP hashing); same seed, same numbers."""

    @property
    def gpus(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @model_validator(mode="after")
    def _check_layout(self) -> Scenario:
        if self.cluster.nodes > 1 and self.cluster.nics_per_node < 1:
            raise ValueError("cluster.nics_per_node: servers need a NIC to reach each other "
                             f"({self.cluster.nodes} nodes, 0 NICs)")
        p = self.parallelism
        n = self.gpus
        if n > B.MAX_GPUS:
            raise ValueError(f"cluster.nodes: {self.cluster.nodes} nodes x "
                             f"{self.cluster.gpus_per_node} GPUs = {n} GPUs, more than "
                             f"{B.MAX_GPUS:,} (the largest clusters built hold 100-200 thousand)")
        fixed = p.tp * p.pp * p.cp
        if p.dp is None:
            if n % fixed:
                raise ValueError(
                    f"parallelism: tp*pp*cp = {fixed} does not divide the {n} GPUs"
                )
        elif fixed * p.dp != n:
            raise ValueError(
                f"parallelism: tp*pp*dp*cp = {fixed * p.dp} but the cluster has {n} GPUs"
            )
        if self.run is not None and self.training.tokens_total is None:
            raise ValueError("run: needs training.tokens_total (the tokens of the whole run)")
        if self.run is not None and self.run.zone_outage is not None and self.cluster.azs < 2:
            raise ValueError("run.zone_outage: needs a cluster over 2 or more zones "
                             f"(cluster.azs is {self.cluster.azs})")
        expert = p.expert_tp * p.ep * p.pp
        if n % expert:
            # parallel_state.initialize_model_parallel: the expert layout (etp, ep, expert-dp,
            # pp) must tile the same world as the attention's.
            raise ValueError(f"parallelism.ep: etp*ep*pp = {p.expert_tp}*{p.ep}*{p.pp} = "
                             f"{expert} does not divide the {n} GPUs")
        return self

    @model_validator(mode="after")
    def _check_claims(self) -> Scenario:
        # The run_usd claim is judged by the hours its dollars buy (sim/analysis/claims.py):
        # at a price of nothing they buy any number.
        if self.claims is not None and self.claims.run_usd is not None \
                and self.pricing.gpu_hour_usd == 0:
            raise ValueError("claims.run_usd: cannot be judged with pricing.gpu_hour_usd 0 "
                             "(free GPUs: any run costs nothing)")
        return self

    @property
    def dp(self) -> int:
        p = self.parallelism
        return p.dp if p.dp is not None else self.gpus // (p.tp * p.pp * p.cp)



_framework_options: tuple[type[BaseModel], ...] = BUILTIN_FRAMEWORK_OPTIONS
_BUILTIN_FRAMEWORK_FIELD = Scenario.model_fields["framework"]


def framework_names() -> tuple[str, ...]:
    """``framework.name`` values the schema accepts, in the registry's order."""
    return tuple(options_name(m) for m in _framework_options)


def framework_option_models() -> tuple[type[BaseModel], ...]:
    """The options models of the registered frameworks, in the registry's order."""
    return _framework_options


def set_framework_options(models: tuple[type[BaseModel], ...]) -> None:
    """Make ``Scenario.framework`` the discriminated union of ``models`` (by ``name``).

    Called by :mod:`sim.frameworks.registry` whenever its entries change, so the schema,
    ``fabricsim schema`` and the "unknown framework" message list exactly the registered
    frameworks; config itself imports no framework. A no-op when nothing changed."""
    global _framework_options
    models = tuple(models)
    if models == _framework_options:
        return
    names = [options_name(m) for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"two options models for one framework name: {names}")
    if models == BUILTIN_FRAMEWORK_OPTIONS:
        field = _BUILTIN_FRAMEWORK_FIELD          # exactly the field the class was built with
    else:
        union: Any = Union[models] if len(models) > 1 else models[0]  # noqa: UP007 (runtime)
        field = FieldInfo.merge_field_infos(
            _BUILTIN_FRAMEWORK_FIELD,
            annotation=Annotated[union, Field(discriminator="name")] if len(models) > 1
            else union)
    Scenario.__pydantic_fields__["framework"] = field
    Scenario.model_rebuild(force=True)
    _framework_options = models


# Kept for older imports: the built-in frameworks (the registry may hold more).
FRAMEWORK_NAMES = framework_names()


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file."""
    return Scenario.model_json_schema()
