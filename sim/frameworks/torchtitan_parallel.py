"""torchtitan's tensor, context and pipeline parallelism around FSDP2 (used by :mod:`fsdp2`).

How torchtitan composes the parallel dimensions of a Llama model, and what that means for the
kernels and collectives of one micro-batch on one rank:

* Mesh (``torchtitan/distributed/parallel_dims.py``, ``ParallelDims``): dimensions
  ``pp, dp_replicate, dp_shard, cp, tp`` laid out row-major, tensor-parallel peers adjacent
  (inside a node), pipeline stages outermost. FSDP shards over ``dp_shard x cp`` flattened
  (``apply_fsdp`` gets the ``["dp_replicate", "fsdp"]`` mesh), HSDP all-reduces over
  ``dp_replicate``. :class:`Mesh` gives every group of a stage.
* Tensor parallelism (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``; the
  same plan as ``models/llama3/sharding.py`` with ``enable_sequence_parallel`` on, torchtitan's
  default): the norms are ``SequenceParallel`` (each rank normalises its 1/tp of the tokens),
  ``PrepareModuleInput`` all-gathers the normalised input before attention and before the
  MLP (Shard(1) -> Replicate), ``wq/wk/wv`` and ``w1/w3`` are colwise, ``wo`` and ``w2``
  rowwise with Shard(1) output, i.e. a reduce-scatter; the residual add runs on the local
  tokens. Backward mirrors it: the reduce-scatter's gradient is an all-gather, the
  all-gather's a reduce-scatter. The embedding is rowwise (vocabulary-sharded table, masked
  lookup, reduce-scatter of the partial output); the final norm is sequence-parallel and the
  output projection colwise with loss parallelism (all-gather of its input, vocabulary-sharded
  logits, cross-entropy with small all-reduces of per-token statistics). DTensor issues each
  collective as a functional collective that the next op waits for: they block the compute
  stream (``async_tp`` is not modelled).
* Context parallelism (``torch/distributed/tensor/experimental/_attention.py``,
  ``_templated_ring_attention`` and ``_templated_ring_attention_backward``; what each step
  runs is :mod:`sim.frameworks.torchtitan_cp`): each rank holds seq/cp tokens, split
  round-robin (chunks r and 2cp-1-r) so every rank gets the same share of the causal
  triangle. Attention runs in cp steps, one per key/value chunk; results are merged in fp32
  (``_SDPAMerger``, ``convert_to_f32``). Keys and values move by the rotate method:
  ``allgather`` (torch's ``_cp_options`` default; torchtitan's ``context_parallel_rotate_method``
  default) gathers every chunk once, issued before the first (local) step;
  ``alltoall`` shifts the buffer to the next rank each step (``permute_tensor``). Backward
  gathers keys and values again the same way and always shifts the fp32 key/value gradients
  round the ring, one shift per step. Eager, each exchange overlaps the next step; compiled,
  each is waited for where it is issued.
* Pipeline parallelism (``torchtitan/distributed/pipeline_parallel.py``,
  ``_generate_llm_fqn_per_model_part``): the layers are split over pp x vp model chunks with the
  embedding weighted as ``pipeline_parallel_first_stage_less_layers`` layers and the output as
  ``..._last_stage_less_layers`` (both 1 by default): see :func:`stage_layers`.

The kernels are those of :mod:`sim.layer_ops` in its ``bf16`` style (torchtitan's Llama),
built with the same :class:`~sim.layer_ops._Builder` operations on the tensor-parallel local
widths and split into segments wherever a collective sits between them, since a per-block kernel
list cannot carry a collective in its middle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sim.compute import ComputeModel
from sim.frameworks.steps import ordered_forward_allocs
from sim.frameworks.titan_float8 import (
    FP8,
    Float8TpBuilder,
    builder,
    cast_module_input,
    tp_all_gather_bytes_per_element,
)
from sim.frameworks.torchtitan_cp import repeat_kv_kernels, ring_step_segments
from sim.layer_ops import (
    BF16,
    FP32,
    IDX,
    Block,
    BlockCost,
    Kernel,
    SacCost,
    Style,
    Tensor,
    _Builder,
    mlp_projections,
    op_sac_costs,
    price_block,
    qkv_projections,
)
from sim.model import ModelSpec
from sim.program import Op, Phase

# ---------------------------------------------------------------------- mesh


@dataclass(frozen=True)
class Mesh:
    """torchtitan's device mesh ``[pp, dp_replicate, dp_shard, cp, tp]``, row-major."""

    pp: int
    replicate: int
    shard: int
    cp: int
    tp: int

    def rank(self, pi: int, ri: int, si: int, ci: int, ti: int) -> int:
        return ti + self.tp * (ci + self.cp * (si + self.shard * (ri + self.replicate * pi)))

    def _coords(self) -> list[tuple[int, int, int, int]]:
        return [(ri, si, ci, ti) for ri in range(self.replicate) for si in range(self.shard)
                for ci in range(self.cp) for ti in range(self.tp)]

    def members(self, st: int) -> tuple[int, ...]:
        return tuple(sorted(self.rank(st, *c) for c in self._coords()))

    def tp_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ti in range(self.tp))
                     for ri in range(self.replicate) for si in range(self.shard)
                     for ci in range(self.cp))

    def cp_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ci in range(self.cp))
                     for ri in range(self.replicate) for si in range(self.shard)
                     for ti in range(self.tp))

    def shard_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        """FSDP's all-gather / reduce-scatter groups: dp_shard x cp flattened."""
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for si in range(self.shard)
                           for ci in range(self.cp))
                     for ri in range(self.replicate) for ti in range(self.tp))

    def replicate_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        """HSDP's all-reduce groups: the same shard on every replica."""
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ri in range(self.replicate))
                     for si in range(self.shard) for ci in range(self.cp)
                     for ti in range(self.tp))

    def stage_pairs(self, st: int, dst: int) -> tuple[tuple[int, int], ...]:
        """Pipeline p2p: every rank of stage ``st`` sends to its peer on stage ``dst``."""
        return tuple((self.rank(st, *c), self.rank(dst, *c)) for c in self._coords())

    def cp_ring_pairs(self, st: int) -> tuple[tuple[int, int], ...]:
        """Context-parallel ring shift: each rank sends to the next in its cp group."""
        return tuple((g[i], g[(i + 1) % len(g)]) for g in self.cp_groups(st)
                     for i in range(len(g)))


# ---------------------------------------------------------------------- pipeline split


def stage_layers(layers: int, stages: int, first_less: int = 1, last_less: int = 1
                 ) -> list[list[int]]:
    """Layers of each pipeline model chunk, as torchtitan's ``_generate_llm_fqn_per_model_part``
    splits them: the embedding counts as ``first_less`` layers and the norm + output as
    ``last_less``; ``layers + first_less + last_less`` effective layers are spread evenly, the
    first chunks taking one more when they do not divide.

    Examples
    --------
    >>> stage_layers(8, 2)
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> stage_layers(8, 4)
    [[0, 1], [2, 3, 4], [5, 6], [7]]
    >>> stage_layers(8, 4, 0, 0)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    """
    if stages == 1:
        return [list(range(layers))]
    effective = layers + first_less + last_less
    per, extra = divmod(effective, stages)
    if per == 0 or first_less > per or last_less > per:
        raise ValueError(f"{layers} layers (+{first_less} +{last_less} for embedding and "
                         f"output) do not fill {stages} pipeline stages")
    out: list[list[int]] = []
    current = 0
    for st in range(stages):
        n = per + (1 if st < extra else 0)
        if st == 0:
            n -= first_less
        elif st == stages - 1:
            n -= last_less
        take = list(range(current, min(layers, current + n)))
        current += len(take)
        out.append(take)
    # torchtitan leaves any layers that do not fit unassigned; with these weights none are.
    return out


# ---------------------------------------------------------------------- segments


def local_dims(m: ModelSpec, tp: int) -> ModelSpec:
    """The model as one tensor-parallel rank sees it: 1/tp of the heads and MLP width."""
    return replace(m, heads=m.heads // tp, kv_heads=m.kv_heads // tp,
                   ffn_hidden=m.ffn_hidden // tp)


def local_vocab(m: ModelSpec, tp: int) -> int:
    """Rows of the vocabulary-sharded embedding and output on one rank (DTensor shards
    unevenly divisible dimensions with the first ranks one larger)."""
    return -(-m.vocab // tp)


@dataclass
class TitanBlocks:
    """The segments of every block of one micro-batch on one rank, priced."""

    seg: dict[str, Block]
    cost: dict[str, BlockCost]
    tp: int
    cp: int
    rotate: str
    tokens: int
    """Tokens of this rank's sequence share (batch x seq / cp)."""
    local_tokens: int
    """Tokens after sequence parallelism (tokens / tp)."""
    kv_bytes: float
    """Local keys and values, bf16, as the ring concatenates them."""
    attn_acc_bytes: float
    """The fp32 gradient accumulators of ring attention's backward."""
    hidden: int
    params: dict[str, int] = field(default_factory=dict)
    """Parameters on this rank per block (embed, attn, mlp, head)."""
    sac: dict[str, SacCost] | None = None
    """Op-level selective checkpointing of each layer segment (``selective``), else None."""
    fp8_tp: bool = False
    """torchao's float8 tensor-parallel styles are in effect (:mod:`titan_float8`)."""
    compiled: bool = False
    """The blocks run under torch.compile: the ring's exchanges are waited for where they
    are issued (:mod:`sim.frameworks.torchtitan_cp`)."""

    def layer_segments(self) -> list[str]:
        """The segments of one transformer layer, in forward order."""
        attn = (["attn_main"] if self.cp == 1 else
                ["attn_qkv"] + [f"attn_ring{i}" for i in range(self.cp)] + ["attn_o"])
        return ["attn_norm", *attn, "attn_resid", "mlp_norm", "mlp_main", "mlp_resid"]


def _norm_seg(m: ModelSpec, style: Style, name: str, local: float, residual: bool,
              fp8_tp: bool = False) -> Block:
    # A SequenceParallel norm on the local tokens; the residual stream read by the norm and by
    # the residual add gets its two gradients summed here.
    b = _Builder(name, style)
    h = m.hidden
    x = b.t("in", local * h, BF16)
    b.block.inputs.append(x)
    if residual:
        b.sum_grads(2, local * h, BF16, "resid_in")
    y = b.norm(m, x, local, "norm")
    if fp8_tp and residual:
        cast_module_input(b, y, local, h)
    b.block.outputs.append(y)
    return b.finish()


def _resid_seg(m: ModelSpec, style: Style, name: str, local: float) -> Block:
    b = _Builder(name, style)
    h = m.hidden
    x = b.t("x", local * h, BF16)
    y = b.t("branch", local * h, BF16)
    b.block.inputs += [x, y]
    b.block.outputs.append(b.residual_add(x, y, local, h, "resid"))
    return b.finish()


def _qkv(b: _Builder, ml: ModelSpec, tokens: float) -> tuple[Tensor, Tensor, Tensor]:
    h = ml.hidden
    y = b.t("in", tokens * h, FP8 if isinstance(b, Float8TpBuilder) else BF16)
    b.block.inputs.append(y)
    # q, k and v read the gathered norm output: their input gradients are summed.
    b.sum_grads(3, tokens * h, BF16, "norm_out")
    return qkv_projections(b, ml, y, tokens, ("wq", "wk", "wv"))


def _mlp_main(ml: ModelSpec, style: Style, tokens: float, fp8_tp: bool = False,
              tp: int = 1) -> Block:
    b = builder("mlp_main", style, fp8_tp, tokens / tp)
    h, f = ml.hidden, ml.ffn_hidden
    y = b.t("in", tokens * h, FP8 if fp8_tp else BF16)
    b.block.inputs.append(y)
    if ml.mlp == "swiglu":
        b.sum_grads(2, tokens * h, BF16, "norm_out")
    b.block.outputs.append(mlp_projections(b, ml, y, tokens, f, ("w1", "w3", "w2")))
    return b.finish()


def _attn_main(ml: ModelSpec, style: Style, batch: int, seq: int, fp8_tp: bool = False,
               tp: int = 1) -> Block:
    """q/k/v, rotary embedding, attention over the whole (local) sequence, wo: no context
    parallelism."""
    tokens = batch * seq
    b = builder("attn_main", style, fp8_tp, tokens / tp)
    q, k, v = _qkv(b, ml, tokens)
    o = b.attention(ml, q, k, v, batch, seq)
    b.block.outputs.append(b.linear(o, tokens, ml.q_dim, ml.hidden, "wo", bias=ml.bias))
    return b.finish()


def _ring_segments(ml: ModelSpec, style: Style, cm: ComputeModel, batch: int, seq: int,
                   cp: int, fp8_tp: bool = False, tp: int = 1, repeat_kv: bool = True
                   ) -> dict[str, Block]:
    """Context parallelism: qkv (with torchtitan's ``repeat_kv``), the cp ring steps forward
    and backward (:func:`sim.frameworks.torchtitan_cp.ring_step_segments`), and wo."""
    tokens = batch * seq          # local queries (seq is already seq/cp)
    b = builder("attn_qkv", style, fp8_tp, tokens / tp)
    q, k, v = _qkv(b, ml, tokens)
    if repeat_kv:
        k, v = repeat_kv_kernels(b, k, v, tokens, ml.kv_dim, ml.q_dim)
    b.block.outputs += [q, k, v]
    segs = {"attn_qkv": b.finish()}
    segs.update(ring_step_segments(ml, style, cm, batch, seq, cp, kv_width(ml, repeat_kv)))
    w = builder("attn_o", style, fp8_tp, tokens / tp)
    oin = w.t("in", tokens * ml.q_dim, BF16)
    w.block.inputs.append(oin)
    w.block.outputs.append(w.linear(oin, tokens, ml.q_dim, ml.hidden, "wo", bias=ml.bias))
    segs["attn_o"] = w.finish()
    return segs


def kv_width(ml: ModelSpec, repeat_kv: bool) -> int:
    """Width of the keys (and of the values) that reach SDPA on one rank."""
    return ml.q_dim if repeat_kv else ml.kv_dim


def _embed_seg(m: ModelSpec, style: Style, tokens: float, tp: int) -> Block:
    """Token embedding; with tensor parallelism rowwise: each rank looks up the ids in its
    vocabulary range (others masked to zero) and the partial outputs are reduce-scattered."""
    b = _Builder("embed", style)
    h, vl = m.hidden, local_vocab(m, tp)
    b.block.params += vl * h
    ids = b.t("ids", tokens, IDX)
    rows = b.t("rows", tokens * h, BF16)
    out = b.t("out", tokens * h, BF16)
    if tp > 1:
        # RowwiseParallel._partition_embedding: mask out-of-range ids, shift, look up, zero.
        mask = b.t("mask", tokens, 1)
        b.fwd(Kernel("mask_ids", "elementwise", (ids,), (mask, ids)))
    b.fwd(Kernel("lookup", "elementwise", (ids, rows), (out,)))
    if tp > 1:
        b.fwd(Kernel("zero_masked", "elementwise", (out, mask), (out,)))
    gout = b.t("g_out", tokens * h, BF16)
    gtab = b.t("g_table", vl * h, BF16)
    b.bwd(Kernel("g_zero", "elementwise", (), (gtab,)),
          Kernel("g_index_add", "elementwise", (gout, ids), (rows,)))
    b.block.weight_grads.append(gtab)
    if m.position == "learned":
        b.block.params += m.max_positions * h
    b.block.outputs.append(out)
    return b.finish()


def _head_main(m: ModelSpec, style: Style, tokens: float, tp: int) -> Block:
    """Output projection to this rank's vocabulary shard and cross-entropy in fp32 (loss
    parallelism with tp > 1), as :func:`sim.layer_ops.head_block` without its norm."""
    b = _Builder("head_main", style)
    h, vl = m.hidden, local_vocab(m, tp)
    y = b.t("in", tokens * h, BF16)
    b.block.inputs.append(y)
    logits = b.linear(y, tokens, h, vl, "output", float8=False)
    if m.tied_embeddings:
        b.block.params -= h * vl
    b.block.forward_scoped.append(logits)
    n = tokens * vl
    lf, lsm = b.t("logits_fp32", n, FP32), b.t("log_softmax", n, FP32)
    b.fwd(Kernel("logits_float", "elementwise", (logits,), (lf,)))
    if tp > 1 and not style.compile:
        _loss_parallel(b, logits, lf, lsm, n)
        return b.finish()
    b.fwd(Kernel("log_softmax", "elementwise", (lf, lf, lf), (lsm,)))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (b.t("loss", 1, FP32),)))
    b.save(lsm)
    g_nll, g_lsm = b.t("g_nll", n, FP32), b.t("g_log_softmax", n, FP32)
    g_logits = b.t("output.g_out", n, BF16)
    b.bwd(Kernel("g_nll", "elementwise", (), (g_nll,)),
          Kernel("g_log_softmax", "elementwise", (g_nll, g_nll, lsm), (g_lsm,)),
          Kernel("g_logits_bf16", "elementwise", (g_lsm,), (g_logits,)))
    return b.finish()


def _loss_parallel(b: _Builder, logits: Tensor, lf: Tensor, lsm: Tensor, n: float) -> None:
    """Eager cross-entropy on vocabulary-sharded logits as torch's ``loss_parallel`` runs it
    (``torch/distributed/tensor/parallel/loss.py``): DTensor dispatches ``_log_softmax`` and
    ``nll_loss_backward`` to decompositions with all-reduces inserted, each op its own
    tensor, unlike aten's fused softmax kernels.

    * ``_log_softmax``: ``shifted = x - x_max``, ``torch.exp(shifted)`` summed over the
      shard, ``result = shifted - log(sumexp)``; ``x`` (the fp32 copy) and ``shifted`` are
      locals until it returns. The exp is materialised and freed before ``result`` exists,
      so the peak (x, shifted and one more fp32 buffer) is the same with the exp and the sum
      written as one kernel, as here.
    * ``_nll_loss_and_log_softmax_backward``: ``grad_input = torch.zeros_like(x)`` (scatter
      of -1 at the targets), returns ``(grad_input + torch.exp(x)) * grad_output``: four fp32
      buffers live at once with the saved output (autograd releases a node's saved tensors
      after its backward returns; ``grad_input`` is a local until then); the log_softmax
      backward handler is a no-op ``.to(input_dtype)``.
    """
    shifted = b.t("shifted", n, FP32)
    b.fwd(Kernel("amax", "elementwise", (lf,), ()))
    b.fwd(Kernel("sub_max", "elementwise", (lf,), (shifted,)))
    b.fwd(Kernel("exp_sum", "elementwise", (shifted, shifted), ()))
    b.fwd(Kernel("sub_lse", "elementwise", (shifted, lf), (lsm,)))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (b.t("loss", 1, FP32),)))
    b.save(lsm)
    gi, ex, s, g = (b.t(k, n, FP32) for k in ("g_zeros", "g_exp", "g_sum", "g_mul"))
    g_logits = b.t("output.g_out", n, BF16)
    b.bwd(Kernel("g_zeros", "elementwise", (), (gi,)),
          Kernel("g_scatter", "tiny", (gi,), (gi,)),
          Kernel("g_exp", "elementwise", (lsm,), (ex,)),
          Kernel("g_add", "elementwise", (gi, ex), (s,)),
          Kernel("g_mul", "elementwise", (s, gi, lsm), (g,)),
          Kernel("g_logits_bf16", "elementwise", (g,), (g_logits,)))


def titan_blocks(m: ModelSpec, style: Style, cm: ComputeModel, batch: int, seq: int, tp: int,
                 cp: int, rotate: str, sac: bool = False, eager_head: bool = False,
                 repeat_kv: bool = True) -> TitanBlocks:
    """Every segment of one micro-batch on one rank under tensor parallelism ``tp`` (with
    sequence parallelism) and context parallelism ``cp``; with ``sac``, also what each layer
    segment keeps and re-runs under torchtitan's op-level selective checkpointing
    (:func:`layer_sac_costs`). ``eager_head``: final norm, output and loss run uncompiled
    although ``style.compile`` (``Fsdp2Options.compile_loss`` false). ``repeat_kv``: the
    keys and values reach SDPA with the query heads' width (torchtitan before 2026,
    :func:`sim.frameworks.torchtitan_cp.titan_repeats_kv`; modelled on the context-parallel
    path, where it sets the bytes the ring moves)."""
    ml = local_dims(m, tp)
    seq_local = seq // cp
    tokens = batch * seq_local
    local = tokens // tp
    hstyle = replace(style, compile=False) if eager_head else style
    # torchao's float8 TP styles (tensorwise scaling: the only float8 modelled here).
    fp8_tp = style.float8 and tp > 1 and not style.autocast
    segs: dict[str, Block] = {
        "embed": _embed_seg(m, style, tokens, tp),
        "attn_norm": _norm_seg(m, style, "attn_norm", local, residual=True, fp8_tp=fp8_tp),
        "attn_resid": _resid_seg(m, style, "attn_resid", local),
        "mlp_norm": _norm_seg(m, style, "mlp_norm", local, residual=True, fp8_tp=fp8_tp),
        "mlp_main": _mlp_main(ml, style, tokens, fp8_tp, tp),
        "mlp_resid": _resid_seg(m, style, "mlp_resid", local),
        "head_norm": _norm_seg(m, hstyle, "head_norm", local, residual=False),
        "head_main": _head_main(m, hstyle, tokens, tp),
    }
    if cp == 1:
        segs["attn_main"] = _attn_main(ml, style, batch, seq_local, fp8_tp, tp)
    else:
        segs.update(_ring_segments(ml, style, cm, batch, seq_local, cp, fp8_tp, tp,
                                   repeat_kv))
    cost = {k: price_block(b, hstyle if k.startswith("head") else style, cm)
            for k, b in segs.items()}
    params = {
        "embed": segs["embed"].params,
        "attn": sum(segs[k].params for k in segs if k.startswith("attn")),
        "mlp": sum(segs[k].params for k in segs if k.startswith("mlp")),
        "head": segs["head_norm"].params + segs["head_main"].params,
    }
    kvw = kv_width(ml, repeat_kv)
    tb = TitanBlocks(segs, cost, tp, cp, rotate, tokens, local,
                     kv_bytes=2.0 * tokens * kvw * BF16,
                     attn_acc_bytes=float(tokens * (ml.q_dim + 2 * kvw) * FP32),
                     hidden=m.hidden, params=params, fp8_tp=fp8_tp, compiled=style.compile)
    if sac:
        tb.sac = layer_sac_costs(tb, style, cm)
    return tb


def layer_sac_costs(tb: TitanBlocks, style: Style, cm: ComputeModel) -> dict[str, SacCost]:
    """Op-level selective checkpointing of one layer's segments on one rank.

    torchtitan's policy (``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``
    and its ``_save_list``) is applied by a dispatch mode that sees the ops as the layer
    issues them: the local matmuls of the tensor-parallel shards (every second one saved,
    counted over the layer in forward order, as :func:`sim.layer_ops.op_sac_costs`), the
    attention op and ``_c10d_functional.reduce_scatter_tensor`` are saved; the functional
    all-gathers are not, so recomputation runs them again. Context parallelism's ring runs
    inside the one attention op that DTensor dispatches (``_context_parallel/_attention.py``),
    so the mode saves that op's output and nothing of the ring (exchanges, merges) re-runs:
    its segments keep what autograd saves and re-run nothing.
    """
    order = tb.layer_segments()
    ring = [k for k in order if k.startswith("attn_ring")]
    out = op_sac_costs([tb.seg[k] for k in order if k not in ring], style, cm)
    for k in ring:
        out[k] = SacCost(cached_bytes=tb.cost[k].saved_bytes, recompute_s=0.0,
                         recompute_flops=0.0)
    return out


# ---------------------------------------------------------------------- ops of a pass


@dataclass
class Comms:
    """How the builder makes the collectives of one pipeline stage (rank class)."""

    tp: Callable[[str, float, str, int, int | None], Op]
    """(collective, nbytes, name, micro-batch, layer) -> a tensor-parallel collective on the
    compute stream."""
    cp_gather: Callable[[float, str, int, int | None], Op]
    """(nbytes, name, micro-batch, layer) -> a context-parallel all-gather on its stream."""
    cp_shift: Callable[[float, str, int, int | None], Op]
    """(bytes per rank, name, micro-batch, layer) -> the ring shift (each rank to the next)."""


class TitanPass:
    """Compute and collective ops of the blocks of one micro-batch under torchtitan's TP/CP.

    :meth:`forward` and :meth:`backward` return, for one block (embed, attn, mlp, head) of
    one layer, its ops in issue order. Memory effects follow :mod:`sim.frameworks.steps`:
    forward allocates what autograd saves, backward frees it and allocates the bf16 weight
    gradients (``grad_alloc``); with ``recompute`` a layer keeps only its input and the
    backward of its MLP block starts by recomputing the whole layer, collectives included
    (torchtitan's full activation checkpointing wraps each TransformerBlock). With the
    blocks' ``sac`` (op-level selective checkpointing) a layer keeps its input, the outputs
    the policy saves and its reduce-scatters' outputs, and its backward starts by re-running
    the rest and the tensor-parallel all-gathers (:func:`layer_sac_costs`).
    """

    def __init__(self, tb: TitanBlocks, comms: Comms, recompute: bool) -> None:
        self.tb = tb
        self.c = comms
        self.sac = tb.sac
        self.recompute = recompute and tb.sac is None
        self._scoped = 0.0

    # ------------------------------------------------------------------ helpers
    def _seg(self, key: str, label: str, mb: int, layer: int | None, phase: Phase,
             backward: bool, alloc_saved: bool = True) -> Op:
        c = self.tb.cost[key]
        blk = self.tb.seg[key]
        if backward:
            free = (("activations", c.saved_bytes),) if c.saved_bytes else ()
            return Op(name=f"bwd {label} mb{mb}", kind="compute", stream="compute",
                      phase=phase, duration=c.bwd_s, free=free,
                      transient=c.bwd_transient_bytes,
                      transient_parts=c.bwd_transient_parts, layer=layer, micro_batch=mb,
                      hw_flops=blk.flops_bwd, category="backward")
        allocs: list[tuple[str, float]] = []
        transient = c.fwd_transient_bytes
        ordered = ordered_forward_allocs(c) if alloc_saved and phase == "fwd" else None
        if ordered is not None:
            self._scoped += c.forward_scoped_bytes
            return Op(name=f"fwd {label} mb{mb}", kind="compute", stream="compute",
                      phase=phase, duration=c.fwd_s, alloc=ordered[0], free=ordered[1],
                      layer=layer, micro_batch=mb, hw_flops=blk.flops_fwd,
                      category="forward")
        if alloc_saved and c.saved_bytes:
            allocs.append(("activations", c.saved_bytes))
        parts = c.fwd_transient_parts
        if not alloc_saved:
            transient = c.fwd_transient_unsaved_bytes
            parts = c.fwd_transient_unsaved_parts
        if c.forward_scoped_bytes and phase == "fwd":
            allocs.append(("buffers", c.forward_scoped_bytes))
            self._scoped += c.forward_scoped_bytes
        return Op(name=f"{'fwd' if phase == 'fwd' else phase} {label} mb{mb}",
                  kind="compute", stream="compute", phase=phase, duration=c.fwd_s,
                  alloc=tuple(allocs), transient=transient, transient_parts=parts,
                  layer=layer, micro_batch=mb,
                  hw_flops=blk.flops_fwd,
                  category="forward" if phase == "fwd" else "recompute")

    def _gathered(self, what: str = "") -> float:
        """Bytes of a tensor-parallel all-gather's output (or reduce-scatter's input) of
        ``what``: float8 for a layer's all-gathers under float8 TP, else bf16."""
        per = BF16 if not what else tp_all_gather_bytes_per_element(self.tb.fp8_tp, what)
        return float(self.tb.tokens * self.tb.hidden * per)

    def _rs_out(self) -> float:
        return float(self.tb.local_tokens * self.tb.hidden * BF16)

    def _free_rs_out(self, op: Op) -> None:
        # The saved reduce-scatter output goes with the residual add's backward.
        if self.sac is not None and self.tb.tp > 1:
            op.free = op.free + (("activations", self._rs_out()),)

    def _sac_recompute(self, layer: int, mb: int) -> list[Op]:
        """Before a layer's backward: re-run, in forward order, what the selective policy did
        not save, with the tensor-parallel all-gathers feeding the re-run matmuls; each
        segment re-creates the tensors autograd holds for its backward beyond the saved ones
        (the layer input stays held from the forward)."""
        tb, sac = self.tb, self.sac
        assert sac is not None
        ops: list[Op] = []
        for key in tb.layer_segments():
            if key in ("attn_main", "attn_qkv", "mlp_main") and tb.tp > 1:
                what = "attn" if key.startswith("attn") else "mlp"
                ops.append(self.c.tp("all_gather", self._gathered(what),
                                     f"tp all_gather {what} (recompute) L{layer} mb{mb}",
                                     mb, layer))
            c = tb.cost[key]
            regen = c.saved_bytes - sac[key].cached_bytes
            if key == "attn_norm":
                regen -= c.input_saved_bytes
            regen = max(0.0, regen)
            if sac[key].recompute_s <= 0 and regen <= 0:
                continue
            ops.append(Op(name=f"recompute {key} L{layer} mb{mb}", kind="compute",
                          stream="compute", phase="recompute", duration=sac[key].recompute_s,
                          alloc=(("activations", regen),) if regen else (),
                          transient=c.fwd_transient_unsaved_bytes, layer=layer,
                          micro_batch=mb, hw_flops=sac[key].recompute_flops,
                          category="recompute"))
        return ops

    # ------------------------------------------------------------------ forward
    def forward(self, block: str, layer: int, mb: int, phase: Phase = "fwd") -> list[Op]:
        tp, lay = self.tb.tp, (layer if layer >= 0 else None)
        layered = block in ("attn", "mlp")
        sac = self.sac if layered and phase == "fwd" else None
        ckpt = (self.recompute or sac is not None) and layered and phase == "fwd"
        ops: list[Op] = []

        def seg(key: str, saved: bool = True) -> Op:
            lbl = f"{key}{'' if lay is None else f' L{layer}'}"
            op = self._seg(key, lbl, mb, lay, phase, backward=False,
                           alloc_saved=saved and not ckpt)
            if sac is not None and sac[key].cached_bytes:
                op.alloc = op.alloc + (("activations", sac[key].cached_bytes),)
            ops.append(op)
            return op

        def tp_comm(kind: str, what: str) -> None:
            if tp > 1:
                nbytes = self._gathered(what if kind == "all_gather" else "")
                op = self.c.tp(kind, nbytes, f"tp {kind} {what}"
                               f"{'' if lay is None else f' L{layer}'} mb{mb}", mb, lay)
                if sac is not None and kind == "reduce_scatter":
                    # The policy saves reduce-scatter outputs (the local tokens' branch).
                    op.alloc = (("activations", self._rs_out()),)
                ops.append(op)

        if block == "embed":
            seg("embed")
            tp_comm("reduce_scatter", "embed")
        elif block == "head":
            seg("head_norm")
            tp_comm("all_gather", "head")
            seg("head_main")
            if tp > 1:
                # Loss parallelism: all-reduces of the per-token max, sum of exponentials and
                # target logit over the vocabulary shards (torch loss_parallel).
                for what in ("max", "sumexp", "target"):
                    ops.append(self.c.tp("all_reduce", float(self.tb.tokens * FP32),
                                         f"tp all_reduce loss {what} mb{mb}", mb, None))
            if phase == "fwd" and self._scoped:
                # The forward returns after the loss: the logits are released.
                ops[-1].free = ops[-1].free + (("buffers", self._scoped),)
                self._scoped = 0.0
        elif block == "attn":
            first = seg("attn_norm")
            if ckpt:
                c = self.tb.cost["attn_norm"]
                first.alloc = first.alloc + (("activations", c.input_saved_bytes),)
            tp_comm("all_gather", "attn")
            if self.tb.cp == 1:
                seg("attn_main")
            else:
                self._ring_forward(ops, seg, mb, lay)
            tp_comm("reduce_scatter", "attn")
            seg("attn_resid")
        else:
            seg("mlp_norm")
            tp_comm("all_gather", "mlp")
            seg("mlp_main")
            tp_comm("reduce_scatter", "mlp")
            seg("mlp_resid")
        if phase == "recompute" and block == "attn":
            # The layer input is still held from the forward: recompute re-saves the rest.
            c = self.tb.cost["attn_norm"]
            op = ops[0]
            op.alloc = tuple((k, v - c.input_saved_bytes) if k == "activations" else (k, v)
                             for k, v in op.alloc)
        return [o for o in ops if o.duration > 0 or o.kind != "compute" or o.alloc or o.free]

    def _ring_forward(self, ops: list[Op], seg: Callable[..., Op], mb: int,
                      lay: int | None) -> None:
        seg("attn_qkv")
        self._kv_ring(ops, mb, lay, ops[-1].phase, lambda i: seg(f"attn_ring{i}"))
        seg("attn_o")

    def _kv_ring(self, ops: list[Op], mb: int, lay: int | None, phase: Phase,
                 step: Callable[[int], Op]) -> None:
        """The key/value exchanges of one ring pass around its cp steps (``step(i)`` appends
        step i's ops and returns the one that needs the keys), as ``_templated_ring_attention
        [_backward]`` issues them: the concatenation and first exchange before step 0; for
        1 <= i < cp-1 a concatenation (dead with the all-gather rotater: eager runs it,
        inductor drops it) and, all-to-all, the next shift. Eager, step i waits for the keys
        it uses; compiled, also for the exchange issued in it (:mod:`torchtitan_cp`)."""
        tb, cp = self.tb, self.tb.cp
        tag = " (bwd)" if phase == "bwd" else ""
        where = f"{'' if lay is None else f' L{lay}'} mb{mb}"
        ops.append(self._cat(mb, lay, phase))
        if tb.rotate == "allgather":
            first = self.c.cp_gather(tb.kv_bytes * cp, f"cp all_gather K/V{tag}{where}", mb,
                                     lay)
        else:
            first = self.c.cp_shift(tb.kv_bytes, f"cp shift K/V 0{tag}{where}", mb, lay)
        first.deps = [ops[-1]]
        ops.append(first)
        arrived = first
        for i in range(cp):
            issued: Op | None = first if i == 0 else None
            if 0 < i < cp - 1:
                cat = self._cat(mb, lay, phase)
                if tb.rotate == "alltoall":
                    cat.deps = [arrived]
                    ops.append(cat)
                    issued = self.c.cp_shift(tb.kv_bytes, f"cp shift K/V {i}{tag}{where}", mb,
                                             lay)
                    issued.deps = [cat]
                    ops.append(issued)
                elif not tb.compiled:
                    ops.append(cat)
            op = step(i)
            deps = [arrived] if i > 0 else []
            if tb.compiled and issued is not None:
                deps.append(issued)
            op.deps = op.deps + deps
            if i > 0 and issued is not None:
                arrived = issued

    def _cat(self, mb: int, lay: int | None, phase: Phase) -> Op:
        c = self.tb.cost["attn_kv_cat"]
        return Op(name=f"cp cat K/V{'' if lay is None else f' L{lay}'} mb{mb}", kind="compute",
                  stream="compute", phase=phase, duration=c.fwd_s, layer=lay, micro_batch=mb,
                  category="forward" if phase == "fwd" else "backward")

    # ------------------------------------------------------------------ backward
    def backward(self, block: str, layer: int, mb: int) -> list[Op]:
        tp, lay = self.tb.tp, (layer if layer >= 0 else None)
        ops: list[Op] = []
        if block == "mlp" and self.recompute:
            ops += self.forward("attn", layer, mb, phase="recompute")
            ops += self.forward("mlp", layer, mb, phase="recompute")
        elif block == "mlp" and self.sac is not None:
            ops += self._sac_recompute(layer, mb)

        def seg(key: str) -> Op:
            lbl = f"{key}{'' if lay is None else f' L{layer}'}"
            op = self._seg(key, lbl, mb, lay, "bwd", backward=True)
            ops.append(op)
            return op

        def tp_comm(kind: str, what: str) -> None:
            if tp > 1:
                nbytes = self._gathered(what if kind == "all_gather" else "")
                ops.append(self.c.tp(kind, nbytes, f"tp {kind} grad {what}"
                                     f"{'' if lay is None else f' L{layer}'} mb{mb}", mb, lay))

        if block == "head":
            seg("head_main")
            tp_comm("reduce_scatter", "head")
            seg("head_norm")
        elif block == "embed":
            tp_comm("all_gather", "embed")
            seg("embed")
        elif block == "mlp":
            self._free_rs_out(seg("mlp_resid"))
            tp_comm("all_gather", "mlp")
            seg("mlp_main")
            tp_comm("reduce_scatter", "mlp")
            seg("mlp_norm")
        else:
            self._free_rs_out(seg("attn_resid"))
            tp_comm("all_gather", "attn")
            if self.tb.cp == 1:
                seg("attn_main")
            else:
                self._ring_backward(ops, seg, mb, lay)
                seg("attn_qkv")
            tp_comm("reduce_scatter", "attn")
            seg("attn_norm")
        return [o for o in ops if o.duration > 0 or o.kind != "compute" or o.alloc or o.free]

    def _ring_backward(self, ops: list[Op], seg: Callable[[str], Op], mb: int,
                       lay: int | None) -> None:
        tb = self.tb
        where = f"{'' if lay is None else f' L{lay}'} mb{mb}"
        seg("attn_o")
        dkv: list[Op] = []
        grad_kv_bytes = 2.0 * tb.kv_bytes     # fp32 gradients of the local keys and values

        def step(i: int) -> Op:
            op = seg(f"attn_ring{i}_bwd")
            if tb.compiled and dkv:
                op.deps = [dkv[-1]]           # compiled: the last shift was waited for at once
            op.transient += tb.attn_acc_bytes
            # The ring's saved tensors (local q, k, v, lse) are freed with the whole node.
            op.free = ()
            acc = seg(f"attn_ring{i}_acc")
            if dkv:
                acc.deps = [dkv[-1]]
            acc.transient += tb.attn_acc_bytes
            shift = self.c.cp_shift(grad_kv_bytes, f"cp shift dK/dV {i}{where}", mb, lay)
            shift.deps = [acc]
            ops.append(shift)
            dkv.append(shift)
            return op

        self._kv_ring(ops, mb, lay, "bwd", step)
        final = seg("attn_ring_final")
        final.deps = dkv[-1:]
        saved = sum(tb.cost[f"attn_ring{i}"].saved_bytes for i in range(tb.cp))
        final.free = (("activations", saved),)
