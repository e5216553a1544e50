"""Host (CPU) time of DeepSpeed's Python around the kernels, and of its CPU optimizer passes.

Model kernels are issued eagerly (:mod:`sim.hardware.compute`'s per-op costs as
``Op.cpu_s``, the GPU time as the duration), so a step can be bound by the host. Stage 3 adds
its Python: every submodule's four hooks (forward pre/post, and the autograd functions that
trigger the backward pre/post hooks), each waited parameter, each gather issued and split,
each parameter freed and each gradient hook. No measured figure was found for these; the
constants below are derived from the calls the code makes (about 90 us for a prefetched
``nn.Linear``'s forward fetch, wait and release, 55 us for a container module), and are an
estimate. Host waits the code makes (event and stream synchronisations, ``.item()``, blocking
copies, hpZ's ``synchronize``) are ops with ``host_sync``.
"""

from __future__ import annotations

from sim.hardware.compute import EAGER_FWD_OP_CPU_S, VIEW_CPU_S
from sim.hardware.host import HostSpec, cpu_pass_s

# Host (CPU) cost of DeepSpeed's Python around the kernels. No published per-hook measurement
# was found (PR #6694 only reports that coalescing halves fetch/release CPU time); these are
# derived from the work the code does, counting its calls:
TORCH_CALL_CPU_S = EAGER_FWD_OP_CPU_S
"""A torch call through the dispatcher (torch.empty, cat, copy_, all_gather_into_tensor,
autograd.Function.apply): the project's eager per-op cost (sim.hardware.compute)."""
CUDA_API_CPU_S = 3e-6
"""A stream or event call from Python (torch.cuda.Event(), record, query, wait_stream,
entering or leaving a stream context): a CUDA runtime call of one to a few microseconds plus
the binding; an estimate, not a measurement."""
RECORD_STREAM_CPU_S = 1.5e-6
"""Tensor.record_stream: the caching allocator notes the stream under its mutex; no CUDA
call; an estimate."""
HOOK_PY_CPU_S = 15e-6
"""Pure-Python bookkeeping of one coordinator entry point (frozenset of the module's
parameters, dict/deque/set work, nested calls behind logger guards); an estimate."""


# Host seconds of the coordinator's entry points (see the constants above for the units).
def _fetch_call_cpu(forward: bool) -> float:
    # fetch_sub_module: iter_params/frozenset, trace bookkeeping, wait_stream (record + wait);
    # forward: _post_backward_module_hook applies PostBackwardFunctionModule to the inputs.
    return HOOK_PY_CPU_S + 2 * CUDA_API_CPU_S + (TORCH_CALL_CPU_S if forward else 0.0)


WAIT_CPU_S = TORCH_CALL_CPU_S + 5 * CUDA_API_CPU_S
"""Per waited parameter: stream context enter/exit, events query, handle.wait (work.wait),
Event() + record."""


def _release_call_cpu(forward: bool) -> float:
    # release_sub_module (+ _pre_backward_module_hook applying PreBackwardFunctionForModule to
    # the outputs in forward).
    return HOOK_PY_CPU_S + (TORCH_CALL_CPU_S if forward else 0.0)


FREE_PARAM_CPU_S = TORCH_CALL_CPU_S + RECORD_STREAM_CPU_S
"""free_param: record_stream + torch.empty(0)."""
GRAD_HOOK_CPU_S = (HOOK_PY_CPU_S + 4 * CUDA_API_CPU_S + RECORD_STREAM_CPU_S + 2 * VIEW_CPU_S
                   + TORCH_CALL_CPU_S)
"""reduce_partition_and_remove_grads -> __add_grad_to_ipg_bucket: wait_stream, stream context,
narrow/view_as, copy_, record_stream."""


def _host_pass_s(host: HostSpec, nbytes: float) -> float:
    """A memory-bound pass of DeepSpeed's CPU optimizer threads over ``nbytes`` of host
    memory (:func:`sim.hardware.host.cpu_pass_s`)."""
    return cpu_pass_s(host, nbytes, "deepspeed")
