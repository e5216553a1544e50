"""A sweep's grid: ``--grid KEY=V1,V2`` options parsed, expanded to every combination, and each
variant's scenario loaded before anything runs.

Part of :mod:`sim.apps.sweep` (which re-exports every public name here; its docstring describes
the phases). A value is parsed as ``--set`` parses it (:func:`sim.scenario.parse_set`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.scenario import Scenario, ScenarioError, load_scenario, parse_set


@dataclass(frozen=True)
class GridAxis:
    """One ``--grid KEY=V1,V2`` option: a dotted scenario key and its values."""

    key: str
    """Dotted path into the scenario (``cluster.nic_gbps``)."""
    raws: tuple[str, ...]
    """Each value as written, handed to the scenario loader as ``KEY=RAW``."""
    values: tuple[Any, ...]
    """Each value parsed as ``--set`` parses it (a YAML scalar or flow collection)."""


@dataclass(frozen=True)
class Variant:
    """One combination of grid values."""

    index: int
    """Position in grid order (the row's position in the output)."""
    values: dict[str, Any]
    """Grid key -> parsed value, in grid order."""
    overrides: tuple[str, ...]
    """``KEY=RAW`` assignments for :func:`sim.scenario.load_scenario`."""


def split_values(text: str) -> list[str]:
    """Split ``V1,V2,...`` at the commas outside brackets, braces and quotes, so a value may
    be a YAML flow collection (``{layers: 2, hidden: 512}``) or a quoted string with a comma.

    Examples
    --------
    >>> split_values("100,200")
    ['100', '200']
    >>> split_values("{a: 1, b: 2},[1, 2],'x,y'")
    ['{a: 1, b: 2}', '[1, 2]', "'x,y'"]
    """
    parts: list[str] = []
    depth = 0
    quote = ""
    start = 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def canonical(value: Any) -> str:
    """One text per value, so that equal values given in different spellings compare equal."""
    return json.dumps(value, sort_keys=True, default=str)


def parse_grid(specs: Sequence[str]) -> list[GridAxis]:
    """Parse ``--grid KEY=V1,V2,...`` options; raise ScenarioError (one line) on bad syntax,
    an empty key path or value, a key given twice or a value given twice for one key."""
    axes: list[GridAxis] = []
    seen: set[str] = set()
    for spec in specs:
        if "=" not in spec:
            raise ScenarioError(f"--grid {spec}: expected KEY=V1,V2,...")
        key, text = (s.strip() for s in spec.split("=", 1))
        if not key or not all(key.split(".")):
            raise ScenarioError(f"--grid {spec}: empty key path")
        if key in seen:
            raise ScenarioError(f"--grid {key}: given twice (put all its values in one --grid)")
        seen.add(key)
        raws = split_values(text)
        if any(not r for r in raws):
            raise ScenarioError(f"--grid {spec}: empty value")
        # The same parse as `--set KEY=VALUE` (sim.scenario.parse_set), value by value.
        values = [parse_set(f"{key}={raw}")[1] for raw in raws]
        canon = [canonical(v) for v in values]
        for i, c in enumerate(canon):
            if c in canon[:i]:
                raise ScenarioError(f"--grid {key}: value {raws[i]} given twice")
        axes.append(GridAxis(key, tuple(raws), tuple(values)))
    return axes


def expand(axes: Sequence[GridAxis]) -> list[Variant]:
    """Every combination of the axes' values, in grid order: the first key varies slowest."""
    combos = itertools.product(*(range(len(a.values)) for a in axes))
    return [
        Variant(i, {a.key: a.values[j] for a, j in zip(axes, combo, strict=True)},
                tuple(f"{a.key}={a.raws[j]}" for a, j in zip(axes, combo, strict=True)))
        for i, combo in enumerate(combos)
    ]


def load_variants(scenario: str, axes: Sequence[GridAxis], variants: Sequence[Variant]
                  ) -> list[Scenario | str]:
    """Each variant's validated scenario, or the loader's one-line error where the combination
    is refused.

    Raises ScenarioError when the input itself is bad: every variant refused (the scenario or
    the grid as a whole), or one grid value refused in every variant it appears in (an
    unknown key, a wrong type, a value out of range for every combination).
    """
    loaded: list[Scenario | str] = []
    for v in variants:
        try:
            loaded.append(load_scenario(scenario, list(v.overrides)))
        except ScenarioError as exc:
            loaded.append(str(exc))
    errors = [x for x in loaded if isinstance(x, str)]
    if not errors:
        return loaded
    if len(errors) == len(loaded):
        load_scenario(scenario)   # the scenario itself is bad: its own error, unprefixed
    # Values refused in every variant they appear in; blame first the one whose key the
    # error names (an unknown key fails every other key's values too when it is alone).
    culprits: list[str] = []
    for axis in axes:
        for raw, value in zip(axis.raws, axis.values, strict=True):
            mine = [x for v, x in zip(variants, loaded, strict=True)
                    if canonical(v.values[axis.key]) == canonical(value)]
            if all(isinstance(x, str) for x in mine):
                line = f"--grid {axis.key}={raw}: {mine[0]}"
                if f"{axis.key}:" in str(mine[0]) or f"{axis.key}." in str(mine[0]):
                    raise ScenarioError(line)
                culprits.append(line)
    if culprits:
        raise ScenarioError(culprits[0])
    return loaded

