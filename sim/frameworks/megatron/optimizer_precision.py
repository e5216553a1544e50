"""What Megatron-Core's optimizer keeps and moves per parameter: the precision-aware optimizer,
FP8 primary weights and the hybrid CPU/GPU optimizer (optimizer CPU offload).

Read from Megatron-Core (NVIDIA/Megatron-LM, ``megatron/core/optimizer``, the same in
core_v0.14.0 and main at d98e8a6) and Transformer Engine's ``FusedAdam``:

* **Default** (``use_precision_aware_optimizer`` off): the distributed optimizer (or
  ``Float16OptimizerWithFloat16Params``) keeps an fp32 main copy of its shard and Apex/TE
  ``FusedAdam`` fp32 ``exp_avg`` / ``exp_avg_sq``: 12 bytes a parameter. With 16-bit gradient
  buffers (``grad_reduce_in_fp32`` false) ``copy_group_grads`` gives each main shard an fp32
  gradient ``shard_model_grad.float()`` at the step; ``zero_grad(set_to_none=True)`` at the
  next step's start drops it, so those 4 bytes live only from the step to the next step's
  start, never beside the activations (the documented "16/d" of ``dist_optimizer.md`` is the
  step's peak).
* **Precision-aware** (``--use-precision-aware-optimizer``, TE's ``FusedAdam`` with
  ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: fp32 4, fp16/bf16 2, fp8 1 byte; the kernel
  computes in fp32 either way). ``OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_
  fp8`` is true unless the model runs an FP8 recipe other than delayed with fp32 main params:
  then TE holds the master weights (``master_weights=True``, ``master_weight_dtype``), reads the
  gradient buffer in place (``use_decoupled_grad``: no fp32 copy) and writes the 16-bit
  parameter itself; with fp32 master weights over bf16 parameters and
  ``store_param_remainders`` (default on) it stores only the 16 low bits the bf16 parameter
  lacks (2 bytes). Otherwise (FP8 tensorwise, blockwise, MXFP8 with fp32 main params) Megatron
  keeps the fp32 master (4 bytes) and the fp32 gradient copy as in the default, and only the
  moments shrink.
* **CPU offload** (``--optimizer-cpu-offload``, needs the precision-aware flag;
  ``cpu_offloading/hybrid_optimizer.py``): ``HybridDeviceOptimizer`` moves the first
  ``optimizer_offload_fraction`` of the shard's elements (in parameter order) to pinned host
  memory with ``param_update_in_fp32=True``: an fp32 parameter, an fp32 pinned gradient and
  ``torch.optim.AdamW(fused=True)``'s fp32 moments (16 bytes a parameter on the host, nothing
  on the GPU); the rest steps on the GPU in TE ``FusedAdam`` built without the dtype arguments
  (fp32 copy and moments, 12 bytes, and the fp32 gradient copy ``grad.to(fp32)``). At the
  step the gradients go device-to-host (non-blocking copies convert on the GPU: 4 bytes a
  parameter), AdamW steps them on the CPU, the updated fp32 parameters come back
  host-to-device (4 bytes, converted to 16 bits on the GPU). With
  ``overlap_cpu_optimizer_d2h_h2d`` each parameter has its own CPU optimizer and the copies
  run on their own streams, so the three stages pipeline; without it they run one after the
  other on the current stream.
* **FP8 primary weights** (``--fp8-param-gather``; Megatron-Bridge's
  ``bf16_with_fp8_current_scaling_mixed`` sets it): each linear weight is a TE
  ``Float8Tensor`` (1 byte), with no 16-bit copy; the distributed optimizer gathers it in FP8.
  TE keeps an FP8 transpose beside it only where the GPU cannot run non-TN FP8 GEMMs
  (``is_non_tn_fp8_gemm_supported``: compute capability 10.x and 13+ can, so Blackwell keeps
  none, Hopper one byte). Without primary weights TE caches the FP8 weight (1 byte) and, on
  Hopper, its transpose (1 byte) between micro-batches beside the 16-bit parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.config.base import Fp8Recipe
from sim.frameworks.common.base import JobContext
from sim.hardware.compute import ComputeModel
from sim.hardware.host import HostSpec, cpu_pass_s
from sim.program.ir import CPU_STREAM, Op
from sim.scenario import MegatronOptions
from sim.workload.layer_rules import fp8_element_bytes

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
"""Bytes of the dtypes Megatron-LM's ``--exp-avg-dtype`` / ``--main-params-dtype`` accept."""

FUSED_CPU_ADAMW_BYTES = 28.0
"""``torch.optim.AdamW(fused=True)`` on CPU tensors (``_fused_adamw_``, one vectorised pass
per parameter): reads the fp32 parameter, gradient and both moments, writes the parameter and
moments (7 x 4 bytes)."""


@dataclass(frozen=True)
class OptimizerPlan:
    """Bytes per parameter of a rank's optimizer shard (see the module docstring)."""

    gpu_bytes: float
    """GPU bytes held for the whole step per shard parameter (master copy and moments), the
    offloaded share excluded."""
    step_bytes: float
    """GPU bytes per shard parameter allocated at the optimizer step and held until the next
    step's ``zero_grad`` (fp32 gradient copies), the offloaded share excluded."""
    kernel_bytes: float
    """HBM bytes the fused Adam kernel moves per shard parameter it steps (28 for fp32
    master, gradient and moments)."""
    cast_bytes: float
    """HBM bytes per parameter of casting the 16-bit gradient into the fp32 copy (0 when the
    optimizer reads the gradient buffer)."""
    copy_bytes: float
    """HBM bytes per parameter of copying the updated master into the model's parameter
    (read 4, write 2; 0 when TE's kernel writes the parameter itself)."""
    offload: float
    """Share of the shard's parameters stepped on the CPU (0 without CPU offload)."""
    overlap_offload: bool
    """``overlap_cpu_optimizer_d2h_h2d``."""
    host_bytes: float = 16.0
    """Host bytes per offloaded parameter (fp32 parameter, pinned gradient, two moments)."""
    d2h_bytes: float = 4.0
    """Bytes per offloaded parameter copied device-to-host (the fp32 gradient)."""
    h2d_bytes: float = 4.0
    """Bytes per offloaded parameter copied host-to-device (the fp32 parameter)."""


def main_grad_bytes(opts: MegatronOptions, precision: str) -> int:
    """Bytes of a ``main_grad`` element, the gradient buffer the wgrad GEMMs accumulate into
    and the data-parallel reduction reads: 4 with ``grad_reduce_in_fp32`` (Megatron-LM's
    default for 16-bit and FP8 training, ``accumulate_allreduce_grads_in_fp32``), or as
    ``main_grads_dtype`` sets it; 2 otherwise.

    Examples
    --------
    >>> from sim.scenario import MegatronOptions
    >>> main_grad_bytes(MegatronOptions(name="megatron"), "bf16"), main_grad_bytes(
    ...     MegatronOptions(name="megatron", grad_reduce_in_fp32=False), "fp8")
    (4, 2)
    """
    if opts.grad_reduce_in_fp32 is not None:
        fp32 = opts.grad_reduce_in_fp32
    elif opts.main_grads_dtype is not None:
        fp32 = opts.main_grads_dtype == "fp32"
    else:
        fp32 = precision in ("bf16", "fp8")
    return 4 if fp32 else 2


def optimizer_plan(opts: MegatronOptions, precision: str, grad_bytes: int) -> OptimizerPlan:
    """The optimizer's bytes per parameter for ``opts`` (checked by :func:`check_optimizer`).

    Examples
    --------
    >>> from sim.scenario import MegatronOptions
    >>> p = optimizer_plan(MegatronOptions(name="megatron"), "bf16", 4)
    >>> (p.gpu_bytes, p.step_bytes)          # fp32 master + moments, fp32 grads in place
    (12.0, 0.0)
    >>> p = optimizer_plan(MegatronOptions(name="megatron", use_precision_aware_optimizer=True,
    ...     exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), "bf16", 2)
    >>> (p.gpu_bytes, p.step_bytes)          # 16-bit remainder + bf16 moments, grads in place
    (6.0, 0.0)
    """
    g = float(grad_bytes)
    fp8_cs = precision == "fp8" and opts.fp8_recipe != "delayed"
    fp32_copy = 0.0 if g == 4 else 4.0
    if opts.optimizer_cpu_offload:
        # HybridDeviceOptimizer: the GPU share in fp32 (param_update_in_fp32), dtype args unused.
        return _plan(12.0, fp32_copy, _adam_bytes(4, 4, 4, g, False),
                     opts.optimizer_offload_fraction, opts.overlap_cpu_optimizer_d2h_h2d)
    if not opts.use_precision_aware_optimizer:
        return _plan(12.0, fp32_copy, _adam_bytes(4, 4, 4, g, False))
    m1 = DTYPE_BYTES[opts.exp_avg_dtype]
    m2 = DTYPE_BYTES[opts.exp_avg_sq_dtype]
    main = DTYPE_BYTES[opts.main_params_dtype]
    if main == 4 and fp8_cs:
        # Megatron keeps the fp32 master for the FP8 cast; only the moments shrink.
        return _plan(float(4 + m1 + m2), fp32_copy, _adam_bytes(4, m1, m2, g, False))
    if main == 4 and opts.store_param_remainders and precision != "fp16":
        main = 2    # the low 16 bits beside the bf16 parameter
    return _plan(float(main + m1 + m2), 0.0, _adam_bytes(main, m1, m2, g, True))


def _plan(gpu: float, step: float, hbm: tuple[float, float, float], offload: float = 0.0,
          overlap: bool = False) -> OptimizerPlan:
    return OptimizerPlan(gpu_bytes=gpu, step_bytes=step, kernel_bytes=hbm[0],
                         cast_bytes=hbm[1], copy_bytes=hbm[2], offload=offload,
                         overlap_offload=overlap)


def _adam_bytes(main: int, m1: int, m2: int, g: float, master_in_kernel: bool
                ) -> tuple[float, float, float]:
    """HBM bytes per parameter of one GPU step: (Adam kernel, gradient cast, parameter copy).

    Megatron's own master (``master_in_kernel`` false): the gradient cast into the fp32 copy
    (read g, write 4, none when already fp32), the fused Adam (read master, gradient, moments;
    write master, moments) and the copy into the 16-bit parameter (read 4, write 2). TE's
    master weights: one kernel reads the 16-bit parameter, the master (or remainder), the
    gradient in place and the moments, and writes all but the gradient.
    """
    if master_in_kernel:
        return 2.0 * (2 + main + m1 + m2) + g, 0.0, 0.0
    return 2.0 * (main + m1 + m2) + 4, (0.0 if g == 4 else g + 4), 6.0


def fp8_weight_bytes(primary: bool, both_layouts: bool, recipe: Fp8Recipe | None = None
                     ) -> tuple[float, float]:
    """Bytes per FP8 linear weight parameter: (the parameter itself, TE's extra buffers).

    FP8 primary weights hold the E4M3 data as the parameter (1 byte) and, where the GEMMs
    need a column-wise copy (Hopper, or block scales: :func:`~sim.workload.layer_rules.
    fp8_both_layouts`), that copy; otherwise the 16-bit parameter (2 bytes) plus TE's cached
    FP8 weight in each layout it needs. Block scales add their share to each FP8 byte
    (:func:`~sim.workload.layer_rules.fp8_element_bytes`). An MXFP8 primary weight is an
    ``MXFP8Tensor`` holding both layouts, and its 16-bit values are all-gathered into the
    reused gradient buffer (``reuse_grad_buf_for_mxfp8_param_ag``, which Megatron-Bridge's
    ``bf16_with_mxfp8_mixed`` sets with ``fp8_param_gather``), not kept beside it.

    >>> fp8_weight_bytes(False, True), fp8_weight_bytes(True, False)
    ((2.0, 2.0), (1.0, 0.0))
    >>> fp8_weight_bytes(True, True, "mxfp8")
    (2.0625, 0.0)
    """
    e = float(fp8_element_bytes(recipe))
    layouts = 2.0 if both_layouts else 1.0
    if primary and recipe == "mxfp8":
        return layouts * e, 0.0
    if primary:
        return e, (layouts - 1.0) * e
    return 2.0, layouts * e


def check_optimizer(ctx: JobContext, opts: MegatronOptions) -> None:
    """Refuse what Megatron-LM refuses: lower-precision optimizer dtypes without
    ``use_precision_aware_optimizer`` (``OptimizerConfig.__post_init__`` asserts them fp32),
    CPU offload without it (``validate_args``: the hybrid optimizer reuses its code path) or
    beside FP8 primary weights under a recipe other than delayed, FP8 primary weights without
    FP8 training or the distributed optimizer (``validate_args``), and a ``main_grads_dtype``
    that contradicts ``grad_reduce_in_fp32``."""
    low = [k for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")
           if getattr(opts, k) != "fp32"]
    if opts.main_grads_dtype == "bf16":
        low.append("main_grads_dtype")
    ctx.require(opts.use_precision_aware_optimizer or not low, "framework." + (low or [""])[0],
                "can only be fp32 without use_precision_aware_optimizer (Megatron-Core "
                "OptimizerConfig)")
    ctx.require(not opts.optimizer_cpu_offload or opts.use_precision_aware_optimizer,
                "framework.optimizer_cpu_offload", "needs use_precision_aware_optimizer "
                "(Megatron-LM validate_args: the hybrid device optimizer reuses its code path)")
    precision = ctx.scenario.training.precision
    ctx.require(not opts.fp8_param_gather or (precision == "fp8" and opts.distributed_optimizer),
                "framework.fp8_param_gather", "FP8 primary weights need training.precision fp8 "
                "and the distributed optimizer (Megatron-LM validate_args)")
    ctx.require(not (opts.optimizer_cpu_offload and opts.fp8_param_gather)
                or opts.fp8_recipe == "delayed", "framework.optimizer_cpu_offload",
                "with fp8_param_gather needs fp8_recipe delayed (Megatron-LM validate_args)")
    g = opts.grad_reduce_in_fp32
    ctx.require(opts.main_grads_dtype is None or g is None
                or g == (opts.main_grads_dtype == "fp32"), "framework.main_grads_dtype",
                "contradicts grad_reduce_in_fp32 (Megatron-LM sets accumulate_allreduce_grads_"
                "in_fp32 from main_grads_dtype)")


def gpu_step_s(cm: ComputeModel, plan: OptimizerPlan, local: float, n: float,
               grad_bytes: int, tensors: int) -> float:
    """GPU seconds of one rank's optimizer step over ``local`` shard parameters (``n`` in the
    rank's gradient buffers): the gradient norm (reads 4 bytes), the gradient cast, the fused
    Adam over the GPU share (``adamw_time``'s calibrated 28-byte rate scaled to the plan's
    bytes), the copy into the model's parameters, and zeroing the gradient buffers."""
    gpu = local * (1.0 - plan.offload)
    # Each pass is one kernel: a pass that does not run costs no launch.
    passes = [4.0, plan.cast_bytes, plan.copy_bytes]
    return (cm.adamw_time(gpu * plan.kernel_bytes / 28.0, True, tensors)
            + sum(cm.membound_time(b * gpu) for b in passes if b)
            + cm.membound_time(grad_bytes * n))


OFFLOAD_CHUNKS = 16
"""With ``overlap_cpu_optimizer_d2h_h2d`` the copies and CPU steps pipeline parameter by
parameter; the builder models the pipeline in this many equal chunks (a pipeline fill of one
chunk's copies, against one parameter's in the real run)."""


def offload_ops(plan: OptimizerPlan, host: HostSpec, local: float, gpu_step: Op,
                deps: list[Op]) -> list[Op]:
    """The CPU share's step of ``HybridDeviceOptimizer.step`` for one rank (``local`` shard
    parameters): gradients device-to-host (after the gradient reduction, ``deps``), torch's
    fused AdamW on the host (the Python thread blocks on each copy's event, then steps), the
    fp32 parameters host-to-device. Without overlap everything runs on the compute stream
    around the GPU share's step (``gpu_step``); with it, on the copy streams in
    :data:`OFFLOAD_CHUNKS` pipelined chunks. Returns the ops, in program order, that the
    caller adds; the last H2D ends the step."""
    cpu = local * plan.offload
    if cpu <= 0:
        return []
    k = OFFLOAD_CHUNKS if plan.overlap_offload else 1
    d2h_stream, h2d_stream = ("d2h", "h2d") if plan.overlap_offload else ("compute", "compute")
    ops: list[Op] = []
    prev_cpu: list[Op] = []
    for i in range(k):
        d2h = Op(name=f"optimizer offload D2H grads {i}", kind="copy", stream=d2h_stream,
                 phase="optimizer", deps=list(deps), host_transfer="d2h",
                 nbytes=plan.d2h_bytes * cpu / k, category="copy")
        step = Op(name=f"optimizer step (fused AdamW on CPU) {i}", kind="host",
                  stream=CPU_STREAM, phase="optimizer", deps=[d2h, *prev_cpu],
                  duration=cpu_pass_s(host, FUSED_CPU_ADAMW_BYTES * cpu / k, "torch"),
                  category="optimizer", host_sync=True)
        h2d = Op(name=f"optimizer offload H2D params {i}", kind="copy", stream=h2d_stream,
                 phase="optimizer", deps=[step, gpu_step], host_transfer="h2d",
                 nbytes=plan.h2d_bytes * cpu / k, category="copy")
        ops += [d2h, step, h2d]
        prev_cpu = [step]
    return ops


def check_fp8_recipe(ctx: JobContext, recipe: Fp8Recipe, precision: str) -> None:
    """Refuse an FP8 recipe the GPU cannot run, as Transformer Engine does when the recipe is
    set up (``check_recipe_support``, ``transformer_engine/pytorch/quantization.py``): MXFP8
    needs compute capability 10.0 (Blackwell; ``check_mxfp8_support``), block scaling 9.0
    (Hopper) with CUDA 12.9's block-scaled cuBLASLt GEMMs (``check_fp8_block_scaling_support``).
    Per-tensor FP8 needs Hopper or Ada, which ``training.precision`` already checks."""
    if precision != "fp8":
        return
    gpu = ctx.compute.gpu
    ctx.require(recipe != "mxfp8" or gpu.arch == "blackwell", "framework.fp8_recipe",
                f"mxfp8 needs a Blackwell GPU (compute capability 10.0, Transformer Engine "
                f"check_mxfp8_support); {gpu.name} is {gpu.arch}: use tensorwise or blockwise")
    ctx.require(recipe != "blockwise" or gpu.arch in ("hopper", "blackwell"),
                "framework.fp8_recipe",
                f"blockwise needs compute capability 9.0 or later (Transformer Engine "
                f"check_fp8_block_scaling_support); {gpu.name} is {gpu.arch}")
