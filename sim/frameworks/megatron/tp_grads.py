"""The tensor-parallel all-reduce of replicated parameters' gradients at the end of a step.

A parameter every tensor-parallel rank holds whole (not split over tp) gets only a partial
gradient on each rank when the ranks see different inputs: under sequence parallelism each
rank runs the layer norms, MLA's down projections and the router on its own ``s / tp``
tokens, and per-head query/key norms see only the rank's heads. Megatron-Core's
``finalize_model_grads`` (megatron/core/distributed/finalize_model_grads.py), after every
model chunk's ``finish_grad_sync`` (the data-parallel reduces) and before the embedding
all-reduce and the optimizer, sums them in ``_allreduce_layernorm_grads`` (newer:
``_allreduce_non_tensor_model_parallel_grads``): with tp > 1 it flattens the gradients of

* every parameter marked ``sequence_parallel`` when ``config.sequence_parallel`` is on: the
  norms (Transformer Engine's fused ``layer_norm_weight`` / ``TENorm``, ``FusedLayerNorm``
  set the attribute from the config), the duplicated linears (``TELinear`` with
  ``parallel_mode="duplicated"``, MLA's ``linear_q_down_proj`` and ``linear_kv_down_proj``:
  "Reduce the gradient further on the TP group since the weight is duplicated across TP
  ranks"), the router (``TopKRouter``: weight, and bias when the linears have one) and
  row-parallel biases (``RowParallelLinear``);
* with ``qk_layernorm``, every parameter whose name holds ``q_layernorm`` or ``k_layernorm``
  (Qwen3's per-head query/key norms, MLA's query-latent norm; MLA's ``kv_layernorm`` does
  not match), with or without sequence parallelism,

into one buffer (``_flatten_dense_tensors``) and all-reduces it over the tensor-parallel
group in one call (``torch.distributed.all_reduce``, synchronous: on the compute stream's
order). The gradients are the ``main_grad`` buffers (fp32 with ``grad_reduce_in_fp32``).
Routed experts' parameters are expert-parallel (``allreduce=False``, no such attribute) and
DeepSeek's ``expert_bias`` is a buffer, so neither is in it; embeddings and the output layer
are vocab-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.model import ModelSpec

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape


def layer_replicated_params(m: ModelSpec, moe_layer: bool, sp: bool) -> int:
    """Replicated parameters of one transformer layer that the all-reduce carries (tp > 1):
    with sequence parallelism its two norms, MLA's down projections and latent norms,
    per-head query/key norms, the router of an MoE layer and the row-parallel biases;
    without, only the ``q_layernorm`` / ``k_layernorm`` names.

    Examples
    --------
    >>> from sim.workload.model import ModelSpec
    >>> v3 = ModelSpec.from_ref("deepseek-v3")
    >>> layer_replicated_params(v3, True, True)   # 2 norms, q/kv down, latent norms, router
    16990208
    >>> layer_replicated_params(v3, True, False)  # the query-latent norm alone
    1536
    """
    h = m.hidden
    qk = 2 * m.head_dim if m.qk_norm else 0
    mla = m.mla
    if not sp:
        return qk + ((mla.q_lora_rank or 0) if mla is not None else 0)
    n = 2 * m.norm_params + qk
    if mla is not None:
        n += h * (mla.q_lora_rank or 0) + h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        n += mla.norm_params
    if m.bias:
        n += h     # the attention output projection's bias (row-parallel)
    if moe_layer:
        assert m.moe is not None
        n += m.moe.experts * h + (m.moe.experts if m.bias else 0)
    elif m.bias:
        n += h     # fc2's bias (row-parallel)
    return n


def stage_replicated_params(s: MegatronShape, st: int) -> int:
    """Parameters pipeline stage ``st`` all-reduces over its tensor-parallel group per step:
    its layers' (:func:`layer_replicated_params`), with sequence parallelism the final norm
    on the last stage, and the multi-token prediction modules' there (``enorm``, ``hnorm``,
    their layer, their final norm; ``eh_proj`` is column-parallel). 0 with tp = 1."""
    if s.t == 1:
        return 0
    m = s.model

    def is_moe(layer: int) -> bool:
        return s.moe is not None and s.moe.is_moe(layer)

    n = sum(layer_replicated_params(m, is_moe(la), s.sp) for la in s.stage_layers(st))
    for _ in range(s.place.lasts(st)):
        if s.sp:
            n += m.norm_params
        if s.mtp is not None:
            for la in s.mtp.layers:
                n += layer_replicated_params(m, is_moe(la), s.sp) + \
                    (3 * m.norm_params if s.sp else 0)
    return n
