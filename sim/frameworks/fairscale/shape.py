"""FairScale FSDP's job shape: option checks, units, dtypes, division factors and bucket size.

:func:`fairscale_shape` checks a scenario's FairScale options (refusing what
``FullyShardedDataParallel.__init__`` refuses) and derives, once, everything the builder's op
makers share: the FSDP units (the root and one per transformer block), the bytes of the
gathered parameters, the gradients and the reduce-scatter, the gradient division factors, the
bucket's capacity and the priced blocks of one micro-batch with the gradient bytes their
backward allocates. :class:`FairscaleShape` is frozen: the op makers
(:mod:`sim.frameworks.fairscale.units`) read it and never change it.

Source: ``fairscale/nn/data_parallel/fully_sharded_data_parallel.py`` (commit 146f1602) and
``fairscale/internal/reduce_scatter_bucketer.py``; see :mod:`sim.frameworks.fairscale.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.frameworks.common.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.frameworks.common.base import JobContext
from sim.frameworks.common.nccl_dtype import half
from sim.hardware.compute import EAGER_BWD_OP_CPU_S, EAGER_FWD_OP_CPU_S, ComputeModel
from sim.program.ir import NcclType
from sim.scenario import FairscaleOptions
from sim.workload.layer_ops import BF16, FP32, BlockCost, Style
from sim.workload.model import ModelSpec

MIB = 1024 * 1024
BUCKET_CAP_MB = 25
"""FullyShardedDataParallel.__init__ default ``bucket_cap_mb=25``, handed to the shared
``ReduceScatterBucketer`` (fairscale/internal/reduce_scatter_bucketer.py)."""


def kernel_style(ctx: JobContext) -> Style:
    """FairScale's mixed precision runs a plain 16-bit module (``bf16``); without it, Hugging
    Face's Llama under autocast."""
    opts = ctx.scenario.framework
    assert isinstance(opts, FairscaleOptions)
    return Style("bf16") if opts.mixed_precision else Style("autocast")


def gradient_divide_factors(world: int) -> tuple[float, float]:
    """(pre, post) gradient division factors of ``world`` ranks.

    ``FullyShardedDataParallel._get_gradient_predivide_factor``: the pre-factor doubles while
    it divides ``world`` and ``world / factor`` exceeds it; the post-factor is the rest, so
    their product is ``world`` (an average, split to avoid fp16 overflow and underflow).

    Examples
    --------
    >>> gradient_divide_factors(16), gradient_divide_factors(8), gradient_divide_factors(1)
    ((4.0, 4.0), (4.0, 2.0), (1.0, 1.0))
    """
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor), world / factor


def shard_numel(numel: int, world: int) -> int:
    """Elements of one rank's shard: ``torch.chunk`` sizes, the last one padded
    (``_get_shard``, ``chunk_and_pad``)."""
    return -(-numel // world)


def bucket_shard_capacity(elem_bytes: int, world: int, cap_mb: float = BUCKET_CAP_MB) -> int:
    """Elements per rank a reduce-scatter bucket holds (``ReduceScatterBucketer.
    _get_shard_size``: ``cap_mb`` MiB of the dtype, divided by the world size); a gradient
    whose per-rank chunk is larger is reduce-scattered directly, without the bucket.

    Examples
    --------
    >>> bucket_shard_capacity(2, 8)   # 25 MiB of bf16 over 8 ranks
    1638400
    """
    return int(cap_mb * MIB / elem_bytes // world)


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP instance: its flat parameter and the compute blocks that use it."""

    name: str
    numel: int
    blocks: tuple[tuple[str, int], ...]
    """(block, layer) keys of the compute ops, in forward order."""
    resharded: bool
    """Gathered parameters freed after the forward (gathered again in backward)."""


@dataclass(frozen=True)
class FairscaleShape:
    """The units, dtypes and priced blocks of one FairScale job (see :func:`fairscale_shape`)."""

    opts: FairscaleOptions
    model: ModelSpec
    n: int
    """World size: every rank holds one shard of every unit."""
    mixed: bool
    """``mixed_precision``: 16-bit gathered parameters and compute."""
    style: Style
    costs: dict[str, BlockCost]
    """Each block of one micro-batch priced on the job's GPU."""
    pbytes: int
    """Bytes per gathered parameter element (``compute_dtype``, or fp32 without mixed
    precision)."""
    gbytes: int
    """Bytes per unsharded gradient element, as autograd produces them."""
    rbytes: int
    """Bytes per reduce-scattered element (fp32 with ``fp32_reduce_scatter`` or without
    mixed precision)."""
    pre_div: float
    post_div: float
    bucket_capacity: int
    """Elements per rank the reduce-scatter bucket holds (:func:`bucket_shard_capacity`)."""
    group: tuple[int, ...]
    root: FsdpUnit
    layers: tuple[FsdpUnit, ...]
    model_flops: dict[str, tuple[float, float]]
    """(forward, backward) model FLOPs of each block (:func:`block_model_flops`)."""
    grad_alloc: dict[str, float]
    """Gradient bytes each block's backward allocates: its weights' gradients, plus the
    unit's flat gradient for the block that completes it."""
    extra_bwd_s: dict[str, float]
    """GPU seconds appended to a block's backward: the flat gradient's cat (and, on the
    embedding, the tied matrix's gradient sum)."""
    pieces_freed: dict[str, float]
    """Per-weight gradient bytes freed after the flat gradient's cat, by the block that
    completes the unit."""
    hook_cpu_s: float
    """Host seconds of one kernel or collective FairScale's hooks issue."""
    half: NcclType = "bf16"
    """NCCL type of the 16-bit tensors (the training precision's)."""

    @property
    def param_dtype(self) -> NcclType:
        """NCCL type of the all-gathered parameters (:attr:`pbytes`)."""
        return "f32" if self.pbytes == FP32 else self.half

    @property
    def reduce_dtype(self) -> NcclType:
        """NCCL type of the gradient reduce-scatters (:attr:`rbytes`): f32 with
        ``fp32_reduce_scatter`` or without mixed precision."""
        return "f32" if self.rbytes == FP32 else self.half

    @property
    def bucket_bytes(self) -> float:
        """Bytes of the bucket's buffers: data (world x shard) plus the output shard."""
        return self.rbytes * self.bucket_capacity * (self.n + 1)

    def held(self, unit: FsdpUnit) -> float:
        """Bytes of a unit's gathered (padded) flat parameter; with one rank and no mixed
        precision the parameter is the fp32 shard itself and nothing is gathered."""
        if self.n == 1 and not self.mixed:
            return 0.0
        return float(self.pbytes * shard_numel(unit.numel, self.n) * self.n)

    def initial_memory(self) -> dict[str, float]:
        """fp32 shard (master weights), fp32 gradient shard, AdamW exp_avg and exp_avg_sq."""
        total, n = self.model.total_params, self.n
        return {"parameters": FP32 * total / n, "gradients": FP32 * total / n,
                "optimizer": 2 * FP32 * total / n}

    def block_cpu(self, cm: ComputeModel, block: str, pass_: str) -> float:
        """Host time to issue a block's kernels (eager PyTorch, as layer_ops prices it)."""
        c = self.costs[block]
        per_op = EAGER_FWD_OP_CPU_S if pass_ == "fwd" else EAGER_BWD_OP_CPU_S
        kernels = c.fwd_kernels if pass_ == "fwd" else c.bwd_kernels
        t = kernels * per_op
        if block == "attn":
            t += cm.attention_cpu_s("fwd" if pass_ == "fwd" else "bwd") - per_op
        return t


def fairscale_shape(ctx: JobContext, hook_cpu_s: float) -> FairscaleShape:
    """Check the scenario's FairScale options and derive the job's shape."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, FairscaleOptions)
    ctx.require_data_parallel_only("fairscale")
    ctx.require(opts.mixed_precision or not opts.fp32_reduce_scatter,
                "framework.fp32_reduce_scatter",
                "needs framework.mixed_precision (FairScale raises ValueError otherwise)")
    m = ctx.model
    n = ctx.n_ranks
    cm = ctx.compute
    mixed = opts.mixed_precision
    style = kernel_style(ctx)
    # The autocast style is Hugging Face's Llama, which builds a KV cache unless recomputed
    # (as for DDP); the 16-bit style is a plain module without one.
    costs = ctx.block_costs(style, kv_cache=not mixed and not ctx.recompute)
    gbytes = style.grad_bytes             # unsharded gradients, as autograd produces them
    rbytes = FP32 if (opts.fp32_reduce_scatter or not mixed) else BF16
    pre_div, post_div = gradient_divide_factors(n)
    root = FsdpUnit("root", m.embedding_params + m.norm_params + m.lm_head_params,
                    (("embed", -1), ("head", -1)), resharded=False)
    layers = tuple(FsdpUnit(f"L{layer}", m.layer_params, (("attn", layer), ("mlp", layer)),
                            resharded=opts.reshard_after_forward) for layer in range(m.layers))
    # Gradients each block's backward produces (per weight), and the flat gradient that the
    # flat parameter's split backward (FlatParameter.get_param_views: split + view) assembles
    # with a cat once the unit's last weight gradient exists; the pieces die after the cat.
    pieces = {b: gbytes * p for b, p in block_grad_params(m, costs).items()}
    flat_grad = {"embed": gbytes * root.numel, "attn": gbytes * m.layer_params}
    return FairscaleShape(
        opts=opts, model=m, n=n, mixed=mixed, style=style, costs=costs,
        pbytes=BF16 if mixed else FP32,      # gathered parameters: compute_dtype
        gbytes=gbytes, rbytes=rbytes, pre_div=pre_div, post_div=post_div,
        bucket_capacity=bucket_shard_capacity(rbytes, n), group=tuple(range(n)),
        root=root, layers=layers,
        model_flops=block_model_flops(m, costs, ctx.micro_batch, ctx.seq),
        grad_alloc={b: pieces[b] + flat_grad.get(b, 0.0) for b in pieces},
        extra_bwd_s={"attn": cm.membound_time(2 * flat_grad["attn"]),
                     "embed": cm.membound_time(2 * flat_grad["embed"])
                     + tied_grad_sum_s(cm, m, gbytes)},   # tied: sum both uses
        pieces_freed={"attn": pieces["attn"] + pieces["mlp"],
                      "embed": pieces["embed"] + pieces["head"]},
        hook_cpu_s=hook_cpu_s, half=half(s.training.precision))
