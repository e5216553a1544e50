"""The scenario file: pydantic models, loading, ``--set`` overrides and one-line errors.

No simulation logic lives here. A scenario is validated once, frozen, and handed to the
builders. Every model forbids unknown keys, so a misspelt key is an error that names itself.

The public contract for these keys is ``CONTRACT.md``: keys may be added, never renamed.

This module is the config layer's import surface: the names the README, the notebooks, the
framework registry and the rest of fabricsim import from ``sim.scenario`` stay here, while
each concern has its own module:

* :mod:`sim.config.base`: :class:`ScenarioError` and the strict base of every section;
* :mod:`sim.config.cluster`: ``cluster:`` (machines, fabric, zones, regions, power cap);
* :mod:`sim.config.training`: the model's dimensions, ``parallelism:``, ``training:``,
  ``allocator:``, ``nccl:``, ``pricing:`` and ``claims:``;
* ``sim/frameworks/<name>/options.py``: the ``framework:`` options of each built-in
  framework (each imports only :mod:`sim.config.base`);
* :mod:`sim.config.scenario`: :class:`Scenario`, the ``framework`` union the registry sets
  (:func:`set_framework_options`) and the JSON Schema;
* :mod:`sim.config.load`: files, shipped names, topology files, ``--set`` and the one-line
  error rendering.
"""

from __future__ import annotations

from sim.config.base import ScenarioError, StrictModel
from sim.config.cluster import Cluster, GpuName
from sim.config.load import (
    TOPOLOGY_META_KEYS,
    load_scenario,
    parse_set,
    read_yaml,
    scenario_from_dict,
    set_dotted,
)
from sim.config.scenario import (
    BUILTIN_FRAMEWORK_OPTIONS,
    FRAMEWORK_NAMES,
    FrameworkOptions,
    Scenario,
    framework_names,
    json_schema,
    options_name,
    set_framework_options,
)
from sim.config.training import (
    Allocator,
    Claims,
    ModelDims,
    Nccl,
    Parallelism,
    Pricing,
    Routing,
    Training,
)
from sim.frameworks.ddp.options import DdpOptions
from sim.frameworks.deepspeed.options import DeepSpeedOptions, DeepSpeedPipeline, ZeroPlusPlus
from sim.frameworks.fairscale.options import FairscaleOptions
from sim.frameworks.fsdp2.options import Fsdp2Options
from sim.frameworks.megatron.options import MegatronOptions

__all__ = [
    "BUILTIN_FRAMEWORK_OPTIONS", "FRAMEWORK_NAMES", "TOPOLOGY_META_KEYS",
    "Allocator", "Claims", "Cluster", "DdpOptions", "DeepSpeedOptions", "DeepSpeedPipeline",
    "FairscaleOptions", "FrameworkOptions", "Fsdp2Options", "GpuName", "MegatronOptions",
    "ModelDims", "Nccl", "Parallelism", "Pricing", "Routing", "Scenario", "ScenarioError",
    "StrictModel", "Training", "ZeroPlusPlus",
    "framework_names", "json_schema", "load_scenario", "options_name", "parse_set",
    "read_yaml", "scenario_from_dict", "set_dotted", "set_framework_options",
]
