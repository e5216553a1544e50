"""The base of every scenario model, and the one error bad input raises.

Part of the config layer (``sim.scenario`` re-exports both names): every section of a
scenario file is a :class:`StrictModel`, so a misspelt key is an error that names itself, and
a validated scenario cannot change under the builders.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8", "blockwise"]
"""Transformer Engine's FP8 scaling recipes as Megatron-LM names them (``--fp8-recipe``):
``delayed`` (``DelayedScaling``: one scale a tensor, from its amax history), ``tensorwise``
(``Float8CurrentScaling``: one scale a tensor, from its own amax; NeMo's FP8-CS), ``mxfp8``
(``MXFP8BlockScaling``: an E8M0 scale per 32 consecutive elements, which Blackwell's tensor
cores apply; NeMo's MXFP8 / FP8-MX) and ``blockwise`` (``Float8BlockScaling``: an fp32 scale per
1x128 block of activations and gradients and per 128x128 block of weights, DeepSeek-V3's
recipe). A schema type: the framework options and the workload's kernel rules share it."""


class ScenarioError(Exception):
    """Bad input: the message is one line naming the file and the key path."""


class StrictModel(BaseModel):
    """A scenario section: unknown keys are errors, and it is frozen once validated.

    (A class docstring is not inherited, so each section's own becomes its JSON Schema
    description.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)
