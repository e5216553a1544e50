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
    move to the wgrad, which ends the block's compute."""
    dgrad_s = min(dgrad_s, main.duration)
    wgrad_s = min(wgrad_s, main.duration - dgrad_s)
    main.duration -= dgrad_s + wgrad_s
    gather.deps = [main]
    dgrad = make(f"{main.name} dgrad", dgrad_s)
    scatter.deps = [dgrad, gather]
    wgrad = make(f"{main.name} wgrad", wgrad_s, deps=[gather], free=main.free)
    main.free = ()
    join = make(f"wait {scatter.name}", 0.0, deps=[scatter])
    join.kernels = 0
    return [main, gather, dgrad, scatter, wgrad, join]
