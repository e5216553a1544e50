"""Memory-bound kernels: PyTorch's elementwise loops (vectorised, non-vectorised, casting),
reductions, eager GELU, AdamW, each at the rate its loads in flight allow.

Rates are the lent H200's (``h200-fit.json``, :func:`sim.hardware.kernel_fit.h200_fit`) scaled
with HBM bandwidth, capped by what one SM keeps in flight (:data:`STREAM_BYTES_PER_SM_S`);
latency-bound loops follow Little's law over the resident threads. The pricing is a mixin of
:class:`sim.hardware.compute.ComputeModel`: a subclass provides ``gpu`` (the
:class:`~sim.catalog.GpuSpec`); the mixin gives it ``kernel_min_s`` and the HBM scale.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from sim import catalog
from sim.catalog import GpuSpec
from sim.hardware.kernel_fit import h200_fit as _fit

MemClass = Literal["elementwise", "norm_fused", "reduction"]

# The AdamW calibration split its parameters in 16 tensors (h200-kernels.json meta).
ADAMW_CALIBRATION_TENSORS = 16
# Bytes a second one SM keeps streaming between HBM and its registers (Little's law: the
# loads one SM holds in flight over the loaded memory latency). A memory-bound kernel runs at
# the lesser of its HBM-scaled rate and this times the SM count: it binds where a GPU's
# bandwidth per SM outgrows what a kernel tuned on Hopper keeps in flight, i.e. on Blackwell
# (B200 7,672 GB/s over 148 SMs, 51.8 GB/s an SM, against the H200's 36.4). Measured, not
# fitted to a validation row: torchao's MXFP8 cast kernels on a B200 move 72.4% of its HBM
# peak, its block-scaled FP8 casts on an H100 84.3% of its (pytorch/ao READMEs,
# sim/catalog/reference/torchao_cast_kernels.yaml); the H200's in-place add (88.7% of 4.8
# TB/s, the elementwise rate) scaled by that ratio, 0.859, is 5.85 TB/s on the B200, 39.5
# GB/s an SM. Hopper's and Ampere's streaming (at most 32.3 GB/s an SM) stays under it.
# Checked on other data: TE's B300 quantization table (tests/unit/workload/
# test_te_gemm_profiling.py); derivation re-done in tests/unit/hardware/
# test_blackwell_streaming.py.
STREAM_BYTES_PER_SM_S = 39.5e9
# Threads one SM holds resident: 2,048 on compute capabilities 8.0, 9.0 and 10.0 (A100,
# H100/H200, B200/GB200; CUDA C++ Programming Guide, "Compute Capabilities", table
# "Technical Specifications per Compute Capability").
RESIDENT_THREADS_PER_SM = 2048
# Loaded HBM latency seen by a copy that keeps one load in flight a thread. Measured
# elsewhere, not fitted: MLX's general (strided) copy on a B200, one element a thread
# (ml-explore/mlx PR 2873, "[CUDA] Faster general copy", the "Pre" column: 50 x 20 copies of
# an (8, 2048, 32, 128) swapaxes(1, 2) view in 140.5 ms in bf16 and 135.7 ms in fp32, 1.91
# and 3.96 TB/s read plus written): by Little's law 148 SMs x 2,048 threads x 2 B in flight
# over 0.955 TB/s of reads is 635 ns, and x 4 B over 1.98 TB/s is 613 ns. That both element
# sizes give the same latency is the check that such a copy is latency-bound.
STRIDED_LOAD_LATENCY_S = 624e-9
# What TensorIterator's dynamic-casting path adds to each element, as a latency in flight per
# resident thread (Little's law, as above): an op whose operands' dtypes differ loads and
# stores each element through ``fetch_and_cast``/``cast_and_store``, a switch on the dtype,
# instead of a typed vector access (aten/src/ATen/native/cuda/CUDALoops.cuh,
# ``unrolled_elementwise_kernel`` with ``LoadWithCast``/``StoreWithCast``; the legacy loop's
# ``gpu_kernel_impl`` where ``gpu_kernel_impl_nocast`` has none). Fitted on the lent H200's
# 1B eager step (h200-train-steps-ops.json, run ``1b-plain``: its unrolled casting copies,
# 231 calls in 20.77 ms, against the model's bf16-to-fp32 copies of that step; derivation in
# tests/integration/test_calibration_h200_ops.py); validated on the 8B-layer step's kernels
# (run ``8b4l-plain``) and on the casting legacy loop (RoPE's bf16 q times fp32 cos), which
# took no part in the fit.
DYNAMIC_CAST_LATENCY_S = 436e-9
# PyTorch's eager GELU in bf16 is bound by its per-element math, not by HBM: on the lent H200
# a [16384, 8192] bf16 GELU (tanh; erf within 2%) took 180 us forward and its backward 212
# us, where their traffic streams in 128 and 191 us; in fp32 both stream (4.03 and 4.13
# TB/s). Measured elements a second, forward and backward (h200-step-power.json, ``loops``;
# tools/measure_step_power.py).
GELU_BF16_ELEMENTS_PER_S = {"fwd": 16384 * 8192 / 180.3e-6, "bwd": 16384 * 8192 / 211.6e-6}


class MemoryBoundKernels:
    """Memory-bound kernel times on ``self.gpu`` (a mixin: the subclass sets ``gpu``)."""

    gpu: GpuSpec

    @cached_property
    def _bw_scale(self) -> float:
        return self.gpu.hbm_gbytes_per_s / _fit()["hbm_gbytes_per_s"]

    @property
    def kernel_min_s(self) -> float:
        """The shortest back-to-back kernel (the fit's fixed term of a memory-bound call)."""
        return float(_fit()["kernel_min_s"])

    def membound_time(self, nbytes: float, klass: MemClass = "elementwise") -> float:
        """A memory-bound kernel moving ``nbytes`` (read plus written).

        ``elementwise``: PyTorch's vectorised elementwise loop, at the rate measured for an
        in-place add (89% of the H200's HBM peak). ``norm_fused`` and ``reduction``: a kernel
        that reduces along rows (a norm, a mean, a softmax, a sum of a gradient over tokens)
        at the rate measured for the fused RMSNorm kernel (56% of peak): PyTorch's reduction
        kernels give each row (or a few) to one block, which must finish its reduction
        before it writes, so fewer loads are in flight than in a streaming loop.

        The fixed ``kernel_min_s`` makes the achieved bandwidth size-dependent:
        ``n / (t0 + n / B)``, half the streaming rate at ``n = t0 * B`` (8.5 MB on the H200),
        a tenth at 1 MB. Little's law puts the knee there: sustaining 4.8 TB/s through
        ~700 ns of loaded HBM latency needs ~3.4 MB in flight, so a kernel only a few times
        that size spends much of its life filling and draining the memory pipeline.
        ``B`` is :meth:`stream_bytes_per_s`.
        """
        return self.kernel_min_s + nbytes / self.stream_bytes_per_s(klass)

    def legacy_loop_time(self, elements: float, nbytes: float, operands: int = 2,
                         cast: bool = False) -> float:
        """A kernel of PyTorch's non-vectorised elementwise loop over ``elements`` outputs,
        moving ``nbytes`` (read plus written): TensorIterator's ``launch_legacy_kernel``
        (``gpu_kernel_impl_nocast``), which every elementwise op and copy takes when an operand
        is not contiguous (a transposed, sliced or broadcast view; ``.contiguous()`` of one).

        Each thread loads its element's operands, stores the result, then does the next (the
        stores may alias the loads, so the compiler keeps them in order): an SM has one
        element a resident thread (:data:`RESIDENT_THREADS_PER_SM`) in flight, and by Little's
        law finishes ``threads / latency`` elements a second. A copy's element (one load, one
        store) takes :data:`STRIDED_LOAD_LATENCY_S`; each of the ``operands`` (inputs and
        output) its share of that, so a binary op's element takes 1.5 copies' (measured on
        the lent H200: RMSNorm's broadcast multiplies 1.37x its expanded-gradient divide, a
        unary loop over as many elements). ``cast``: operands of different dtypes, each
        element also through the dynamic cast (:data:`DYNAMIC_CAST_LATENCY_S`). Never faster
        than the vectorised loop moving the same bytes (:meth:`stream_bytes_per_s`).

        Examples
        --------
        >>> from sim import catalog
        >>> from sim.hardware.compute import ComputeModel
        >>> cm = ComputeModel(catalog.gpu("b200"))
        >>> n = 67e6                      # a bf16 copy of 67 M elements: 268 MB moved
        >>> round(cm.legacy_loop_time(n, 4 * n) / cm.membound_time(4 * n), 1)
        2.9
        """
        latency = operands / 2 * STRIDED_LOAD_LATENCY_S + (DYNAMIC_CAST_LATENCY_S if cast
                                                           else 0.0)
        return self.kernel_min_s + max(self._one_in_flight_s(elements, latency),
                                       nbytes / self.stream_bytes_per_s("elementwise"))

    def cast_loop_time(self, elements: float, nbytes: float) -> float:
        """A kernel of PyTorch's unrolled elementwise loop with dynamic casts over ``elements``
        contiguous elements moving ``nbytes``: the vectorised loop's streaming time plus each
        element's casts (:data:`DYNAMIC_CAST_LATENCY_S` a resident thread, Little's law).
        Taken by a copy or op between dtypes other than PyTorch's special-cased fp32-to-bf16
        copy (``bfloat16_copy_kernel_cuda``, vectorised): autocast's bf16 gradients cast back
        to fp32, a bf16 branch added to an fp32 residual stream.

        Examples
        --------
        >>> from sim import catalog
        >>> from sim.hardware.compute import ComputeModel
        >>> cm = ComputeModel(catalog.gpu("h200"))
        >>> n = 33.5e6                    # bf16 -> fp32 of 33.5 M elements: 201 MB moved
        >>> round(cm.cast_loop_time(n, 6 * n) / cm.membound_time(6 * n), 2)
        2.1
        """
        return self.membound_time(nbytes) + self._one_in_flight_s(elements,
                                                                  DYNAMIC_CAST_LATENCY_S)

    def _one_in_flight_s(self, elements: float, latency: float) -> float:
        """``elements`` through every resident thread of the GPU, one in flight each for
        ``latency`` (Little's law over SMs x :data:`RESIDENT_THREADS_PER_SM`)."""
        return elements * latency / (self.gpu.sm_count * RESIDENT_THREADS_PER_SM)

    def stream_bytes_per_s(self, klass: MemClass = "elementwise") -> float:
        """Rate a memory-bound kernel of ``klass`` streams at on this GPU: the H200's measured
        rate scaled with HBM bandwidth, at most :data:`STREAM_BYTES_PER_SM_S` an SM (the
        bytes each SM keeps in flight bound it where bandwidth per SM is Blackwell's).

        Examples
        --------
        >>> from sim import catalog
        >>> from sim.hardware.compute import ComputeModel
        >>> round(ComputeModel(catalog.gpu("h200")).stream_bytes_per_s() / 1e12, 2)
        4.26
        >>> round(ComputeModel(catalog.gpu("b200")).stream_bytes_per_s() / 1e12, 2)
        5.85
        """
        return self._stream_rate(self._membound_bw[klass])

    def _stream_rate(self, h200_bytes_per_s: float) -> float:
        """A rate measured on the H200 on this GPU: scaled with HBM, capped per SM."""
        return min(h200_bytes_per_s * self._bw_scale, STREAM_BYTES_PER_SM_S * self.gpu.sm_count)

    @cached_property
    def _membound_bw(self) -> dict[str, float]:
        mb = _fit()["membound"]
        return {"elementwise": mb["add_"]["bytes_per_s"],
                "norm_fused": mb["rms_norm"]["bytes_per_s"],
                "reduction": mb["rms_norm"]["bytes_per_s"]}

    def gelu_time(self, elements: float, pass_: Literal["fwd", "bwd"] = "fwd") -> float:
        """PyTorch's eager GELU (or its backward) over ``elements`` bf16 values at the rate its
        per-element math allows (:data:`GELU_BF16_ELEMENTS_PER_S`); a kernel takes the longer
        of this and its memory traffic at the elementwise rate. The math runs on the CUDA
        cores, so other GPUs scale it by their FP32 peak.

        Examples
        --------
        >>> from sim import catalog
        >>> from sim.hardware.compute import ComputeModel
        >>> cm = ComputeModel(catalog.gpu("h200"))
        >>> round(cm.gelu_time(16384 * 8192) * 1e6)            # measured 180 us
        180
        """
        h200 = catalog.gpu("h200")
        scale = h200.peak_flops("fp32") / self.gpu.peak_flops("fp32")
        return elements / GELU_BF16_ELEMENTS_PER_S[pass_] * scale

    def adamw_time(self, params: float, fused: bool = True, tensors: int = 16,
                   elem_bytes: int = 4) -> float:
        """One AdamW step over ``params`` parameters in ``tensors`` tensors, each parameter,
        gradient and moment of ``elem_bytes`` (fp32; 2 for a bf16 model's own states).

        Seven elements move per parameter (read param, grad, two moments; write param and
        moments): 28 bytes in fp32.
        The calibration's fixed cost was measured with the parameters split in 16 tensors; it
        is charged per tensor (step counters and list handling are per-tensor work).
        """
        a = _fit()["adamw"]["fused" if fused else "foreach"]
        per_tensor = a["fixed_s"] / ADAMW_CALIBRATION_TENSORS
        # A multi-tensor streaming kernel: capped per SM like any other (stream_bytes_per_s).
        return per_tensor * tensors + params * 7 * elem_bytes / self._stream_rate(
            a["bytes_per_s"])
