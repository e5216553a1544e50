"""Fused attention on Blackwell (sm100: B200, GB200; sm103: B300, GB300) priced from the units
that bound it.

From Hopper to Blackwell the tensor cores doubled per SM and per clock (dense BF16 4,096 ->
8,192 FLOP/clock/SM) while the exponential unit (MUFU, 16 exp2/clock/SM) and shared-memory
bandwidth (128 B/clock/SM) stayed as they were (Zadouri, Hoehnerbach, Shah, Liu, Thakkar,
Dao, "FlashAttention-4", arXiv 2603.05451, 2026, sec. 3 "feeds and speeds"; Together AI blog
"FlashAttention-4"). So the Hopper-fitted form of
:meth:`sim.hardware.compute.ComputeModel.attention_time`, scaled by the matrix throughput
alone, would run the exponentials and the shared-memory traffic 2x faster than the silicon
does. Here each unit's time per 128 x 128 tile of the score matrix is counted in SM cycles
and the kernel takes the slowest, since Blackwell's kernels overlap them (asynchronous
``tcgen05.mma`` issued by one thread, two softmax warpgroups ping-ponging against it in the
forward, FA-4 sec. 4):

* tensor cores: ``2 M N d`` FLOPs per MMA at 8,192 FLOP/clock/SM; two MMAs forward
  (``S = Q K^T``, ``O = P V``), five backward (``S``, ``dP = dO V^T``, ``dV = P^T dO``,
  ``dK = dS^T Q``, ``dQ = dS K``);
* MUFU: one exponential per score, forward, and one in the backward's recomputation of
  ``P = exp(S - LSE)``, at 16 per clock per SM;
* shared memory, 128 B/clock/SM: the operand tiles each MMA reads from it, plus what the
  kernel writes there (:func:`smem_bytes`).

At head_dim 128 this gives the paper's roofline: 1,024 cycles of MMA and 1,024 of
exponentials forward; 2,560 of MMA and 3,328 of shared memory backward. Blackwell Ultra
(B300, GB300) doubles the exponential unit's rate and keeps the tensor cores' and shared
memory's (NVIDIA technical blog "Making Softmax More Efficient with NVIDIA Blackwell Ultra",
2026-02; the part's ``sfu_exp_per_clock_sm``): the head-dim-128 forward stays MMA-bound there,
the head-dim-64 one stops being exponential-bound, and the backward stays bound by shared
memory. Its kernels are priced at the same rates per unit otherwise (no measured sm103
attention kernel was found; FA-4's CuTe forward refused sm103 in 2026-05, lightseekorg/
tokenspeed PR 5, "FA4's CUTE kernels only support SM 10.0 variants").

Cycles become seconds at the clock the datasheet's dense BF16 peak implies
(``peak / (8192 x SMs)``: 1.86 GHz on the B200), times the share of it a GEMM sustains
(catalogue ``matmul_efficiency``, with the power cap's clock ratio): the same silicon clock
and issue limits hold the MMA pipe of an attention kernel as of a GEMM, and MUFU and shared
memory run on the same SM clock. FlashAttention-4's best, 1,613 TFLOP/s (71% of the 2.25 PF
peak), is within 2% of what that gives (1,647) -- FA-4 reaches about what cuBLAS does; its
measured 8k head-dim-128 figures (PR #2280: 1,535 forward, 1,248 backward with one SM per
tile) are within 7% and 2%.

Kernels (:func:`score_seconds`):

* ``flash4``: FlashAttention-4. Its forward computes a share of the exponentials with a
  cubic polynomial on the FMA units instead of MUFU: "10-25% of entries" (FA-4 paper; the
  midpoint, :data:`FA4_EMULATED_EXP_SHARE`). At head_dim 128 the forward stays
  bound by its MMAs either way; at 64 it is exponential-bound and the share sets its speed.
  Its backward is priced with one SM per tile: FA-4's 2-CTA MMA mode (``cta_group::2``, a
  pair of SMs staging each B operand once, half in each) would halve the B-operand reads and
  predict +24%, but it measured +9% over the 1-CTA kernel (Dao-AILab/flash-attention PR
  #2280): whatever binds the 2-CTA kernel is not among these units, so it is not modelled.
* ``cudnn``: cuDNN's fused attention (Transformer Engine's FusedAttention, what Megatron runs)
  at FA-4's unit rates. FA-4 was published 1.1-1.3x faster than cuDNN 9.13, but cuDNN took its
  techniques in: cuDNN 9.22's own benchmark on a GB200 (cudnn-frontend
  ``benchmark/sdpa_benchmark_training``, ``sim/catalog/reference/cudnn_sdpa.yaml``) runs causal
  head-dim-128 attention at 1,708 TFLOP/s forward at 16k, FA-4's best on a B200 (1,613) times
  the GB200's SMs x clock (1.078). One cuDNN is priced for every container, since scenarios do
  not name the release: the newest measured.

Every query tile (every key tile, backward) also pays a fixed fill (:data:`ROW_FILL_CYCLES`):
loading its first operands through the pipeline and its epilogue (the output and
log-sum-exp written forward; dK and dV backward), which a row of many score tiles hides behind
its main loop and a short row does not. It is what a sliding window of 128 keys costs beyond
its two score tiles a row (cuDNN 9.22 at head dim 64: 3.7-4.7x the tiles' time) and what
short causal rows lose. Hopper's fitted form carries the fill of whole causal
rows in its per-score cost, so there only a sliding window's rows add it
(:meth:`sim.hardware.compute.ComputeModel.attention_time`), in the same SM cycles.

The reference figures are in ``sim/catalog/reference/blackwell_attention.yaml``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from sim.hardware.power import sustained_clock_ratio, sustained_matrix_flops

if TYPE_CHECKING:
    from sim.catalog import GpuSpec

Pass = Literal["fwd", "bwd"]

# Per-SM, per-clock rates (FA-4 paper sec. 3; Together AI blog "FlashAttention-4": "From the
# Hopper H100 to the Blackwell B200 ... BF16 tensor core throughput increases from 1 to 2.25
# PFLOPs, while both the SFU count and shared memory bandwidth remains unchanged").
# Ampere and Volta from their whitepapers (dense FP16 FMA per clock per SM x 2): A100 four
# third-generation tensor cores of 256 FMA (312 TF = 108 SMs x 1.41 GHz x 2,048), V100 eight
# of 64 (125 TF = 80 x 1.53 GHz x 1,024); they set the SM clock that the row fill's cycles run at.
MMA_FLOPS_PER_CLOCK_SM = {"volta": 1024, "ampere": 2048, "hopper": 4096,
                          "blackwell": 8192}   # dense BF16/FP16
MUFU_EXP_PER_CLOCK_SM = 16
SMEM_BYTES_PER_CLOCK_SM = 128
# FA-4's tile: 128 query rows x 128 key columns per SM (the roofline's tile; the 2-CTA mode
# pairs two of them into a 256-row MMA across two SMs).
TILE_M = 128
TILE_N = 128
BF16_BYTES = 2
FP32_BYTES = 4

# Share of the forward's exponentials FA-4 computes on the FMA units (software exp2, a
# degree-3 polynomial): "10-25% of entries" (FA-4 paper sec. 4, as its summaries quote it);
# the midpoint. It matters only where the exponentials bind (head_dim 64: 10% gives 922
# cycles a tile, 25% 768); no B200 head-dim-64 measurement was found to pin it.
FA4_EMULATED_EXP_SHARE = 0.175

# SM cycles a 128-row query tile (forward) or 128-key tile (backward) costs beyond its score
# tiles: pipeline fill and epilogue (module docstring). Fitted on cuDNN 9.22's sliding-window
# rows on a GB200 (window 128, head dim 64, 2,048-16,384 tokens: the fill is 70% of their time),
# the median of (measured - score tiles' time) / query tiles per SM, at the burst clock the
# benchmark ran; validated on the same benchmark's full and causal rows of Llama 3.1's shape
# (head dim 128, 2,048-32,768 tokens), which set nothing (tests/unit/hardware/
# test_cudnn_sdpa_reference.py reproduces the fit and checks the rest).
ROW_FILL_CYCLES = {"fwd": 4250.0, "bwd": 8930.0}

BACKENDS: tuple[str, ...] = ("flash4", "cudnn")

# cuDNN's Blackwell attention by release. FA-4 over cuDNN 9.13: forward "up to 1.1-1.3x"
# (Together AI's FA-4 blog; the midpoint), backward "~1.1x vs cuDNN SM100 backward" at 8k
# (Dao-AILab/flash-attention PR #1945, 2025-10-19, when 9.13-9.14 were current); cuDNN 9.19
# "still beats the FA4 CuTe kernels by 1.24-1.98x" on B200 (sgl-project/sglang PR #33655) and
# 9.22 runs at FA-4's best on a GB200 (cudnn_sdpa.yaml): from 9.19 the FA-4 rates hold. A
# release is priced as the newest measured release not newer than it: 9.15-9.18 are
# unmeasured and take 9.14's gap, releases before 9.13 are taken as no faster than 9.13.
CUDNN_913_GAP = {"fwd": 1.2, "bwd": 1.1}
FIRST_CUDNN_AT_FA4_RATES = (9, 19)
LAST_CUDNN_MEASURED_WITH_GAP = (9, 14)


class TileCycles(NamedTuple):
    """SM cycles one ``TILE_M x TILE_N`` tile of scores costs on each unit."""

    mma: float
    exp: float
    smem: float

    @property
    def bound(self) -> float:
        """The slowest unit: the kernels overlap the three (module docstring)."""
        return max(self.mma, self.exp, self.smem)


def smem_bytes(pass_: Pass, head_dim: int, two_cta: bool = False,
               operand_bytes: float = BF16_BYTES) -> float:
    """Shared-memory bytes one SM moves for one ``128 x 128`` tile of scores.

    Forward: ``S = Q K^T`` reads Q and K, ``O = P V`` reads V; P stays in tensor memory (FA-4
    writes it over S there). Backward: the five MMAs read both operands from shared memory
    (``Q, K``; ``dO, V``; ``P^T, dO``; ``dS^T, Q``; ``dS, K``: seven ``128 x d`` and three
    ``128 x 128`` bf16 tiles), and two tiles are written there: dS for dQ's MMA (bf16) and the
    dQ partial, fp32, that is reduced into global memory (FA-2/3/4's ``dQaccum``). At head_dim
    128 that is 13 tiles of 32 KiB, the paper's 3,328 cycles. The split into these terms is
    ours; the paper gives the total. ``two_cta``: the 2-CTA mode halves each SM's reads of
    the five B operands (K, V, dO, Q, K: all ``128 x d``). ``operand_bytes``: 1 for an FP8
    kernel's operands (the fp32 dQ partial stays fp32).

    Examples
    --------
    >>> smem_bytes("bwd", 128) / 128, smem_bytes("fwd", 128) / 128
    (3328.0, 768.0)
    """
    d_tile = TILE_M * head_dim * operand_bytes         # Q, dO (128 x d); K, V likewise
    s_tile = TILE_M * TILE_N * operand_bytes           # P, dS
    if pass_ == "fwd":
        return 3.0 * d_tile
    reads = 7.0 * d_tile + 3.0 * s_tile
    if two_cta:
        reads -= 5.0 * d_tile / 2.0
    writes = s_tile + TILE_M * head_dim * FP32_BYTES
    return reads + writes


def tile_cycles(pass_: Pass, head_dim: int, arch: str = "blackwell",
                two_cta: bool = False, emulated_exp: float = 0.0,
                exp_per_clock: int = MUFU_EXP_PER_CLOCK_SM) -> TileCycles:
    """SM cycles of one ``128 x 128`` score tile per unit (module docstring).
    ``emulated_exp``: the share of the exponentials computed on the FMA units, not MUFU;
    ``exp_per_clock``: the part's MUFU rate (``GpuSpec.sfu_exp_per_clock_sm``: doubled on
    Blackwell Ultra, where the forward at head_dim 64 stops being exponential-bound).

    Examples
    --------
    >>> tile_cycles("fwd", 128)                  # FA-4 sec. 3: 1,024 and 1,024
    TileCycles(mma=1024.0, exp=1024.0, smem=768.0)
    >>> tile_cycles("bwd", 128)                  # 2,560 of MMA, 3,328 of shared memory
    TileCycles(mma=2560.0, exp=1024.0, smem=3328.0)
    >>> tile_cycles("fwd", 64, exp_per_clock=32)  # Blackwell Ultra: MMA-bound again
    TileCycles(mma=512.0, exp=512.0, smem=384.0)
    """
    mmas = 2 if pass_ == "fwd" else 5
    mma = mmas * 2.0 * TILE_M * TILE_N * head_dim / MMA_FLOPS_PER_CLOCK_SM[arch]
    exp = TILE_M * TILE_N * (1.0 - emulated_exp) / exp_per_clock
    smem = smem_bytes(pass_, head_dim, two_cta) / SMEM_BYTES_PER_CLOCK_SM
    return TileCycles(mma, exp, smem)


def fp8_unit_gain(pass_: Pass, head_dim: int, exp_per_clock: int = MUFU_EXP_PER_CLOCK_SM
                  ) -> float:
    """BF16 over FP8 bound of one score tile by the units: FP8 halves the tensor cores'
    cycles (twice the dense FLOPs a clock) and the operands' shared-memory bytes and leaves
    the exponentials (and the forward's emulated share, :data:`FA4_EMULATED_EXP_SHARE`).
    Where the exponentials bind the FP8 forward (Blackwell: 845 cycles against 512 of MMA at
    head dim 128) a part with a faster MUFU (``exp_per_clock``) gains more from FP8.

    Examples
    --------
    >>> round(fp8_unit_gain("fwd", 128), 2), round(fp8_unit_gain("bwd", 128), 2)
    (1.21, 1.73)
    >>> round(fp8_unit_gain("fwd", 128, exp_per_clock=32), 2)   # Blackwell Ultra: MMA-bound
    2.0
    """
    emulated = FA4_EMULATED_EXP_SHARE if pass_ == "fwd" else 0.0
    bf16 = tile_cycles(pass_, head_dim, emulated_exp=emulated, exp_per_clock=exp_per_clock)
    fp8_smem = smem_bytes(pass_, head_dim, operand_bytes=1) / SMEM_BYTES_PER_CLOCK_SM
    fp8 = TileCycles(bf16.mma / 2.0, bf16.exp, fp8_smem)
    return bf16.bound / fp8.bound


def sm_clock_hz(gpu: GpuSpec) -> float:
    """The SM clock the datasheet's dense BF16 peak implies: ``peak / (8192 x SMs)``.

    Examples
    --------
    >>> from sim import catalog
    >>> round(sm_clock_hz(catalog.gpu("b200")) / 1e9, 3)     # 2,250 TF / (8192 x 148)
    1.856
    """
    return gpu.peak_flops("bf16") / (MMA_FLOPS_PER_CLOCK_SM[gpu.arch] * gpu.sm_count)


def sustained_cycles_per_s(gpu: GpuSpec) -> float:
    """SM cycles per second one SM delivers to a kernel: the datasheet clock times the share
    of the peak a GEMM sustains (``matmul_efficiency``, power cap included)."""
    share = sustained_matrix_flops(gpu, "bf16") / gpu.peak_flops("bf16")
    return sm_clock_hz(gpu) * share


def sm80_kernel_scale(gpu: GpuSpec) -> float:
    """How much faster than on the calibration H200 a kernel built for sm80 runs on a
    Blackwell GPU: the ratio of SMs x clock (power cap included), not of matrix throughput.

    FlashAttention-2 issues warp-level ``mma.sync``, not ``tcgen05.mma``, so it does not reach
    the doubled tensor cores; nor do its exponentials or its shared-memory traffic, which run
    at Hopper's per-SM rates. Per SM and clock it is the Hopper kernel. Measured: FA-2 2.7.4 on
    a B200 ran head-dim-64 non-causal at 379 TFLOP/s forward at 16k, 381 at 2k, 302 backward at
    2k (Dao-AILab/flash-attention issue #1589), against 324, 318 and 264 on an H100 (FA-3 paper
    fig. 5 and the backward figure): 1.14-1.20x, where SMs x clock give 1.14 and the matrix
    throughput 2.1.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.hardware.power import burst_spec
    >>> round(sm80_kernel_scale(burst_spec(catalog.gpu("b200"))), 3)   # 148 x 1.856 / (132 x 1.830)
    1.137
    >>> round(sm80_kernel_scale(catalog.gpu("b200")), 3)   # held at the power limit (x 0.928)
    1.055
    """
    from sim import catalog

    h200 = catalog.gpu("h200")
    ratio = (gpu.sm_count * sm_clock_hz(gpu)) / (h200.sm_count * sm_clock_hz(h200))
    return ratio * sustained_clock_ratio(gpu)


def score_seconds(gpu: GpuSpec, pass_: Pass, head_dim: int) -> float:
    """Seconds one SM spends per score (one query-key pair) of a fused attention pass, FA-4's
    and cuDNN's alike (module docstring).

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.hardware.power import burst_spec
    >>> b200 = burst_spec(catalog.gpu("b200"))     # at the boost clock FA-4's benchmarks ran
    >>> tflops = lambda p, d=128: ((4 if p == "fwd" else 10) * d * b200.sm_count
    ...     / score_seconds(b200, p, d) / 1e12)
    >>> round(tflops("fwd")), round(tflops("bwd"))
    (1647, 1267)
    >>> round(tflops("fwd", 64))                 # exponential-bound at head_dim 64
    998
    """
    emulated = FA4_EMULATED_EXP_SHARE if pass_ == "fwd" else 0.0
    cycles = tile_cycles(pass_, head_dim, gpu.arch, emulated_exp=emulated,
                         exp_per_clock=gpu.sfu_exp_per_clock_sm).bound
    return cycles / (TILE_M * TILE_N) / sustained_cycles_per_s(gpu)


def cudnn_release_gap(release: tuple[int, ...] | None, pass_: Pass) -> float:
    """Time of cuDNN ``release``'s Blackwell attention pass over FA-4's unit rates (the rates
    :func:`score_seconds` gives): :data:`CUDNN_913_GAP` before
    :data:`FIRST_CUDNN_AT_FA4_RATES`, 1 from it on and for an unnamed release (None).

    Examples
    --------
    >>> cudnn_release_gap((9, 11, 0), "fwd"), cudnn_release_gap((9, 13, 1), "bwd")
    (1.2, 1.1)
    >>> cudnn_release_gap((9, 18, 0), "fwd"), cudnn_release_gap((9, 20, 0), "fwd")
    (1.2, 1.0)
    >>> cudnn_release_gap(None, "bwd")
    1.0
    """
    if release is None or tuple(release[:2]) >= FIRST_CUDNN_AT_FA4_RATES:
        return 1.0
    return CUDNN_913_GAP[pass_]


def row_fill_seconds(gpu: GpuSpec, pass_: Pass, rows: int, sequences: int) -> float:
    """Seconds the SMs spend filling and draining the row tiles of one call: ``sequences``
    (batch x heads) rows of ``rows`` tokens each (queries forward, keys backward), cut into
    ``TILE_M`` tiles spread over the SMs, each paying :data:`ROW_FILL_CYCLES`.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.hardware.power import burst_spec
    >>> gb200 = burst_spec(catalog.gpu("gb200"))
    >>> round(row_fill_seconds(gb200, "fwd", 4096, 2 * 128) * 1e6)   # 54 tiles an SM
    161
    """
    tiles = sequences * -(-rows // TILE_M)
    return -(-tiles // gpu.sm_count) * ROW_FILL_CYCLES[pass_] / sustained_cycles_per_s(gpu)
