"""torchao's MXFP8 grouped GEMM for MoE training (``_MXFP8GroupedMM``), as torchtitan's
``quantize.grouped_mm.mx`` converter runs the routed experts' ``torch._grouped_mm`` on
Blackwell.

Source: pytorch/ao ``torchao/prototype/moe_training/scaled_grouped_mm.py`` at v0.15.0
(``_MXFP8GroupedMM``; the release the PyTorch + Nebius DeepSeek-V3 recipe pins), reached from
torchtitan's ``MXGroupedMMConverter`` (``torchtitan/components/quantization/mx.py`` at
1a36996b: ``quantize_(model, MoETrainingConfig(scaling_type=MXFP8))`` on the expert weights,
so every ``torch._grouped_mm`` on them dispatches to the function; token groups aligned to
32 rows, ``MXFP8_GROUP_ALIGNMENT_SIZE``). One call ``A[M, K] x B_t[G, K, N]``:

* forward: ``A`` and the weights cast to MXFP8 along ``K`` (E4M3 data, one E8M0 scale per 32
  elements; the scales computed as it casts, no amax pass), each scale tensor rearranged into
  the blocked layout the kernel reads (``triton_mx_block_rearrange_2d_M_groups``,
  ``..._per_group_3d``), then ``torch._scaled_grouped_mm``; autograd keeps the bf16 ``A``
  and weights;
* backward: the output gradient cast along ``N`` and the weights again (``mxfp8_quantize_cuda_3d``),
  two rearrangements, the dgrad ``torch._scaled_grouped_mm``; the output gradient and ``A``
  cast along ``M`` (``_to_mxfp8_dim1_kernel_wrapper``, the CUDA kernel), two rearrangements
  (``..._2d_K_groups``), the wgrad ``torch._scaled_grouped_mm``.

torchtitan's ``_run_experts_grouped_mm`` calls ``torch._grouped_mm`` for ``w1`` and ``w3``
separately (then ``w2``), so the first linear's input is cast twice in each direction:
``input_calls``. The GEMMs are PyTorch's CUTLASS grouped kernels at Blackwell's block-scaled
FP8 rate (:func:`sim.workload.grouped_gemm.grouped_gemm_time` with ``block_scaled``) and at the
slowdown measured for its bf16 grouped kernel (``Kernel.grouped_impl`` ``torch``): nothing of
this module was fitted; ``tests/unit/workload/test_torch_grouped_mm_blackwell.py`` checks the
forward and backward against torchao's own B200 timing of the function.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from sim.workload.float8_mx import mx_cast
from sim.workload.kernels import BF16, Kernel, Tensor, accumulating
from sim.workload.layer_rules import linear_params
from sim.workload.mx_swizzle import ALL, Operand, scale_swizzles

if TYPE_CHECKING:
    from sim.workload.layer_builder import _Builder
    from sim.workload.moe_ops import MoELayout


def _rearrange(name: str, pass_: str, kind: Operand, numel: float) -> Kernel:
    """One operand's scales rearranged into the blocked layout the grouped kernel reads: the
    same read and write of 1/32 byte an element as Transformer Engine's scale swizzle
    (:func:`sim.workload.mx_swizzle.scale_swizzles`)."""
    return scale_swizzles(name, pass_, ((kind, numel),), ALL)[0]


def mx_grouped_linear(b: _Builder, x: Tensor, counts: tuple[float, ...], n_in: int, n_out: int,
                      name: str, lay: MoELayout, input_calls: int = 1,
                      model_rows: float | None = None) -> Tensor:
    """The local experts' ``x W^T`` as ``input_calls`` calls of torchao's ``_MXFP8GroupedMM``
    (``n_out`` split evenly between them), the group of expert ``i`` over ``counts[i]`` rows.
    Returns the bf16 output; the weight gradients accumulate as the bf16 path's do
    (:func:`sim.workload.moe_grouped_mlp.grouped_linear`).

    Examples
    --------
    >>> from sim.workload.layer_builder import _Builder
    >>> from sim.workload.moe_ops import STYLE, MoELayout
    >>> b = _Builder("experts", STYLE)
    >>> x = b.t("in", 64 * 2048, 2)
    >>> y = mx_grouped_linear(b, x, (32.0, 32.0), 2048, 1536, "fc1",
    ...                       MoELayout(torch_grouped_mm=True, torchao_mx=True), input_calls=2)
    >>> [k.name for k in b.block.forward if k.klass == "gemm"]
    ['fc1.fwd']
    >>> sum(k.name.startswith("fc1.cast_in") for k in b.block.forward)   # once per call
    2
    """
    rows = sum(counts)
    experts = len(counts)
    b.block.params += experts * linear_params(n_in, n_out, False)
    fl = 2.0 * (rows if model_rows is None else model_rows) * n_in * n_out
    numel_w = experts * n_in * n_out
    nx, ng = rows * n_in, rows * n_out

    def gemm(pass_: str, reads: tuple[Tensor, ...], out: Tensor) -> Kernel:
        return Kernel(f"{name}.{pass_}", "gemm", reads, (out,), fl,
                      gemm=(rows, n_in, n_out, pass_), fp8=True, fp8_block=True,
                      group=counts, launches=input_calls, grouped_impl="torch")

    def per_call(k: Kernel) -> Kernel:
        return replace(k, launches=input_calls)

    w = b.t(f"{name}.w", numel_w, BF16)
    y = b.t(f"{name}.out", ng, BF16)
    fwd: list[Kernel] = []
    x8 = x
    for i in range(input_calls):
        k, x8 = mx_cast(name, "in" if i == 0 else f"in{i}", x, nx, b)
        fwd += [k, _rearrange(name, "fwd" if i == 0 else f"fwd{i}", "in", nx)]
    # Each call casts its own weight (and, backward, its own output gradient): the halves of
    # one priced cast, one launch each.
    kw, w8 = mx_cast(name, "w", w, numel_w, b)
    fwd += [per_call(kw), per_call(_rearrange(name, "fwd", "w", numel_w)),
            gemm("fwd", (x8, w8), y)]
    for k in fwd:
        b.fwd(k)
    b.save(x)

    gy = b.t(f"{name}.g_out", ng, BF16)
    gx = b.t(f"{name}.g_in", nx, BF16)
    gw = b.t(f"{name}.main_grad", numel_w, lay.main_grad_bytes)
    kg0, g0 = mx_cast(name, "g", gy, ng, b)
    kw1, w1 = mx_cast(name, "w_bwd", w, numel_w, b)
    bwd = [per_call(kg0), per_call(kw1), per_call(_rearrange(name, "dgrad", "g", ng)),
           per_call(_rearrange(name, "dgrad", "w", numel_w)), gemm("dgrad", (g0, w1), gx)]
    if input_calls > 1:
        # Each call returns its own input gradient; autograd sums them into x's.
        gsum = b.t(f"{name}.g_in_sum", nx, BF16)
        bwd.append(Kernel(f"{name}.g_in_add", "elementwise", (gx, gx), (gsum,)))
    kg1, g1 = mx_cast(name, "g_t", gy, ng, b)
    bwd += [per_call(kg1), per_call(_rearrange(name, "wgrad", "g", ng))]
    x1 = x
    for i in range(input_calls):
        k, x1 = mx_cast(name, "in_bwd" if i == 0 else f"in_bwd{i}", x, nx, b)
        bwd += [k, _rearrange(name, "wgrad" if i == 0 else f"wgrad{i}", "in", nx)]
    bwd.append(accumulating(gemm("wgrad", (g1, x1), gw), gw))
    b.bwd(*bwd)
    b.block.weight_grads.append(gw)
    return y
