"""Megatron-Core's fine-grained activation offloading (``--fine-grained-activation-offloading``
with ``--offload-modules``), for the routed experts' modules ``expert_fc1`` and ``moe_act``.

What Megatron-Core does (NVIDIA/Megatron-LM @ d98e8a6,
``megatron/core/pipeline_parallel/fine_grained_activation_offload.py`` and
``transformer/moe/experts.py``; docs/user-guide/features/fine_grained_activation_offloading.md):

* Each offload module is a **group** per layer and micro-batch: the tensors autograd saves
  inside it. ``expert_fc1`` is the grouped fc1's saved input (its MXFP8 copy, or the 16-bit
  sorted tokens in bf16), ``moe_act`` the activation's saved input, fc1's output (also what
  ``moe_act`` recomputation keeps). Tensors under ``min_offloaded_tensor_size`` elements
  stay (the routing probabilities).
* **Forward**: when a group's forward ends (``group_offload``; ``moe_act``'s after fc2) the
  D2H stream waits for the compute stream and copies the group's tensors into pinned host
  memory; their GPU storage is released once the copy is done (``record_stream`` on the D2H
  stream, the forced release of the module's input).
* **Backward**: groups are reloaded in the reverse of the order they were offloaded (a
  stack). Whenever a group's backward ends (the start marker's backward,
  ``on_group_start_backward``) the H2D stream waits for the compute stream and reloads the
  next group on the stack; with the stack empty it reloads the next group of the next
  backward chunk instead, if that chunk's forward has been issued (``pre_reload_last_layer``).
  A group's backward starts by waiting for its reload (``on_group_commit_backward``); one
  never reloaded is copied back in place on the compute stream when its tensor is used
  (``tensor_pop``).
* **Which groups stay** (``post_warmup_callback``, ``should_bulk_offload``): of the first
  backward chunk, the last group of each module name (the "offload margin", so that every
  later reload is issued a group of each name ahead of its use); and, when the chunk whose
  forward just ended is also the next one to run backward (the last stage of 1F1B), its last
  group of each name; then, on pipeline rank r, the first r x
  ``delta_offload_bytes_across_pp_ranks`` bytes of groups in backward-chunk order; then, in
  each chunk, the groups past ``activation_offload_fraction`` of its eligible ones (the later
  forward groups).

Here a group's bytes are the experts block's saved tensors that the group's backward kernel
reads (``fc1.wgrad``; ``weighted_act.bwd``) on the pace-setting rank; a backward chunk is a
backward unit in the stage's schedule order. The experts' backward op is cut in two where
fc1's backward begins (``{...} experts`` then ``{...} experts fc1``, the time split by the
kernels' own prices), so a reload issued when ``moe_act``'s backward ends can stall fc1's.
Approximations, both slightly pessimistic: ``expert_fc1``'s copy starts when the experts'
forward op ends rather than after fc1, and ``moe_act``'s reload is waited for before fc2's
backward rather than before the activation's recompute.

Not modelled (refused): skewed routing, the attention and norm modules, ``fused_group_mlp``,
``expert_fc1`` under per-tensor or blockwise FP8 (fc1 then saves its 16-bit input,
``set_save_original_input``), and the combination with full recomputation and with ``moe``
recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_ranks import experts_op_name
from sim.frameworks.megatron.delay_wgrad import delayed_kernels
from sim.frameworks.megatron.pipeline import schedule
from sim.hardware.compute import EAGER_FWD_OP_CPU_S, ComputeModel
from sim.program.ir import Op
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Block

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape

KEY = "framework.offload_modules"
D2H_STREAM = "act_d2h"
"""The offload manager's own D2H stream (``PipelineOffloadManager.d2h_stream``)."""
H2D_STREAM = "act_h2d"
GROUP_KERNEL = {"expert_fc1": "fc1.wgrad", "moe_act": "weighted_act.bwd"}
"""The backward kernel whose saved inputs are each module's group."""
FC1_BACKWARD = ("fc1.",)
"""Kernel-name prefixes of the experts' backward from fc1's on (with the padding and chunk
sort backwards after it): the part cut off as ``experts fc1``."""
# Host calls, Python-level torch calls at an eager op's cost: per group the two marker
# autograd functions (start, commit); per offloaded group the stream wait and event record,
# and per tensor the pinned pool's allocation, copy_, record_stream and the push (forward),
# the empty GPU tensor, copy_ and the pool's free (backward).
MARKER_CALLS = 2
GROUP_CALLS = 2
TENSOR_CALLS_D2H = 4
TENSOR_CALLS_H2D = 3


def check_activation_offload(ctx: JobContext, shape: MegatronShape) -> None:
    """Refuse what Megatron-Core refuses and what is not modelled yet."""
    s = ctx.scenario
    opts = shape.opts
    if not opts.fine_grained_activation_offloading:
        return
    mods = opts.offload_modules or []
    ctx.require(bool(mods), KEY, "fine_grained_activation_offloading needs offload_modules "
                "(expert_fc1, moe_act)")
    ctx.require(ctx.model.moe is not None, KEY,
                "expert_fc1 and moe_act are modules of the routed experts: the model has none")
    ctx.require(s.training.activation_checkpointing != "full", KEY,
                "offloading beside full recomputation is not modelled")
    ctx.require("moe" not in (opts.recompute_modules or []), KEY,
                "offloading inside a recomputed MoE layer is not modelled")
    ctx.require(shape.moe is None or shape.moe.pace is None or not shape.moe.ranks, KEY,
                "offloading under skewed routing (training.routing) is not modelled yet")
    ctx.require("expert_fc1" not in mods or s.training.precision != "fp8"
                or opts.fp8_recipe == "mxfp8", KEY,
                "expert_fc1 under per-tensor or blockwise FP8 saves fc1's 16-bit input "
                "(set_save_original_input): not modelled yet; use mxfp8 or bf16")
    if opts.cuda_graph_impl != "none":
        scope = set(opts.cuda_graph_scope or [])
        ctx.require(opts.cuda_graph_impl == "transformer_engine"
                    and {"attn", "moe_router"} <= scope, KEY,
                    "with CUDA graphs Megatron-Core offloads only under cuda_graph_impl "
                    "transformer_engine with attn and moe_router in cuda_graph_scope")


def _elements(name: str, nbytes: float) -> float:
    # FP8 copies are a byte an element, other activations 16-bit.
    return nbytes / (1.0 if "fp8" in name else 2.0)


def group_bytes(experts: Block, modules: Iterable[str], min_elements: int
                ) -> dict[str, float]:
    """Bytes of each module's group per layer and micro-batch: the saved tensors the group's
    backward kernel reads, of at least ``min_elements`` elements, each counted in one group
    (``expert_fc1`` first)."""
    saved = {id(t): t for t in experts.saved}
    taken: set[int] = set()
    out: dict[str, float] = {}
    for mod in ("expert_fc1", "moe_act"):
        if mod not in modules:
            continue
        total = 0.0
        for k in experts.backward:
            if k.name != GROUP_KERNEL[mod]:
                continue
            for t in k.reads:
                if id(t) in saved and id(t) not in taken \
                        and _elements(t.name, t.nbytes) >= min_elements:
                    taken.add(id(t))
                    total += t.nbytes
        out[mod] = total
    return out


def fc1_backward_share(experts: Block, cm: ComputeModel, delayed: bool = False
                       ) -> tuple[float, float]:
    """(GPU-time share, kernel share) of the experts' backward op from fc1's backward on;
    ``delayed``: without the weight-gradient GEMMs ``delay_wgrad_compute`` moves out."""
    wgrad = {id(k) for k in delayed_kernels(experts)} if delayed else set()
    times = [(k, kernel_time(cm, k)) for k in experts.backward if id(k) not in wgrad]
    total = sum(t for _, t in times)
    start = next((i for i, (k, _) in enumerate(times) if k.name.startswith(FC1_BACKWARD)),
                 len(times))
    tail = sum(t for _, t in times[start:])
    n = len(times)
    return (tail / total if total > 0 else 0.0), ((n - start) / n if n else 0.0)


@dataclass
class Group:
    """One (module, layer) group of a backward unit, in backward order."""

    module: str
    layer: int
    first: Op
    """The op that waits for the group's reload."""
    end: Op
    """The op at whose end the group's backward ends (the reload hook)."""
    d2h: Op | None = None
    """The group's offload copy; None when the group stays on the GPU."""
    nbytes: float = 0.0


@dataclass
class BackwardGroups:
    """A backward unit's groups in backward order."""

    groups: list[Group] = field(default_factory=list)


class OffloadPlan:
    """Which groups are offloaded, the forward copies, and the reload ops of every unit."""

    def __init__(self, s: MegatronShape, cm: ComputeModel) -> None:
        opts = s.opts
        assert s.moe is not None
        experts = s.moe.pace.ops.experts if s.moe.pace is not None else s.moe.ops.experts
        self.modules = tuple(m for m in ("expert_fc1", "moe_act")
                             if m in (opts.offload_modules or []))
        self.bytes = group_bytes(experts, self.modules, opts.min_offloaded_tensor_size)
        self.time_share, self.kernel_share = fc1_backward_share(
            experts, cm, opts.delay_wgrad_compute)
        self.p = n_stages = s.p
        kind = "1f1b" if s.vp > 1 else opts.pipeline_schedule
        self.order = {st: schedule(kind, n_stages, st, s.mb_count, s.vp,
                                   int(opts.moe_a2a_overlap))
                      for st in range(n_stages)}
        self.d2h: dict[tuple[int, int, int], Op] = {}
        self.offloaded: dict[tuple[int, int, int], tuple[str, ...]] = {}
        """(virtual stage, micro-batch, layer) -> the modules whose groups its copy moves."""
        self.backward: dict[tuple[int, int], BackwardGroups] = {}
        self.kept: set[tuple[int, int, int, str]] = set()
        """(virtual stage, micro-batch, layer, module) groups that stay on the GPU."""
        moe_layers = {v: [x for x in s.chunks[v] if s.moe.is_moe(x)]
                      for v in range(s.n_virtual)}
        for st, order in self.order.items():
            units = [(k, c * n_stages + st, mb) for k, c, mb in order]
            self._keep_rules(units, moe_layers, st * opts.delta_offload_bytes_across_pp_ranks,
                             opts.activation_offload_fraction)

    def _keep_rules(self, units: list[tuple[str, int, int]], moe_layers: dict[int, list[int]],
                    keep_bytes: float, fraction: float) -> None:
        """One stage's groups that stay (``post_warmup_callback``, ``should_bulk_offload``),
        in the manager's order: the offload margin, the forward whose backward runs next, the
        bytes kept on higher pipeline ranks, then the fraction."""
        def groups(v: int, mb: int) -> list[tuple[int, int, int, str]]:
            return [(v, mb, la, m) for la in moe_layers[v] for m in self.modules
                    if self.bytes[m] > 0]

        # The offload margin: the first backward chunk's last group of each name.
        first_b = next((u for u in units if u[0] == "B" and moe_layers[u[1]]), None)
        if first_b is not None:
            _, v, mb = first_b
            self.kept.update((v, mb, moe_layers[v][-1], m) for m in self.modules)
        # A forward whose chunk is the next to run backward keeps its last group of each name.
        for i, u in enumerate(units):
            if u[0] != "F" or not moe_layers[u[1]]:
                continue
            nxt = next((w for w in units[i + 1:] if w[0] == "B" and moe_layers[w[1]]), None)
            if nxt is not None and nxt[1:] == u[1:]:
                self.kept.update((u[1], u[2], moe_layers[u[1]][-1], m) for m in self.modules)
        backward = [u[1:] for u in units if u[0] == "B"]
        # delta_offload_bytes_across_pp_ranks: pp_rank x delta bytes stay, the backward
        # chunks' groups in order.
        for v, mb in backward:
            for g in groups(v, mb):
                if keep_bytes <= 0:
                    break
                if g not in self.kept:
                    keep_bytes -= self.bytes[g[3]]
                    self.kept.add(g)
        # activation_offload_fraction: each chunk keeps its later groups past the fraction.
        for v, mb in backward:
            eligible = [g for g in groups(v, mb) if g not in self.kept]
            n_off = int(len(eligible) * (1.0 - fraction))
            self.kept.update(eligible[len(eligible) - n_off:] if n_off else [])

    # ------------------------------------------------------------------ forward
    def forward_copy(self, v: int, mb: int, layer: int, experts: Op, carrier: Op
                     ) -> Op | None:
        """The D2H copy of a forward MoE layer's groups after its experts op (None when they
        stay); the marker functions' host calls go on the experts op. ``carrier`` is the op
        that allocates the layer's saved activations: the groups become allocations of their
        own there (the allocator then releases exactly them when the copy ends)."""
        experts.cpu_s += len(self.modules) * MARKER_CALLS * EAGER_FWD_OP_CPU_S
        mods = tuple(m for m in self.modules
                     if self.bytes[m] > 0 and (v, mb, layer, m) not in self.kept)
        parts = tuple(self.bytes[m] for m in mods)
        held = [b for cat, b in carrier.alloc if cat == "activations"]
        if not parts or len(held) != 1 or held[0] < sum(parts):
            return None
        carrier.alloc_parts = (held[0] - sum(parts), *parts)
        op = Op(name=f"offload moe L{layer} mb{mb}", kind="copy", stream=D2H_STREAM,
                phase="fwd", deps=[experts], host_transfer="d2h", nbytes=sum(parts),
                category="copy", micro_batch=mb, layer=layer, kernels=0,
                cpu_s=len(parts) * (GROUP_CALLS + TENSOR_CALLS_D2H) * EAGER_FWD_OP_CPU_S,
                free=tuple(("activations", b) for b in parts))
        self.d2h[(v, mb, layer)] = op
        self.offloaded[(v, mb, layer)] = mods
        return op

    def backward_frees(self, v: int, mb: int, layer: int, op: Op) -> None:
        """The op that frees the layer's saved activations (the attention's backward) frees
        the reloaded groups as the allocations they came back as."""
        if (v, mb, layer) not in self.d2h:
            return
        parts = tuple(b for cat, b in self.d2h[(v, mb, layer)].free if cat == "activations")
        frees = list(op.free)
        i = next(i for i, (cat, b) in enumerate(frees) if cat == "activations"
                 and b >= sum(parts) - 1.0)
        frees[i] = ("activations", frees[i][1] - sum(parts))
        op.free = (*frees, *(("activations", b) for b in parts))

    # ------------------------------------------------------------------ backward
    def finish(self, units: dict[tuple[str, int, int], list[Op]]) -> None:
        """After the units are built (and their weight gradients split out): cut every
        backward MoE layer's experts op where fc1's backward begins, then add the reloads
        (:meth:`link_reloads`)."""
        for (kind, v, mb), ops in units.items():
            if kind != "B":
                continue
            for i in range(len(ops) - 1, -1, -1):
                o = ops[i]
                if o.layer is not None and o.name == experts_op_name("bwd", o.layer, mb):
                    ops[i:i + 1] = self._split_experts(v, mb, o.layer, o)
            # Groups in backward order: the unit's ops run later layers first.
            unit = self.backward.get((v, mb))
            if unit is not None:
                unit.groups.sort(key=lambda g: ops.index(g.first))
        self.link_reloads(units)

    def _split_experts(self, v: int, mb: int, layer: int, experts: Op) -> list[Op]:
        """The experts' backward op cut where fc1's backward begins: ``[experts, experts
        fc1]``; the unit's groups recorded for :meth:`link_reloads`."""
        d = experts.duration
        tail = replace(experts, name=f"{experts.name} fc1", deps=[experts],
                       duration=d * self.time_share,
                       kernels=round(experts.kernels * self.kernel_share),
                       cpu_s=experts.cpu_s * self.kernel_share,
                       flops=experts.flops * self.time_share,
                       hw_flops=experts.hw_flops * self.time_share,
                       alloc=(), free=(), transient=0.0, transient_parts=())
        experts.duration = d - tail.duration
        experts.kernels -= tail.kernels
        experts.cpu_s -= tail.cpu_s
        experts.flops -= tail.flops
        experts.hw_flops -= tail.hw_flops
        marker = len(self.modules) * MARKER_CALLS * EAGER_FWD_OP_CPU_S
        experts.cpu_s += marker
        d2h = self.d2h.get((v, mb, layer))
        moved = self.offloaded.get((v, mb, layer), ())
        unit = self.backward.setdefault((v, mb), BackwardGroups())
        for module, first in (("moe_act", experts), ("expert_fc1", tail)):
            if module in self.modules:
                unit.groups.append(Group(module, layer, first, first,
                                         d2h if module in moved else None,
                                         self.bytes[module] if module in moved else 0.0))
        return [experts, tail]

    def _reload(self, g: Group, mb: int, after: list[Op]) -> Op:
        """The H2D copy of group ``g``, issued after ``after``; ``g.first`` waits for it."""
        assert g.d2h is not None
        op = Op(name=f"reload {g.module} L{g.layer} mb{mb}", kind="copy", stream=H2D_STREAM,
                phase="bwd", deps=[*after, g.d2h], host_transfer="h2d", nbytes=g.nbytes,
                category="copy", micro_batch=mb, kernels=0,
                cpu_s=(GROUP_CALLS + TENSOR_CALLS_H2D) * EAGER_FWD_OP_CPU_S,
                alloc=(("activations", g.nbytes),))
        g.first.deps = [*g.first.deps, op]
        return op

    def link_reloads(self, unit_ops: dict[tuple[str, int, int], list[Op]]) -> None:
        """Add every backward unit's reload copies to the units' op lists, stage by stage in
        schedule order, as the manager's stack issues them (see the module docstring)."""
        for st, order in self.order.items():
            units = [(k, c * self.p + st, mb) for k, c, mb in order]
            pos = {u: i for i, u in enumerate(units)}
            spare: list[Op] = []      # hooks of the previous backward unit with an empty stack
            prev_b: tuple[str, int, int] | None = None
            for u in units:
                if u[0] != "B":
                    continue
                _, v, mb = u
                groups = self.backward.get((v, mb), BackwardGroups()).groups
                ops = unit_ops[u]
                stack = [g for g in groups if g.d2h is not None]   # in backward order
                ready: set[int] = set()
                if prev_b is not None and pos[("F", v, mb)] < pos[prev_b]:
                    # pre_reload_last_layer: the previous unit's spare hooks.
                    prev_ops = unit_ops[prev_b]
                    for hook in spare:
                        if not stack:
                            break
                        g = stack.pop(0)
                        prev_ops.insert(prev_ops.index(hook) + 1, self._reload(g, mb, [hook]))
                        ready.add(id(g))
                spare = []
                for g in groups:
                    if g.d2h is not None and id(g) not in ready:
                        # Never reloaded: copied back where it is used (tensor_pop); the
                        # group stays on the stack, and the next hook pops it for nothing.
                        i = ops.index(g.first)
                        ops.insert(i, self._reload(g, mb, [ops[i - 1]] if i else []))
                        ready.add(id(g))
                    # The group's backward ends: the hook pops the stack's top.
                    if stack:
                        x = stack.pop(0)
                        if id(x) not in ready:
                            ops.insert(ops.index(g.end) + 1, self._reload(x, mb, [g.end]))
                            ready.add(id(x))
                    else:
                        spare.append(g.end)
                prev_b = u
