"""A multi-job file: several training jobs on one shared cluster (CONTRACT.md, "Additions
(2026-12)": ``cluster:`` plus ``jobs: [{scenario, name, nodes | placement, start_s}]``).

Part of the config layer: it validates the file, resolves each job's scenario (a shipped name,
a path, relative to the file first, or an inline mapping), fits it to the shared cluster and
places it on nodes. It runs nothing (:mod:`sim.apps.multijob` does).

Placement (one rule each, on the shared cluster's node numbers ``0 .. nodes-1``):

* ``nodes: [..]``: exactly those nodes, in that order (the job's node ``i`` is ``nodes[i]``);
* ``placement: packed``: the first run of consecutive free nodes long enough (first fit, in
  node order), so a job sits under as few leaves as the free nodes allow;
* ``placement: spread``: one free node from each leaf group in turn (round robin over the
  leaf groups of :class:`sim.fabric.topology.layout.Layout`'s numbering: the zone of
  ``cluster.az_placement`` (:mod:`sim.config.zones`; round robin: ``n % azs``), group
  ``position in the zone // nodes_per_leaf``), so a job crosses as many leaves, and zones, as
  it can;
* ``zone: z`` beside a policy: only zone ``z``'s nodes (round robin: ``z, z + azs, ...``, in
  that order: ``packed`` takes free nodes next to each other in it).

A job is a training scenario (``scenario:``) or background traffic (``traffic: {bytes,
period_s, count, direction, nodes}``, :mod:`sim.program.traffic`); a file needs one training
job at least (the shared fabric's NCCL settings and seed are the first one's).

Jobs are placed in file order, explicit lists first. A job's node count is the length of its
``nodes`` list, else its own scenario's ``cluster.nodes``; its scenario's ``cluster`` is
replaced by the shared one with ``nodes`` set to that count (so every job sees the same GPU,
NICs and switches; its own cluster keys are ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from sim.config import bounds as B
from sim.config import resources
from sim.config.base import ScenarioError, StrictModel
from sim.config.cluster import Cluster
from sim.config.load import (
    _first_error,
    _merge_topology,
    _resolve_histogram,
    parse_set,
    read_yaml,
    scenario_from_dict,
    set_dotted,
)
from sim.config.scenario import Scenario
from sim.config.zones import zone_of_node, zone_position


class Traffic(StrictModel):
    """Background traffic between the job's nodes (:mod:`sim.program.traffic`): every
    ``period_s``, ``count`` times, each GPU sends ``bytes`` to the same GPU of the next node."""

    bytes: float = Field(gt=0, le=B.MAX_TRANSFER_BYTES, allow_inf_nan=False)
    """Bytes each GPU sends per transfer."""
    period_s: float = Field(gt=0, le=B.MAX_DURATION_S, allow_inf_nan=False)
    """Seconds from one transfer's start to the next's (later if a transfer outlasts it)."""
    count: int = Field(default=1, ge=1, le=100_000)
    direction: Literal["ring", "chain"] = "ring"
    """``ring``: node j to node j+1, the last to the first; ``chain``: no wrap around."""
    nodes: int = Field(default=2, ge=2, le=B.MAX_NODES)
    """Nodes to place it on when the job gives ``placement`` (not ``nodes``)."""


class JobEntry(StrictModel):
    """One job of a multi-job file: a training scenario, or background traffic."""

    scenario: str | dict[str, Any] | None = None
    """A shipped scenario's name, a path (relative to the multi-job file first) or an inline
    scenario mapping."""
    traffic: Traffic | None = None
    """Instead of ``scenario``: background traffic."""
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """The job's name: its rows in the output, and the prefix of its collectives' keys."""
    nodes: list[int] | None = None
    """The shared cluster's nodes this job runs on, in the job's node order."""
    placement: Literal["packed", "spread"] | None = None
    """Where to place it when ``nodes`` is not given (default ``packed``)."""
    zone: int | None = Field(default=None, ge=0, le=B.MAX_ZONES)
    """With ``placement``: place it only on nodes of this availability zone (node ``n`` is
    in zone ``n % cluster.azs``, or its block with ``cluster.az_placement: blocks``)."""
    start_s: float = Field(default=0.0, ge=0.0, le=B.MAX_DURATION_S, allow_inf_nan=False)
    """Seconds after the simulation starts that this job's first step starts."""
    steps: int = Field(default=1, ge=1, le=1000)
    """Training steps the job runs, back to back (its summary is per step)."""


class MultiJobFile(StrictModel):
    """Several jobs sharing one cluster's fabric."""

    name: str = "multi-job"
    cluster: dict[str, Any]
    """The shared cluster (the scenario file's ``cluster:`` keys, ``topology:`` included)."""
    jobs: list[JobEntry] = Field(min_length=1)


@dataclass(frozen=True)
class PlacedJob:
    """A validated job: its scenario fitted to the shared cluster (None for background
    traffic, ``traffic`` set) and its nodes."""

    name: str
    scenario: Scenario | None
    nodes: tuple[int, ...]
    start_s: float
    origin: str
    """Where its scenario came from, for messages."""
    steps: int = 1
    traffic: Traffic | None = None


@dataclass(frozen=True)
class MultiJob:
    """A validated multi-job file."""

    name: str
    cluster: Cluster
    jobs: tuple[PlacedJob, ...]
    origin: str

    @property
    def lead(self) -> Scenario:
        """The first training job's scenario on the whole cluster: the shared fabric's
        NCCL settings, seed and allocator come from it."""
        first = next(j.scenario for j in self.jobs if j.scenario is not None)
        return first.model_copy(update={"cluster": self.cluster})


def is_multijob_data(data: dict[str, Any]) -> bool:
    """Whether a file's top-level mapping is a multi-job file (it has ``jobs:``)."""
    return "jobs" in data


def is_multijob_file(ref: str) -> bool:
    """Whether ``ref`` (a path or a shipped scenario's name) is a multi-job file. A file that
    cannot be read or parsed is not (the scenario loader then reports it)."""
    path = resources.resolve("scenarios", ref)
    if path is None:
        return False
    try:
        return is_multijob_data(read_yaml(path))
    except ScenarioError:
        return False


def load_multijob(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> MultiJob:
    """Load and place a multi-job file; ``overrides`` (``cluster.nic_gbps=100``, ...) apply to
    the file before validation. Raises :class:`ScenarioError` with one line naming the file
    and the key on bad input."""
    path = resources.resolve("scenarios", ref)
    if path is None:
        raise ScenarioError(f"{ref}: no such file")
    data = read_yaml(path)
    for assignment in overrides:
        key, value = parse_set(assignment)
        set_dotted(data, key, value)
    return multijob_from_dict(data, str(path), path.parent)


def multijob_from_dict(data: dict[str, Any], origin: str, base: Path | None = None
                       ) -> MultiJob:
    """Validate a multi-job mapping read from ``origin`` (relative scenario paths resolve
    against ``base`` first)."""
    try:
        spec = MultiJobFile.model_validate(data)
    except ValidationError as err:
        raise ScenarioError(f"{origin}: {_first_error(err, data)}") from None
    merged = _merge_topology({"cluster": dict(spec.cluster)}, origin)["cluster"]
    try:
        cluster = Cluster.model_validate(merged)
    except ValidationError as err:
        raise ScenarioError(
            f"{origin}: cluster.{_first_error(err, merged)}") from None
    names = [j.name for j in spec.jobs]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise ScenarioError(f"{origin}: jobs[{i}].name: {n!r} names two jobs")
    for i, j in enumerate(spec.jobs):
        if (j.scenario is None) == (j.traffic is None):
            raise ScenarioError(f"{origin}: jobs[{i}]: give scenario or traffic (one of them)")
    if all(j.scenario is None for j in spec.jobs):
        raise ScenarioError(f"{origin}: jobs: no training job (a scenario), only traffic")
    raw = [_job_data(j, i, origin, base) if j.traffic is None else {}
           for i, j in enumerate(spec.jobs)]
    counts = [len(j.nodes) if j.nodes is not None else
              j.traffic.nodes if j.traffic is not None else _nodes_of(d, i, origin)
              for i, (j, d) in enumerate(zip(spec.jobs, raw, strict=True))]
    placed = place(spec.jobs, counts, cluster, origin)
    jobs: list[PlacedJob] = []
    for i, (j, d) in enumerate(zip(spec.jobs, raw, strict=True)):
        if j.traffic is not None:
            if len(placed[i]) < 2:
                raise ScenarioError(f"{origin}: jobs[{i}].nodes: traffic needs two nodes")
            jobs.append(PlacedJob(j.name, None, placed[i], j.start_s, f"{origin}: jobs[{i}]",
                                  1, j.traffic))
            continue
        where = f"{origin}: jobs[{i}].scenario"
        d = dict(d)
        d["cluster"] = {**merged, "nodes": len(placed[i])}
        sc = scenario_from_dict(d, origin=where)
        if sc.faults is not None and not sc.faults.empty:
            raise ScenarioError(f"{where}.faults: not supported in a multi-job file")
        jobs.append(PlacedJob(j.name, sc, placed[i], j.start_s, where, j.steps))
    return MultiJob(spec.name, cluster, tuple(jobs), origin)


def _job_data(job: JobEntry, i: int, origin: str, base: Path | None) -> dict[str, Any]:
    """The job's scenario mapping (a copy), from a name, a path or inline."""
    assert job.scenario is not None
    if isinstance(job.scenario, dict):
        return dict(job.scenario)
    ref = job.scenario
    path = None
    if base is not None and (base / ref).is_file():
        path = base / ref
    path = path or resources.resolve("scenarios", ref)
    if path is None:
        raise ScenarioError(f"{origin}: jobs[{i}].scenario: no scenario {ref!r} (a path, "
                            "or a shipped name)")
    data = read_yaml(path)
    if is_multijob_data(data):
        raise ScenarioError(f"{origin}: jobs[{i}].scenario: {ref!r} is itself a multi-job "
                            "file")
    _resolve_histogram(data, path.parent)
    return data


def _nodes_of(data: dict[str, Any], i: int, origin: str) -> int:
    """A job's node count from its own scenario's ``cluster.nodes`` (its topology file's when
    the scenario names one), 1 when neither says."""
    cluster = _merge_topology({"cluster": data.get("cluster") or {}}, origin)["cluster"]
    n = cluster.get("nodes", 1) if isinstance(cluster, dict) else 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ScenarioError(f"{origin}: jobs[{i}].scenario: cluster.nodes: a positive "
                            f"integer is needed to place the job (got {n!r})")
    return n


def leaf_group(node: int, c: Cluster) -> tuple[int, int]:
    """(zone, leaf group) of a node: the fabric's numbering (nodes go to zones by
    ``az_placement``, :mod:`sim.config.zones`, then ``nodes_per_leaf`` at a time to a leaf
    group; :class:`sim.fabric.topology.layout.Layout`)."""
    return (zone_of_node(node, c.nodes, c.azs, c.az_placement),
            zone_position(node, c.nodes, c.azs, c.az_placement) // c.nodes_per_leaf)


def place(jobs: list[JobEntry], counts: list[int], c: Cluster, origin: str
          ) -> list[tuple[int, ...]]:
    """Each job's nodes: explicit lists first (checked), then the policies in file order."""
    out: list[tuple[int, ...] | None] = [None] * len(jobs)
    used: dict[int, int] = {}
    total = sum(counts)
    if total > c.nodes:
        raise ScenarioError(f"{origin}: jobs: need {total} nodes, cluster.nodes is {c.nodes}")
    for i, j in enumerate(jobs):
        if j.nodes is None:
            continue
        if j.placement is not None or j.zone is not None:
            raise ScenarioError(f"{origin}: jobs[{i}]: give nodes or placement (and zone), "
                                "not both")
        if not j.nodes:
            raise ScenarioError(f"{origin}: jobs[{i}].nodes: empty")
        for n in j.nodes:
            if not 0 <= n < c.nodes:
                raise ScenarioError(f"{origin}: jobs[{i}].nodes: node {n} is not in the "
                                    f"cluster (nodes 0..{c.nodes - 1})")
            if n in used:
                who = "twice" if used[n] == i else f"also in jobs[{used[n]}]"
                raise ScenarioError(f"{origin}: jobs[{i}].nodes: node {n} {who}")
            used[n] = i
        out[i] = tuple(j.nodes)
    for i, j in enumerate(jobs):
        if out[i] is not None:
            continue
        if j.zone is not None and j.zone >= c.azs:
            raise ScenarioError(f"{origin}: jobs[{i}].zone: {j.zone} is not a zone of the "
                                f"cluster (cluster.azs is {c.azs})")
        # The nodes it may take, in the zone's order (round robin: a zone holds nodes z,
        # z + azs, ...; blocks: a run of consecutive nodes).
        candidates = [n for n in range(c.nodes) if j.zone is None
                      or zone_of_node(n, c.nodes, c.azs, c.az_placement) == j.zone]
        if j.placement == "spread":
            got = _spread([n for n in candidates if n not in used], counts[i], c)
            why = f"no {counts[i]} free nodes"
        else:
            got = _packed(candidates, used, counts[i])
            why = f"no {counts[i]} consecutive free nodes (give nodes: [...] or spread)"
        if got is None:
            where = f" in zone {j.zone}" if j.zone is not None else ""
            raise ScenarioError(f"{origin}: jobs[{i}].placement: {why}{where}")
        for n in got:
            used[n] = i
        out[i] = got
    return [o for o in out if o is not None]


def _packed(candidates: list[int], used: dict[int, int], k: int) -> tuple[int, ...] | None:
    """The first run of ``k`` free nodes next to each other in ``candidates``."""
    run: list[int] = []
    for n in candidates:
        run = [*run, n] if n not in used else []
        if len(run) == k:
            return tuple(run)
    return None


def _spread(free: list[int], k: int, c: Cluster) -> tuple[int, ...] | None:
    """``k`` free nodes taken one per leaf group in turn (groups in (zone, group) order)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for n in free:
        groups.setdefault(leaf_group(n, c), []).append(n)
    queues = [groups[g] for g in sorted(groups)]
    got: list[int] = []
    depth = 0
    while len(got) < k and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(got) < k:
                got.append(q[depth])
        depth += 1
    return tuple(got) if len(got) == k else None
