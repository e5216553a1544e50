"""Per-block accounting the block-level builders share (DDP, FSDP2, FairScale, DeepSpeed).

These builders run a micro-batch as the blocks of :mod:`sim.frameworks.common.steps` (embedding,
per layer attention and MLP, then norm + LM head + loss). Two rules about those blocks were
written once per builder; they live here so a fix reaches all of them:

* :func:`block_model_flops`: the model FLOPs each block's forward and backward is credited
  with (the same convention as :meth:`sim.workload.model.ModelSpec.model_flops_per_token`);
* :func:`block_grad_params` and :func:`tied_grad_sum_s`: where a tied embedding's gradient
  first appears and what autograd pays to sum its two uses.

Megatron-LM and Megatron-DeepSpeed's pipeline builders take their FLOPs from the priced
kernels of each block instead (``BlockCost.flops_fwd``/``flops_bwd``).
"""

from __future__ import annotations

from collections.abc import Mapping

from sim.hardware.attention_cost import window_pairs
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import BlockCost
from sim.workload.model import ModelSpec

WINDOWED_ATTN = "attn_window"
"""The block key of a sliding-window layer's attention where a builder prices it apart from
the full layers' ``attn`` (NeMo AutoModel's GPT-OSS in fsdp2, ``Job.attn_key``)."""


def block_model_flops(model: ModelSpec, costs: Mapping[str, BlockCost], micro_batch: int,
                      seq: int) -> dict[str, tuple[float, float]]:
    """Model FLOPs (forward, backward) of each block for one micro-batch.

    Per token, a block is credited 6 x the parameters it multiplies with (2 forward, 4
    backward: the data and the weight gradient), plus causal attention's 6 x seq x q_dim in
    the attention block (:meth:`~sim.workload.model.ModelSpec.attention_flops_per_token`). The
    embedding is a lookup (0); the LM head multiplies with the vocab x hidden output matrix,
    tied or not. Forward gets a third, backward two thirds, as in PaLM's MFU convention
    (Chowdhery et al. 2022, appendix B) that
    :meth:`~sim.workload.model.ModelSpec.model_flops_per_token`
    follows. The final norm's scale (``hidden`` parameters) is in
    ``matmul_params`` but credited to no block here.

    Parameters
    ----------
    model : ModelSpec
        The model (``q_dim``, ``vocab``, ``hidden``).
    costs : Mapping[str, BlockCost]
        The priced blocks; ``costs["attn"].params`` and ``costs["mlp"].params`` (weights, biases
        and the block's norm) are the parameters counted.
    micro_batch, seq : int
        Sequences per micro-batch and tokens per sequence.

    Returns
    -------
    dict[str, tuple[float, float]]
        ``{"embed", "attn", "mlp", "head"}`` -> (forward, backward) FLOPs of one micro-batch
        (one layer for ``attn`` and ``mlp``).

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.workload.layer_ops import Style, model_blocks, price_block
    >>> m = ModelSpec.from_ref("llama3-8b")
    >>> style = Style("bf16")
    >>> costs = {b.name: price_block(b, style, ComputeModel(catalog.gpu("h100-sxm")))
    ...          for b in model_blocks(m, style, 1, 4096, False)}
    >>> f = block_model_flops(m, costs, 1, 4096)
    >>> f["embed"], f["head"][1] / f["head"][0]
    ((0.0, 0.0), 2.0)
    """
    tokens = micro_batch * seq
    per_token = {"embed": 0.0,
                 "attn": 6.0 * costs["attn"].params + 6.0 * seq * model.q_dim,
                 "mlp": 6.0 * costs["mlp"].params,
                 "head": 6.0 * (model.vocab * model.hidden)}
    if WINDOWED_ATTN in costs and model.sliding_window is not None:
        # A sliding layer's own block: 12 x q_dim FLOPs per (query, key) pair it scores
        # (forward and backward), the pairs of its band (window_pairs; S^2 / 2 without one
        # gives the line above).
        per_token[WINDOWED_ATTN] = 6.0 * costs[WINDOWED_ATTN].params + 12.0 * model.q_dim \
            * window_pairs(seq, model.sliding_window) / seq
    return {b: (v * tokens / 3, 2 * v * tokens / 3) for b, v in per_token.items()}


def block_grad_params(model: ModelSpec, costs: Mapping[str, BlockCost]) -> dict[str, int]:
    """Parameters whose gradient each block's backward produces first.

    Backward runs head, layers, embedding. A tied embedding is one leaf used by the LM head
    and the embedding lookup, so its vocab x hidden gradient first appears in the head's
    backward: the head is charged it and the embedding only its other parameters (learned
    positions, if any). Multiply by the gradient dtype's bytes for memory.

    Parameters
    ----------
    model : ModelSpec
        The model (``tied_embeddings``, ``embedding_params``, ``vocab``, ``hidden``).
    costs : Mapping[str, BlockCost]
        The priced blocks whose ``params`` the attention, MLP and head blocks own (the head
        block of a tied model holds only the final norm).

    Returns
    -------
    dict[str, int]
        ``{"embed", "attn", "mlp", "head"}`` -> parameter count (per layer for attn and mlp).

    Examples
    --------
    Llama 3.2 1B ties its embeddings (and has no learned positions):

    >>> from sim import catalog
    >>> from sim.workload.layer_ops import Style, model_blocks, price_block
    >>> m = ModelSpec.from_ref("llama3.2-1b")
    >>> cm = ComputeModel(catalog.gpu("h100-sxm"))
    >>> costs = {b.name: price_block(b, Style("bf16"), cm)
    ...          for b in model_blocks(m, Style("bf16"), 1, 2048, False)}
    >>> g = block_grad_params(m, costs)
    >>> g["embed"], g["head"] == m.vocab * m.hidden + m.norm_params
    (0, True)
    """
    vh = model.vocab * model.hidden if model.tied_embeddings else 0
    return {"embed": model.embedding_params - vh,
            "attn": costs["attn"].params,
            "mlp": costs["mlp"].params,
            "head": costs["head"].params + vh}


def tied_grad_sum_s(cm: ComputeModel, model: ModelSpec, grad_bytes: int) -> float:
    """Seconds autograd spends summing a tied embedding's two gradients (0 if untied).

    The leaf receives one vocab x hidden gradient from the LM head and one from the embedding
    lookup; autograd adds them before its AccumulateGrad hook runs (``InputBuffer::add`` in
    PyTorch's torch/csrc/autograd/input_buffer.cpp): an elementwise add that reads two
    tensors and writes one, 3 x the gradient's bytes. Charged to the embedding's backward, the
    tensor's last use.

    Parameters
    ----------
    cm : ComputeModel
        Prices the memory-bound add (:meth:`~sim.hardware.compute.ComputeModel.membound_time`).
    model : ModelSpec
        The model (``tied_embeddings``, ``vocab``, ``hidden``).
    grad_bytes : int
        Bytes per gradient element as autograd produces it (4 under autocast, 2 in bf16).

    Returns
    -------
    float
        Seconds; ``0.0`` when the embeddings are not tied.

    Examples
    --------
    >>> from sim import catalog
    >>> cm = ComputeModel(catalog.gpu("h100-sxm"))
    >>> m = ModelSpec.from_ref("llama3.2-1b")
    >>> tied_grad_sum_s(cm, m, 2) == cm.membound_time(3 * 2 * m.vocab * m.hidden)
    True
    """
    if not model.tied_embeddings:
        return 0.0
    return cm.membound_time(3 * grad_bytes * (model.vocab * model.hidden))
