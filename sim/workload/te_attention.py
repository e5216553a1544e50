"""Transformer Engine's ``DotProductAttention`` around its fused kernel, as Megatron-Core calls
it: the FP8 inputs of ``fp8_dpa`` and the copies and merges of the context-parallel ring.

Source: ``transformer_engine/pytorch/attention/dot_product_attention/backends.py`` and
``context_parallel.py`` (NVIDIA/TransformerEngine @ d0067d0; the ring's structure, two chunks
a rank, the per-step corrections and the accumulation of the gradients in the communication
buffers, is the same back to the 1.x releases NeMo 24.07 shipped).

``AttnFuncWithCPAndKVP2P`` (Megatron's default ``cp_comm_type`` "p2p"), causal, ``sbhd``, one
rank's work beside its ``cp`` attention calls (whose time
:meth:`~sim.hardware.compute.ComputeModel.cp_attention_time` prices):

* Forward. ``p2p_comm_buffers[0] = torch.cat((k.view(-1), v.view(-1)))``: keys and values
  copied once into the first send buffer. Each step's call writes its own output and
  log-sum-exp; the log-sum-exps are merged step by step (``flash_attn_fwd_softmax_lse_
  correction``, one fused kernel on ``batch x heads x seq`` floats; the first a ``clone``),
  and after the loop every step's output is scaled into the result
  (``flash_attn_fwd_out_correction_init`` for step 0, ``flash_attn_fwd_out_correction``:
  ``out.add_(out_per_step * exp(lse_step - lse))``, one fused kernel each, ``jit_fuser``):
  on the whole local output for the steps a rank attends with all its queries, on its second
  half for the others (``flash_attn_fwd_second_half_out_correction``). The last rank of the
  ring runs whole-output corrections only, and the ring waits for it: priced at that rank.
* Backward (16-bit attention). ``p2p_comm_buffers[0][0].copy_(kv)``: keys and values copied
  into the first send buffer. Each step's call writes the step's ``dq_``, ``dk_``, ``dv_``;
  ``dq`` is copied or added into the query gradient (``dq.copy_``/``dq.add_``, or on one half,
  ``dq[1].add_``), and once the previous rank's key/value gradients arrived (``req.wait()``)
  this step's are added into them in the receive buffer (``dk.add_(dk_)``, ``dv.add_(dv_)``,
  or on one half), which the next step sends on. Priced at the larger of the two kinds of
  rank in bytes (the last rank adds whole query gradients and half key/value gradients, the
  first rank the reverse), as the ring waits for its slowest member.

FP8 attention (``fp8_dpa``) takes another path (outputs and gradients dequantized to fp32
buffers each step); its merges are priced as the 16-bit ones, an approximation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.layer_ops import BF16, Kernel, Tensor, _Builder
from sim.workload.layer_rules import fp8_element_bytes, te_scaled_cast

if TYPE_CHECKING:
    from sim.workload.megatron_ops import MegatronLayout

FP8_ATTENTION_INPUTS = ("query", "key", "value")   # the FP8 copies' tags: {tag}_fp8


def fp8_attention_inputs(b: _Builder, lay: MegatronLayout, qkv: tuple[Tensor, ...],
                         grad_out: Tensor
                         ) -> tuple[tuple[Tensor, ...], Tensor, list[Kernel], tuple[bool, bool]]:
    """Under ``fp8_attention``: TE's DotProductAttention quantizes its inputs (query, key,
    value forward; the output's gradient backward) with the recipe's quantizer before cuDNN's
    FP8 kernel reads them, and saves the FP8 copies (``fp8_dpa`` without ``fp8_mha``,
    ``attention/dot_product_attention/backends.py`` @ d0067d0). Returns the kernel's inputs,
    its output gradient, the backward's quantization (to issue just before the backward
    kernel) and the attention kernels' (fp8, fp8_block) flags; unchanged in 16 bits."""
    if not lay.fp8_attention:
        return qkv, grad_out, [], (False, False)
    amax, per = lay.fp8 == "tensorwise", fp8_element_bytes(lay.fp8)
    out = tuple(b.t(f"{tag}_fp8", t.nbytes / BF16, per)
                for t, tag in zip(qkv, FP8_ATTENTION_INPUTS, strict=True))
    for t, t8, tag in zip(qkv, out, FP8_ATTENTION_INPUTS, strict=True):
        for kern in te_scaled_cast("core_attn", tag, t, (t8,), amax):
            b.fwd(kern)
    g8 = b.t("dout_fp8", grad_out.nbytes / BF16, per)
    return (out, g8, te_scaled_cast("core_attn", "dout", grad_out, (g8,), amax),
            (True, lay.fp8 == "mxfp8"))


def cp_ring_forward_kernels(k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cp: int
                            ) -> list[Kernel]:
    """The forward ring's copies and merges beside its ``cp`` attention calls (module doc):
    ``k``, ``v`` the local keys and values, ``out`` the local output, ``lse`` its
    log-sum-exp. Named ``flash_fwd.cp_*`` so they count as core attention (they run inside
    TE's attention function: selective recomputation of ``core_attn`` runs them again).

    Examples
    --------
    >>> q = Tensor("o", 4096 * 4096 * 2)
    >>> ks = cp_ring_forward_kernels(Tensor("k", 2**24), Tensor("v", 2**24), q,
    ...                              Tensor("lse", 32 * 4096 * 4), cp=2)
    >>> [x.name for x in ks]      # doctest: +NORMALIZE_WHITESPACE
    ['flash_fwd.cp_kv_cat', 'flash_fwd.cp_lse_clone', 'flash_fwd.cp_lse_correction1',
     'flash_fwd.cp_out_correction0', 'flash_fwd.cp_out_correction1']
    """
    if cp <= 1:
        return []
    buf = Tensor("cp_kv_send", k.nbytes + v.nbytes)
    ks = [Kernel("flash_fwd.cp_kv_cat", "elementwise", (k, v), (buf,)),
          Kernel("flash_fwd.cp_lse_clone", "tiny", (lse,), (lse,))]
    ks += [Kernel(f"flash_fwd.cp_lse_correction{i}", "tiny", (lse,), (lse,))
           for i in range(1, cp)]
    for i in range(cp):
        step = Tensor(f"cp_out_step{i}", out.nbytes)
        reads = (step, lse) if i == 0 else (out, step, lse)
        ks.append(Kernel(f"flash_fwd.cp_out_correction{i}", "elementwise", reads, (out,)))
    return ks


def cp_ring_backward_kernels(q: Tensor, k: Tensor, v: Tensor, cp: int) -> list[Kernel]:
    """The backward ring's copy and gradient accumulations beside its ``cp`` attention calls
    (module doc), on gradients the size of the local ``q``, ``k``, ``v`` (16 bits). Named
    ``flash_bwd.cp_*`` (core attention).

    Examples
    --------
    >>> ks = cp_ring_backward_kernels(Tensor("q", 2**25), Tensor("k", 2**23),
    ...                               Tensor("v", 2**23), cp=2)
    >>> len(ks), ks[0].name, ks[-1].name
    (7, 'flash_bwd.cp_kv_copy', 'flash_bwd.cp_dv_add1')
    """
    if cp <= 1:
        return []
    send = Tensor("cp_kv_send", k.nbytes + v.nbytes)
    ks = [Kernel("flash_bwd.cp_kv_copy", "elementwise", (k, v), (send,))]
    kv = k.nbytes + v.nbytes
    # The last rank: whole query gradients, half key/value ones; the first: the reverse.
    fq, fkv = (1.0, 0.5) if q.nbytes + kv / 2 >= q.nbytes / 2 + kv else (0.5, 1.0)
    sizes = (("dq", q.nbytes * fq), ("dk", k.nbytes * fkv), ("dv", v.nbytes * fkv))
    dq, dk, dv = (Tensor(f"cp_{n}_acc", nb) for n, nb in sizes)
    for i in range(cp):
        parts = tuple(Tensor(f"cp_{n}_step{i}", nb) for n, nb in sizes)
        for acc, part, n in zip((dq, dk, dv), parts, ("dq", "dk", "dv"), strict=True):
            # The first step copies into the accumulator, the others add.
            reads = (part,) if i == 0 else (acc, part)
            ks.append(Kernel(f"flash_bwd.cp_{n}_{'copy' if i == 0 else 'add'}{i}",
                             "elementwise", reads, (acc,)))
    return ks


__all__ = ["FP8_ATTENTION_INPUTS", "cp_ring_backward_kernels", "cp_ring_forward_kernels",
           "fp8_attention_inputs"]
