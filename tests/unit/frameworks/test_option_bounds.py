"""Every number a framework's options take has a bound (issue 16, item 1), as the config
sections' have (tests/unit/config/test_bounds.py): a value past it is one line naming
``framework.KEY`` and the bound, exit 2, never an OverflowError from numpy (exit 1).

Truth: the options models themselves (every int or float field, nested blocks included),
walked from each framework's registry entry.
"""

from __future__ import annotations

import typing

import annotated_types
import pytest
from pydantic import BaseModel

from sim.frameworks import framework
from sim.scenario import ScenarioError, load_scenario

FRAMEWORKS = ("ddp", "fsdp2", "megatron", "deepspeed", "fairscale")


def _numeric_fields(model: type[BaseModel], prefix: str = "framework."):
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        for sub in args:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from _numeric_fields(sub, f"{prefix}{name}.")
        if any(a in (int, float) for a in args):
            yield f"{prefix}{name}", field


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_every_numeric_option_has_an_upper_bound(name: str) -> None:
    unbounded = [key for key, field in _numeric_fields(framework(name).options)
                 if not any(isinstance(m, (annotated_types.Le, annotated_types.Lt))
                            for m in field.metadata)]
    assert unbounded == []


@pytest.mark.parametrize("scenario, key, value", [
    # a finite float numpy cannot size a buffer from (it ended as an OverflowError)
    ("mixtral-8x7b-deepspeed-moe-zero2-ep8-64xh100", "framework.moe.capacity_factor", "1e300"),
    ("llama3-70b-deepspeed-zero3-64xh100", "framework.stage3_prefetch_bucket_size",
     str(10**30)),
    ("llama3-70b-megatron-tp8pp4-64xh100", "framework.bucket_size", str(2**62)),
    ("llama3-70b-fsdp2-64xh100", "framework.hsdp_shard_size", str(2**40)),
])
def test_an_absurd_option_is_one_line_naming_it(scenario: str, key: str, value: str) -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(scenario, [f"{key}={value}"])
    text = str(err.value)
    assert key in text and "less than or equal to" in text and "\n" not in text
