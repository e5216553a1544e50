"""``fabricsim plan``: search the frameworks and parallel layouts that fit a model on a cluster.

The model, the cluster, the sequence length, the global batch and the precision stay as the
scenario gives them; everything else a team chooses when it sets up a run is searched:

* the framework (Megatron-LM, FSDP2, DeepSpeed ZeRO 1/2/3, FairScale FSDP, DDP) and the
  options that change memory or communication (ZeRO stage, FSDP ``reshard_after_forward``,
  FSDP2's HSDP shard size); the rest at the frameworks' recipe values;
* tensor (inside a node), pipeline, context and data parallelism, Megatron's and torchtitan's
  interleaved pipeline chunks, the micro-batch size and activation recomputation.

Each phase is cheap enough to decide what the next one spends time on:

1. **Enumerate** (:func:`enumerate_layouts`) every combination; each layout is a set of
   overrides of the scenario (:meth:`Layout.varied`, usable as ``--set KEY=VALUE``).
2. **Profile** (:func:`layer_profile`): one layer's forward, backward and recomputation per
   micro-batch, built once per framework x tensor/context split x micro-batch size x
   recomputation on a 2-layer copy of the model. It gives every layout a lower bound on its
   step time (:func:`profile_bound`: its busiest stage's layers x micro-batches, plus the
   pipeline ramp), and refuses at once the splits the framework refuses.
3. **Build** layouts best bound first (``JobContext`` + ``build_program``, no simulation;
   long pipelines as a shorter step, :func:`proxy_micro_batches`). A refusal (ScenarioError
   naming a key path) drops the layout, counted under that key. A built program gives the
   memory estimate (:func:`memory_estimate`) and a tighter lower bound, the earliest
   schedule of its ops (:func:`_earliest_schedule`). Layouts above the GPU's usable memory
   are dropped, and with them the layouts of the same family that need more (larger
   micro-batches, less recomputation).
4. **Simulate** (branch and bound): the fitting layouts in order of their bound, several at
   once, until the next bound is no better than the K-th best simulated result (nothing left
   can enter the top K) or the simulation budget is spent. The scenario as given is
   simulated too, for comparison.
5. **Report** the top K by step time or by dollars per million tokens, each with what makes
   it fast (exposed communication, pipeline bubble, recomputation, memory headroom); with
   ``--out``, plan.json and plan.csv (every layout, its status and reason) and pareto.png.

See docs/planner.md for the measurements behind the bounds and the estimate.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from sim.executor import (
    BACKENDS,
    Backend,
    Outcome,
    Pool,
    Task,
    attempt,
    cpu_count,
    simulate_in_order,
    type_and_message,
)
from sim.frameworks import registry
from sim.frameworks.registry import SearchPoint, SearchSpace
from sim.host_clock import host_issues, issue_order, issue_time
from sim.scenario import (
    Scenario,
    ScenarioError,
    load_scenario,
    scenario_from_dict,
)

GIB = float(2**30)
OBJECTIVES = ("time", "cost")
PLAN_ORIGIN = "plan"
"""The origin the planner's builds report in their ScenarioError (``plan: KEY: message``)."""

DEFAULT_TOP = 5
DEFAULT_MAX_SIMULATIONS = 16
"""Simulations at most, whatever the bounds say. Llama 3 70B on 64 H100: the 16 best bounds
are all Megatron layouts of 1.6-7 s each, 50 CPU-seconds; the search as a whole stays under
two minutes on two cores (docs/planner.md)."""
CP_MAX = 8
"""Context-parallel degrees searched: powers of two up to this. Context parallelism splits
the sequence; beyond 8 ranks the per-rank sequence of the common 4k-8k training lengths is a
few hundred tokens, where attention no longer dominates (Megatron-LM's context-parallel
guide uses cp 2-8 for 8k-128k sequences)."""
VP_MAX = 8
"""Interleaved pipeline chunks per stage searched at most: each chunk adds p2p transfers per
micro-batch; NeMo's recipes use 2-8 (Llama 3 70B: 5 on pp 4; 405B: 8 on pp 8)."""


# --------------------------------------------------------------------------- layouts
@dataclass(frozen=True, order=True)
class Layout:
    """One point of the search: the keys of the scenario the planner sets."""

    framework: str
    tp: int
    pp: int
    dp: int
    cp: int
    vp: int
    micro_batch_size: int
    activation_checkpointing: str
    options: tuple[tuple[str, Any], ...] = ()
    """Framework options the planner sets (``framework.<key>``), sorted by key."""

    def varied(self) -> dict[str, Any]:
        """The scenario keys this layout sets, as dotted paths (usable as ``--set KEY=V``).

        Examples
        --------
        >>> Layout("fsdp2", 1, 1, 8, 1, 1, 1, "full",
        ...        (("reshard_after_forward", True),)).varied()["framework.reshard_after_forward"]
        True
        """
        out: dict[str, Any] = {"framework.name": self.framework}
        out.update({f"framework.{k}": v for k, v in self.options})
        out.update({"parallelism.tp": self.tp, "parallelism.pp": self.pp,
                    "parallelism.dp": self.dp, "parallelism.cp": self.cp,
                    "parallelism.vp": self.vp,
                    "parallelism.sequence_parallel": self.sequence_parallel,
                    "training.micro_batch_size": self.micro_batch_size,
                    "training.activation_checkpointing": self.activation_checkpointing})
        return out

    @property
    def sequence_parallel(self) -> bool:
        # Megatron's sequence parallelism whenever tensor parallelism is used (Korthikanti et
        # al., "Reducing Activation Recomputation in Large Transformer Models", 2022: the
        # norms' and dropouts' activations split t ways for the same bytes moved, an
        # all-reduce becoming a reduce-scatter plus an all-gather). torchtitan's tensor
        # parallelism always shards the sequence (the flag is Megatron's only): the
        # registry entry's search space says which framework sets it.
        space = _space(self.framework)
        return space is not None and space.sequence_parallel and self.tp > 1

    def label(self) -> str:
        """A short name: ``megatron tp8 pp4 vp2 dp2 mbs1 selective``.

        Examples
        --------
        >>> Layout("deepspeed", 1, 1, 64, 1, 1, 1, "full", (("zero_stage", 3),)).label()
        'deepspeed zero3 dp64 mbs1 full'
        """
        parts = [self.framework]
        opts = dict(self.options)
        if "zero_stage" in opts:
            parts.append(f"zero{opts['zero_stage']}")
        for key, short in (("tp", "tp"), ("pp", "pp"), ("vp", "vp"), ("cp", "cp")):
            value = getattr(self, key)
            if value > 1:
                parts.append(f"{short}{value}")
        parts.append(f"dp{self.dp}")
        if opts.get("hsdp_shard_size"):
            parts.append(f"hsdp{opts['hsdp_shard_size']}")
        if opts.get("reshard_after_forward") is False:
            parts.append("no-reshard")
        if opts.get("account_for_embedding_in_pipeline_split") or \
                opts.get("account_for_loss_in_pipeline_split"):
            parts.append("emb/loss-split")
        parts.append(f"mbs{self.micro_batch_size}")
        parts.append(self.activation_checkpointing)
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order.

    Examples
    --------
    >>> _divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Shape:
    """What the enumeration needs to know about the scenario."""

    gpus: int
    gpus_per_node: int
    layers: int
    global_batch: int
    seq_len: int


def _shape(base: Scenario) -> _Shape:
    from sim.model import ModelSpec

    m = ModelSpec.from_ref(base.model, base.training.seq_len)
    return _Shape(base.gpus, base.cluster.gpus_per_node, m.layers, step_sequences(base),
                  base.training.seq_len)


def step_sequences(base: Scenario) -> int:
    """Sequences per optimizer step: the scenario's ``global_batch_size``, else one
    micro-batch per replica of its own layout. Every layout keeps it."""
    t = base.training
    return t.global_batch_size or t.micro_batch_size * base.dp


def _space(framework: str) -> SearchSpace | None:
    """The planner's search space of ``framework`` (its registry entry's), if any."""
    try:
        return registry.framework(framework).search
    except KeyError:
        return None


def _vp_values(layers: int, pp: int, space: SearchSpace) -> list[int]:
    """Interleaving degrees worth building for ``pp`` stages: 1, and each ``vp`` up to
    :data:`VP_MAX` whose ``pp x vp`` chunks split the layers (Megatron: evenly, possibly
    counting the embedding and loss; torchtitan: ``stage_layers`` spreads them unevenly, so
    every chunk needs a layer)."""
    if pp == 1:
        return [1]
    out = [1]
    for vp in range(2, VP_MAX + 1):
        if not space.chunks_split(layers, pp, vp):
            continue
        if layers // (pp * vp) < 1:
            continue
        out.append(vp)
    return out


# Framework options every layout of a framework gets, at the values the frameworks' own
# recipes use for large models: each registry entry's ``search.recipe``
# (sim/frameworks/search_spaces.py says why). Kept here for older imports.
MEGATRON_BEST_PRACTICE = registry.framework("megatron").search.recipe  # type: ignore[union-attr]


def enumerate_layouts(base: Scenario, frameworks: Sequence[str] | None = None
                      ) -> list[Layout]:
    """Every layout the planner builds for ``base``'s model, cluster, batch and precision.

    Enumerated by construction (never refused later): tp divides the GPUs of a node (tensor
    parallelism stays on NVLink), tp x pp x cp divides the GPU count (dp fills the rest),
    the micro-batch size divides the sequences each replica runs per step. The framework's
    own rules (heads over tp, layers over pp x vp, micro-batch counts for interleaving, HSDP
    divisibility, ...) are left to its builder, which refuses what it does not run.

    Pure data-parallel frameworks (DeepSpeed, FairScale, DDP) are modelled with tp = pp =
    cp = 1 and without selective recomputation, so only those are enumerated for them.
    ``frameworks``: names of registered frameworks with a search space (default: all of
    them, :func:`sim.frameworks.registry.searchable`).

    Examples
    --------
    >>> from sim.scenario import load_scenario
    >>> s = load_scenario("llama3.2-1b-ddp-8xh100")
    >>> layouts = enumerate_layouts(s, ["deepspeed"])
    >>> sorted({(x.micro_batch_size, dict(x.options)["zero_stage"]) for x in layouts})[:3]
    [(1, 1), (1, 2), (1, 3)]
    """
    shape = _shape(base)
    searchable = registry.searchable()
    out: list[Layout] = []
    for fw in searchable if frameworks is None else frameworks:
        if fw not in searchable:
            raise ScenarioError(f"--framework {fw}: unknown framework "
                                f"(available: {', '.join(searchable)})")
        out.extend(_framework_layouts(fw, shape, base))
    return out


def _micro_batch_sizes(shape: _Shape, dp: int) -> list[int]:
    if shape.global_batch % dp:
        return [1]      # the builder refuses it (global batch not a multiple of dp)
    return _divisors(shape.global_batch // dp)


def _framework_layouts(fw: str, shape: _Shape, base: Scenario) -> Iterable[Layout]:
    n = shape.gpus
    space = _space(fw)
    assert space is not None
    data_parallel_only = space.data_parallel_only
    tps = [1] if data_parallel_only else _divisors(shape.gpus_per_node)
    cps = [1] if data_parallel_only else [c for c in (1, 2, 4, 8, 16, 32)
                                          if c <= CP_MAX]
    recompute = ["none", "full"] if data_parallel_only else ["none", "selective", "full"]
    for tp in tps:
        for cp in cps:
            if n % (tp * cp):
                continue
            pps = [1] if data_parallel_only else [p for p in _divisors(n // (tp * cp))
                                                  if p <= shape.layers]
            for pp in pps:
                dp = n // (tp * cp * pp)
                for vp in _vp_values(shape.layers, pp, space) if not data_parallel_only \
                        else [1]:
                    point = SearchPoint(tp, pp, vp, dp, cp, shape.layers)
                    for varied in space.options(point):
                        options = tuple(sorted(space.recipe + varied))
                        for mbs in _micro_batch_sizes(shape, dp):
                            for ac in recompute:
                                yield Layout(fw, tp, pp, dp, cp, vp, mbs, ac, options)


def layout_scenario(base: Scenario, layout: Layout, global_batch: int | None = None,
                    model: dict[str, Any] | None = None) -> Scenario:
    """``base`` with the layout's keys set.

    The framework section is replaced by the layout's; options the planner does not set keep
    the scenario's values when the framework is the scenario's own (a user can pin
    ``implementation: local`` or ``compile: true``), else the framework's defaults. The
    ``claims`` block is dropped: it describes the scenario's own layout. ``global_batch``
    and ``model`` replace the scenario's (for :func:`layer_profile`'s small copies only).
    """
    data = base.model_dump(mode="json", exclude_unset=True)
    data.pop("claims", None)
    fw: dict[str, Any] = {"name": layout.framework}
    if base.framework.name == layout.framework:
        fw.update(base.framework.model_dump(mode="json", exclude_unset=True))
    fw.update(dict(layout.options))
    data["framework"] = fw
    data["parallelism"] = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                           "cp": layout.cp, "vp": layout.vp,
                           "sequence_parallel": layout.sequence_parallel}
    training = dict(data.get("training", {}))
    training["micro_batch_size"] = layout.micro_batch_size
    training["activation_checkpointing"] = layout.activation_checkpointing
    training["global_batch_size"] = global_batch or step_sequences(base)
    data["training"] = training
    if model is not None:
        data["model"] = model
    data["name"] = f"{base.name} [{layout.label()}]"
    return scenario_from_dict(data, origin=PLAN_ORIGIN)


# --------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class LinkRates:
    """The fabric figures the step-time lower bound needs, bytes per second."""

    gpus_per_node: int
    nvlink: float
    """Per GPU, per direction."""
    node_network: float
    """Every NIC of a node together, per direction."""

    @classmethod
    def of(cls, s: Scenario) -> LinkRates:
        from sim import catalog

        c = s.cluster
        gpu = catalog.gpu(c.gpu)
        nvlink = (c.nvlink_gbytes_per_s or gpu.nvlink_gbytes_per_s) * 1e9
        return cls(c.gpus_per_node, nvlink, c.nics_per_node * c.nic_gbps * 1e9 / 8)


def collective_lower_bound(op: Any, rates: LinkRates) -> float:
    """Seconds a collective or point-to-point op takes at least on the fabric, whatever
    NCCL's algorithm: the bytes some GPU or some server must move over its own links.

    * A group inside one server: each of its ``n`` GPUs receives (all-gather, all-reduce) or
      sends (reduce-scatter) at least ``(n-1)/n`` of the message over its NVLink port.
    * A group over several servers: a server holding ``g`` of the ``n`` ranks must bring in
      the ``(n-g)/n`` of an all-gather's output it lacks, and send out the ``(n-g)/n`` of a
      reduce-scatter's reduced shards that other servers own (its own ranks' contributions
      pre-reduced at best); an all-reduce does both (``(k-1)/k`` each way on ``k`` servers,
      the bandwidth-optimal bound that ring and tree algorithms reach at best). All groups
      of a folded op run at once through the server's NICs together.
    * A send: bytes leaving (entering) each server through its NICs, or one GPU's NVLink
      port inside a server.

    Broadcasts and all-to-alls count zero (a lower bound). Latencies count zero.

    Examples
    --------
    >>> from sim.program import Op
    >>> rates = LinkRates(gpus_per_node=8, nvlink=450e9, node_network=400e9)
    >>> ag = Op("ag", "collective", "c", "comm", collective="all_gather", nbytes=8e9,
    ...         group=tuple(range(16)), key="k")
    >>> round(collective_lower_bound(ag, rates), 4)      # half of 8 GB enters each server
    0.01
    """
    return CommBounds(rates).seconds(op)


class CommBounds:
    """:func:`collective_lower_bound` with the per-byte time of each group shape kept (a
    program repeats the same groups thousands of times)."""

    def __init__(self, rates: LinkRates) -> None:
        self.rates = rates
        self._per_byte: dict[tuple[Any, ...], float] = {}

    def seconds(self, op: Any) -> float:
        nbytes = float(op.nbytes)
        if nbytes <= 0:
            return 0.0
        if op.kind in ("send", "recv"):
            key: tuple[Any, ...] = ("p2p", op.pairs)
        elif op.collective in ("all_gather", "reduce_scatter", "all_reduce"):
            key = ("coll", op.groups or (op.group,))
        else:
            return 0.0
        per_byte = self._per_byte.get(key)
        if per_byte is None:
            per_byte = self._per_byte[key] = (self._p2p(op.pairs) if key[0] == "p2p"
                                              else self._groups(key[1]))
        return nbytes * per_byte

    def _p2p(self, pairs: Sequence[tuple[int, int]]) -> float:
        per_node = self.rates.gpus_per_node
        out_count: Counter[int] = Counter()
        in_count: Counter[int] = Counter()
        worst = 0.0
        for src, dst in pairs:
            a, b = src // per_node, dst // per_node
            if a == b:
                worst = 1.0 / self.rates.nvlink
            else:
                out_count[a] += 1
                in_count[b] += 1
        busiest = max(list(out_count.values()) + list(in_count.values()) + [0])
        return max(worst, busiest / self.rates.node_network)

    def _groups(self, groups: Sequence[Sequence[int]]) -> float:
        per_node = self.rates.gpus_per_node
        intra = 0.0
        load: dict[int, float] = defaultdict(float)
        for group in groups:
            n = len(group)
            if n <= 1:
                continue
            nodes = Counter(r // per_node for r in group)
            if len(nodes) == 1:
                intra = max(intra, (n - 1) / n / self.rates.nvlink)
                continue
            for node, held in nodes.items():
                load[node] += (n - held) / n
        inter = max(load.values()) / self.rates.node_network if load else 0.0
        return max(intra, inter)


@dataclass
class _Schedule:
    """Earliest start and end of every op in the lower-bound schedule, by ``op.index``."""

    start: list[float]
    end: list[float]
    makespan: float


class _HostNodes(NamedTuple):
    """The host-clock nodes of :func:`_earliest_schedule`, node ``n_op_nodes + i`` for entry
    ``i``: one per op of each rank class, in the order its host issues them."""

    cpu: list[float]
    """The op's CPU seconds."""
    waits: list[int]
    """How many of ``preds`` the host waits for before spending them: 0 (the class's first
    op), 1 (the host's previous node) or 2 (that and the ``host_sync`` op just issued)."""
    preds: list[tuple[int, ...]]
    """Those, then the nodes whose ends free the launch-queue room the op needs."""


def _host_nodes(program: Any, node_of: list[int], preds: list[list[int]]) -> _HostNodes:
    """Host nodes for every op of ``program`` by the engine's rule (:mod:`sim.host_clock`),
    each added to ``preds`` of its op's node (an op starts once issued). ``node_of`` maps an
    op's index to its node; host nodes are numbered after the ``len(preds)`` op nodes."""
    first = len(preds)
    nodes = _HostNodes([], [], [])
    cpu, waits, host_preds = nodes
    for cls in program.classes:
        prev_host = -1
        for op, synced, launches in host_issues(issue_order(cls)):
            h_node = first + len(cpu)
            cpu.append(float(op.cpu_s))
            # A sync op is issued before the op that waits for it: prev_host exists then.
            if synced is not None:
                before: tuple[int, ...] = (prev_host, node_of[synced.index])
            else:
                before = (prev_host,) if prev_host >= 0 else ()
            waits.append(len(before))
            host_preds.append(before + tuple([node_of[o.index] for o in launches])
                              if launches else before)
            preds[node_of[op.index]].append(h_node)
            prev_host = h_node
    return nodes


def _earliest_schedule(program: Any, rates: LinkRates) -> _Schedule | None:
    """The program run with every op at its fastest, as :class:`sim.engine.Engine` runs it
    but with nothing shared: compute and copy ops take their durations, collectives and
    sends :func:`collective_lower_bound`; an op starts once its stream predecessor, its
    dependencies and (for a collective) every class of its group allow, and once its rank
    class's host has issued it. The host clock is the engine's own rule,
    :mod:`sim.host_clock` (:func:`~sim.host_clock.host_issues` names the ops the host waits
    for, :func:`~sim.host_clock.issue_time` adds them up), run on this schedule's ends.

    The engine can only be slower: its compute ops are slowed beside NCCL kernels, its flows
    share links and pay latencies. None if the graph has a cycle (a broken program)."""
    ops = program.ops
    n_ops = len(ops)
    bounds = CommBounds(rates)
    node_of = [0] * n_ops
    dur: list[float] = []
    key_node: dict[str, int] = {}
    for op in ops:
        kind = op.kind
        if kind == "collective":
            node = key_node.get(op.key)
            t = bounds.seconds(op)
            if node is None:
                node = key_node[op.key] = len(dur)
                dur.append(t)
            elif t > dur[node]:
                dur[node] = t
        else:
            node = len(dur)
            if kind in ("send", "recv"):
                dur.append(bounds.seconds(op))
            elif op.host_transfer is not None:
                dur.append(0.0)     # PCIe/NVMe flows: bounded below by nothing here
            else:
                dur.append(float(op.duration))
        node_of[op.index] = node
    n_op_nodes = len(dur)
    preds: list[list[int]] = [[] for _ in range(n_op_nodes)]
    for cls in program.classes:
        for stream in cls.streams.values():
            prev = -1
            for op in stream:
                node = node_of[op.index]
                np_ = preds[node]
                if prev >= 0 and prev != node:
                    np_.append(prev)
                for d in op.deps:
                    dn = node_of[d.index]
                    if dn != node:
                        np_.append(dn)
                prev = node
    host_cpu, host_waits, host_preds = _host_nodes(program, node_of, preds)
    n_nodes = n_op_nodes + len(host_cpu)
    all_preds: list[Sequence[int]] = [*preds, *host_preds]
    succs: list[list[int]] = [[] for _ in range(n_nodes)]
    indegree = [0] * n_nodes
    for node, ps in enumerate(all_preds):
        indegree[node] = len(ps)
        for p in ps:
            succs[p].append(node)
    ready = [node for node in range(n_nodes) if indegree[node] == 0]
    start = [0.0] * n_nodes
    end = [0.0] * n_nodes
    done = 0
    while ready:
        node = ready.pop()
        done += 1
        if node < n_op_nodes:
            t = 0.0
            for p in all_preds[node]:
                if end[p] > t:
                    t = end[p]
            start[node] = t
            end[node] = t + dur[node]
        else:
            i = node - n_op_nodes
            ps = host_preds[i]
            w = host_waits[i]
            launch_end = -math.inf
            for j in range(w, len(ps)):
                if end[ps[j]] > launch_end:
                    launch_end = end[ps[j]]
            start[node] = end[node] = issue_time(end[ps[0]] if w else 0.0,
                                                 end[ps[1]] if w == 2 else -math.inf,
                                                 host_cpu[i], launch_end)
        for s in succs[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if done != n_nodes:
        return None
    return _Schedule([start[node_of[i]] for i in range(n_ops)],
                     [end[node_of[i]] for i in range(n_ops)],
                     max(end[:n_op_nodes], default=0.0))


def memory_program_order(program: Any) -> dict[int, float]:
    """Peak bytes of each rank class replaying its ops one at a time in program order."""
    class_of_op: dict[int, int] = {}
    for cls in program.classes:
        for stream in cls.streams.values():
            for op in stream:
                class_of_op[op.index] = cls.id
    cur = {c.id: sum(c.initial_memory.values()) for c in program.classes}
    peak = dict(cur)
    for op in program.ops:
        c = class_of_op[op.index]
        if op.alloc:
            cur[c] += sum(b for _, b in op.alloc)
        top = cur[c] + op.transient
        if top > peak[c]:
            peak[c] = top
        if op.free:
            cur[c] -= sum(b for _, b in op.free)
    return peak


def memory_on_schedule(program: Any, sched: _Schedule) -> dict[int, float]:
    """Peak bytes of each rank class on the earliest schedule: allocations at an op's start,
    transients while it runs, frees at its end. At equal times frees count first: an op
    that starts the instant another ends is almost always waiting for it (same stream or a
    dependency), and the engine frees when an op ends before the next one starts."""
    out: dict[int, float] = {}
    for cls in program.classes:
        events: list[tuple[float, int, float]] = []
        for stream in cls.streams.values():
            for op in stream:
                a = sum(b for _, b in op.alloc)
                f = sum(b for _, b in op.free)
                tr = op.transient if op.kind in ("compute", "copy") else 0.0
                if a + tr:
                    events.append((sched.start[op.index], 1, a + tr))
                if f + tr:
                    events.append((sched.end[op.index], 0, -(f + tr)))
        events.sort()
        cur = sum(cls.initial_memory.values())
        peak = cur
        for _, _, d in events:
            cur += d
            if cur > peak:
                peak = cur
        out[cls.id] = peak
    return out


def memory_estimate(program: Any, sched: _Schedule | None) -> dict[int, float]:
    """Upper estimate of each rank class's peak bytes, without the engine.

    The larger of two replays of the program's allocations and frees (``Op.alloc`` at an
    op's start, ``Op.transient`` while it runs, ``Op.free`` at its end, from
    ``RankClass.initial_memory``): in program order one op at a time, and on the earliest
    schedule (:func:`_earliest_schedule`), where communication runs at its fastest and so
    as far ahead of computation as the program's dependencies and the host clock let it:
    prefetched gathers hold their buffers longest there. It is an estimate, not a proof:
    the engine's communication is slower, which lets less run ahead but also keeps some
    buffers longer. ``tests/test_plan.py`` checks it against simulated peaks (at most a
    few % below). The program-order replay alone falls far short where communication
    streams run ahead (FairScale 70B on 64 H100: 33 GiB, simulated 106 GiB).
    """
    order = memory_program_order(program)
    if sched is None:
        return order
    timed = memory_on_schedule(program, sched)
    return {c: max(order[c], timed.get(c, 0.0)) for c in order}


# --------------------------------------------------------------------------- per-layer profile
PROFILE_LAYERS = 2
"""Layers of the model copy a profile is built with: the per-layer ops do not depend on the
layer count, and two give a minimum over layers."""
_MATH_CATEGORIES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class Profile:
    """One transformer layer's work per micro-batch on the stream that computes it, for a
    framework, tensor/context split, micro-batch size and recomputation (the same for every
    pipeline and data-parallel layout around it)."""

    layer_s: float
    """Forward + backward (+ recomputation) kernels of one layer for one micro-batch, plus
    the lower bound of the tensor/context-parallel exchanges that block that stream."""
    embed_s: float = 0.0
    """The same for the embedding (forward and backward), on the first pipeline stage."""
    head_s: float = 0.0
    """The same for the final norm, output layer and loss, on the last pipeline stage."""
    refused: str | None = None
    """The key path the framework refused this split with (then ``layer_s`` is inf)."""
    message: str | None = None


def _layer_options(layout: Layout) -> tuple[tuple[str, Any], ...]:
    # Options that change a layer's ops (the search space's ``layer_options``): Megatron's
    # tensor-parallel overlap moves the exchanges off the compute stream; the rest (pipeline
    # split, sharding, resharding) changes other streams or other ops.
    space = _space(layout.framework)
    keys = space.layer_options if space is not None else ()
    return tuple((k, v) for k, v in layout.options if k in keys)


def _profile_key(layout: Layout) -> tuple[Any, ...]:
    opts = _layer_options(layout)
    return (layout.framework, layout.tp, layout.cp, layout.micro_batch_size,
            layout.activation_checkpointing, opts)


def refusal_key(exc: ScenarioError) -> tuple[str, str]:
    """(key path, message) of a builder's refusal ``plan: KEY: message``.

    Examples
    --------
    >>> refusal_key(ScenarioError("plan: parallelism.tp: 6 heads do not split"))
    ('parallelism.tp', '6 heads do not split')
    """
    text = str(exc)
    if text.startswith(PLAN_ORIGIN + ": "):
        text = text[len(PLAN_ORIGIN) + 2:]
    key, _, message = text.partition(": ")
    if not message or " " in key:
        return "scenario", text
    return key, message


def layer_profile(base: Scenario, layout: Layout, rates: LinkRates) -> Profile:
    """Build a :data:`PROFILE_LAYERS`-layer copy of the model under the layout's framework,
    tensor/context split, micro-batch size and recomputation (no pipeline, one micro-batch,
    the remaining GPUs data-parallel) and time one layer: the minimum over its layers of the
    forward, backward and recompute kernels of micro-batch 0 on the compute stream, plus the
    collectives blocking that stream (:func:`collective_lower_bound`). Data-parallel
    communication, copies and the optimizer are left out, so a pipeline stage of L layers
    running m micro-batches computes for at least ``L x m x layer_s``."""
    from sim.frameworks import JobContext, build_program
    from sim.model import ModelSpec

    m = ModelSpec.from_ref(base.model, base.training.seq_len)
    dims = {"layers": PROFILE_LAYERS, "hidden": m.hidden, "heads": m.heads,
            "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
            "mlp": m.mlp, "tied_embeddings": m.tied_embeddings, "head_dim": m.head_dim,
            "norm": m.norm, "position": m.position, "bias": m.bias,
            "max_positions": m.max_positions or None, "name": f"{m.name} (profile)"}
    dp = base.gpus // (layout.tp * layout.cp)
    opts = _layer_options(layout)
    probe = Layout(layout.framework, layout.tp, 1, dp, layout.cp, 1, layout.micro_batch_size,
                   layout.activation_checkpointing, opts)
    try:
        scenario = layout_scenario(base, probe, global_batch=layout.micro_batch_size * dp,
                                   model=dims)
        program = build_program(JobContext.from_scenario(scenario, PLAN_ORIGIN))
    except ScenarioError as exc:
        key, message = refusal_key(exc)
        return Profile(math.inf, refused=key, message=message)
    per_layer: dict[int, float] = defaultdict(float)
    # Work outside the layers, by position on the stream: before the first layer op the
    # embedding's forward, after the last its backward, in between the head and the loss.
    outside: list[tuple[int, float]] = []
    first = last = -1
    stream = program.classes[0].streams.get("compute", [])
    for pos, op in enumerate(stream):
        if op.micro_batch not in (0, None):
            continue
        if op.kind == "compute" and op.category in _MATH_CATEGORIES:
            t = op.duration
        elif op.kind in ("collective", "send") and op.phase == "comm" and \
                op.category != "optimizer":
            if op.layer is None:
                continue       # data-parallel traffic of the whole model, not per layer
            t = collective_lower_bound(op, rates)
        else:
            continue
        if op.layer is None:
            outside.append((pos, t))
            continue
        per_layer[op.layer] += t
        first = pos if first < 0 else first
        last = pos
    embed = sum(t for pos, t in outside if pos < first or pos > last)
    head = sum(t for pos, t in outside if first < pos < last)
    return Profile(min(per_layer.values(), default=0.0), embed, head)


def stage_layer_split(layout: Layout, layers: int) -> list[list[int]] | None:
    """Layers of each virtual pipeline chunk (chunk v on stage v % pp), as the framework
    splits them (its registry entry's ``stage_split``); None if it cannot."""
    entry = registry.framework(layout.framework)
    return entry.chunks(layers, layout.pp, layout.vp, dict(layout.options))


def profile_bound(layout: Layout, profile: Profile, layers: int, micro_batches: int
                  ) -> float:
    """Step-time lower bound from a layer profile, before building the layout.

    Stage s computes its layers for every micro-batch, and cannot start before micro-batch
    0's forward has crossed the first chunk of every stage before it, nor finish before the
    last micro-batch's backward has crossed them back:
    ``max_s (layer_s x sum_{s'<s} |chunk_s'| + m x work_s)``, where a stage's work per
    micro-batch is its layers' plus the embedding (first stage) or head (last stage). With
    even stages and no interleaving that is ``(m + p - 1)`` stage-micro-batches: the bubble share
    ``(p - 1) / (m + p - 1)``; interleaving divides the ramp by vp.

    Examples
    --------
    >>> x = Layout("megatron", 8, 4, 2, 1, 1, 1, "none")
    >>> profile_bound(x, Profile(0.01), 80, 32)     # 20 layers x (32 + 3) x 10 ms
    7.0
    """
    if profile.refused is not None or not math.isfinite(profile.layer_s):
        return math.inf
    split = stage_layer_split(layout, layers)
    if split is None:
        return math.inf
    p = layout.pp
    n_chunks = len(split)
    work = [profile.layer_s * sum(len(split[v]) for v in range(s, n_chunks, p))
            for s in range(p)]
    work[0] += profile.embed_s
    work[(n_chunks - 1) % p] += profile.head_s
    ramp = 0.0
    worst = 0.0
    for s in range(p):
        worst = max(worst, ramp + micro_batches * work[s])
        ramp += profile.layer_s * len(split[s]) + (profile.embed_s if s == 0 else 0.0)
    return worst


# --------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class Evaluation:
    """What building one layout told: refused, or its memory estimate and time bound."""

    refused: str | None
    """Key path of the framework's refusal, or None."""
    message: str | None
    memory_bytes: float
    """Upper estimate of the busiest rank class's peak (:func:`memory_estimate`)."""
    states_bytes: float
    """The largest ``RankClass.initial_memory`` (parameters, gradients, optimizer states)."""
    lower_bound_s: float
    """Step time of the earliest schedule (:func:`_earliest_schedule`); inf if not computed
    (the layout does not fit)."""
    ops: int
    wall_s: float


def _short_step(layout: Layout) -> bool:
    """Whether the layout's memory peak stops growing after 2 x pp micro-batches: without
    pipeline parallelism always, with it when the search space says so
    (``short_step_with_pipeline``; checked in ``tests/test_plan.py``)."""
    space = _space(layout.framework)
    return layout.pp == 1 or (space is not None and space.short_step_with_pipeline)


def proxy_micro_batches(micro_batches: int, pp: int) -> int:
    """Micro-batches of the shorter step the planner builds instead of the layout's own.

    A pipeline reaches its steady state within 2 x pp micro-batches: 1F1B keeps at most
    pp - s in flight on stage s, interleaved 1F1B at most (pp - s - 1) x 2 + (vp - 1) x pp
    + 1 chunk passes, under 2 x pp micro-batches' worth; data parallelism without a
    pipeline after its first micro-batch. Each micro-batch after that adds the same ops,
    so the peak memory of the short step is the long one's, and its step time grows by
    the same amount per micro-batch (:func:`per_micro_batch_bound`). The count keeps
    ``micro_batches mod pp`` (interleaving needs a multiple of pp; torch's Schedule1F1B at
    least pp) and at least three, so that a micro-batch with neither the first's nor the
    last's extra work exists.

    Not for FSDP2 with pipeline parallelism (:func:`_short_step`): there the simulated
    last stage's buffers keep growing with the micro-batch count (70B-like 8-layer model,
    pp 4: 3.8 GiB of buffers at 8 micro-batches, 7.1 at 16, 11.1 at 32), so the full step
    is built.

    Examples
    --------
    >>> proxy_micro_batches(32, 4), proxy_micro_batches(8, 4), proxy_micro_batches(64, 1)
    (8, 8, 3)
    """
    if micro_batches <= max(3 * pp, 3):
        return micro_batches
    return max(2 * pp + micro_batches % pp, 3)


def per_micro_batch_bound(program: Any, rates: LinkRates, micro_batches: int) -> float:
    """The least time one more micro-batch adds: over the micro-batches that are neither
    the first nor the last, the smallest of (the busiest stream of any rank class: its
    compute ops' durations plus its collectives' and sends' lower bounds). Each extra
    micro-batch puts that much more on that stream, which runs its ops one at a time."""
    per: dict[tuple[int, int, str], float] = defaultdict(float)
    middle = set(range(1, micro_batches - 1))
    bounds = CommBounds(rates)
    for cls in program.classes:
        for name, stream in cls.streams.items():
            for op in stream:
                if op.micro_batch not in middle:
                    continue
                if op.kind in ("collective", "send", "recv"):
                    t = bounds.seconds(op)
                elif op.host_transfer is None:
                    t = float(op.duration)
                else:
                    continue
                per[(op.micro_batch, cls.id, name)] += t
    if not per:
        return 0.0
    busiest: dict[int, float] = defaultdict(float)
    for (mb, _, _), t in per.items():
        busiest[mb] = max(busiest[mb], t)
    return min(busiest[mb] for mb in middle) if len(busiest) == len(middle) else 0.0


def evaluate_layout(base: Scenario, layout: Layout, rates: LinkRates, usable_bytes: float,
                    micro_batches: int = 0) -> Evaluation:
    """Build the layout's program and estimate it (runs in a worker).

    With ``micro_batches`` (the layout's count) above :func:`proxy_micro_batches`, the
    shorter step is built: same memory, and the bound grows by
    :func:`per_micro_batch_bound` per micro-batch left out. A layout whose program-order
    replay already exceeds ``usable_bytes`` is not scheduled (it is pruned either way) and
    gets an infinite bound."""
    from sim.frameworks import JobContext, build_program

    t0 = time.perf_counter()
    built = micro_batches
    try:
        if micro_batches > 0 and _short_step(layout):
            built = proxy_micro_batches(micro_batches, layout.pp)
            scenario = layout_scenario(base, layout, global_batch=built * layout.dp
                                       * layout.micro_batch_size)
        else:
            scenario = layout_scenario(base, layout)
        program = build_program(JobContext.from_scenario(scenario, PLAN_ORIGIN))
    except ScenarioError as exc:
        key, message = refusal_key(exc)
        return Evaluation(key, message, 0.0, 0.0, math.inf, 0, time.perf_counter() - t0)
    states = max(sum(c.initial_memory.values()) for c in program.classes)
    order = memory_program_order(program)
    if max(order.values()) > usable_bytes:
        return Evaluation(None, None, max(order.values()), states, math.inf,
                          len(program.ops), time.perf_counter() - t0)
    sched = _earliest_schedule(program, rates)
    memory = memory_estimate(program, sched)
    bound = sched.makespan if sched is not None else 0.0
    if micro_batches > built:
        bound += (micro_batches - built) * per_micro_batch_bound(program, rates, built)
    return Evaluation(None, None, max(memory.values()), states, bound, len(program.ops),
                      time.perf_counter() - t0)


@dataclass(frozen=True)
class Simulated:
    summary: dict[str, Any] | None
    error: str | None
    wall_s: float


def simulate_layout(base: Scenario, layout: Layout) -> Simulated:
    """Simulate one training step of the layout (runs in a worker); an exception, building
    the layout's scenario included, is the layout's error, not the plan's."""
    from sim.api import simulate

    return _simulated(attempt(
        0, lambda: simulate(layout_scenario(base, layout), origin=PLAN_ORIGIN).summary,
        type_and_message))


def _simulated(out: Outcome) -> Simulated:
    return Simulated(out.summary, out.error, out.wall_s)


def _profiles_task(base: Scenario, layouts: list[Layout], rates: LinkRates
                   ) -> list[Profile]:
    return [layer_profile(base, x, rates) for x in layouts]


# --------------------------------------------------------------------------- backend hook
SimulateMany = Callable[[Scenario, list[Layout]], list[Simulated]]
"""A backend hook: simulate these layouts of the base scenario (anywhere), in order."""


def backend_simulations(be: Backend) -> SimulateMany:
    """The :data:`SimulateMany` hook on an open executor backend (``--backend ray|dask``):
    each batch of layouts runs there, one layout to a worker task, and comes back in order
    (a failed layout or a dead worker as that layout's error)."""
    def simulate_many(base: Scenario, layouts: list[Layout]) -> list[Simulated]:
        tasks = [Task(i, layout_scenario(base, x), x.varied()) for i, x in enumerate(layouts)]
        return [_simulated(o) for o in simulate_in_order(be, tasks, 1)]

    return simulate_many


# --------------------------------------------------------------------------- the search
RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}
"""Activation checkpointing from the most memory to the least (none keeps every activation,
selective drops the attention core's or the ops torchtitan's policy re-runs, full keeps
only each layer's input)."""


@dataclass
class Candidate:
    """One enumerated layout and what the search learnt about it."""

    index: int
    layout: Layout
    micro_batches: int
    bound0_s: float = 0.0
    """:func:`profile_bound` (0 where no profile applies)."""
    status: str = "pending"
    """refused | memory | bound | budget | simulated | oom | error"""
    reason: str = ""
    evaluation: Evaluation | None = None
    simulated: Simulated | None = None

    @property
    def family(self) -> tuple[Any, ...]:
        """Layouts that differ only in micro-batch size and recomputation."""
        x = self.layout
        return (x.framework, x.tp, x.pp, x.dp, x.cp, x.vp, x.options)

    @property
    def lower_bound_s(self) -> float:
        """The best lower bound known: the built program's, else the profile's."""
        ev = self.evaluation
        if ev is not None and math.isfinite(ev.lower_bound_s):
            return max(ev.lower_bound_s, self.bound0_s)
        return self.bound0_s

    @property
    def summary(self) -> dict[str, Any] | None:
        return self.simulated.summary if self.simulated is not None else None


@dataclass
class PlanResult:
    """Everything one search did."""

    base: Scenario
    objective: str
    top_k: int
    candidates: list[Candidate]
    wall_s: float
    workers: int
    backend: str
    stop: str
    """Why the search stopped: bound (nothing left could enter the top K), budget
    (``max_simulations`` reached), time (``time_limit_s``), exhausted (everything done)."""
    profiles: int = 0
    """Layer profiles built (:func:`layer_profile`)."""
    usd_per_second: float = 0.0
    """GPU price of the whole cluster per second (for bounds in dollars)."""
    baseline: Simulated | None = None
    """The scenario as given, simulated: what the top layouts are compared with."""

    def objective_of(self, summary: dict[str, Any]) -> float:
        return objective_value(summary, self.objective)

    @property
    def built(self) -> list[Candidate]:
        return [c for c in self.candidates if c.evaluation is not None]

    @property
    def fitted(self) -> list[Candidate]:
        """Built layouts whose memory estimate fits (simulated out-of-memory ones excluded)."""
        return [c for c in self.candidates if c.evaluation is not None
                and c.evaluation.refused is None and c.status not in ("memory", "oom")]

    @property
    def simulated(self) -> list[Candidate]:
        return [c for c in self.candidates if c.simulated is not None]

    def ranked(self) -> list[Candidate]:
        """Simulated layouts that fit, best first by the objective (ties: fewer GPUs-idle
        reasons do not break them; the enumeration order does)."""
        ok = [c for c in self.candidates if c.status == "simulated" and c.summary]
        return sorted(ok, key=lambda c: (self.objective_of(c.summary or {}), c.index))

    def pruned(self) -> dict[str, int]:
        """Layouts not simulated (or simulated and out of memory), counted by reason."""
        counts: Counter[str] = Counter()
        for c in self.candidates:
            if c.status in ("simulated",):
                continue
            counts[f"{c.status}: {c.reason}" if c.reason else c.status] += 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def objective_value(summary: dict[str, Any], objective: str) -> float:
    """Step time (s) or dollars per million tokens of a summary: lower is better."""
    if objective == "cost":
        return float(summary["cost"]["usd_per_million_tokens"])
    return float(summary["step_time_s"])


def search(base: Scenario, objective: str = "time", top: int = DEFAULT_TOP,
           frameworks: Sequence[str] | None = None, workers: int = 1,
           max_simulations: int = DEFAULT_MAX_SIMULATIONS, time_limit_s: float | None = None,
           simulate_many: SimulateMany | None = None, backend: str = "local",
           progress: Callable[[str, int, int], None] | None = None,
           simulation_batch: int | None = None, compare_baseline: bool = True
           ) -> PlanResult:
    """Enumerate, build, bound and simulate layouts of ``base``; see the module docstring.

    ``workers`` processes (joblib's loky) build and simulate; 1 runs everything here.
    ``simulate_many`` (a hook for Ray or Dask) simulates instead of the local processes:
    called from one thread with the next ``simulation_batch`` (default ``workers``) best
    layouts at a time, while the local processes keep building. ``progress(phase, done,
    total)`` is called after each build or simulation (``done`` of that phase so far, of
    ``total`` layouts). With ``compare_baseline`` the scenario as
    given is simulated too (:attr:`PlanResult.baseline`). Raises ScenarioError on bad
    arguments.
    """
    from sim import catalog
    from sim.cost import resolve_pricing

    if objective not in OBJECTIVES:
        raise ScenarioError(f"--objective {objective}: expected time or cost")
    if top < 1:
        raise ScenarioError(f"--top {top}: expected at least 1")
    if max_simulations < 1:
        raise ScenarioError(f"--max-simulations {max_simulations}: expected at least 1")
    t0 = time.perf_counter()
    layouts = enumerate_layouts(base, frameworks)
    shape = _shape(base)
    rates = LinkRates.of(base)
    gpu = catalog.gpu(base.cluster.gpu)
    usable = gpu.usable_memory_bytes
    tokens = float(shape.global_batch * shape.seq_len)
    usd_per_s = resolve_pricing(base, gpu).gpu_hour_usd * base.gpus / 3600.0

    def to_objective(seconds: float) -> float:
        # Dollars per million tokens at least: GPU time only (transfer costs >= 0).
        return seconds if objective == "time" else seconds * usd_per_s / tokens * 1e6

    cands = []
    for i, x in enumerate(layouts):
        per_step = x.micro_batch_size * x.dp
        m = shape.global_batch // per_step if shape.global_batch % per_step == 0 else 0
        cands.append(Candidate(i, x, m))
    runner = Pool(workers)
    sim_thread: Any = None
    if simulate_many is not None:
        from concurrent.futures import ThreadPoolExecutor

        # One thread calls the hook, one batch at a time: the backend runs the batch's
        # layouts in parallel; local processes keep building meanwhile.
        sim_thread = ThreadPoolExecutor(max_workers=1)

    # Phase 1: a layer profile per (framework, tp, cp, micro-batch, recomputation).
    def space(c: Candidate) -> SearchSpace:
        found = _space(c.layout.framework)
        assert found is not None
        return found

    profiled = [c for c in cands if space(c).layer_profile and c.micro_batches > 0]
    keys: dict[tuple[Any, ...], Layout] = {}
    for c in profiled:
        keys.setdefault(_profile_key(c.layout), c.layout)
    profiles = dict(zip(keys, runner.map_chunks(_profiles_task, list(keys.values()), base,
                                                 rates), strict=True))
    # Megatron's FP8 weight casts are shared by the micro-batches of a step
    # (MegatronLayout.weight_cast_share = 1/m): a one-micro-batch profile charges each
    # micro-batch all of it, which is no lower bound for a longer step. There the profile
    # only refuses; the bound comes from each layout's own build.
    amortised = base.training.precision == "fp8"
    for c in profiled:
        prof = profiles[_profile_key(c.layout)]
        if prof.refused is not None:
            c.status, c.reason = "refused", prof.refused
            continue
        if not (amortised and space(c).weight_casts_per_step):
            c.bound0_s = profile_bound(c.layout, prof, shape.layers, c.micro_batches)
    if progress is not None:
        progress("profiles", len(keys), len(keys))

    # The scenario as given, for comparison, alongside the search.
    baseline_future = runner.submit(_simulate_base, base) if compare_baseline else None

    # Phase 2: best first over (bound, stage): stage 0 builds a layout, stage 1 simulates.
    heap: list[tuple[float, int, int]] = [(to_objective(c.bound0_s), c.index, 0)
                                          for c in cands if c.status == "pending"]
    heapq.heapify(heap)
    best: list[float] = []            # objective values of fitting simulated layouts
    states_oom: set[tuple[Any, ...]] = set()
    oom_points: dict[tuple[Any, ...], list[tuple[int, int]]] = defaultdict(list)
    in_flight: dict[Any, tuple[str, list[int]]] = {}
    sims_started = 0
    completed: Counter[str] = Counter()
    stop = "exhausted"
    capacity = runner.workers + 1

    families: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for c in cands:
        if c.status == "pending":
            families[c.family].append(c.index)
    probed: set[tuple[Any, ...]] = set()
    probing: set[tuple[Any, ...]] = set()
    waiting: dict[tuple[Any, ...], list[int]] = defaultdict(list)

    def lightness(c: Candidate) -> tuple[int, int, int]:
        return (c.layout.micro_batch_size,
                -RECOMPUTE_RANK[c.layout.activation_checkpointing], c.index)

    def threshold() -> float:
        return sorted(best)[top - 1] if len(best) >= top else math.inf

    def dominated(c: Candidate) -> str | None:
        if c.family in states_oom:
            return "model states (another micro-batch size or recomputation)"
        rank = RECOMPUTE_RANK[c.layout.activation_checkpointing]
        for mbs, r in oom_points.get(c.family, ()):
            if c.layout.micro_batch_size >= mbs and rank <= r:
                return "implied (a smaller micro-batch or more recomputation does not fit)"
        return None

    def settle_evaluation(c: Candidate, ev: Evaluation) -> None:
        c.evaluation = ev
        if ev.refused is not None:
            c.status, c.reason = "refused", ev.refused
        elif ev.states_bytes > usable:
            c.status, c.reason = "memory", "model states"
            states_oom.add(c.family)
        elif ev.memory_bytes > usable:
            c.status, c.reason = "memory", "estimate"
            oom_points[c.family].append((c.layout.micro_batch_size,
                                         RECOMPUTE_RANK[c.layout.activation_checkpointing]))
        else:
            heapq.heappush(heap, (to_objective(c.lower_bound_s), c.index, 1))

    def settle_simulation(c: Candidate, sim: Simulated) -> None:
        c.simulated = sim
        if sim.summary is None:
            c.status, c.reason = "error", sim.error or ""
        elif sim.summary["oom"]:
            c.status, c.reason = "oom", "simulated peak above usable memory"
        else:
            c.status = "simulated"
            best.append(objective_value(sim.summary, objective))

    try:
        while True:
            while heap and len(in_flight) < capacity:
                if sims_started >= max_simulations:
                    stop = "budget"
                    break
                key, i, stage = heap[0]
                if key >= threshold():
                    stop = "bound"
                    break
                if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                    stop = "time"
                    break
                heapq.heappop(heap)
                c = cands[i]
                if stage == 0:
                    if c.status != "pending":
                        continue            # built already, as its family's probe
                    why = dominated(c)
                    if why is not None:
                        c.status, c.reason = "memory", why
                        continue
                    fam = c.family
                    if fam in probing:
                        waiting[fam].append(c.index)
                        continue
                    if fam not in probed:
                        # Build the family's lightest layout first: if even that does not
                        # fit, no layout of the family does.
                        probe = min((x for x in families[fam] if cands[x].status == "pending"),
                                    key=lambda x: lightness(cands[x]))
                        probed.add(fam)
                        if probe != c.index:
                            probing.add(fam)
                            waiting[fam].append(c.index)
                            c = cands[probe]
                    c.status = "building"
                    fut = runner.submit(evaluate_layout, base, c.layout, rates, usable,
                                        c.micro_batches)
                    in_flight[fut] = ("build", [c.index])
                else:
                    c.status = "simulating"
                    sims_started += 1
                    batch = [c.index]
                    if sim_thread is not None:
                        # The next best simulations, as many as there are workers.
                        while (len(batch) < (simulation_batch or runner.workers)
                               and heap and heap[0][2] == 1
                               and heap[0][0] < threshold()
                               and sims_started < max_simulations):
                            j = heapq.heappop(heap)[1]
                            cands[j].status = "simulating"
                            sims_started += 1
                            batch.append(j)
                        fut = sim_thread.submit(simulate_many, base,
                                                [cands[j].layout for j in batch])
                    else:
                        fut = runner.submit(simulate_layout, base, c.layout)
                    in_flight[fut] = ("simulate", batch)
            if not in_flight:
                break
            done = [f for f in in_flight if f.done()]
            if not done:
                from concurrent.futures import FIRST_COMPLETED, wait

                finished, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
                done = list(finished)
            for fut in done:
                kind, indices = in_flight.pop(fut)
                if kind == "build":
                    i = indices[0]
                    settle_evaluation(cands[i], fut.result())
                    fam = cands[i].family
                    if fam in probing:
                        probing.discard(fam)
                        for j in waiting.pop(fam, []):
                            heapq.heappush(heap, (to_objective(cands[j].bound0_s), j, 0))
                    continue
                try:
                    outcome = fut.result()
                    results = outcome if isinstance(outcome, list) else [outcome]
                    if len(results) != len(indices):
                        raise RuntimeError(f"the simulation backend returned {len(results)} "
                                           f"results for {len(indices)} layouts")
                except Exception as exc:   # a failed batch: its layouts' error, not ours
                    text = type_and_message(exc)
                    results = [Simulated(None, text, 0.0) for _ in indices]
                for j, sim in zip(indices, results, strict=True):
                    settle_simulation(cands[j], sim)
                completed[kind] += len(indices)
                if progress is not None:
                    progress(kind, completed[kind], len(cands))
    finally:
        if sim_thread is not None:
            sim_thread.shutdown(wait=True, cancel_futures=True)
    # What is left was never needed (its bound reaches the K-th best simulated result) or
    # never reached (the simulation budget or the time limit ran out first).
    limit = threshold()
    for c in cands:
        if c.status in ("pending", "building", "simulating"):
            if to_objective(c.lower_bound_s) >= limit:
                c.status, c.reason = "bound", "lower bound at or above the top-K threshold"
            else:
                c.status = stop if stop in ("budget", "time") else "bound"
                c.reason = ("simulation budget spent" if stop == "budget"
                            else "time limit reached" if stop == "time"
                            else "lower bound at or above the top-K threshold")
    baseline = baseline_future.result() if baseline_future is not None else None
    return PlanResult(base, objective, top, cands, time.perf_counter() - t0,
                      runner.workers, backend, stop, len(keys), usd_per_s, baseline)


def _simulate_base(base: Scenario) -> Simulated:
    # The scenario as given may be one its framework refuses: its error, not the plan's.
    from sim.api import simulate

    return _simulated(attempt(0, lambda: simulate(base, origin=PLAN_ORIGIN).summary,
                              type_and_message))


# --------------------------------------------------------------------------- reporting
def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Which points no other point beats on both coordinates (both are minimised): a point
    is dominated when another is no worse on either and better on one.

    Examples
    --------
    >>> pareto_front([(1, 5), (2, 3), (3, 4), (4, 1), (2, 3)])
    [True, True, False, True, True]
    """
    out = []
    for i, (x, y) in enumerate(points):
        dominated = any((a <= x and b <= y) and (a < x or b < y)
                        for j, (a, b) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def why(summary: dict[str, Any]) -> dict[str, float]:
    """What a layout's step is made of, as shares of its step time and memory: the
    quantities the top-K table explains a rank with.

    ``exposed_comm``: communication not hidden under computation; ``bubble``: the pipeline
    leaving the critical stage idle; ``recompute``: the share of the hardware's FLOPs spent
    recomputing activations ((hfu - mfu) / hfu); ``headroom_gib``: usable memory left at the
    peak.

    Examples
    --------
    >>> w = why({"step_time_s": 4.0, "exposed_comm_s": 0.2, "bubble_fraction": 0.05,
    ...          "mfu": 0.45, "hfu": 0.6, "peak_memory_gib": 60.0, "gpu_memory_gib": 79.19})
    >>> [round(w[k], 2) for k in ("exposed_comm", "bubble", "recompute", "headroom_gib")]
    [0.05, 0.05, 0.25, 19.19]
    """
    step = float(summary["step_time_s"]) or 1.0
    hfu = float(summary.get("hfu") or 0.0)
    mfu = float(summary.get("mfu") or 0.0)
    return {"exposed_comm": float(summary["exposed_comm_s"]) / step,
            "bubble": float(summary["bubble_fraction"]),
            "recompute": (hfu - mfu) / hfu if hfu > 0 else 0.0,
            "headroom_gib": float(summary["gpu_memory_gib"]) - float(summary["peak_memory_gib"]),
            "mfu": mfu}


def explain(summary: dict[str, Any], other: dict[str, Any] | None = None,
            other_name: str = "next") -> str:
    """One line on what makes a layout fast, and where it beats ``other`` (the scenario as
    given, or the next layout).

    Examples
    --------
    >>> a = {"step_time_s": 4.0, "exposed_comm_s": 0.04, "bubble_fraction": 0.0, "mfu": 0.5,
    ...      "hfu": 0.5, "peak_memory_gib": 60.0, "gpu_memory_gib": 79.19}
    >>> b = dict(a, step_time_s=4.4, exposed_comm_s=0.5, mfu=0.45, hfu=0.6)
    >>> explain(a, b).split("; ")[-1]
    'vs next: exposed comm 1% vs 11%, recompute 0% vs 25%, MFU 50.0% vs 45.0%'
    """
    w = why(summary)
    parts = [f"MFU {w['mfu']:.0%}",
             f"exposed comm {w['exposed_comm']:.0%} of the step",
             f"bubble {w['bubble']:.0%}" if w["bubble"] > 0.005 else "no bubble",
             f"recompute {w['recompute']:.0%} of FLOPs" if w["recompute"] > 0.005
             else "no recompute",
             f"{w['headroom_gib']:.1f} GiB free"]
    if other is not None:
        o = why(other)
        gains = []
        for key, label in (("exposed_comm", "exposed comm"), ("bubble", "bubble"),
                           ("recompute", "recompute")):
            # Name the shares where this layout is at least 1 point lower than the next.
            if o[key] - w[key] >= 0.01:
                gains.append(f"{label} {w[key]:.0%} vs {o[key]:.0%}")
        if w["mfu"] > o["mfu"] + (0.0 if not gains else 0.01):
            gains.append(f"MFU {w['mfu']:.1%} vs {o['mfu']:.1%}")
        if gains:
            parts.append(f"vs {other_name}: " + ", ".join(gains))
    return "; ".join(parts)


def _why_line(result: PlanResult, ranked: list[Candidate], k: int) -> str:
    """Layout ``k`` of the ranking explained against the scenario as given when it
    simulated and fits, else against the next layout."""
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None and not base["oom"]:
        return explain(ranked[k].summary or {}, base, "the scenario as given")
    nxt = ranked[k + 1].summary if k + 1 < len(ranked) else None
    return explain(ranked[k].summary or {}, nxt)


def _gib(x: float | None) -> float | None:
    return None if x is None else x / GIB


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def layout_row(c: Candidate) -> dict[str, Any]:
    """One layout as a flat row (plan.csv) and entry (plan.json's ``layouts``)."""
    x = c.layout
    ev = c.evaluation
    s = c.summary
    row: dict[str, Any] = {
        "index": c.index, "layout": x.label(), "framework": x.framework,
        "tp": x.tp, "pp": x.pp, "dp": x.dp, "cp": x.cp, "vp": x.vp,
        "micro_batch_size": x.micro_batch_size,
        "activation_checkpointing": x.activation_checkpointing,
        "options": ";".join(f"{k}={v}" for k, v in x.options),
        "micro_batches": c.micro_batches, "status": c.status, "reason": c.reason,
        "profile_bound_s": _finite(c.bound0_s) if c.bound0_s else None,
        "lower_bound_s": _finite(c.lower_bound_s) if ev is not None else None,
        "memory_estimate_gib": _gib(ev.memory_bytes) if ev is not None and ev.refused is None
        else None,
        "model_states_gib": _gib(ev.states_bytes) if ev is not None and ev.refused is None
        else None,
    }
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib",
                "exposed_comm_s", "bubble_fraction"):
        row[key] = s.get(key) if s else None
    row["usd_per_million_tokens"] = s["cost"]["usd_per_million_tokens"] if s else None
    return row


def scenario_mapping(base: Scenario, layout: Layout) -> dict[str, Any]:
    """The layout as a complete scenario file (what ``--out`` writes as top-K.yaml).

    ``Layout.varied`` lists the keys the planner set; applied with ``--set`` to a scenario
    of another framework they can clash with that framework's options (``framework.
    reshard_after_forward`` is no Megatron key), because the planner replaces the
    framework section rather than merging it. This mapping runs as it is.
    """
    return layout_scenario(base, layout).model_dump(mode="json", exclude_unset=True)


def plan_json(result: PlanResult, everything: bool = False) -> dict[str, Any]:
    """The ``--json`` object (CONTRACT.md: ``searched, fitted, wall_s, top``, plus ``pruned``
    counts by reason and how the search went); each top entry also carries its complete
    scenario (``scenario_file``). With ``everything``, every layout too (plan.json)."""
    ranked = result.ranked()[:result.top_k]
    out: dict[str, Any] = {
        "scenario": result.base.name,
        "objective": result.objective,
        "searched": len(result.candidates),
        "fitted": len(result.fitted),
        "wall_s": result.wall_s,
        "top": [{"scenario": c.layout.varied(), "summary": c.summary,
                 "lower_bound_s": c.lower_bound_s, "why": _why_line(result, ranked, k),
                 "scenario_file": scenario_mapping(result.base, c.layout)}
                for k, c in enumerate(ranked)],
        "baseline": ({"scenario": result.base.name, "summary": result.baseline.summary,
                      "error": result.baseline.error}
                     if result.baseline is not None else None),
        "pruned": result.pruned(),
        "built": len(result.built),
        "simulated": len(result.simulated),
        "layer_profiles": result.profiles,
        "stop": result.stop,
        "workers": result.workers,
        "backend": result.backend,
    }
    if everything:
        # Each layout's row (its keys are the row's columns; ``options`` the framework
        # options it sets), with the summary of those simulated.
        out["layouts"] = [dict(layout_row(c), summary=c.summary) if c.summary is not None
                          else layout_row(c) for c in result.candidates]
    return out


def write_outputs(result: PlanResult, out: Path) -> list[Path]:
    """plan.json, plan.csv, pareto.png and top-1.yaml ... top-K.yaml (each a scenario file
    ``fabricsim run`` takes) in ``out``; returns their paths."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "plan.json", out / "plan.csv", out / "pareto.png"]
    for k, c in enumerate(result.ranked()[:result.top_k]):
        path = out / f"top-{k + 1}.yaml"
        path.write_text(yaml.safe_dump(scenario_mapping(result.base, c.layout),
                                       sort_keys=False))
        paths.append(path)
    paths[0].write_text(json.dumps(plan_json(result, everything=True), default=str))
    rows = [layout_row(c) for c in result.candidates]
    with paths[1].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["index"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    pareto_figure(result).savefig(paths[2], dpi=120)
    return paths


def pareto_figure(result: PlanResult) -> Any:
    """Step time against dollars per million tokens of every simulated layout that fits,
    the Pareto front (no layout both faster and cheaper) joined and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = result.ranked()
    pts = [(float(c.summary["step_time_s"]), float(c.summary["cost"]["usd_per_million_tokens"]))
           for c in ranked if c.summary]
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    by_fw: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c, p in zip(ranked, pts, strict=True):
        by_fw[c.layout.framework].append(p)
    for fw, ps in sorted(by_fw.items()):
        ax.scatter([p[0] for p in ps], [p[1] for p in ps], s=22, alpha=0.6, label=fw)
    fpts = sorted(p for p, f in zip(pts, front, strict=True) if f)
    if fpts:
        ax.plot([p[0] for p in fpts], [p[1] for p in fpts], "-o", color="black", lw=1.2,
                ms=7, mfc="none", label="Pareto front")
        for c, p, f in zip(ranked, pts, front, strict=True):
            if f:
                ax.annotate(c.layout.label(), p, textcoords="offset points", xytext=(6, 4),
                            fontsize=7)
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None:
        ax.scatter([base["step_time_s"]], [base["cost"]["usd_per_million_tokens"]],
                   marker="*", s=160, color="crimson", zorder=5,
                   label="the scenario as given" + (" (out of memory)" if base["oom"] else ""))
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("$ per million tokens")
    ax.set_title(f"{result.base.name}: {len(pts)} simulated layouts that fit "
                 f"(of {len(result.candidates)} searched)", fontsize=10)
    ax.grid(alpha=0.3)
    if pts or base is not None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def print_table(result: PlanResult, console: Any = None) -> None:
    """The top K as a rich table, what makes each one fast, then how the search went."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    ranked = result.ranked()[:result.top_k]
    by = "step time" if result.objective == "time" else "$ per million tokens"
    t = Table(title=f"{result.base.name}: best {len(ranked)} layouts by {by}",
              title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("layout", no_wrap=True)
    for col in ("step s", "tok/s/GPU", "$/M tok", "MFU", "peak GiB"):
        t.add_column(col, justify="right")
    for k, c in enumerate(ranked):
        s = c.summary or {}
        t.add_row(str(k + 1), c.layout.label(), f"{s['step_time_s']:.3f}",
                  f"{s['tokens_per_s_per_gpu']:,.0f}",
                  f"{s['cost']['usd_per_million_tokens']:.3f}", f"{why(s)['mfu']:.0%}",
                  f"{s['peak_memory_gib']:.1f}")
    base = result.baseline.summary if result.baseline is not None else None
    if base is not None:
        t.add_row("", "(the scenario as given)", f"{base['step_time_s']:.3f}",
                  f"{base['tokens_per_s_per_gpu']:,.0f}",
                  f"{base['cost']['usd_per_million_tokens']:.3f}", f"{why(base)['mfu']:.0%}",
                  f"{base['peak_memory_gib']:.1f}" + (" OOM" if base["oom"] else ""),
                  style="dim")
    console.print(t)
    for k, c in enumerate(ranked):
        console.print(f"  #{k + 1} {c.layout.label()}: {_why_line(result, ranked, k)}")
    pruned = ", ".join(f"{n:,} {reason}" for reason, n in result.pruned().items())
    console.print(f"Searched {len(result.candidates):,} layouts ({result.profiles:,} layer "
                  f"profiles, {len(result.built):,} built, {len(result.fitted):,} fit, "
                  f"{len(result.simulated):,} simulated) in {result.wall_s:.1f} s with "
                  f"{result.workers} worker{'s' if result.workers > 1 else ''}; stopped: "
                  f"{result.stop}. Not simulated: {pruned}.")
    if not ranked:
        console.print("No layout fits in memory and simulates: nothing to recommend.")


def plan_command(scenario: str, overrides: Sequence[str] = (), objective: str = "time",
                 top: int = DEFAULT_TOP, backend: str = "local", workers: int | None = None,
                 frameworks: Sequence[str] | None = None,
                 max_simulations: int = DEFAULT_MAX_SIMULATIONS,
                 time_limit_s: float | None = None, out: Path | None = None,
                 as_json: bool = False, simulate_many: SimulateMany | None = None,
                 quiet: bool = False) -> int:
    """Everything ``fabricsim plan`` does; returns the exit status (0), or raises
    ScenarioError (one line; the CLI exits 2) on bad input before anything runs.

    Prints the top-K table (or, with ``as_json``, the CONTRACT's object) on stdout; with
    ``out``, writes plan.json, plan.csv and pareto.png there. ``backend`` ray or dask needs
    ``simulate_many`` (the CLI builds it from :mod:`sim.sweep`'s backends); layouts are
    built locally either way.
    """
    if backend not in BACKENDS:
        raise ScenarioError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if backend != "local" and simulate_many is None:
        raise ScenarioError(f"--backend {backend}: no {backend} connection was given to the "
                            "planner")
    if workers is not None and workers < 1:
        raise ScenarioError(f"--workers {workers}: expected at least 1")
    if time_limit_s is not None and time_limit_s <= 0:
        raise ScenarioError(f"--time-limit {time_limit_s}: expected a positive number of "
                            "seconds")
    if out is not None and out.exists() and not out.is_dir():
        raise ScenarioError(f"--out {out}: exists and is not a folder")
    base = load_scenario(scenario, list(overrides))
    local = cpu_count()
    from contextlib import nullcontext

    from rich.console import Console

    err = Console(stderr=True)
    live = not as_json and not quiet and err.is_terminal
    with err.status("plan: profiling layers") if live else nullcontext() as status:
        counts = {"build": 0, "simulate": 0, "profiles": 0}

        def progress(phase: str, done: int, total: int) -> None:
            counts[phase] = done
            if status is not None:
                status.update(f"plan: {total:,} layouts, {counts['build']:,} built, "
                              f"{counts['simulate']:,} simulated")

        report = progress if live else None
        if simulate_many is None:
            result = search(base, objective, top, tuple(frameworks or registry.searchable()),
                            workers or local, max_simulations, time_limit_s, backend=backend,
                            progress=report)
        else:
            # Builds on this machine's cores, simulations ``workers`` at a time on the
            # backend.
            result = search(base, objective, top, tuple(frameworks or registry.searchable()), local,
                            max_simulations, time_limit_s, simulate_many, backend, report,
                            simulation_batch=workers or local)
    if out is not None:
        write_outputs(result, out)
    if as_json:
        print(json.dumps(plan_json(result), indent=2, default=str))
    elif not quiet:
        print_table(result)
        if out is not None:
            print(f"wrote plan.json, plan.csv, pareto.png and top-1.yaml ... in {out}")
    return 0
