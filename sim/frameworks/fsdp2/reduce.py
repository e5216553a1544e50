"""FSDP2's gradient reduction of one unit (``post_backward`` -> ``foreach_reduce``): copy-in
into a reduce_dtype buffer, reduce-scatter over the FSDP mesh, HSDP all-reduce, offload.

* After the unit's backward its gradients are copied into a reduce_dtype buffer on the compute
  stream (``foreach_reduce_scatter_copy_in``) and reduce-scattered on the reduce-scatter
  stream; that copy-in waits until the previous reduce-scatter has finished (one
  ``ReduceScatterState``).
* HSDP (``hsdp_shard_size`` = s): a 2-D mesh (dp/s replicas x s shards, consecutive ranks
  shard together). Right after each reduce-scatter ``foreach_reduce`` all-reduces the reduced
  shard across the replicas on its own ``all_reduce_stream`` (which waits for the
  reduce-scatter stream; "run the HSDP all-reduces concurrently with all-gather/reduce-scatter
  since collectives use different network resources", ``FSDPCommContext.lazy_init``). The next
  micro-batch's post-backward of the same unit, and the optimizer, wait for that all-reduce
  (``_wait_for_post_backward``).
* Tensor parallelism: the sequence-parallel norms' weights are replicated and their gradients
  come out Partial: post_backward all-reduces each over the tensor-parallel group before the
  copy-in (``FSDPParam._get_grad_inner_tensor`` redistributes to Replicate).
"""

from __future__ import annotations

from sim.frameworks.fsdp2.offload import offload_grad
from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.units import RS, Unit
from sim.program.ir import Op
from sim.workload.layer_ops import BF16


def reduce(stage: Stage, u: Unit, grads: float, mb: int, deps: list[Op], free_params: bool,
           first_grad: bool) -> None:
    """post_backward -> foreach_reduce: copy-in, reduce-scatter, HSDP all-reduce,
    offload of the reduced shard."""
    job, cm = stage.job, stage.job.ctx.compute
    rb = job.rbytes
    deps = list(deps)
    if stage.last_rs is not None:
        deps.append(stage.last_rs)
    if u.name in stage.last_ar:
        deps.append(stage.last_ar[u.name])
    sizes = (job.ctx.model.hidden,) * u.partial_grads + u.partial_extra
    for i, size in enumerate(sizes):
        # Each replicated norm weight's gradient, in the dtype it is held in.
        held = BF16 if job.pp == 1 else rb
        stage.add(stage.tp_op("all_reduce", float(held * size),
                              f"tp all_reduce norm grad {i} {u.name} mb{mb}", mb, None,
                              dtype="bf16" if job.pp == 1 else job.reduce_dtype))
    frees: tuple[tuple[str, float], ...] = (("gradients", grads),)
    if free_params:
        frees += (("parameters", job.param_bytes(u)),)
    deps += drop_reduce_scatter_state(stage, mb)
    copy_in = stage.add(Op(
        name=f"copy-in grads {u.name} mb{mb}", kind="compute", stream="compute",
        phase="bwd", deps=deps, duration=cm.membound_time(grads + rb * u.numel),
        category="copy", alloc=(("buffers", rb * u.numel),), free=frees,
        micro_batch=mb))
    if job.shard_size(u) > 1:
        groups = stage.groups_of(u)
        rs = stage.add(Op(
            name=f"{RS} {u.name} mb{mb}", kind="collective", stream="rs", phase="comm",
            deps=[copy_in], collective="reduce_scatter", group=groups[0],
            groups=groups, nbytes=rb * u.numel, dtype=job.reduce_dtype,
            key=stage.key(f"rs/{u.name}/{mb}"), category="reduce_scatter",
            micro_batch=mb))
    else:
        # World size 1: the reduce-scatter is a copy (foreach_reduce).
        rs = stage.add(Op(name=f"reduce copy {u.name} mb{mb}", kind="compute",
                          stream="rs", phase="bwd", deps=[copy_in], category="copy",
                          duration=cm.membound_time(2 * rb * u.numel), micro_batch=mb))
    stage.last_rs = rs
    stage.rs_held = rb * u.numel
    stage.reduces.append(rs)
    post = rs
    if job.mesh.replicate > 1:
        post = hsdp_all_reduce(stage, u, rs, mb)
    if job.host is not None:
        offload_grad(stage, u, post, mb, first_grad)


def hsdp_all_reduce(stage: Stage, u: Unit, rs: Op, mb: int) -> Op:
    """HSDP: the reduced shard all-reduced across the replicas, on its own stream, after the
    reduce-scatter; the unit's next post-backward and the optimizer wait for it."""
    job = stage.job
    post = stage.add(Op(
        name=f"all-reduce {u.name} mb{mb}", kind="collective", stream="ar",
        phase="comm", deps=[rs], collective="all_reduce", group=stage.rep_groups[0],
        groups=stage.rep_groups, nbytes=job.rbytes * u.numel / job.shard_size(u),
        dtype=job.reduce_dtype,
        key=stage.key(f"ar/{u.name}/{mb}"), category="all_reduce", micro_batch=mb))
    stage.last_ar[u.name] = post
    stage.reduces.append(post)
    return post


def drop_reduce_scatter_state(stage: Stage, mb: int) -> list[Op]:
    """The compute stream waits for the last reduce-scatter and drops its
    ``ReduceScatterState``, releasing the reduce-scatter input (``foreach_reduce``
    allocates it on the compute stream and returns it, so it is not freed when the
    collective ends): at the next unit's ``post_backward`` or in ``finalize_backward``
    at the end of each backward (``_fsdp_param_group.py``, ``_fsdp_state.py``)."""
    if not stage.rs_held or stage.last_rs is None:
        return []
    op = stage.add(Op(name=f"wait reduce-scatter (drop state) mb{mb}", kind="compute",
                      stream="compute", phase="bwd", deps=[stage.last_rs],
                      free=(("buffers", stage.rs_held),), category="copy", micro_batch=mb))
    stage.rs_held = 0.0
    return [op]
