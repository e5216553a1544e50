"""Megatron-Core's unfused token permutations (``moe_permute_fusion`` off), kernel by kernel.

With the fusion off, ``moe_utils.permute``, ``unpermute`` and ``sort_chunks_by_idxs``
(Megatron-Core ``megatron/core/transformer/moe/moe_utils.py`` since e19fbe2e, 2026-03-06,
which replaced the ``masked_select`` of the earlier code by a fixed-shape argsort) run as
PyTorch ops:

* **permute** (dropless, or dropping without padding): ``routing_map.bool().T.contiguous()``
  (a transposed copy), ``reshape(-1).argsort(descending=True, stable=True)`` over every
  (expert, token) pair (PyTorch's stable sort of a one-byte key: an iota of int64 indices,
  then CUB's onesweep radix sort, one histogram pass and one 8-bit digit pass), the first
  ``num_out_tokens`` of it modulo the token count, the probs' transposed copy gathered by
  advanced indexing, and ``tokens.index_select(0, sorted_indices)``; with
  ``moe_pad_expert_input_to_capacity`` an argsort of each expert's row of the int8 map, its
  first ``capacity`` indices made contiguous, the probs' flat indices built (``arange``,
  multiply, add) and gathered by ``index_select``. Backward: ``index_select``'s is
  ``zeros(...).index_add_(0, index, grad)``; the advanced index's ``index_put_`` with
  ``accumulate=True`` sorts its indices first (``index_put_with_sort_kernel``); the probs'
  transpose copies back.
* **unpermute** (without probs, as the ``alltoall`` dispatcher calls it): ``zeros`` and
  ``scatter_add_`` of every permuted row into its token (an index expanded over the hidden
  size); backward ``gather``s the output gradient per row.
* **sort_chunks_by_idxs**: ``torch.split`` by the (source rank, local expert) counts, the
  chunks reordered in Python and ``torch.cat``: one view a chunk, and PyTorch's batched cat
  kernel (``CatArrayBatchedCopy``: 64 inputs a launch when they are 16-byte aligned and
  contiguous, as the token chunks are, 128 otherwise; ``aten/src/ATen/native/cuda/Shape.cu``,
  ``CAT_ARRAY_BATCH_SIZE``). Backward: ``CatBackward`` narrows the gradient into the chunks
  and ``SplitWithSizesBackward`` cats them back.

PyTorch's ``index_select``, ``index_add_``, ``scatter_add_`` and ``gather`` kernels move one
element a thread at a time through computed offsets (``indexSelectLargeIndex``,
``indexFuncLargeIndex``, ``_scatter_gather_elementwise_kernel``; the stores and atomics may
alias the next loads, so nothing is in flight ahead of them): priced as PyTorch's
non-vectorised loop (:attr:`sim.workload.kernels.Kernel.legacy_elements`) with three operands
an element (index, source, destination), where TE's fused kernels stream whole rows.
"""

from __future__ import annotations

import math

from sim.workload.kernels import BF16, BOOL, Kernel, Tensor
from sim.workload.layer_builder import _Builder

INT64 = 8   # PyTorch's sort indices and index tensors
CAT_BATCH_ALIGNED = 64
"""Inputs per ``CatArrayBatchedCopy`` launch when every input is contiguous and 16-byte
aligned (PyTorch ``Shape.cu``: ``CAT_ARRAY_BATCH_SIZE / 2`` on the vectorised path)."""
CAT_BATCH = 128
"""Inputs per launch otherwise (``CAT_ARRAY_BATCH_SIZE``)."""


def cat_launches(chunks: int, row_bytes: float) -> int:
    """Kernel launches of ``torch.cat`` over ``chunks`` contiguous pieces of rows of
    ``row_bytes`` each: 16-byte aligned rows take the vectorised batches of 64.

    >>> cat_launches(128, 2048 * 2), cat_launches(128, 2)      # tokens, bf16 probs
    (2, 1)
    """
    batch = CAT_BATCH_ALIGNED if row_bytes % 16 == 0 else CAT_BATCH
    return max(1, math.ceil(chunks / batch))


def stable_argsort(b: _Builder, name: str, keys: Tensor, n: float) -> Tensor:
    """``argsort(stable=True)`` of ``n`` one-byte keys: the int64 iota of indices, CUB's
    radix histogram pass, the exclusive scan of its bins, and one onesweep pass moving every
    key and index (an 8-bit key is one 8-bit digit). Returns the sorted indices."""
    iota = b.t(f"{name}.iota", n, INT64)
    hist = b.t(f"{name}.histogram", 256, INT64)
    out_keys = b.t(f"{name}.sorted_keys", n, BOOL)
    idx = b.t(f"{name}.indices", n, INT64)
    b.fwd(Kernel(f"{name}.iota", "elementwise", (), (iota,)))
    b.fwd(Kernel(f"{name}.histogram", "elementwise", (keys,), (hist,)))
    b.fwd(Kernel(f"{name}.scan", "tiny", (hist,), (hist,)))
    b.fwd(Kernel(f"{name}.onesweep", "elementwise", (keys, iota, hist), (out_keys, idx)))
    return idx


def torch_permute_kernels(b: _Builder, h: int, experts: int, x: Tensor, probs: Tensor,
                          gprobs: Tensor, tokens: float, rows: float, router_bytes: int,
                          pad: bool = False) -> None:
    """Permutation 1 with ``moe_permute_fusion`` off: ``tokens`` rows of width ``h`` copied
    into ``rows`` expert-ordered rows with their probs (``experts`` wide routing map);
    ``pad``: the drop-and-pad variant (``rows`` = experts x capacity). Adds the permuted
    tokens and probs to the block's outputs, as :func:`sim.workload.moe_router_ops.
    permute_kernels` does."""
    n = tokens * experts
    rmap = b.t("permute.routing_map", n, BOOL)
    rmap_t = b.t("permute.routing_map_t", n, BOOL)
    # .bool() (int8 with padding) .T.contiguous(): a transposed copy, element by element.
    b.fwd(Kernel("permute.map_transpose", "elementwise", (rmap,), (rmap_t,), legacy_elements=n))
    order = stable_argsort(b, "permute.argsort", rmap_t, n)
    idx = b.t("permute.sorted_indices", rows, INT64)
    if pad:
        # [:, :capacity].contiguous(): a strided copy of each expert's first indices; the
        # probs' flat indices: arange(experts)[:, None] * tokens + indices.
        b.fwd(Kernel("permute.capacity_slice", "elementwise", (order,), (idx,),
                     legacy_elements=rows))
        flat = b.t("permute.flat_indices", rows, INT64)
        b.fwd(Kernel("permute.flat_indices", "elementwise", (idx,), (flat,)))
    else:
        # flat_sorted[:num_out_tokens] % num_tokens.
        flat = order
        b.fwd(Kernel("permute.token_of", "elementwise", (order,), (idx,)))
    probs_t = b.t("permute.probs_t", n, router_bytes)
    b.fwd(Kernel("permute.probs_transpose", "elementwise", (probs,), (probs_t,),
                 legacy_elements=n))
    pp = b.t("permuted_probs", rows, router_bytes)
    # The transposed probs gathered at the kept flat indices (reads only ``rows`` of each;
    # the whole tensors are named for the dataflow, a few MB at most).
    b.fwd(Kernel("permute.probs_gather", "elementwise", (flat, probs_t), (pp,)))
    src = b.t("permute.gathered_rows", rows * h, BF16)
    out = b.t("permuted", rows * h, BF16)
    b.fwd(Kernel("permute", "elementwise", (src, idx), (out,), legacy_elements=rows * h,
                 legacy_operands=3))
    b.save(idx, flat)
    # Backward, last op first as autograd runs it: index_select's zeros + index_add_ ...
    g = b.t("g_permuted", rows * h, BF16)
    gx = b.t("permute.g_in", tokens * h, BF16)
    b.bwd(Kernel("permute.bwd_zeros", "elementwise", (), (gx,)),
          Kernel("permute.bwd", "elementwise", (g, idx), (gx,), legacy_elements=rows * h,
                 legacy_operands=3))
    # ... the probs' index_put_(accumulate=True): zeros, its indices sorted (int64 keys of
    # log2(n) bits: three 8-bit passes), the accumulation; then the transpose's copy back.
    gpp = b.t("g_permuted_probs", rows, router_bytes)
    gpt = b.t("permute.g_probs_t", n, router_bytes)
    keys = b.t("permute.bwd_sort_keys", rows, 2 * INT64)
    passes = max(1, math.ceil(math.log2(max(n, 2.0)) / 8))
    b.bwd(Kernel("permute.probs_bwd_zeros", "elementwise", (), (gpt,)),
          Kernel("permute.probs_bwd_sort", "elementwise", (keys,), (keys,), launches=passes),
          Kernel("permute.probs_bwd", "elementwise", (gpp, keys), (gpt,),
                 legacy_elements=rows, legacy_operands=3),
          Kernel("permute.probs_transpose_bwd", "elementwise", (gpt,), (gprobs,),
                 legacy_elements=n))
    b.block.outputs += [out, pp]


def torch_unpermute_kernels(b: _Builder, h: int, x: Tensor, tokens: float, rows: float
                            ) -> Tensor:
    """Unpermutation 1 with ``moe_permute_fusion`` off, without probs: ``zeros`` of the
    ``tokens`` rows and ``scatter_add_`` of the ``rows`` expert outputs into them; backward
    a ``gather`` of the output gradient per row. Returns the unpermuted tokens."""
    idx = b.t("row_index", rows, INT64)
    out = b.t("out", tokens * h, BF16)
    b.fwd(Kernel("unpermute.zeros", "elementwise", (), (out,)))
    b.fwd(Kernel("unpermute", "elementwise", (x, idx), (out,), legacy_elements=rows * h,
                 legacy_operands=3))
    gsrc = b.t("unpermute.g_rows", tokens * h, BF16)
    gx = b.t("g_in", rows * h, BF16)
    b.bwd(Kernel("unpermute.bwd", "elementwise", (gsrc, idx), (gx,),
                 legacy_elements=rows * h, legacy_operands=3))
    return out


def torch_sort_chunks(b: _Builder, name: str, x: Tensor, probs: Tensor | None, rows: float,
                      h: int, router_bytes: int, chunks: int
                      ) -> tuple[Tensor, Tensor | None]:
    """``sort_chunks_by_idxs`` with the fusion off: ``torch.split`` into ``chunks`` views and
    ``torch.cat`` in the new order, for the tokens and (``probs`` given) their probs;
    backward the gradient's cat back. Returns the sorted tokens and probs."""
    xs = b.t(name, rows * h, BF16)
    b.fwd(Kernel(name, "elementwise", (x,), (xs,), launches=cat_launches(chunks, h * BF16)))
    gxs, gx = b.t(f"g_{name}", rows * h, BF16), b.t(f"{name}.g_in", rows * h, BF16)
    ps = None
    bwd = [Kernel(f"{name}.bwd", "elementwise", (gxs,), (gx,),
                  launches=cat_launches(chunks, h * BF16))]
    if probs is not None:
        ps = b.t(f"{name}_probs", rows, router_bytes)
        b.fwd(Kernel(f"{name}.probs", "elementwise", (probs,), (ps,),
                     launches=cat_launches(chunks, router_bytes)))
        gps, gp = b.t(f"g_{name}_probs", rows, router_bytes), b.t(f"{name}.g_probs", rows,
                                                                  router_bytes)
        bwd.append(Kernel(f"{name}.probs_bwd", "elementwise", (gps,), (gp,),
                          launches=cat_launches(chunks, router_bytes)))
    b.bwd(*bwd)
    return xs, ps
