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

Not modelled: Megatron-FSDP's double buffering options and its bucket sizes beyond one unit.
(``gradient_accumulation_fusion`` off is the option of that name, priced per linear.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    ctx.require(ctx.model.moe is None, KEY, "Megatron-FSDP with experts is not modelled yet")
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
    """Parameters (one tensor-parallel rank's) of each FSDP unit of the single stage."""
    parts: dict[int | str, float] = {"embed": s.emb_params}
    parts.update((layer, s.layer_params) for layer in s.chunks[0])    # pp = vp = 1
    parts["head"] = s.head_params
    return {part: n for part, n in parts.items() if n > 0}


def fsdp_memory(s: MegatronShape, mem: dict[str, float], fp8_copy_bytes: float
                ) -> dict[str, float]:
    """Per-rank memory before the step under Megatron-FSDP (module doc): the shape's
    unsharded figures divided over dp x cp, plus the gathered units and one whole gradient.
    ``fp8_copy_bytes``: bytes of Transformer Engine's FP8 copy per linear parameter (0 in 16
    bits), transient here."""
    shard = s.dp * s.cp
    biggest = max(unit_params(s).values())
    out = dict(mem)
    out["parameters"] = mem["parameters"] / shard
    out["gradients"] = mem["gradients"] / shard
    out["buffers"] = (UNITS_GATHERED * (s.act + fp8_copy_bytes) * biggest
                      + s.grad_bytes * biggest)
    return out


def fsdp_ops(s: MegatronShape, units: dict[tuple[str, int, int], UnitOps],
             groups: tuple[tuple[int, ...], ...], key: Callable[[], str], cpu_s: float,
             launch_after: dict[int, list[Op]], insert_before: dict[int, list[Op]]
             ) -> StageBuckets:
    """Every micro-batch's parameter all-gathers (forward and backward) and gradient
    reduce-scatters of the single stage, hooked into its units (module doc). Returns them as
    the stage's buckets: ``gathers`` (non-empty, so no gather follows the optimizer) and
    ``grads`` (what the optimizer step waits for)."""
    out = StageBuckets()
    params = unit_params(s)
    fwd_order = list(params)                # embed, layers, head
    per_param = s.gather_bytes(0, False)
    bwd_order = fwd_order[::-1]

    def gather(part: int | str, mb: int, kind: str) -> Op:
        op = Op(name=f"fsdp param all_gather {kind} mb{mb} {part}", kind="collective",
                stream=GATHER_STREAM, phase="comm", collective="all_gather",
                group=groups[0], groups=groups, nbytes=per_param * params[part], key=key(),
                dtype=s.act_dtype, category="all_gather", cpu_s=cpu_s, micro_batch=mb)
        out.gathers.append(op)
        return op

    for mb in range(s.chunk_micro_batches):
        f_unit, b_unit = units[("F", 0, mb)], units[("B", 0, mb)]
        hooks = [f_unit.part_op[part] for part in fwd_order]
        _chain(hooks, [gather(part, mb, "fwd") for part in fwd_order], insert_before)
        firsts = _backward_firsts(b_unit, bwd_order)
        _chain(firsts, [gather(part, mb, "bwd") for part in bwd_order], insert_before)
        for part in bwd_order:
            done = b_unit.part_op[part]
            rs = Op(name=f"fsdp grad reduce_scatter mb{mb} {part}", kind="collective",
                    stream="dp", phase="comm", collective="reduce_scatter", group=groups[0],
                    groups=groups, nbytes=s.grad_bytes * params[part], key=key(),
                    dtype=s.grad_dtype, category="reduce_scatter", cpu_s=cpu_s, deps=[done],
                    micro_batch=mb)
            launch_after.setdefault(id(done), []).append(rs)
            out.grads.append(rs)
    return out


def _chain(hooks: list[Op], gathers: list[Op], insert_before: dict[int, list[Op]]) -> None:
    """Unit i's pre-hook waits for gather i and dispatches gather i + 1; the first gather is
    dispatched at the first pre-hook."""
    for i, (hook, g) in enumerate(zip(hooks, gathers, strict=True)):
        hook.deps = list(hook.deps) + [g]
        at = insert_before.setdefault(id(hook), [])
        if i == 0:
            at.append(g)
        if i + 1 < len(gathers):
            at.append(gathers[i + 1])


def _backward_firsts(unit: UnitOps, order: list[int | str]) -> list[Op]:
    """The first op of each part's backward, in ``order``: the unit's first op, then the op
    after the previous part's last."""
    index = unit.positions()
    return [unit.ops[0]] + [unit.neighbour(unit.part_op[prev], 1, index)
                            for prev in order[:-1]]
