"""Time of a grouped GEMM: one GEMM per local expert, each over the tokens routed to it.

Megatron-Core's ``TEGroupedMLP`` (``megatron/core/transformer/moe/experts.py``) runs each of
fc1 and fc2 as one Transformer Engine ``GroupedLinear`` call over the local experts, split by
``tokens_per_expert``. TE executes it in ``nvte_multi_tensor_gemm``
(``transformer_engine/common/gemm/cublaslt_gemm.cu``): by default (and always for FP8 and off
Hopper) ``multi_stream_cublas_gemm``, one cuBLASLt GEMM per expert issued round-robin on
``get_num_compute_streams()`` = 4 side streams (``common/util/multi_stream.cpp``); a CUTLASS
grouped kernel only with ``NVTE_USE_CUTLASS_GROUPED_GEMM=1`` on Hopper, 16-bit, no epilogue.

So we price the default path: each expert's GEMM with M = its token count under the existing
:meth:`~sim.hardware.compute.ComputeModel.gemm_time` (its small-M penalty, wave
quantisation and HBM floor are what matter at a few hundred tokens per expert), not one GEMM
of the summed M, which would hide exactly that inefficiency. The four streams let GEMMs run
side by side, which pays off when each fills only part of the GPU: the group takes the longer
of the busiest stream's serial sum and the SM-time of all GEMMs (each GEMM's time weighted by
the share of the SMs it occupies, at most 1) and the time to stream every expert's operands
through HBM once (side by side they share the bandwidth). A GEMM occupies at least the share
of SMs its output tiles need, at least the share its math needs at the GPU's sustained peak
(cuBLAS runs a few-row GEMM with a deep K split-K over more SMs than it has tiles), and at
least the occupancy :meth:`~sim.hardware.compute.ComputeModel.gemm_occupancy` its own time
was priced at: the fitted wave model spreads a partial wave over nearly every SM, so the SMs
its nominal tiles leave idle are already spent and cannot be lent to another stream. (Without
that, 2-4 experts of 256-512 rows came out 35-53% faster than DeepGEMM's measured FP8 grouped
kernel on H800 and faster than one GEMM over all their rows; sim/catalog/reference/
moe_components.yaml.) An expert with no tokens launches nothing that costs GPU time.

What counts as SM-time is a GEMM's work, not its fixed part: ``gemm_time`` holds a per-call
constant (:attr:`~sim.hardware.compute.ComputeModel.gemm_fixed_s`, 9.5 us in the H200 fit),
of which every kernel keeps :attr:`~sim.hardware.compute.ComputeModel.kernel_min_s` (an
empty kernel's launch-to-complete, what the simulator charges each launch); the rest is a
single GEMM's ramp and drain, when another stream's GEMM takes the SMs it leaves, so only the
group's first GEMM pays it in the open. Charging it as SM-time for each of 16 experts priced
Transformer Engine 2.7's own multi-stream measurement (TE pull request 2045, H100 bf16,
``general_grouped_gemm`` 16 x 2,048 and 8 x 4,096 rows of 2,048 x 768) 60% and 40% too
slow; with it the group is 4% and 9% slower than measured
(``sim/catalog/reference/te_grouped_gemm.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.hardware.compute import ComputeModel, GemmPass, gemm_dims
from sim.hardware.power import sustained_gemm_flops

TE_COMPUTE_STREAMS = 4
"""Side streams of TE's multi-stream cuBLAS grouped GEMM
(``transformer_engine/common/util/multi_stream.cpp``, ``get_num_compute_streams``)."""

TORCH_GROUPED_MM_SLOWDOWN = {"hopper": 1.23, "blackwell": 1.61}
"""``torch._grouped_mm`` in bf16 (PyTorch's CUTLASS grouped kernel, ``GroupMM.cu``; what
torchtitan's ``GroupedExperts`` run) over the same groups priced as cuBLAS GEMMs, per GPU
generation. **Fitted** (``tools/fit_torch_grouped_mm.py``) on torchao's kernel benchmarks:
Hopper on an H100's forward over 16 groups of 8,192 x 5,120 x 8,192 (pytorch/ao PR 2490,
``sim/catalog/reference/torchao_grouped_mm_h100.yaml``; its other row, K and N swapped, is
+3.3%), Blackwell on a B200's forward plus backward of Llama 4 Scout's experts in 1-8 groups
(the torchao README, ``torchao_grouped_mm.yaml``; DeepSeek-V3's rows are -7% to +12%). Neither
benchmark says why; one kernel configuration per architecture against cuBLAS's per-shape
heuristics would. Other generations: 1 (no kernel of its own before sm90)."""


def torch_grouped_mm_slowdown(arch: str) -> float:
    """:data:`TORCH_GROUPED_MM_SLOWDOWN` of a GPU generation, 1 where none is measured.

    Examples
    --------
    >>> torch_grouped_mm_slowdown("hopper"), torch_grouped_mm_slowdown("ampere")
    (1.23, 1.0)
    """
    return TORCH_GROUPED_MM_SLOWDOWN.get(arch, 1.0)


def grouped_gemm_time(cm: ComputeModel, rows: Sequence[float], k: float, n: float,
                      pass_: GemmPass = "fwd", fp8: bool = False, block_scaled: bool = False
                      ) -> float:
    """GPU time of one grouped GEMM pass: GEMM ``i`` is ``[rows[i], k] x [k, n]``.

    Parameters
    ----------
    cm : ComputeModel
        The GPU.
    rows : sequence of float
        Tokens of each local expert (M of its GEMM); zeros launch nothing.
    k, n : float
        Input and output features of each expert's linear (``Y = X W^T`` with W ``n x k``).
    pass_ : {"fwd", "dgrad", "wgrad"}
        Which of the linear's three GEMMs.
    fp8 : bool
        FP8 operands (Transformer Engine under ``fp8_autocast``).
    block_scaled : bool
        With block scales (:meth:`~sim.hardware.compute.ComputeModel.gemm_time`).

    Returns
    -------
    float
        Seconds.

    Examples
    --------
    >>> from sim import catalog
    >>> cm = ComputeModel(catalog.gpu("h200"))
    >>> one = cm.gemm_time(4096, 7168, 4096, "fwd")
    >>> grouped_gemm_time(cm, [4096], 7168, 4096) == one
    True
    >>> # 32 experts of 128 tokens read 32 weights: slower than 4 GEMMs of 1024 rows
    >>> grouped_gemm_time(cm, [128] * 32, 7168, 4096) > grouped_gemm_time(cm, [1024] * 4,
    ...                                                                   7168, 4096)
    True
    """
    times: list[float] = []
    busy = 0.0
    hbm = 0.0
    latency = 0.0
    sms = cm.gpu.sm_count
    peak = sustained_gemm_flops(cm.gpu, "bf16")
    if fp8:
        peak *= cm.gpu.peak_flops("fp8") / cm.gpu.peak_flops("bf16")
    operand = 1.0 if fp8 else 2.0
    for m in rows:
        if m <= 0:
            continue
        t = cm.gemm_time(m, k, n, pass_, fp8=fp8, block_scaled=block_scaled)
        times.append(t)
        # The GEMM's fixed part beyond an empty kernel's (gemm_fixed_s - kernel_min_s: its
        # ramp and drain) holds no SMs another stream's GEMM could not use: only the rest
        # counts as SM-time.
        fixed = min(cm.gemm_fixed_s - cm.kernel_min_s, t)
        latency = latency or fixed
        work = t - fixed
        # Its SM-time: at the share of the SMs gemm_time priced it on (its wave model's
        # occupancy, near 1 even for few tiles), not the share its nominal tiles would leave.
        tiles = cm.gemm_tiles(m, k, n, pass_) / sms
        share = max(tiles, cm.gemm_occupancy(m, k, n, pass_),
                    2.0 * m * k * n / (peak * work) if work > 0 else 1.0)
        busy += work * min(1.0, share)
        # Operands in, 16-bit output out, as the GEMM's own roofline floor counts them.
        r, c, red = gemm_dims(m, k, n, pass_)
        hbm += operand * (r * red + c * red) + 2.0 * r * c
    if not times:
        return 0.0
    streams = [0.0] * min(TE_COMPUTE_STREAMS, len(times))
    for i, t in enumerate(times):
        streams[i % len(streams)] += t
    # The first GEMM's fixed part has nothing beside it yet: it stays in the open. One GEMM
    # alone is its own time exactly (latency + busy could exceed it by a rounding).
    shared = latency + busy if len(times) > 1 else 0.0
    return max(max(streams), shared, cm.membound_time(hbm))
