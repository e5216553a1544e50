"""Communication that Megatron-Core hides behind compute inside a layer.

Sequence parallelism, backward of a column-parallel linear (QKV, fc1):
``LinearWithGradAccumulationAndAsyncCommunication.backward``
(``megatron/core/tensor_parallel/layers.py``; Transformer Engine's ``_LayerNormLinear.backward``
does the same without userbuffers). The forward kept only this rank's sequence shard of the
input, so backward

1. issues the all-gather of the input shard (``async_op=True``) and runs the dgrad GEMM
   beside it;
2. waits for the gather, issues the reduce-scatter of the input gradient (``async_op=True``,
   the backward of the forward's all-gather) and runs the wgrad GEMM beside it;
3. waits for the reduce-scatter before the norm's backward needs the gradient.

``CUDA_DEVICE_MAX_CONNECTIONS=1`` (which Megatron requires for this) makes the collectives
start before the GEMM they overlap. PyTorch's NCCL process group orders each collective after
the work already queued on the compute stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sim.program.ir import Op

if TYPE_CHECKING:
    from sim.workload.layer_ops import Block, Kernel


def column_linear_backward(main: Op, dgrad_s: float, wgrad_s: float, gather: Op,
                           scatter: Op, make: Callable[..., Op]) -> list[Op]:
    """Split ``main`` (a block's backward ending with a column-parallel linear) into the
    rest, the linear's dgrad and its wgrad, with the input re-gather beside the dgrad and the
    gradient reduce-scatter beside the wgrad. ``gather`` and ``scatter`` are the two
    collectives on a communication stream; ``make(name, duration, **kw)`` builds a compute
    op like ``main``. Returns the ops in the order the host issues them; ``main``'s frees
    move to the wgrad, which ends the block's compute. The caller makes the next compute op
    wait for ``scatter`` (the handle's wait at the end of the linear's backward)."""
    dgrad_s = min(dgrad_s, main.duration)
    wgrad_s = min(wgrad_s, main.duration - dgrad_s)
    main.duration -= dgrad_s + wgrad_s
    gather.deps = [main]
    dgrad = make(f"{main.name} dgrad", dgrad_s)
    scatter.deps = [dgrad, gather]
    wgrad = make(f"{main.name} wgrad", wgrad_s, deps=[gather], free=main.free)
    main.free = ()
    return [main, gather, dgrad, scatter, wgrad]


def cp_ring(main: Op, before_s: float, core_s: float, cp: int, step_bytes: list[float],
            transfer: Callable[[float, int], Op], make: Callable[..., Op]) -> list[Op]:
    """Context parallelism as Transformer Engine's ``AttnFuncWithCPAndKVP2P`` runs it
    (``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``):
    attention in ``cp`` steps, each over the key/value chunk of one ring neighbour, the
    exchange for step i + 1 (``flash_attn_p2p_communicate``: send to the next rank, receive
    from the previous) issued at the start of step i and waited for before step i + 1. With
    the load-balanced causal split (each rank holds sequence chunks r and 2cp - 1 - r) every
    step does the same work: the diagonal step two causal halves and a full quarter, the
    others half of a full block. Forward sends K/V for cp - 1 steps; backward sends K/V at
    step 0, K/V with the accumulated dK/dV in the middle and dK/dV alone at the last step,
    waited for after the loop (``step_bytes``: one size per exchange).

    ``main`` (the block's compute) is split into the part before the core attention
    (``before_s``), the cp steps (``core_s`` in all) and the rest, which keeps ``main``'s
    frees. ``transfer(nbytes, i)`` builds exchange i; ``make(name, duration, **kw)`` a compute
    op like ``main``. Returns the ops in the order the host issues them."""
    before_s = min(before_s, main.duration)
    core_s = min(core_s, main.duration - before_s)
    rest_s = main.duration - before_s - core_s
    main.duration = before_s
    free, main.free = main.free, ()
    ops: list[Op] = [main]
    sent: list[Op] = []
    for i in range(cp):
        if i < len(step_bytes):
            x = transfer(step_bytes[i], i)
            x.deps = [sent[-1] if sent else main]
            ops.append(x)
            sent.append(x)
        ops.append(make(f"{main.name} cp step {i}", core_s / cp,
                        deps=[sent[i - 1]] if i > 0 else []))
    ops.append(make(f"{main.name} (after attention)", rest_s, free=free,
                    deps=[sent[-1]] if len(step_bytes) >= cp else []))
    return ops


# Transformer Engine's userbuffers overlap (``tp_comm_overlap``; Megatron-LM's
# ``validate_args`` requires sequence parallelism for it). NeMo's Llama 3 userbuffer configs
# (``TransformerLayerTPOverlapCfg`` in nemo/collections/llm/recipes/tp_overlap_configs) run
# the forward all-gathers before QKV and fc1 and the backward all-gathers before the output
# projection's and fc2's dgrad as ring exchanges (``RingExchangeOverlapCfg``: the GEMM runs in
# tp chunks, chunk i on the shard that arrived in exchange step i, the local shard first), and
# the forward reduce-scatters after the output projection and fc2 as pipelined overlaps
# (``PipelineOverlapCfg``, ``num_splits`` 4: the GEMM in 4 row chunks, each chunk's
# reduce-scatter beside the next chunk's GEMM). The column-parallel backward (QKV, fc1) uses
# bulk overlaps, the same shape as :func:`column_linear_backward`.
TE_PIPELINE_SPLITS = 4
"""Row chunks of a pipelined GEMM + reduce-scatter (``PipelineOverlapCfg.num_splits``, 4 in
NeMo's H100 and B200 configs and in Transformer Engine's ``initialize_ub`` defaults)."""
UB_FP8_BYTES = 1
"""Bytes per element of an FP8 userbuffers all-gather (``torch.uint8`` buffers)."""


def userbuffers_gather_bytes(nbytes: float, act_bytes: int, fp8: bool) -> float:
    """Bytes a userbuffers all-gather of ``nbytes`` of 16-bit activations moves.

    Transformer Engine's ``initialize_ub`` (``transformer_engine/pytorch/module/base.py``)
    gives every all-gather buffer (``layers_all_gather_overlap``: ``qkv_fprop``, ``fc1_fprop``,
    ``proj_dgrad``, ``fc2_dgrad`` and the bulk ``qkv_dgrad`` / ``fc1_dgrad`` input re-gathers)
    an FP8 ``uint8`` buffer under FP8 training, and ``fill_userbuffers_buffer_for_all_gather``
    quantizes the local shard before the exchange (the norm output with the input quantizer
    in forward, the output gradient with the grad-output quantizer in ``grad_output_preprocess``
    for the row-parallel dgrad): one byte per element. The reduce-scatter buffers
    (``proj_fprop``, ``fc2_fprop``, ``qkv_wgrad``, ``fc1_wgrad``) keep the activation dtype
    unless a user config sets ``fp8_buf`` on a pipelined one (not modelled: TE's default)."""
    return nbytes / act_bytes * UB_FP8_BYTES if fp8 else nbytes


def te_sp_gather_bytes(nbytes: float, act_bytes: int, fp8: bool, hp_bytes: float = 0.0
                       ) -> float:
    """Bytes a sequence-parallel all-gather of ``nbytes`` of 16-bit activations moves through
    NCCL (no userbuffers) when a Transformer Engine linear issues it; ``hp_bytes`` of them are
    gathered by Megatron itself and keep 16 bits.

    Under FP8 Transformer Engine quantizes before it gathers. TE 1.x: ``Linear`` casts its
    input with ``cast_to_fp8`` (no fused transpose under sequence parallelism) and
    ``LayerNormLinear`` / ``LayerNormMLP`` write the norm output as ``uint8`` before
    ``gather_along_first_dim`` (``transformer_engine/pytorch/module/linear.py``,
    ``layernorm_linear.py``, ``layernorm_mlp.py``, v1.13); the backward re-gathers the saved FP8
    input for wgrad, and ``grad_output_preprocess`` (``module/base.py``) casts the row-parallel
    linear's output gradient before gathering it ("FP8 case with gather"). TE 2.x does the same
    through quantizers: ``gather_along_first_dim(..., quantizer=...)`` sends ``Float8Quantizer``
    (delayed) and, from v2.2, ``Float8CurrentScalingQuantizer`` (tensorwise) inputs to
    ``_all_gather_fp8`` (``transformer_engine/pytorch/distributed.py``), which all-gathers the
    ``uint8`` data and keeps the one per-tensor scale (4 bytes, not counted). So the forward input
    gathers of the column-parallel linears (QKV, fc1), their backward input re-gathers and the
    backward output-gradient gathers of the row-parallel linears (proj, fc2) move one byte per
    element. The reduce-scatters (the row-parallel output forward, the column-parallel dgrad
    backward) reduce GEMM outputs in 16 bits: unchanged. Megatron's own gathers (MLA's shared
    rotary key, ``gather_from_sequence_parallel_region`` in ``multi_latent_attention.py``) keep
    16 bits: ``hp_bytes``."""
    if not fp8:
        return nbytes
    return (nbytes - hp_bytes) / act_bytes * UB_FP8_BYTES + hp_bytes


TE_AMAX_BYTES = 4
"""One fp32 amax, all-reduced (MAX) over the tensor-parallel group."""


def amax_reductions(fp8: str | None, sp: bool) -> bool:
    """Whether Transformer Engine all-reduces an amax before each quantize-then-gather.

    Current scaling (``Float8CurrentScaling``, Megatron's ``--fp8-recipe tensorwise``) takes
    each tensor's scale from its own amax; a gathered FP8 tensor carries one scale, so under
    sequence parallelism TE makes the shards agree first: the column-parallel linears' input
    quantizer and the row-parallel linears' grad-output quantizer get
    ``with_amax_reduction`` over the tensor-parallel group
    (``_customize_quantizers_float8_current_scaling`` in ``module/linear.py`` and
    ``layernorm_linear.py``, TE 2.2 to 2.17; ``set_quantizer_amax_reduction_group`` in 2.18),
    and the quantize all-reduces the amax before it casts (``csrc/quantizer.cpp``:
    ``amax_reduction_group->allreduce(...)->wait()``). Delayed scaling reads the scale from
    the amax history: no reduction in the layer. The backward input re-gather sends the
    saved, already quantized shard: none either."""
    return fp8 == "tensorwise" and sp


def _cut(main: Op, seconds: float) -> float:
    """Take ``seconds`` off ``main``; return the share of its FLOPs that goes with them."""
    share = seconds / main.duration if main.duration > 0 else 0.0
    flops = main.flops * share
    main.duration -= seconds
    main.flops -= flops
    return flops


def ring_exchange_gather(main: Op, before_s: float, gemm_s: float, tp: int, gather: Op,
                         after: Op, make: Callable[..., Op]) -> list[Op]:
    """An all-gather as Transformer Engine's ring exchange overlaps it with the GEMM that
    consumes it.

    ``main`` starts with ``before_s`` of other kernels (FP8 casts), then that GEMM
    (``gemm_s``). The gather leaves once ``after`` (the op that produced its input, a norm)
    is done; the GEMM's first ``tp - 1`` chunks run beside the exchange (each on a shard that
    has arrived: the local one first), and the last chunk, with everything after it, waits
    for the whole exchange. So the block costs ``max(gemm (tp-1)/tp, gather) + gemm/tp`` plus
    the rest, never less than the GEMM. Returns the ops in issue order; the new head op takes
    ``main``'s allocation and host time, ``main`` keeps its frees."""
    head_s = min(main.duration, before_s + gemm_s * (tp - 1) / tp)
    gather.deps = [after]
    flops = _cut(main, head_s)
    head = make(f"{main.name} (ring-exchange chunks)", head_s, alloc=main.alloc,
                cpu_s=main.cpu_s, flops=flops)
    main.alloc, main.cpu_s = (), 0.0
    main.deps = list(main.deps) + [gather]
    return [gather, head, main]


def pipelined_scatter(main: Op, gemm_s: float, after_s: float, body: Op, tail: Op,
                      make: Callable[..., Op], done_name: str,
                      splits: int = TE_PIPELINE_SPLITS) -> list[Op]:
    """A reduce-scatter as Transformer Engine's pipelined overlap runs it beside the GEMM that
    produces it.

    ``main`` ends with that GEMM (``gemm_s``) and ``after_s`` of kernels that use the
    scattered output (bias-dropout-add). The GEMM runs in ``splits`` row chunks; the
    reduce-scatter of the first ``splits - 1`` chunks (``body``; the caller sizes it) runs
    beside the GEMM's later chunks, the last chunk's (``tail``) after the GEMM, and the
    kernels after it (``done_name``) wait for ``tail``. Returns the ops in issue order; the
    last op takes ``main``'s frees."""
    rest_s = min(main.duration, gemm_s * (splits - 1) / splits + after_s)
    after_s = min(after_s, rest_s)
    gemm_flops = _cut(main, rest_s - after_s)
    after_flops = _cut(main, after_s)
    body.deps = [main]
    gemm_rest = make(f"{main.name} (pipelined chunks)", rest_s - after_s, flops=gemm_flops)
    tail.deps = [gemm_rest]
    done = make(done_name, after_s, deps=[tail], free=main.free, flops=after_flops)
    main.free = ()
    return [main, body, gemm_rest, tail, done]


def userbuffer_gemm_spans(blocks: dict[str, Block], seconds: Callable[[Kernel], float]
                          ) -> dict[tuple[str, str], tuple[float, float, float, float]]:
    """Where the overlapped GEMMs sit in each block's kernels, keyed by the block's op names
    (:attr:`sim.frameworks.megatron.layer.BlockSpec.names`: ``(pre, main)`` forward,
    ``(main, pre)`` backward):
    ``(seconds before, seconds of)`` the GEMM that consumes the block's all-gather (forward
    QKV and fc1; backward the output projection's and fc2's dgrad) and ``(seconds of,
    seconds after)`` the GEMM whose output the forward reduce-scatters (the output projection,
    fc2; zero in backward, where the column-parallel linears' bulk overlap applies)."""
    spans: dict[tuple[str, str], tuple[float, float, float, float]] = {}
    for names, blk, backward, first, last in (
            (("norm", "attention"), "attn_main", False, "qkv.fwd", "proj.fwd"),
            (("norm", "mlp"), "mlp_main", False, "fc1.fwd", "fc2.fwd"),
            (("attention", "norm"), "attn_main", True, "proj.dgrad", None),
            (("mlp", "norm"), "mlp_main", True, "fc2.dgrad", None)):
        ks = blocks[blk].backward if backward else blocks[blk].forward
        ts = [seconds(k) for k in ks]
        order = [k.name for k in ks]
        i = order.index(first)
        j = order.index(last) if last else len(ks)
        spans[names] = (sum(ts[:i]), ts[i], ts[j] if last else 0.0, sum(ts[j + 1:]))
    return spans
