"""Loading a scenario: YAML files, shipped names, topology files, ``--set`` overrides, and
pydantic's errors rendered as one line naming the file and the key path.

Part of the config layer (``sim.scenario`` re-exports these names).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sim.config import bounds, resources
from sim.config.base import BOOL_FOR_NUMBER, ScenarioError
from sim.config.cluster import Cluster
from sim.config.key_hints import unknown_key_hint
from sim.config.scenario import Scenario, framework_names, framework_option_models

_UNION_TAGS = {"model": ("str", "ModelDims")}


def _union_tags(field: Any) -> tuple[str, ...]:
    return framework_names() if field == "framework" else _UNION_TAGS.get(field, ())


def _branch(item: Any) -> Any:
    """A union branch's tag without the wrapper pydantic names a model with an after-validator
    by ("function-after[_check_variants(), ModelDims]" -> "ModelDims")."""
    if isinstance(item, str) and item.startswith("function-") and item.endswith("]"):
        return item[:-1].rsplit(", ", 1)[-1]
    return item


def _loc_items(loc: tuple[Any, ...]) -> list[Any]:
    """``loc`` without the branch tags pydantic inserts after a union field ("model" ->
    "ModelDims", "framework" -> "fsdp2"), and only there: a user's key may be called
    anything."""
    items: list[Any] = []
    prev: Any = None
    for item in loc:
        if isinstance(prev, str) and _branch(item) in _union_tags(prev):
            prev = None
            continue
        items.append(item)
        prev = item
    return items


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in _loc_items(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _first_error(err: ValidationError, data: dict[str, Any]) -> str:
    errors = err.errors()
    # An inline model mapping fails both union branches; the string branch's complaint
    # ("should be a valid string") says nothing useful, so report the mapping's own error.
    if isinstance(data.get("model"), dict):
        dims = [e for e in errors
                if tuple(map(_branch, e["loc"][:2])) == ("model", "ModelDims")]
        others = [e for e in errors if e["loc"][:1] != ("model",)]
        errors = others + dims if others else dims or errors
    e = errors[0]
    loc = _format_loc(tuple(e["loc"]))
    if e["type"] == "extra_forbidden":
        items = _loc_items(tuple(e["loc"]))
        hint = "" if any(isinstance(i, int) for i in items) else unknown_key_hint(
            [str(i) for i in items], data, Scenario, framework_option_models())
        return f"{loc}: unknown key{hint}"
    if e["type"] == "union_tag_invalid":
        return (f"{loc}.name: unknown framework {e['input'].get('name')!r} "
                f"(available: {', '.join(framework_names())})")
    if e["type"] == "union_tag_not_found":
        return f"{loc}.name: missing"
    if e["type"] == BOOL_FOR_NUMBER:
        key = e["ctx"]["key"]
        return f"{loc}.{key}: {e['msg']}" if loc != "(top level)" else f"{key}: {e['msg']}"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "value_error":
        return msg
    return f"{loc}: {msg} (got {e.get('input')!r})"


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c = value`` in nested dicts, creating mappings on the way.

    Examples
    --------
    >>> d = {"cluster": {"nodes": 1}}
    >>> set_dotted(d, "cluster.nic_gbps", 100); d
    {'cluster': {'nodes': 1, 'nic_gbps': 100}}
    """
    parts = key.split(".")
    if not all(parts):
        raise ScenarioError(f"--set {key}: empty key path")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, dict):
            if part not in node or node[part] is None:
                node[part] = {}
            elif isinstance(node[part], str) and part in ("model", "framework"):
                # `model: llama3-8b` or `framework: fsdp2` shorthand turned into a mapping.
                node[part] = {"name": node[part]}
            node = node[part]
        if not isinstance(node, dict):
            path = ".".join(parts[: i + 1])
            raise ScenarioError(f"--set {key}: {path} is not a mapping")
    node[parts[-1]] = value


def parse_set(assignment: str) -> tuple[str, Any]:
    """Split ``key.path=value``; the value is a YAML scalar (``100``, ``true``, ``ring``)."""
    if "=" not in assignment:
        raise ScenarioError(f"--set {assignment}: expected KEY=VALUE")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


MAX_FILE_BYTES = 4 << 20
"""A scenario or topology file larger than this is refused before it is read: the largest
shipped one is a few kB (measured per-expert loads go in their own file)."""
MAX_EXPANDED_NODES = 1_000_000
"""Values a scenario may hold once YAML's aliases are expanded: anchors are plain data, but
nested aliases ("billion laughs") would make validation walk ~10^9 values (a hang)."""


def read_yaml(path: Path) -> dict[str, Any]:
    """A scenario or topology file as data: ``yaml.safe_load`` (no tags that construct
    objects), at most :data:`MAX_FILE_BYTES`, at most :data:`MAX_EXPANDED_NODES` values once
    its aliases are expanded; a top-level mapping. Anything else is one line naming the file."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ScenarioError(f"{path}: {path.stat().st_size:,} bytes, more than a scenario "
                                f"file holds ({MAX_FILE_BYTES:,} at most)")
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not a text file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{path}:{where} not valid YAML") from None
    except RecursionError:
        raise ScenarioError(f"{path}: nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: top level must be a mapping")
    if _expanded_size(data, {}) > MAX_EXPANDED_NODES:
        raise ScenarioError(f"{path}: its YAML aliases expand to more than "
                            f"{MAX_EXPANDED_NODES:,} values")
    return data


def _expanded_size(value: Any, seen: dict[int, int], depth: int = 0) -> int:
    """Values in ``value`` with every shared (aliased) container counted each time it is
    referenced, computed once per container (linear in the file, not in the expansion)."""
    if not isinstance(value, (dict, list)):
        return 1
    key = id(value)
    if key in seen:
        return seen[key]
    if depth > 200:
        return MAX_EXPANDED_NODES + 1   # a self-referencing alias or absurd nesting
    seen[key] = MAX_EXPANDED_NODES + 1   # a cycle back to here counts as too large
    items = value.values() if isinstance(value, dict) else value
    total = 1
    for item in items:
        total += _expanded_size(item, seen, depth + 1)
        if total > MAX_EXPANDED_NODES:
            break
    seen[key] = total
    return total


TOPOLOGY_META_KEYS = ("name", "description", "sources")

_TOPOLOGIES: dict[tuple[str, int, int], dict[str, Any]] = {}
"""Topology files read, by path, modification time and size: ``fabricsim plan`` loads a
scenario for every layer profile (tens of thousands), and parsing the same topology file
again took a quarter of its time."""


def _read_topology(path: Path) -> dict[str, Any]:
    """:func:`read_yaml` of a topology file, remembered while the file is unchanged (a deep
    copy each time: the caller's data is its own)."""
    try:
        st = path.stat()
    except OSError:
        return read_yaml(path)   # its one-line error
    key = (str(path), st.st_mtime_ns, st.st_size)
    data = _TOPOLOGIES.get(key)
    if data is None:
        if len(_TOPOLOGIES) >= 64:
            _TOPOLOGIES.clear()
        data = _TOPOLOGIES[key] = read_yaml(path)
    return copy.deepcopy(data)


def _merge_topology(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """Fill cluster fields from the named topology file; inline fields win."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict) or not cluster.get("topology"):
        return data
    ref = cluster["topology"]
    if not isinstance(ref, str):
        raise ScenarioError(f"{origin}: cluster.topology: expected a name or a path")
    path = resources.resolve("topologies", ref)
    if path is None:
        names = ", ".join(resources.available("topologies")) or "none"
        raise ScenarioError(
            f"{origin}: cluster.topology: no topology {ref!r} (shipped: {names})"
        )
    topo = _read_topology(path)
    fields = {k: v for k, v in topo.items() if k not in TOPOLOGY_META_KEYS}
    unknown = sorted(set(fields) - set(Cluster.model_fields))
    if unknown:
        raise ScenarioError(f"{path}: {unknown[0]}: unknown key")
    merged = dict(fields)
    merged.update(cluster)
    out = dict(data)
    out["cluster"] = merged
    return out


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    # `framework: fsdp2` is accepted as shorthand for `framework: {name: fsdp2}`.
    if isinstance(data.get("framework"), str):
        data = dict(data)
        data["framework"] = {"name": data["framework"]}
    model = data.get("model")
    if isinstance(model, dict):
        data = dict(data)
        data["model"] = catalogue_model_with_overrides(model)
    return data


def catalogue_model_with_overrides(model: dict[str, Any]) -> dict[str, Any]:
    """A model mapping naming a catalogue model without its dimensions (``{name:
    deepseek-v3, mtp_layers: 0}``, what ``--set model.mtp_layers=0`` makes of ``model:
    deepseek-v3``): the catalogue entry's fields with the mapping's over them; any other
    mapping as given (a ``name`` beside ``layers`` labels a model described in full).

    Examples
    --------
    >>> m = catalogue_model_with_overrides({"name": "deepseek-v3", "mtp_layers": 0})
    >>> m["name"], m["layers"], m["mtp_layers"], "source" in m
    ('deepseek-v3', 61, 0, False)
    >>> catalogue_model_with_overrides({"name": "mine", "layers": 2})
    {'name': 'mine', 'layers': 2}
    """
    from sim import catalog  # late import: as scenario_from_dict's

    name = model.get("name")
    if "layers" in model or not isinstance(name, str) or name not in catalog.model_names():
        return model
    entry = {k: v for k, v in catalog.model_entry(name).items() if k != "source"}
    return {**entry, **model}


def scenario_from_dict(data: dict[str, Any], origin: str = "<scenario>") -> Scenario:
    """Validate a scenario mapping; raise ScenarioError with one line on bad input."""
    data = _merge_topology(_normalise(data), origin)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(f"{origin}: {_first_error(err, data)}") from None
    # Under the fields' own bounds: what a section without them (a framework's options)
    # took, "1e400" read as inf included.
    beyond = bounds.unrepresentable(scenario.model_dump())
    if beyond:
        raise ScenarioError(f"{origin}: {beyond}")
    from sim import catalog  # late import: catalogue loading is not needed for validation

    if isinstance(scenario.model, str) and scenario.model not in catalog.model_names():
        names = ", ".join(catalog.model_names())
        raise ScenarioError(f"{origin}: model: unknown model {scenario.model!r} (known: {names})")
    return scenario


def load_scenario(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Load a scenario by path or shipped name and apply ``key.path=value`` overrides.

    Examples
    --------
    >>> s = load_scenario("llama3.2-1b-1xh200", ["training.seq_len=2048"])
    >>> s.training.seq_len
    2048
    """
    path = resources.resolve("scenarios", ref)
    if path is None:
        names = ", ".join(resources.available("scenarios")) or "none"
        raise ScenarioError(f"{ref}: no such file or shipped scenario (shipped: {names})")
    data = read_yaml(path)
    for assignment in overrides:
        key, value = parse_set(assignment)
        set_dotted(data, key, value)
    _resolve_histogram(data, path.parent)
    return scenario_from_dict(data, origin=str(path))


def _resolve_histogram(data: dict[str, Any], base: Path) -> None:
    """A relative ``training.routing.histogram`` (or ``training.moe_routing.file``) path names
    a file beside the scenario when one is there (else it stays relative to the working
    directory)."""
    training = data.get("training")
    if not isinstance(training, dict):
        return
    for section, key in (("routing", "histogram"), ("moe_routing", "file")):
        routing = training.get(section)
        if not isinstance(routing, dict):
            continue
        h = routing.get(key)
        if isinstance(h, str) and not Path(h).is_absolute() and (base / h).is_file():
            routing[key] = str(base / h)
