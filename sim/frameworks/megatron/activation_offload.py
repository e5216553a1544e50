"""Megatron-Core's fine-grained activation offloading (``--fine-grained-activation-offloading``
with ``--offload-modules``): the attention's ``qkv_linear``, ``core_attn`` and ``attn_proj``,
an MoE layer's ``mlp_norm`` and the routed experts' ``expert_fc1`` and ``moe_act``.

What Megatron-Core does (NVIDIA/Megatron-LM @ d98e8a6,
``megatron/core/pipeline_parallel/fine_grained_activation_offload.py``,
``transformer/attention.py``, ``transformer/transformer_layer.py``,
``transformer/moe/experts.py``; docs/user-guide/features/fine_grained_activation_offloading.md):

* Each offload module is a **group** per layer and micro-batch: the tensors autograd saves
  inside it. ``qkv_linear`` is Transformer Engine's LayerNormLinear, so its input norm's
  saved input and statistics go with the QKV linear's saved input; ``core_attn`` the fused
  attention's saved query, key, value, output and log-sum-exp; ``attn_proj`` the output
  projection's saved input (its FP8 copy; in 16 bits it is core attention's output, counted
  once, with ``core_attn``); ``mlp_norm`` an MoE layer's pre-MLP norm (its own module: a dense
  layer's is fused into fc1, an ``IdentityOp``, as ``attn_norm`` is under Transformer Engine,
  which then offloads nothing); ``expert_fc1`` the grouped fc1's saved input (its MXFP8 copy,
  or the 16-bit sorted tokens in bf16); ``moe_act`` the activation's saved input, fc1's output
  (also what ``moe_act`` recomputation keeps). Tensors under ``min_offloaded_tensor_size``
  elements stay (the routing probabilities).
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
* **Which groups stay** (``post_warmup_callback``, ``should_bulk_offload``): when the chunk
  whose forward just ended is also the next one to run backward (``front_backward_chunk``:
  the last stage of 1F1B, and on every stage the first backward chunk, since no backward has
  run before it), its last group of each name. That covers the "offload margin" too (of the
  first backward chunk, the last group of each name), so every later reload is issued a
  group of each name ahead of its use; the margin is not applied a second time. Then, on
  pipeline rank r, the first r x ``delta_offload_bytes_across_pp_ranks`` bytes of groups in
  backward-chunk order; then, in each chunk, the groups past ``activation_offload_fraction``
  of its eligible ones (the later forward groups).

Here a group's bytes are the saved tensors that the group's backward kernels read, on the
pace-setting rank; a backward chunk is a backward unit in the stage's schedule order. The
attention's backward op is cut into three where core attention's and the QKV linear's
backward begin (``{...} proj``, ``{...} core``, then the op itself), the experts' in two
where fc1's begins (``{...} experts`` then ``{...} experts fc1``), the time split by the
kernels' own prices, so a reload issued when one group's backward ends can stall the next.
Approximations, slightly pessimistic: a layer's attention groups leave when its attention's
forward op ends and its MoE groups when its experts' forward op ends (not each after its own
module), and ``moe_act``'s reload is waited for before fc2's backward rather than before the
activation's recompute.

Not modelled (refused): skewed routing, the local (non Transformer Engine) layer spec,
``fused_group_mlp``, the attention modules under tensor or context parallelism or with
multi-latent attention, ``core_attn`` beside its own recomputation, ``expert_fc1`` under
per-tensor or blockwise FP8 (fc1 then saves its 16-bit input, ``set_save_original_input``),
and the combination with full recomputation and with ``moe`` recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_ranks import experts_op_name
from sim.frameworks.megatron.delay_wgrad import delayed_kernels
from sim.frameworks.megatron.pipeline import schedule
from sim.hardware.compute import EAGER_FWD_OP_CPU_S, ComputeModel
from sim.program.ir import Op
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Block, Kernel
from sim.workload.megatron_ops import attention_key

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape

KEY = "framework.offload_modules"
D2H_STREAM = "act_d2h"
"""The offload manager's own D2H stream (``PipelineOffloadManager.d2h_stream``)."""
H2D_STREAM = "act_h2d"
ATTENTION = ("qkv_linear", "core_attn", "attn_proj")
MOE = ("mlp_norm", "expert_fc1", "moe_act")
ORDER = ("attn_norm", *ATTENTION, *MOE)
"""The modules in a layer's forward order."""
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
    mods = set(opts.offload_modules or [])
    ctx.require(bool(mods), KEY, "fine_grained_activation_offloading needs offload_modules")
    ctx.require(not shape.legacy, KEY,
                "offloading under the local layer spec is not modelled yet (Transformer "
                "Engine's only)")
    ctx.require(not (mods & set(MOE)) or ctx.model.moe is not None, KEY,
                "mlp_norm, expert_fc1 and moe_act are modules of an MoE layer: the model "
                "has none")
    ctx.require("attn_proj" not in mods or "core_attn" in mods, KEY,
                "attn_proj cannot be offloaded without core_attn (Megatron-Core)")
    if mods & set(ATTENTION):
        ctx.require(shape.t == 1 and shape.cp == 1 and ctx.model.mla is None, KEY,
                    "offloading the attention's modules is modelled at tp 1 and cp 1 "
                    "without multi-latent attention only")
        ctx.require("core_attn" not in mods or "core_attn" not in shape.recompute, KEY,
                    "offloading core_attn beside its recomputation is not modelled")
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
                    and {"attn", "moe_router"} <= scope
                    and not mods & {"attn_norm", "mlp_norm"}, KEY,
                    "with CUDA graphs Megatron-Core offloads only under cuda_graph_impl "
                    "transformer_engine with attn and moe_router in cuda_graph_scope, and "
                    "not attn_norm or mlp_norm")


def _elements(name: str, nbytes: float) -> float:
    # FP8 copies are a byte an element, other activations 16-bit.
    return nbytes / (1.0 if "fp8" in name else 2.0)


def _is_core(k: Kernel) -> bool:
    return k.klass == "attention"


# The backward kernels whose saved inputs are each module's group, by block: (block role,
# kernel selector). "attn" is the layer's attention block, "attn_pre" its fused input norm.
_READERS: dict[str, tuple[tuple[str, Callable[[Kernel], bool]], ...]] = {
    "qkv_linear": (("attn_pre", lambda k: True),
                   ("attn", lambda k: k.name.startswith("qkv."))),
    "core_attn": (("attn", _is_core),),
    "attn_proj": (("attn", lambda k: k.name.startswith("proj.")),),
    "mlp_norm": (("mlp_pre", lambda k: True),),
    "expert_fc1": (("experts", lambda k: k.name == "fc1.wgrad"),),
    "moe_act": (("experts", lambda k: k.name == "weighted_act.bwd"),),
}


def group_bytes(blocks: dict[str, Block], modules: Iterable[str], min_elements: int,
                exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    """Bytes of each module's group per layer and micro-batch: the saved tensors its
    backward kernels read (``blocks`` by role: attn, attn_pre, mlp_pre, experts), of at least
    ``min_elements`` elements, each counted once, in the first group in forward order;
    ``exclude``: saved tensors (full names) a recomputation already drops."""
    taken: set[int] = set()
    out: dict[str, float] = {}
    for mod in ORDER:
        if mod not in modules:
            continue
        total = 0.0
        for role, pick in _READERS.get(mod, ()):
            block = blocks.get(role)
            if block is None:
                continue
            saved = {id(t) for t in block.saved if t.name not in exclude}
            for k in block.backward:
                if not pick(k):
                    continue
                for t in k.reads:
                    if id(t) in saved and id(t) not in taken \
                            and _elements(t.name, t.nbytes) >= min_elements:
                        taken.add(id(t))
                        total += t.nbytes
        out[mod] = total
    return out


def _shares(kernels: list[Kernel], cm: ComputeModel, starts: list[Callable[[Kernel], bool]]
            ) -> list[tuple[float, float]]:
    """(GPU-time share, kernel share) of each segment of ``kernels``, cut before the first
    kernel each of ``starts`` selects."""
    times = [kernel_time(cm, k) for k in kernels]
    total = sum(times) or 1.0
    cuts = [0]
    for pick in starts:
        cuts.append(next((i for i in range(cuts[-1], len(kernels)) if pick(kernels[i])),
                         len(kernels)))
    cuts.append(len(kernels))
    n = len(kernels) or 1
    return [(sum(times[a:b]) / total, (b - a) / n)
            for a, b in zip(cuts, cuts[1:], strict=False)]


def _backward_kernels(block: Block | None, delayed: bool) -> list[Kernel]:
    if block is None:
        return []
    wgrad = {id(k) for k in delayed_kernels(block)} if delayed else set()
    return [k for k in block.backward if id(k) not in wgrad]


@dataclass
class Group:
    """One (module, layer) group of a backward unit, in backward order."""

    module: str
    layer: int
    first: Op
    """The op that waits for the group's reload (and at whose end its backward ends)."""
    d2h: Op | None = None
    """The group's offload copy; None when the group stays on the GPU."""
    nbytes: float = 0.0


def _cut(op: Op, shares: list[tuple[float, float]], names: list[str], keep_last: bool
         ) -> list[Op]:
    """``op`` cut into consecutive ops of the given (time, kernel) shares, its duration,
    kernels, host time and FLOPs divided among them (the totals kept). ``keep_last``: ``op``
    itself becomes the last piece (what waits on it and the hooks keyed on it stay at its
    end, with its frees; its allocations move to the first piece), else the first (its memory
    events stay with it)."""
    d, k, cpu, fl, hw = op.duration, op.kernels, op.cpu_s, op.flops, op.hw_flops
    own = len(shares) - 1 if keep_last else 0
    pieces: list[Op] = []
    for i, ((ts, ks), name) in enumerate(zip(shares, names, strict=True)):
        if i == own:
            pieces.append(op)
            continue
        piece = replace(op, name=name, deps=[], alloc=(), free=(), transient=0.0,
                        transient_parts=(), alloc_parts=(), duration=d * ts,
                        kernels=round(k * ks), cpu_s=cpu * ks, flops=fl * ts,
                        hw_flops=hw * ts)
        pieces.append(piece)
    others = [p for i, p in enumerate(pieces) if i != own]
    op.duration = d - sum(p.duration for p in others)
    op.kernels = k - sum(p.kernels for p in others)
    op.cpu_s = cpu - sum(p.cpu_s for p in others)
    op.flops = fl - sum(p.flops for p in others)
    op.hw_flops = hw - sum(p.hw_flops for p in others)
    if keep_last and len(pieces) > 1:
        first = pieces[0]
        first.deps, op.deps = list(op.deps), []
        first.alloc, op.alloc = op.alloc, ()
        first.alloc_parts, op.alloc_parts = op.alloc_parts, ()
        first.transient, first.transient_parts = op.transient, op.transient_parts
        op.transient, op.transient_parts = 0.0, ()
    for a, b in zip(pieces, pieces[1:], strict=False):
        b.deps = [*b.deps, a]
    return pieces


class OffloadPlan:
    """Which groups are offloaded, the forward copies, and the reload ops of every unit."""

    def __init__(self, s: MegatronShape, cm: ComputeModel) -> None:
        opts = s.opts
        delayed = opts.delay_wgrad_compute
        self.modules = tuple(m for m in ORDER if m in (opts.offload_modules or [])
                             and m != "attn_norm")   # an IdentityOp under Transformer Engine
        self.attn_modules = tuple(m for m in self.modules if m in ATTENTION)
        self.moe_modules = tuple(m for m in self.modules if m in MOE)
        self.min_elements = opts.min_offloaded_tensor_size
        self.s = s
        # The pre-MLP norm's statistics are dropped when layernorm is recomputed.
        self.exclude = frozenset({"mlp_pre.norm.stats"}) if "layernorm" in s.recompute \
            else frozenset()
        self.bytes: dict[tuple[str, str], float] = {}
        """(attention key, module) -> bytes; MoE modules under the key ``"moe"``."""
        self.attn_shares: dict[str, list[tuple[float, float]]] = {}
        for key in {attention_key(s.model, la, s.blocks) for la in range(s.model.layers)}:
            blocks = {"attn": s.blocks[key], "attn_pre": s.blocks["attn_pre"]}
            for m, b in group_bytes(blocks, self.attn_modules, self.min_elements).items():
                self.bytes[(key, m)] = b
            kernels = _backward_kernels(s.blocks[key], delayed) + \
                _backward_kernels(s.blocks["attn_pre"], delayed)
            self.attn_shares[key] = _shares(kernels, cm, [_is_core,
                                                          lambda k: k.name.startswith("qkv.")])
        self.fc1_share = [(1.0, 1.0), (0.0, 0.0)]
        if s.moe is not None:
            experts = s.moe.pace.ops.experts if s.moe.pace is not None else s.moe.ops.experts
            blocks = {"experts": experts, "mlp_pre": s.blocks["mlp_pre"]}
            for m, b in group_bytes(blocks, self.moe_modules, self.min_elements,
                                    self.exclude).items():
                self.bytes[("moe", m)] = b
            self.fc1_share = _shares(_backward_kernels(experts, delayed), cm,
                                     [lambda k: k.name.startswith("fc1.")])
        self.p = n_stages = s.p
        self.order = {st: schedule(s.schedule_kind, n_stages, st, s.mb_count, s.vp,
                                   int(opts.moe_a2a_overlap))
                      for st in range(n_stages)}
        self.d2h: dict[tuple[int, int, int, str], Op] = {}
        """(virtual stage, micro-batch, layer, module) -> the copy that moves the group."""
        self.parts: dict[tuple[int, int, int], list[float]] = {}
        """(virtual stage, micro-batch, layer) -> the bytes of its offloaded groups."""
        self.backward: dict[tuple[int, int], list[Group]] = {}
        """(virtual stage, micro-batch) -> the backward unit's groups in backward order."""
        self.kept: set[tuple[int, int, int, str]] = set()
        """(virtual stage, micro-batch, layer, module) groups that stay on the GPU."""
        for st, order in self.order.items():
            units = [(k, c * n_stages + st, mb) for k, c, mb in order]
            self._keep_rules(units, st * opts.delta_offload_bytes_across_pp_ranks,
                             opts.activation_offload_fraction)

    def group_size(self, layer: int, module: str) -> float:
        """Bytes of ``module``'s group in ``layer`` (0 where the layer has no such group)."""
        s = self.s
        if module in MOE:
            return self.bytes.get(("moe", module), 0.0) \
                if s.moe is not None and s.moe.is_moe(layer) else 0.0
        return self.bytes.get((attention_key(s.model, layer, s.blocks), module), 0.0)

    def _groups(self, v: int, mb: int) -> list[tuple[int, int, int, str]]:
        """The chunk's groups that could be offloaded, in forward order."""
        return [(v, mb, la, m) for la in self.s.chunks[v] for m in self.modules
                if self.group_size(la, m) > 0]

    def _keep_rules(self, units: list[tuple[str, int, int]], keep_bytes: float,
                    fraction: float) -> None:
        """One stage's groups that stay (``post_warmup_callback``, ``should_bulk_offload``),
        in the manager's order: the forward whose backward runs next (which also covers the
        offload margin, see the module docstring), the bytes kept on higher pipeline ranks,
        then the fraction."""
        chunks = {u[1:]: self._groups(*u[1:]) for u in units}

        def last_of_each_name(v: int, mb: int) -> set[tuple[int, int, int, str]]:
            return set({g[3]: g for g in chunks[(v, mb)]}.values())

        for i, u in enumerate(units):
            if u[0] != "F" or not chunks[u[1:]]:
                continue
            nxt = next((w for w in units[i + 1:] if w[0] == "B" and chunks[w[1:]]), None)
            if nxt is not None and nxt[1:] == u[1:]:
                self.kept |= last_of_each_name(*u[1:])
        backward = [u[1:] for u in units if u[0] == "B"]
        for v, mb in backward:
            for g in chunks[(v, mb)]:
                if keep_bytes <= 0:
                    break
                if g not in self.kept:
                    keep_bytes -= self.group_size(g[2], g[3])
                    self.kept.add(g)
        for v, mb in backward:
            eligible = [g for g in chunks[(v, mb)] if g not in self.kept]
            n_off = int(len(eligible) * (1.0 - fraction))
            self.kept.update(eligible[len(eligible) - n_off:] if n_off else [])

    # ------------------------------------------------------------------ forward
    def forward_copy(self, v: int, mb: int, layer: int, after: Op, carrier: Op,
                     moe: bool) -> Op | None:
        """The D2H copy of a forward layer's attention groups (``moe`` False: after its
        attention op) or MoE groups (after its experts op), None when they all stay; the
        marker functions' host calls go on ``after``. ``carrier`` is the op that allocates
        the layer's saved activations: the groups become allocations of their own there (the
        allocator then releases exactly them when the copy ends)."""
        mods = self.moe_modules if moe else self.attn_modules
        after.cpu_s += len(mods) * MARKER_CALLS * EAGER_FWD_OP_CPU_S
        moved = tuple(m for m in mods if self.group_size(layer, m) > 0
                      and (v, mb, layer, m) not in self.kept)
        parts = [self.group_size(layer, m) for m in moved]
        done = self.parts.get((v, mb, layer), [])
        held = [b for cat, b in carrier.alloc if cat == "activations"]
        if not parts or len(held) != 1 or held[0] < sum(done) + sum(parts):
            return None
        allp = [*done, *parts]
        self.parts[(v, mb, layer)] = allp
        carrier.alloc_parts = (held[0] - sum(allp), *allp)
        op = Op(name=f"offload {'moe' if moe else 'attn'} L{layer} mb{mb}", kind="copy",
                stream=D2H_STREAM, phase="fwd", deps=[after], host_transfer="d2h",
                nbytes=sum(parts), category="copy", micro_batch=mb, layer=layer, kernels=0,
                cpu_s=len(parts) * (GROUP_CALLS + TENSOR_CALLS_D2H) * EAGER_FWD_OP_CPU_S,
                free=tuple(("activations", b) for b in parts))
        for m in moved:
            self.d2h[(v, mb, layer, m)] = op
        return op

    def backward_frees(self, v: int, mb: int, layer: int, op: Op) -> None:
        """The op that frees the layer's saved activations (the attention's backward) frees
        the reloaded groups as the allocations they came back as."""
        parts = self.parts.get((v, mb, layer))
        if not parts:
            return
        frees = list(op.free)
        i = next(i for i, (cat, b) in enumerate(frees) if cat == "activations"
                 and b >= sum(parts) - 1.0)
        frees[i] = ("activations", frees[i][1] - sum(parts))
        op.free = (*frees, *(("activations", b) for b in parts))

    # ------------------------------------------------------------------ backward
    def finish(self, units: dict[tuple[str, int, int], list[Op]]) -> None:
        """After the units are built (and their weight gradients split out): cut each
        backward layer's attention and experts ops at its groups' boundaries, record the
        groups, then add the reloads (:meth:`link_reloads`)."""
        for (kind, v, mb), ops in units.items():
            if kind != "B":
                continue
            unit = self.backward.setdefault((v, mb), [])
            for i in range(len(ops) - 1, -1, -1):
                o = ops[i]
                la = o.layer
                if la is None:
                    continue
                if self.moe_modules and o.name == experts_op_name("bwd", la, mb):
                    ops[i:i + 1] = self._split(unit, v, mb, la, o, "moe")
                elif self.moe_modules and o.name == f"bwd moe L{la} mb{mb} router":
                    self._record(unit, v, mb, la, "mlp_norm", o)
                elif self.attn_modules and o.name == f"bwd attn L{la} mb{mb}":
                    ops[i:i + 1] = self._split(unit, v, mb, la, o, "attn")
            unit.sort(key=lambda g: ops.index(g.first))
        self.link_reloads(units)

    def _record(self, unit: list[Group], v: int, mb: int, layer: int, module: str,
                first: Op) -> None:
        if module not in self.modules or self.group_size(layer, module) <= 0:
            return
        d2h = self.d2h.get((v, mb, layer, module))
        unit.append(Group(module, layer, first, d2h,
                                 self.group_size(layer, module) if d2h is not None else 0.0))

    def _split(self, unit: list[Group], v: int, mb: int, layer: int, op: Op, what: str
               ) -> list[Op]:
        """The experts' backward op cut where fc1's begins (``experts``, ``experts fc1``) or
        the attention's where core attention's and the QKV linear's begin (``proj``,
        ``core``, then the op itself, which keeps its memory frees and hooks)."""
        marker = len(self.moe_modules if what == "moe" else self.attn_modules) \
            * MARKER_CALLS * EAGER_FWD_OP_CPU_S
        if what == "moe":
            pieces = _cut(op, self.fc1_share, [op.name, f"{op.name} fc1"], keep_last=False)
            mods: tuple[str, ...] = ("moe_act", "expert_fc1")
        else:
            key = attention_key(self.s.model, layer, self.s.blocks)
            pieces = _cut(op, self.attn_shares[key],
                          [f"{op.name} proj", f"{op.name} core", op.name], keep_last=True)
            mods = ("attn_proj", "core_attn", "qkv_linear")
        pieces[0].cpu_s += marker
        for m, piece in zip(mods, pieces, strict=True):
            self._record(unit, v, mb, layer, m, piece)
        return pieces

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
                groups = self.backward.get((v, mb), [])
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
                            ops.insert(ops.index(g.first) + 1, self._reload(x, mb, [g.first]))
                            ready.add(id(x))
                    else:
                        spare.append(g.first)
                prev_b = u
