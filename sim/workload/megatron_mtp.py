"""The kernels of a multi-token prediction module's input projection in Megatron-Core.

``MultiTokenPredictionLayer._concat_embeddings``
(megatron/core/transformer/multi_token_prediction.py) joins, per token, the embedding of the
token k places ahead with the previous depth's hidden state: ``enorm`` (RMSNorm) on the
embedding, ``hnorm`` on the hidden state, ``torch.cat`` into a [s, b, 2h] tensor, ``eh_proj``
(a column-parallel linear 2h -> h, ``gather_output=False``, no bias), then
``gather_from_tensor_model_parallel_region`` (an all-gather of the h/tp output slices over the
tensor-parallel group, done by the unit builder) and, with sequence parallelism,
``scatter_to_sequence_parallel_region`` (each rank keeps its sequence slice: one copy). With
sequence parallelism the norms and the concatenation run on the rank's sequence shard and
``eh_proj`` (Transformer Engine's column-parallel linear) gathers its 2h-wide input, keeping
only the shard for backward. The transformer layer, final norm and the shared output head
that follow are the model's own blocks (:mod:`sim.workload.megatron_ops`).
"""

from __future__ import annotations

from sim.workload.layer_ops import BF16, Block, Kernel, _Builder
from sim.workload.megatron_ops import STYLE, MegatronLayout, _keep_input_shard, _linear, _norm
from sim.workload.model import ModelSpec


def mtp_proj_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int) -> Block:
    """enorm, hnorm, concatenation and ``eh_proj`` of one prediction depth on one
    tensor-parallel rank; its output is the h/tp slice before the tensor-parallel gather."""
    t = lay.tp
    tokens = batch * (seq // lay.cp)
    local = tokens / t if lay.sequence_parallel else tokens
    h = m.hidden
    b = _Builder("mtp_proj", STYLE)
    emb = b.t("emb", local * h, BF16)
    hid = b.t("hidden", local * h, BF16)
    b.block.inputs.extend((emb, hid))
    e = _norm(b, m, emb, local, "enorm")
    x = _norm(b, m, hid, local, "hnorm")
    cat = b.t("cat", local * 2 * h, BF16)
    b.fwd(Kernel("cat", "elementwise", (e, x), (cat,)))
    b.bwd(Kernel("cat.bwd", "elementwise", (b.t("g_cat", local * 2 * h, BF16),),
                 (b.t("g_e", local * h, BF16), b.t("g_x", local * h, BF16))))
    xin = b.t("eh_proj_in", tokens * 2 * h, BF16) if local != tokens else cat
    kept = len(b.block.saved)
    y = _linear(b, xin, tokens, 2 * h, h // t, "eh_proj", False, lay=lay)
    _keep_input_shard(b, kept, "eh_proj_in_shard", local * 2 * h, lay)
    if t > 1:
        # gather_from_tensor_model_parallel_region: NCCL gathers the slices rank after rank
        # into one buffer, then torch.cat along the hidden dimension copies them into place.
        gathered = b.t("gathered", tokens * h, BF16)
        b.fwd(Kernel("gather_cat", "elementwise", (b.t("gather_buf", tokens * h, BF16),),
                     (gathered,)))
        if local != tokens:
            # scatter_to_sequence_parallel_region: the rank's sequence slice, contiguous.
            out = b.t("scattered", local * h, BF16)
            b.fwd(Kernel("split", "elementwise", (b.t("slice", local * h, BF16),), (out,)))
            gathered = out
        y = gathered
    b.block.outputs.append(y)
    return b.finish()
