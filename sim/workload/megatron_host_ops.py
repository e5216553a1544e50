"""Host (CPU) calls of a Megatron-LM transformer layer's blocks, and what they cost.

The engine starts an op only once the host has issued it; Megatron's host time is its
Python-level calls per block (:data:`PYTHON_OPS` for its local layers, :data:`PYTHON_OPS_TE`
for Transformer Engine's) times a per-call cost: for the local layers the one Megatron's
builder fits (``sim.frameworks.megatron.build.MEGATRON_CPU_S_PER_OP``), for Transformer
Engine's a TE module call on the job's host (:func:`sim.hardware.host.te_module_call_cpu_s`).
A backward autograd node of a
plain torch op costs half a call; the Python ``backward`` body of a Transformer Engine Function
costs :data:`TE_BWD_OVER_FWD` calls (:func:`backward_host_s`). The MoE layer's calls are
counted the same way in :mod:`sim.workload.moe_host_ops`.
"""

from __future__ import annotations

from sim.workload.megatron_ops import WINDOWED
from sim.workload.model import ModelSpec

# Python-level torch operations Megatron issues per block (forward ops; backward autograd
# nodes), counted from Megatron's layer code (ParallelTransformerLayer, ParallelAttention,
# CoreAttention, ParallelMLP; Megatron-DeepSpeed and megatron/core local spec): attention =
# QKV ColumnParallelLinear (copy-to-region + linear), view and split, core attention (views
# and transposes, baddbmm, view, fused softmax with its views, the CUDA RNG tracker's state
# save/restore around dropout, dropout, bmm, permute/contiguous/view), RowParallelLinear
# (linear + all-reduce), bias expand + fused bias-dropout-add; MLP = two linears with their
# region functions, fused bias-GeLU, bias-dropout-add. Many are views that launch no kernel
# but cost the CPU as much; a tiny layer is bound by them.
PYTHON_OPS = {"attn_pre": (1, 1), "attn_main": (30, 24), "mlp_pre": (1, 1),
              "mlp_main": (7, 6), "embed": (10, 5), "head": (16, 8)}
# With Transformer Engine (megatron/core/extensions/transformer_engine.py) a layer is a few
# module calls: fused LayerNorm+QKV linear, rotary embedding, TE dot-product attention, row-
# parallel linear, bias-dropout-add; fused LayerNorm+fc1, activation, fc2, bias-dropout-add.
PYTHON_OPS_TE = {"attn_pre": (0, 0), "attn_main": (8, 6), "mlp_pre": (0, 0),
                 "mlp_main": (5, 4), "embed": (10, 5), "head": (16, 8)}
# Of PYTHON_OPS_TE's backward nodes, the Python ``backward`` bodies of Transformer Engine's
# autograd Functions: attention's _LayerNormLinear (QKV), FusedAttnFunc and _Linear (proj);
# the MLP's _LayerNormLinear (fc1) and _Linear (fc2). The other nodes (rotary, activation,
# bias-dropout-add) are light. Each such body costs TE_BWD_OVER_FWD module calls.
TE_FUNCTION_BWD = {"attn_main": 3, "mlp_main": 2}
# Multi-head Latent Attention's extra TE linears (kv down and kv up projections; a query
# latent's down and up projections replace the one query projection: one more).
MLA_TE_FUNCTION_BWD = 2
# A TE module's backward costs the host more than its forward, not less: TE's own CPU-time
# benchmark (NVIDIA/TransformerEngine PR 3523, 2026-09, GB200, CPU time only, before the
# PR's change) gives forward / forward + backward of 59.19 / 311.30 us (Linear, BF16),
# 83.48 / 397.73 (LayerNormLinear, BF16), 114.51 / 440.93 (Linear, MXFP8) and 135.42 /
# 518.67 (LayerNormLinear, MXFP8): backward over forward 4.26, 3.76, 2.85, 2.83, mean 3.43.
# The body re-derives the quantizers, checks every saved tensor, and calls general_gemm for
# dgrad and wgrad with their workspaces, where a plain torch op's node is one C++ kernel call
# (the /2 of PYTHON_OPS' nodes). A ratio of CPU times, so the host's speed cancels out.
TE_BWD_OVER_FWD = (311.30 / 59.19 - 1 + 397.73 / 83.48 - 1 + 440.93 / 114.51 - 1
                   + 518.67 / 135.42 - 1) / 4


# An FP8 Transformer Engine linear costs the host more than a 16-bit one: its quantizers are
# built and checked, its inputs quantized and their scales kept, in forward and backward alike.
# PR 3523's table above, MXFP8 over BF16, forward 114.51 / 59.19 (Linear) and 135.42 / 83.48
# (LayerNormLinear), backward (forward + backward less forward) 326.42 / 252.11 and 383.25 /
# 314.25: the means, a ratio of one host's CPU times, so the host's speed cancels out.
TE_FP8_FWD_OVER_BF16 = (114.51 / 59.19 + 135.42 / 83.48) / 2
TE_FP8_BWD_OVER_BF16 = ((440.93 - 114.51) / (311.30 - 59.19)
                        + (518.67 - 135.42) / (397.73 - 83.48)) / 2


def fp8_linear_host_s(linears: int, cpu_call: float) -> tuple[float, float]:
    """Host seconds (forward, backward) ``linears`` FP8 Transformer Engine linear modules cost
    beyond the same modules in 16 bits (a forward module call ``cpu_call``, a backward body
    :data:`TE_BWD_OVER_FWD` calls; :data:`TE_FP8_FWD_OVER_BF16`, :data:`TE_FP8_BWD_OVER_BF16`).

    Examples
    --------
    >>> round(TE_FP8_FWD_OVER_BF16, 3), round(TE_FP8_BWD_OVER_BF16, 3)
    (1.778, 1.257)
    >>> [round(x * 1e6, 1) for x in fp8_linear_host_s(2, 34e-6)]   # an attention block's two
    [52.9, 59.9]
    """
    return (linears * (TE_FP8_FWD_OVER_BF16 - 1.0) * cpu_call,
            linears * (TE_FP8_BWD_OVER_BF16 - 1.0) * TE_BWD_OVER_FWD * cpu_call)


def te_linears(m: ModelSpec, key: str) -> int:
    """Transformer Engine linear modules of block ``key`` (its Function bodies less the fused
    attention's; :func:`te_function_bwd`).

    >>> te_linears(ModelSpec.from_ref("llama3-8b"), "attn_main"), te_linears(
    ...     ModelSpec.from_ref("llama3-8b"), "mlp_main")
    (2, 2)
    """
    n = te_function_bwd(m, key)
    return n - 1 if key in ("attn_main", WINDOWED) and n else n


def backward_host_s(nodes: int, te_functions: int, cpu_call: float) -> float:
    """Host seconds of ``nodes`` backward autograd nodes, ``te_functions`` of them Python
    bodies of Transformer Engine Functions (:data:`TE_BWD_OVER_FWD` module calls each), the
    rest plain nodes at half a call (``cpu_call``: a forward module call's seconds).

    Examples
    --------
    >>> round(TE_BWD_OVER_FWD, 2)
    3.43
    >>> round(backward_host_s(6, 3, 34e-6) * 1e6, 1)   # a TE attention block's backward
    400.5
    """
    return (nodes - te_functions) * cpu_call / 2 + te_functions * cpu_call * TE_BWD_OVER_FWD


def te_function_bwd(m: ModelSpec, key: str) -> int:
    """Transformer Engine Function bodies among block ``key``'s backward nodes
    (:data:`TE_FUNCTION_BWD`, MLA's extra linears; a windowed attention block as any).

    Examples
    --------
    >>> te_function_bwd(ModelSpec.from_ref("llama3-8b"), "attn_main")
    3
    >>> te_function_bwd(ModelSpec.from_ref("deepseek-v3"), "attn_main")   # MLA, query latent
    6
    """
    if key == WINDOWED:
        key = "attn_main"
    n = TE_FUNCTION_BWD.get(key, 0)
    if key == "attn_main" and m.mla is not None:
        n += MLA_TE_FUNCTION_BWD + (1 if m.mla.q_lora_rank else 0)
    return n


# Qwen3's query and key norms (qk_layernorm): one module call each in forward, one autograd
# node each in backward (SelfAttention.get_query_key_value_tensors).
QK_NORM_OPS = (2, 2)


# Multi-head Latent Attention's calls beyond a TE layer's attention (MLASelfAttention.forward
# and get_query_key_value_tensors): q projection, kv down projection, its split, the latent
# norm, kv up projection, two views, unsqueeze, two splits, two rotary applications, expand,
# two concatenations, three contiguous copies, core attention, output projection and
# bias-dropout-add are 21 against PYTHON_OPS_TE's 8; a query latent adds its down projection
# and norm. As many autograd nodes in backward.
MLA_OPS = 13
MLA_Q_LATENT_OPS = 2
# With apply_rope_fusion the two splits, two rotary applications, the expand and the two
# concatenations (7 calls) are fused_apply_mla_rope_for_q and _for_kv (2 calls).
MLA_ROPE_FUSION_SAVED_OPS = 5


def python_ops(m: ModelSpec, legacy: bool, rope_fusion: bool = False
               ) -> dict[str, tuple[int, int]]:
    """Python-level (forward, backward) ops per block: :data:`PYTHON_OPS` for Megatron's
    local layers (``legacy``), :data:`PYTHON_OPS_TE` for Transformer Engine's, plus the
    query/key norms' or latent attention's calls when the model has them (fewer with MLA's
    fused rotary kernels, ``rope_fusion``)."""
    ops = dict(PYTHON_OPS if legacy else PYTHON_OPS_TE)
    extra = (QK_NORM_OPS[0], QK_NORM_OPS[1]) if m.qk_norm else (0, 0)
    if m.mla is not None:
        n = MLA_OPS + (MLA_Q_LATENT_OPS if m.mla.q_lora_rank else 0) \
            - (MLA_ROPE_FUSION_SAVED_OPS if rope_fusion else 0)
        extra = (extra[0] + n, extra[1] + n)
    f, b = ops["attn_main"]
    ops["attn_main"] = (f + extra[0], b + extra[1])
    # A sliding-window layer makes the same module calls (the window is a kernel argument).
    ops[WINDOWED] = ops["attn_main"]
    return ops


# Extra ops of a checkpointed layer's recompute: RNG states saved and restored (CPU and
# CUDA), inputs detached (megatron/core/tensor_parallel/random.py CheckpointFunction).
CHECKPOINT_OPS = 6
