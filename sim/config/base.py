"""The base of every scenario model, and the one error bad input raises.

Part of the config layer (``sim.scenario`` re-exports both names): every section of a
scenario file is a :class:`StrictModel`, so a misspelt key is an error that names itself, and
a validated scenario cannot change under the builders.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

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

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        # Pydantic's lax mode reads true as 1 and false as 0 where a number is due, so a
        # YAML 1.1 "yes" or "on" (PyYAML's booleans) silently became a one-token sequence or
        # one node. A wrong type is an error, as every other one is; the loader adds the key
        # (``BOOL_FOR_NUMBER``'s ``key``) to the section's path.
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(value, bool) and field is not None and \
                        wants_number_not_bool(field.annotation):
                    raise PydanticCustomError(BOOL_FOR_NUMBER, "expected a number, got "
                                              "{value}", {"key": key,
                                                          "value": str(value).lower()})
        return data


BOOL_FOR_NUMBER = "bool_for_number"
"""The error type of a boolean given where a section's field wants a number."""


def wants_number_not_bool(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and not a bool (``int``, ``float``,
    ``int | None``, ``Annotated[int, ...]``; not ``bool | int``).

    Examples
    --------
    >>> wants_number_not_bool(int | None), wants_number_not_bool(bool | int)
    (True, False)
    """
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return wants_number_not_bool(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return bool not in args and any(wants_number_not_bool(a) for a in args)
    return annotation in (int, float)
