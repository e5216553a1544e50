"""FSDP2's CPU offload (``CPUOffloadPolicy``): sharded fp32 parameters, gradients and optimizer
states stay in pinned host memory.

Each all-gather's input is first copied to the GPU (``FSDPParam.all_gather_inputs``:
``.to(device, non_blocking=True)``, then cast to param_dtype) on the all-gather copy-in
stream; after each reduce the fp32 reduced shard is copied to the host on the post-reduce
stream (``foreach_reduce``: non-blocking into pinned memory for the first gradient, blocking
and added on the CPU when accumulating). The backward ends by waiting for those copies
(``finalize_backward``) and ``torch.optim.AdamW`` steps the CPU tensors
(:func:`sim.hardware.host.cpu_adam_s`, one thread per rank under torchrun).
"""

from __future__ import annotations

from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.units import Unit
from sim.hardware.host import cpu_adam_s, cpu_pass_s
from sim.program.ir import CPU_STREAM, Op
from sim.workload.layer_ops import FP32


def h2d_params(stage: Stage, u: Unit, deps: list[Op], mb: int, phase: str) -> Op:
    """The fp32 shard of a unit copied to the GPU on the all-gather copy-in stream, before it
    is cast and gathered."""
    job = stage.job
    nbytes = FP32 * u.numel / job.n_shard
    return stage.add(Op(
        name=f"H2D params {u.name} ({phase}) mb{mb}", kind="copy",
        stream="ag-copy-in", phase="comm", deps=list(deps), host_transfer="h2d",
        nbytes=nbytes, category="copy", micro_batch=mb,
        transient=nbytes))


def offload_grad(stage: Stage, u: Unit, post: Op, mb: int, first_grad: bool) -> None:
    """The reduced shard, cast to fp32, is copied to pinned host memory on the
    post-reduce stream: non-blocking for a step's first gradient; when accumulating onto
    the host gradient the copy blocks the host, which then adds on the CPU."""
    job = stage.job
    host = job.host
    assert host is not None
    nbytes = FP32 * u.numel / job.n_shard
    d2h = stage.add(Op(
        name=f"D2H grads {u.name} mb{mb}", kind="copy", stream=post.stream, phase="comm",
        deps=[post], host_transfer="d2h", nbytes=nbytes, category="copy", micro_batch=mb,
        host_sync=not first_grad))
    stage.offloads.append(d2h)
    if not first_grad:
        # grad += new on CPU tensors: read both, write one (12 B per parameter), one
        # thread under torchrun.
        stage.offloads.append(stage.add(Op(
            name=f"CPU grad += {u.name} mb{mb}", kind="host", stream=CPU_STREAM,
            phase="bwd", deps=[d2h], category="copy", micro_batch=mb, host_sync=True,
            duration=cpu_pass_s(host, 3 * nbytes, "torch"))))


def cpu_optimizer_step(stage: Stage, last: list[Op], local: float) -> None:
    """finalize_backward: the host waits for every gradient copy, then torch.optim.AdamW
    steps the fp32 shard (``local`` parameters) in host memory."""
    host = stage.job.host
    assert host is not None
    sync = stage.add(Op(name="wait gradient offload", kind="compute", stream="compute",
                        phase="optimizer", deps=last + stage.offloads, host_sync=True,
                        category="optimizer"))
    stage.add(Op(name="optimizer step (AdamW on CPU, local shard)", kind="host",
                 stream=CPU_STREAM, phase="optimizer", deps=[sync],
                 duration=cpu_adam_s(host, local, "torch"), category="optimizer"))
