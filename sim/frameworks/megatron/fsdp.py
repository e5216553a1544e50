"""Megatron-FSDP (``--use-megatron-fsdp``, NeMo's ``use_mcore_fsdp``) with its
``optim_grads_params`` sharding: the data-parallel side of a Megatron-Core step when NVIDIA's
GB200 Llama 3 70B and 405B recipes run fully sharded.

Source: Megatron-Core ``megatron/core/distributed/fsdp/`` (``MegatronFSDP``,
``param_and_grad_buffer.py``: one bucket per FSDP unit, the ``TransformerLayer`` and the
embedding and output layer each one) and NeMo's perf scripts (``scripts/performance/utils.py``
``set_primary_perf_configs`` at v2.3.0: ``fsdp="megatron"``,
``data_parallel_sharding_strategy="optim_grads_params"``, ``gradient_accumulation_fusion``
off, no FP8 parameter gather, no CUDA graphs, ``keep_fp8_transpose_cache_when_using_custom_
fsdp`` off; Megatron-Bridge's ``set_megatron_fsdp_overrides`` at a28844195 the same, with
gradient accumulation fusion on and FP8 parameters gathered where the precision asks):

* With ``fp8_param_gather`` the gathers move the FP8 linear weights in one byte (the shape's
  ``gather_bytes``, spread over every unit).
* Parameters, gradients and the optimizer state are sharded over the data- (and context-)
  parallel group; nothing of a unit stays whole between its uses.
* Forward, each unit's pre-hook waits for its parameters' all-gather and dispatches the next
  unit's (one unit prefetched); backward, the same in backward order, the parameters
  gathered again. After a unit's backward its gradients are reduce-scattered into the
  sharded gradient buffer, every micro-batch (the whole gradient is not kept). Gathers and
  reduce-scatters run on their own streams.
* The optimizer steps on the shard; no gather follows it (the next forward gathers).
* Transformer Engine's FP8 weight copies are not cached across micro-batches: each gathered
  16-bit weight is cast again every micro-batch (the shape sets ``weight_cast_share`` 1; FP8
  parameters gathered on Blackwell are used as they arrive, cast never).

Memory (:func:`fsdp_memory`): a 1/(dp x cp) share of the parameters, gradients and optimizer
state, plus two units' gathered parameters (the one in use and the prefetched one) with their
FP8 copies and one unit's whole gradient before its reduce-scatter.

With experts (MoE parallel folding): a layer's routed experts are sharded over its
expert-data-parallel group (``expt_dp``, Megatron-FSDP's expert parameter groups), the rest of
the layer over dp x cp as before; the layer's pre-hook waits for both gathers (each on the
gather stream, the next layer's both dispatched there), and its backward ends in a
reduce-scatter over each group. With expert-dp 1 the experts stay whole and move nothing
(the ``published-moe`` suite holds the Megatron-MoE model zoo's intra-node-EP Qwen3-235B run:
TP2, EP8, FSDP over DP128 / EDP32). FP8, multi-token prediction and the combined 1F1B
all-to-all overlap beside experts are not modelled (refused by key).

Not modelled: Megatron-FSDP's double buffering options and its bucket sizes beyond one unit.
(``gradient_accumulation_fusion`` off is the option of that name, priced per linear.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.buckets import StageBuckets
from sim.program.ir import Op

if TYPE_CHECKING:
    from collections.abc import Callable

    from sim.frameworks.megatron.shape import MegatronShape
    from sim.frameworks.megatron.unit_ops import UnitOps
    from sim.scenario import MegatronOptions

KEY = "framework.use_megatron_fsdp"
GATHER_STREAM = "dp-ag"
"""Megatron-FSDP's all-gather stream (the reduce-scatters keep ``dp``)."""
UNITS_GATHERED = 2
"""Units whose parameters are whole at once: the one running and the prefetched next."""


def check_megatron_fsdp(ctx: JobContext, opts: MegatronOptions) -> None:
    """Refuse what this model of Megatron-FSDP does not cover, by key."""
    if not opts.use_megatron_fsdp:
        return
    par = ctx.scenario.parallelism
    ctx.require(par.pp == 1 and par.vp == 1, KEY,
                "Megatron-FSDP is modelled without pipeline parallelism (pp and vp 1), as "
                "NeMo's FSDP recipes run it")
    if ctx.model.moe is not None:
        ctx.require(ctx.scenario.training.precision != "fp8", KEY,
                    "Megatron-FSDP with experts is modelled in 16 bits only (FP8 expert "
                    "weights under FSDP are not)")
        ctx.require(not ctx.model.mtp_layers, KEY, "Megatron-FSDP with experts and "
                    "multi-token prediction modules is not modelled")
        ctx.require(not opts.moe_a2a_overlap, "framework.moe_a2a_overlap",
                    "the combined 1F1B all-to-all overlap beside Megatron-FSDP is not modelled")
    ctx.require(opts.distributed_optimizer and opts.overlap_grad_reduce
                and opts.overlap_param_gather, KEY,
                "Megatron-FSDP shards the optimizer and overlaps both collectives: set "
                "distributed_optimizer, overlap_grad_reduce and overlap_param_gather")
    ctx.require(not opts.delay_wgrad_compute, "framework.delay_wgrad_compute",
                "Megatron-FSDP with delayed weight gradients is not modelled")
    ctx.require(opts.cuda_graph_impl == "none", "framework.cuda_graph_impl",
                "no CUDA graphs with Megatron-FSDP (NeMo turns them off with it)")
    ctx.require(opts.num_distributed_optimizer_instances == 1,
                "framework.num_distributed_optimizer_instances",
                "Megatron-FSDP shards over the whole data-parallel group")


def unit_params(s: MegatronShape) -> dict[int | str, float]:
    """Parameters (one tensor-parallel rank's) of each FSDP unit of the single stage, routed
    experts excepted (:func:`unit_expert_params`)."""
    moe = s.moe
    parts: dict[int | str, float] = {"embed": s.emb_params}
    parts.update((layer, s.layer_params if moe is None or moe.is_moe(layer)
                  else s.dense_layer_params) for layer in s.chunks[0])    # pp = vp = 1
    parts["head"] = s.head_params
    return {part: n for part, n in parts.items() if n > 0}


def unit_expert_params(s: MegatronShape) -> dict[int | str, float]:
    """Routed-expert parameters of each MoE layer's unit on one rank (its local experts)."""
    moe = s.moe
    if moe is None:
        return {}
    return {layer: moe.expert_params for layer in s.chunks[0] if moe.is_moe(layer)}


def fsdp_memory(s: MegatronShape, mem: dict[str, float], fp8_copy_bytes: float
                ) -> dict[str, float]:
    """Per-rank memory before the step under Megatron-FSDP (module doc): the shape's
    unsharded figures divided over dp x cp (the routed experts' over expert-dp), plus the
    gathered units and one whole gradient. ``fp8_copy_bytes``: bytes of Transformer Engine's
    FP8 copy per linear parameter (0 in 16 bits), transient here."""
    shard = s.dp * s.cp
    dense, experts = unit_params(s), unit_expert_params(s)
    e = sum(experts.values())
    edp = s.moe.edp if s.moe is not None else 1
    biggest = max(n + experts.get(part, 0.0) for part, n in dense.items())
    out = dict(mem)
    out["parameters"] = (mem["parameters"] - s.act * e) / shard + s.act * e / edp
    out["gradients"] = (mem["gradients"] - s.grad_bytes * e) / shard + s.grad_bytes * e / edp
    # The gathered units replace TE's cached FP8 copies; DeepEP's buffer stays.
    deepep = s.moe.flex.persistent_bytes if s.moe is not None and s.moe.flex is not None \
        else 0.0
    out["buffers"] = (deepep + UNITS_GATHERED * (s.act + fp8_copy_bytes) * biggest
                      + s.grad_bytes * biggest)
    return out


def fsdp_ops(s: MegatronShape, units: dict[tuple[str, int, int], UnitOps],
             groups: tuple[tuple[int, ...], ...], key: Callable[[], str], cpu_s: float,
             launch_after: dict[int, list[Op]], insert_before: dict[int, list[Op]],
             expert_groups: tuple[tuple[int, ...], ...] | None = None,
             expert_key: Callable[[], str] | None = None
             ) -> tuple[StageBuckets, StageBuckets]:
    """Every micro-batch's parameter all-gathers (forward and backward) and gradient
    reduce-scatters of the single stage, hooked into its units (module doc): over ``groups``
    (dp x cp), and for the routed experts over ``expert_groups`` (expert-dp; None: experts
    whole, nothing to move). Returns the dense and the expert ones as the stage's buckets:
    ``gathers`` (non-empty, so no gather follows the optimizer) and ``grads`` (what the
    optimizer step waits for)."""
    out, out_e = StageBuckets(), StageBuckets()
    params = unit_params(s)
    experts = unit_expert_params(s) if expert_groups is not None else {}
    fwd_order = list(params)                # embed, layers, head
    per_param = s.gather_bytes(0, False)
    bwd_order = fwd_order[::-1]

    def collective(expert: bool, what: str, part: int | str, mb: int, nbytes: float,
                   deps: tuple[Op, ...] = ()) -> Op:
        """A gather (``what`` "fwd"/"bwd") or the gradients' reduce-scatter ("grad")."""
        g, next_key = (expert_groups, expert_key) if expert else (groups, key)
        assert g is not None and next_key is not None
        gather = what != "grad"
        coll: Literal["all_gather", "reduce_scatter"] = \
            "all_gather" if gather else "reduce_scatter"
        label = f"param {coll} {what}" if gather else f"grad {coll}"
        return Op(name=f"fsdp {'expert ' if expert else ''}{label} mb{mb} {part}",
                  kind="collective", stream=GATHER_STREAM if gather else "dp", phase="comm",
                  collective=coll, group=g[0], groups=g, nbytes=nbytes,
                  key=next_key(),
                  dtype=s.act_dtype if gather else s.grad_dtype, category=coll,
                  cpu_s=cpu_s, deps=list(deps), micro_batch=mb)

    def gathers(part: int | str, mb: int, when: str) -> list[Op]:
        ops = [collective(False, when, part, mb, per_param * params[part])]
        out.gathers.append(ops[0])
        if part in experts:
            ops.append(collective(True, when, part, mb, s.act * experts[part]))
            out_e.gathers.append(ops[1])
        return ops

    for mb in range(s.chunk_micro_batches):
        f_unit, b_unit = units[("F", 0, mb)], units[("B", 0, mb)]
        hooks = [f_unit.part_op[part] for part in fwd_order]
        _chain(hooks, [gathers(part, mb, "fwd") for part in fwd_order], insert_before)
        firsts = _backward_firsts(b_unit, bwd_order)
        _chain(firsts, [gathers(part, mb, "bwd") for part in bwd_order], insert_before)
        for part in bwd_order:
            done = b_unit.part_op[part]
            reduces = [(out, collective(False, "grad", part, mb, s.grad_bytes * params[part],
                                        (done,)))]
            if part in experts:
                reduces.append((out_e, collective(True, "grad", part, mb,
                                                  s.grad_bytes * experts[part], (done,))))
            for buckets, rs in reduces:
                launch_after.setdefault(id(done), []).append(rs)
                buckets.grads.append(rs)
    return out, out_e


def _chain(hooks: list[Op], gathers: list[list[Op]], insert_before: dict[int, list[Op]]
           ) -> None:
    """Unit i's pre-hook waits for its gathers and dispatches unit i + 1's; the first unit's
    are dispatched at the first pre-hook."""
    for i, (hook, gs) in enumerate(zip(hooks, gathers, strict=True)):
        hook.deps = list(hook.deps) + gs
        at = insert_before.setdefault(id(hook), [])
        if i == 0:
            at.extend(gs)
        if i + 1 < len(gathers):
            at.extend(gathers[i + 1])


def _backward_firsts(unit: UnitOps, order: list[int | str]) -> list[Op]:
    """The first op of each part's backward, in ``order``: the unit's first op, then the op
    after the previous part's last."""
    index = unit.positions()
    return [unit.ops[0]] + [unit.neighbour(unit.part_op[prev], 1, index)
                            for prev in order[:-1]]
