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

from sim.program import Op


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
