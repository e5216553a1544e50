"""The base of every scenario model, and the one error bad input raises.

Part of the config layer (``sim.scenario`` re-exports both names): every section of a
scenario file is a :class:`StrictModel`, so a misspelt key is an error that names itself, and
a validated scenario cannot change under the builders.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ScenarioError(Exception):
    """Bad input: the message is one line naming the file and the key path."""


class StrictModel(BaseModel):
    """A scenario section: unknown keys are errors, and it is frozen once validated.

    (A class docstring is not inherited, so each section's own becomes its JSON Schema
    description.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)
