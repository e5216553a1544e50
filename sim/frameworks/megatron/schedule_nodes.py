"""The host cost of the combined 1F1B's schedule nodes (``moe_a2a_overlap``).

Megatron-Core's combined 1F1B (:mod:`sim.frameworks.megatron.a2a_overlap`) runs each layer as
separate schedule nodes, each a Python object that wraps its sub-module with its own stream
and event bookkeeping and, in backward, its own autograd call. Plain 1F1B runs the same
sub-modules without that wrapper, so the wrapper's calls are host time the combined schedule
adds on top of the layer's own (NVIDIA/Megatron-LM @ core_v0.14.0, the core of the
Megatron-Bridge 25.09 and 25.11 containers):

* ``pipeline_parallel/utils.py`` ``ScheduleNode._forward``: ``stream_acquire_context`` (the
  chunk's ``event.wait(stream)`` on entry, ``event.record(stream)`` on exit), the
  ``torch.cuda.stream(self.stream)`` context (set the current stream, set it back), the
  input's ``make_viewless(e).detach()`` and its ``requires_grad`` copy: six torch calls.
* ``ScheduleNode._backward`` with ``TransformerLayerNode.backward_impl``
  (``models/gpt/fine_grained_callables.py``): the same event wait, record and stream switch
  (four), the detached inputs' ``.grad`` reads, one ``Variable._execution_engine.run_backward``
  per node (a separate autograd graph task for each node instead of one per micro-batch),
  ``record_stream`` of the output gradient and ``get_grad``'s read of the input's ``.grad``:
  eight.
* With FP8 each forward node runs inside the layer's ``get_fp8_context()``
  (``TransformerLayerSchedulePlan.run``: ``with f_layer.get_fp8_context()`` around every
  forward node): Transformer Engine's ``fp8_autocast`` enter and exit, two more.

NVTX ranges (``range_push``/``range_pop``) are left out: without a profiler attached they
return at once. A node with no ops (``NoopScheduleNode``: a dense layer's dispatch, combine
and ``post_attn``, a layer without MTP's ``mtp_post_process``) has none of this.

Each call is a plain torch-level call (an event, a stream switch, a view, a ``.grad`` read,
one autograd-engine entry) and is priced as :mod:`sim.workload.moe_host_ops` prices one, at
an eager PyTorch op's host time (:data:`sim.hardware.compute.EAGER_FWD_OP_CPU_S`), in both
passes since the backward wrapper is Python too (not the C++ autograd engine's lower rate).
Not at ``MEGATRON_CPU_S_PER_OP`` (34 us): that unit is a whole layer op with its module
wrappers, fitted on vTrain. Priced at it, an ``event.record`` cost 34 us and a MoE layer's
forward-backward pair (5 + 5 nodes, 70 calls in bf16) 2.4 ms of host time, 6.5 ms on Grace
(x 2.75, ``GRACE_CPU_OP_FACTOR``): the MoE report's Qwen3-235B on 256 GB200 went host-bound,
its step 21.3 -> 28.3 s. At the eager rate: 0.7 ms, 1.9 ms on Grace.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.hardware.compute import EAGER_FWD_OP_CPU_S

FWD_NODE_CALLS = 6
"""Torch calls of one forward node's wrapper (``ScheduleNode._forward``, core_v0.14.0)."""
BWD_NODE_CALLS = 8
"""Torch calls of one backward node's wrapper (``ScheduleNode._backward`` and
``TransformerLayerNode.backward_impl``, core_v0.14.0)."""
FP8_CONTEXT_CALLS = 2
"""``fp8_autocast`` enter and exit around each forward node with FP8."""


@dataclass(frozen=True)
class NodeHost:
    """Host seconds one schedule node's wrapper costs, by pass."""

    fwd_s: float
    bwd_s: float

    def node_s(self, forward: bool) -> float:
        """Host seconds of one node's wrapper in the forward or the backward pass."""
        return self.fwd_s if forward else self.bwd_s


def node_host(fp8: bool) -> NodeHost:
    """The wrapper's host seconds per node, each call at an eager torch call's host time
    (:data:`~sim.hardware.compute.EAGER_FWD_OP_CPU_S`).

    >>> h = node_host(fp8=True)
    >>> round(h.fwd_s * 1e6), round(h.bwd_s * 1e6)
    (80, 80)
    >>> round(node_host(fp8=False).fwd_s * 1e6)
    60
    """
    fwd = FWD_NODE_CALLS + (FP8_CONTEXT_CALLS if fp8 else 0)
    return NodeHost(fwd * EAGER_FWD_OP_CPU_S, BWD_NODE_CALLS * EAGER_FWD_OP_CPU_S)
