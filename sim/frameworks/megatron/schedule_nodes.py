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

Each call is priced at Megatron's per Python-level torch op host time (``cpu_call``,
:data:`sim.frameworks.megatron.build.MEGATRON_CPU_S_PER_OP`), the unit the layers' own host
time is counted in; these calls are Python in both passes, so the backward ones are not the
C++ autograd engine's half price.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def node_host(cpu_call: float, fp8: bool) -> NodeHost:
    """The wrapper's host seconds per node at ``cpu_call`` seconds a torch call.

    >>> h = node_host(34e-6, fp8=True)
    >>> round(h.fwd_s * 1e6), round(h.bwd_s * 1e6)
    (272, 272)
    >>> round(node_host(34e-6, fp8=False).fwd_s * 1e6)
    204
    """
    fwd = FWD_NODE_CALLS + (FP8_CONTEXT_CALLS if fp8 else 0)
    return NodeHost(fwd * cpu_call, BWD_NODE_CALLS * cpu_call)
