"""torch's context-parallel ring attention as torchtitan runs it: the kernels of each ring step,
their shapes under load balancing, and where the exchanges are waited for.

Source: ``torch/distributed/tensor/experimental/_attention.py`` (pytorch/pytorch), the same
ring from torch 1963fc8 (2024-12-23, the build of torchtitan's published H100 runs,
``benchmarks/llama3_h100_202412_torchtitan.md``) to mid-2025:

* ``_is_causal_behavior`` and ``_templated_ring_attention`` with
  ``_cp_options.enable_load_balance`` (default True; ``context_parallel`` shards the buffers
  round-robin: rank r holds chunks r and 2cp-1-r of 2cp). Step 0: the local q, k, v, causal.
  Step i >= 1 holds the keys of rank (r - i) mod cp: for i <= r every local query against
  the first half of those keys (``key.chunk(2)[0]``); for i > r the second half of the
  queries (``query.chunk(2)[1]``) against all of them, merged into the second half of the
  output only (``partial``). Both are non-causal and the same work, half a (seq/cp)^2 block,
  but not the same kernel: :func:`ring_steps`.
* ``_SDPAMerger.step``: the block output cast to fp32, then ``out - sigmoid(block_lse - lse)
  * (out - block_out)`` and ``lse - logsigmoid(lse - block_lse)``; a partial step's
  ``_partial_update`` concatenates the untouched first half and the new second half into a
  new full fp32 output (``torch.cat``). ``results`` casts the output back to bf16.
* Every step i < cp-1 concatenates keys and values (``torch.cat([key.flatten(),
  value.flatten()])``) for ``rotater.exchange_buffers``. ``_AllGatherRotater`` (the default
  ``rotate_method``; torchtitan's ``context_parallel_rotate_method`` default "allgather")
  all-gathers only on its first call: its later concatenations are dead -- eager runs them,
  inductor drops them.
* ``_templated_ring_attention_backward``: fp32 ``zeros_like`` accumulators for dq, dk, dv;
  keys and values fetched again by a new rotater of the same method; per step the flash
  backward on the step's shape, then the key/value gradients received from the previous rank
  (``dkv_rotater``: always ``_AllToAllRotater``, ``ft_c.permute_tensor``) plus this step's
  (for i <= r into the first half: ``_partial_update(add=True)``, an in-place add on the half
  and a ``torch.cat``), concatenated in fp32 and sent on, every step including the last;
  ``grad_query +=`` the step's dq (for i > r into the second half, again a partial update).
  After the loop dq is cast to bf16, the last shift is waited for and cast to bf16.
* Waits (``_maybe_wait``): eager, an exchange is an ``AsyncCollectiveTensor`` waited for at
  the next step's ``next_buffer``, so it overlaps one step's attention. Under torch.compile
  the ring is traced into the graph of the TransformerBlock (torchtitan compiles each block
  with ``fullgraph=True``, ``parallelize_llama.apply_compile``), and a traced functional
  collective is waited for where it is issued (``_functional_collectives._maybe_wrap_tensor``
  returns ``wait_tensor(...)`` when ``_are_we_tracing()``). Inductor moves waits only under
  ``reorder_for_compute_comm_overlap``, False by default and not set by torchtitan (9dec370
  sets only ``_micro_pipeline_tp``): compiled, every exchange blocks the compute stream.
* torchtitan's Llama (``models/llama/model.py`` ``Attention.forward`` at 9dec370, until
  pytorch/torchtitan#2259 "GQA without kv repeats", 2026-01-27) repeats the key/value heads
  (``repeat_kv``) before SDPA: the ring gathers, shifts and accumulates keys and values
  ``heads`` wide, not ``kv_heads`` (:func:`titan_repeats_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import BF16, FP32, Block, Kernel, Style, Tensor, _Builder, price_block
from sim.workload.model import ModelSpec

# The last torch release of the span in which torchtitan repeated the key/value heads:
# torchtitan's #2259 (2026-01-27) moved to SDPA's enable_gqa; torchtitan tracks torch
# nightlies, and 2.10 (January 2026) is the last release before it.
LAST_TORCH_WITH_REPEAT_KV = (2, 10)


def titan_repeats_kv(torch_version: str) -> bool:
    """Whether torchtitan of a torch release's time feeds SDPA repeated key/value heads.

    Examples
    --------
    >>> titan_repeats_kv("2.6"), titan_repeats_kv("2.10"), titan_repeats_kv("2.11")
    (True, True, False)
    """
    major, minor = (int(x) for x in torch_version.split(".")[:2])
    return (major, minor) <= LAST_TORCH_WITH_REPEAT_KV


@dataclass(frozen=True)
class RingStep:
    """One step of ``_templated_ring_attention`` on one rank."""

    q: float
    """Share of the local queries attending (1 or 1/2)."""
    kv: float
    """Share of the received keys attended to (1 or 1/2)."""
    causal: bool
    partial: bool
    """Merged into the second half of the output only (``_partial_update``)."""

    @property
    def work(self) -> float:
        """Scores computed, in (seq/cp)^2 units."""
        return self.q * self.kv * (0.5 if self.causal else 1.0)


def ring_steps(cp: int, rank: int, load_balance: bool = True) -> list[RingStep | None]:
    """The attention call of each of the cp steps on ``rank`` (None: skipped), as
    ``_templated_ring_attention`` makes them (``_is_causal_behavior``, causal attention).

    Examples
    --------
    >>> [s.work for s in ring_steps(4, 1)]              # balanced: cp/2 on every rank
    [0.5, 0.5, 0.5, 0.5]
    >>> [s and s.work for s in ring_steps(4, 1, load_balance=False)]
    [0.5, 1.0, None, None]
    """
    steps: list[RingStep | None] = [RingStep(1.0, 1.0, True, False)]
    for i in range(1, cp):
        if not load_balance:
            steps.append(RingStep(1.0, 1.0, False, False) if i <= rank else None)
        elif i <= rank:
            steps.append(RingStep(1.0, 0.5, False, False))
        else:
            steps.append(RingStep(0.5, 1.0, False, True))
    return steps


# The two kinds of a balanced step i >= 1. Every step has ranks of both (rank cp-1 runs only
# the first, rank 0 only the second), and each step's exchange ties neighbours, so a step
# takes as long as its slower kind.
FULL_Q = RingStep(1.0, 0.5, False, False)
HALF_Q = RingStep(0.5, 1.0, False, True)


def _attention(batch: int, heads: int, seq: int, hd: int, qd: int, st: RingStep,
               pass_: str) -> tuple[float, dict]:
    sq, sk = int(seq * st.q), int(seq * st.kv)
    fl = 4.0 * batch * sq * sk * qd * (0.5 if st.causal else 1.0)
    fl *= 2.5 if pass_ == "bwd" else 1.0
    kw: dict = {"attn": (batch, heads, sq, hd, pass_)}
    if not st.causal:
        kw["attn_block"] = (sq, sk)
    return fl, kw


def _forward_step(i: int, st: RingStep, cp: int, style: Style, batch: int, seq: int,
                  heads: int, hd: int, qd: int, kvw: int, out32: Tensor, lse: Tensor
                  ) -> Block:
    """Forward of step i: the attention call and ``_SDPAMerger.step`` (and, last,
    ``results``)."""
    r = _Builder(f"attn_ring{i}", style)
    tokens = batch * seq
    tq = tokens * st.q
    qi = Tensor(f"ring{i}.q", tokens * qd * BF16)
    ki = Tensor(f"ring{i}.k", tokens * kvw * BF16)
    vi = Tensor(f"ring{i}.v", tokens * kvw * BF16)
    r.block.inputs += [qi, ki, vi]
    o = r.t("block_out", tq * qd, BF16)
    blse = r.t("block_lse", batch * heads * seq * st.q, FP32)
    fl, kw = _attention(batch, heads, seq, hd, qd, st, "fwd")
    r.fwd(Kernel(f"ring{i}.sdpa", "attention", (qi, ki, vi), (o, blse), fl, **kw))
    o32 = r.t("block_out_fp32", tq * qd, FP32)
    r.fwd(Kernel(f"ring{i}.out_to_fp32", "elementwise", (o,), (o32,)))
    if i > 0:
        cur = Tensor(f"{out32.name}.part", tq * qd * FP32)   # a view when partial
        d = r.t("diff", tq * qd, FP32)
        p = r.t("scaled", tq * qd, FP32)
        new = r.t("merged", tq * qd, FP32) if st.partial else out32
        r.fwd(Kernel(f"ring{i}.lse_sigmoid", "tiny", (blse,), ()))
        r.fwd(Kernel(f"ring{i}.sub", "elementwise", (cur, o32), (d,)))
        r.fwd(Kernel(f"ring{i}.mul", "elementwise", (d,), (p,)))
        r.fwd(Kernel(f"ring{i}.update", "elementwise", (cur, p), (new,)))
        r.fwd(Kernel(f"ring{i}.lse_update", "tiny", (blse,), (lse,)))
        if st.partial:
            # _partial_update: torch.cat of the kept first half and the merged second half.
            keep = Tensor(f"{out32.name}.first", (tokens - tq) * qd * FP32)
            r.fwd(Kernel(f"ring{i}.cat_out", "elementwise", (keep, new), (out32,)))
            r.fwd(Kernel(f"ring{i}.cat_lse", "tiny", (lse,), (lse,)))
    if i == 0:
        # Autograd keeps the local q, k, v for backward (which fetches the others again).
        r.save(qi, ki, vi)
    if i == cp - 1:
        outb = r.t("out", tokens * qd, BF16)
        r.fwd(Kernel("ring.out_to_bf16", "elementwise", (out32,), (outb,)))
        r.save(lse)
    return r.finish()


def _backward_step(i: int, st: RingStep, style: Style, batch: int, seq: int, heads: int,
                   hd: int, qd: int, kvw: int) -> tuple[Block, Block]:
    """Backward of step i: the flash backward, then (once the previous shift arrived) the
    fp32 accumulation and the concatenation sent on."""
    tokens = batch * seq
    tq, tk = tokens * st.q, tokens * st.kv
    fb = _Builder(f"attn_ring{i}_bwd", style)
    go = fb.t("g_out", tq * qd, BF16)
    qi, oi = fb.t("q", tq * qd, BF16), fb.t("o", tq * qd, BF16)
    ki, vi = fb.t("k", tk * kvw, BF16), fb.t("v", tk * kvw, BF16)
    blse = fb.t("lse", batch * heads * seq * st.q, FP32)
    gq, gk, gv = fb.t("g_q", tq * qd, BF16), fb.t("g_k", tk * kvw, BF16), fb.t(
        "g_v", tk * kvw, BF16)
    fl, kw = _attention(batch, heads, seq, hd, qd, st, "bwd")
    ks = []
    if i == 0:
        acc = fb.t("acc", tokens * (qd + 2 * kvw), FP32)
        ks.append(Kernel("ring.zeros", "elementwise", (), (acc,)))
    if st.partial:
        ks.append(Kernel(f"ring{i}.lse_contiguous", "tiny", (), ()))
    ks.append(Kernel(f"ring{i}.sdpa_bwd", "attention", (go, qi, ki, vi, oi, blse),
                     (gq, gk, gv), fl, **kw))
    fb.bwd(*ks)
    ab = _Builder(f"attn_ring{i}_acc", style)
    accq = ab.t("acc_q", tokens * qd, FP32)
    acckv = ab.t("acc_kv", tokens * 2 * kvw, FP32)
    gkv = ab.t("g_kv", tk * 2 * kvw, BF16)
    gqb = ab.t("g_q", tq * qd, BF16)
    nxt = ab.t("next_g_kv", tokens * 2 * kvw, FP32)
    acc_ks = []
    if st.kv < 1.0:
        # _partial_update(add=True) on dk and dv: in-place add into the first half, then cat.
        half = ab.t("acc_kv_half", tk * 2 * kvw, FP32)
        acc_ks += [Kernel(f"ring{i}.acc_kv_half", "elementwise", (half, gkv), (half,)),
                   Kernel(f"ring{i}.cat_acc_kv", "elementwise", (acckv,), (acckv,))]
    else:
        acc_ks.append(Kernel(f"ring{i}.acc_kv", "elementwise", (acckv, gkv), (acckv,)))
    acc_ks.append(Kernel(f"ring{i}.cat_g_kv", "elementwise", (acckv,), (nxt,)))
    if st.q < 1.0:
        half = ab.t("acc_q_half", tq * qd, FP32)
        acc_ks += [Kernel(f"ring{i}.acc_q_half", "elementwise", (half, gqb), (half,)),
                   Kernel(f"ring{i}.cat_acc_q", "elementwise", (accq,), (accq,))]
    else:
        acc_ks.append(Kernel(f"ring{i}.acc_q", "elementwise", (accq, gqb), (accq,)))
    ab.bwd(*acc_ks)
    return fb.finish(), ab.finish()


def ring_step_segments(ml: ModelSpec, style: Style, cm: ComputeModel, batch: int, seq: int,
                       cp: int, kv_width: int) -> dict[str, Block]:
    """The segments of the cp ring steps (forward ``attn_ring{i}``, backward
    ``attn_ring{i}_bwd`` and ``attn_ring{i}_acc``), the key/value concatenation
    ``attn_kv_cat`` and ``attn_ring_final``, on the local ``seq`` (already seq/cp) with
    keys and values ``kv_width`` wide. Each step i >= 1 is the slower of its two kinds
    (:data:`FULL_Q`, :data:`HALF_Q`) as priced by ``cm``."""
    qd, heads, hd = ml.q_dim, ml.heads, ml.head_dim
    tokens = batch * seq
    segs: dict[str, Block] = {}
    out32 = Tensor("ring.out_fp32", tokens * qd * FP32)
    lse = Tensor("ring.lse", batch * heads * seq * FP32)
    args = (style, batch, seq, heads, hd, qd, kv_width)
    first = RingStep(1.0, 1.0, True, False)
    for i in range(cp):
        kinds = [first] if i == 0 else [FULL_Q, HALF_Q]
        fwd = [_forward_step(i, k, cp, *args, out32, lse) for k in kinds]
        segs[f"attn_ring{i}"] = max(fwd, key=lambda b: price_block(b, style, cm).fwd_s)
        bwd = [_backward_step(i, k, *args) for k in kinds]
        fb, ab = max(bwd, key=lambda p: price_block(p[0], style, cm).bwd_s
                     + price_block(p[1], style, cm).bwd_s)
        segs[f"attn_ring{i}_bwd"], segs[f"attn_ring{i}_acc"] = fb, ab
    c = _Builder("attn_kv_cat", style)
    kin, vin = c.t("k", tokens * kv_width, BF16), c.t("v", tokens * kv_width, BF16)
    c.fwd(Kernel("kv_cat", "elementwise", (kin, vin),
                 (c.t("kv", tokens * 2 * kv_width, BF16),)))
    segs["attn_kv_cat"] = c.finish()
    f = _Builder("attn_ring_final", style)
    accq = f.t("acc_q", tokens * qd, FP32)
    acckv = f.t("acc_kv", tokens * 2 * kv_width, FP32)
    f.bwd(Kernel("ring.g_q_to_bf16", "elementwise", (accq,), (f.t("g_q", tokens * qd, BF16),)),
          Kernel("ring.g_kv_to_bf16", "elementwise", (acckv,),
                 (f.t("g_kv", tokens * 2 * kv_width, BF16),)))
    segs["attn_ring_final"] = f.finish()
    return segs


def repeat_kv_kernels(b: _Builder, k: Tensor, v: Tensor, tokens: float, kv_dim: int,
                      q_dim: int) -> tuple[Tensor, Tensor]:
    """torchtitan's ``repeat_kv`` (expand + reshape: a copy) of keys and values to the query
    heads, and autograd's sum over the repeats in backward (a reduction)."""
    if kv_dim == q_dim:
        return k, v
    out = []
    for x, n in ((k, "k"), (v, "v")):
        y = b.t(f"{n}_rep", tokens * q_dim, BF16)
        b.fwd(Kernel(f"repeat_{n}", "elementwise", (x,), (y,)))
        gy = b.t(f"g_{n}_rep", tokens * q_dim, BF16)
        gx = b.t(f"g_{n}", tokens * kv_dim, BF16)
        b.bwd(Kernel(f"g_repeat_{n}_sum", "elementwise", (gy,), (gx,), reduction=True))
        out.append(y)
    return out[0], out[1]
