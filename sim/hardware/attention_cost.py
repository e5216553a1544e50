"""Which fused-attention kernel a framework runs, and how fast each one is per GPU generation.

The attention form in :meth:`sim.hardware.compute.ComputeModel.attention_time` (tiles of the causal
triangle over the SMs, 4D or 10D matmul FLOPs plus one exponential per score) was fitted on
``torch.nn.functional.scaled_dot_product_attention`` timed with PyTorch 2.11 on an H200
(``catalog/calibration/h200-kernels.json``). That measurement was cuDNN's fused attention:
causal, head_dim 128, 16 heads x 16k tokens ran at 612 TFLOP/s forward and ~535 backward,
against 335 / 322 for FlashAttention-2 on the same silicon (Shah et al. 2024, "FlashAttention-3",
arXiv 2407.08608, fig. 5d and fig. 6) -- beyond what FA2's ``mma.sync`` kernels reach on
Hopper -- and PyTorch 2.11 is the first release whose bundled cuDNN passes the
``check_prefer_cudnn_attention`` gate in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
(cuDNN > 9.15 on sm90/sm100; see :data:`SDPA_CUDNN_FIRST`).

Other kernels run the same form at their own matrix throughput (:func:`matmul_share`), from one
published figure each at one anchor shape (causal or not as the figure says, head_dim 128,
16k tokens, 16 heads, batch 1 -- the benchmark shape of both FlashAttention papers); the
shape of the curve (sequence length, head dim, causal tile skipping, waves over the SMs)
stays the physical form's. Only the measured backend keeps the H200's measured residuals.

On Blackwell, cuDNN (and FlashAttention-4, priced but chosen by no framework here) leave this
form: their tensor cores doubled while the exponential unit and shared memory did not, so
each unit is priced at its own rate (:mod:`sim.hardware.blackwell_attention`).
FlashAttention-2's sm80 kernels there keep the form at their Hopper share.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Literal

from sim.config.training import DEFAULT_TORCH_VERSION
from sim.hardware.flash_curves import curve_arch, flash1_share, head_dim_weight
from sim.hardware.te_fused_attention import te_fallback, te_fused_attention_trains

if TYPE_CHECKING:
    from sim.catalog import GpuSpec
    from sim.scenario import Scenario

# The kernel that runs. ``mem_efficient``: PyTorch's CUTLASS (xformers) kernel, SDPA's choice
# where no flash kernel exists (Volta). ``unfused``: no fused kernel (Megatron's baddbmm,
# softmax, bmm path); recorded only, no attention kernel is priced then. ``flash1``:
# FlashAttention's first CUDA kernels (flash-attn 1.x; PyTorch's SDPA flash kernel before 2.2).
# ``flash1_triton``: FlashAttention's first Triton kernel (flash-attn ``flash_attn_triton.py``),
# which MosaicML's llm-foundry runs as ``attn_impl: triton`` on triton-pre-mlir; not the Triton
# tutorial's kernel of 2024, which uses Hopper's wgmma (the FA3 paper: 395 TFLOP/s forward on
# the H100, above FA2; ``blackwell_attention.yaml``). ``flex``: PyTorch's FlexAttention
# (compiled Triton templates over block-sparse masks; :data:`FLEX_SHARE_OF_FLASH2`).
AttentionBackend = Literal["flash1", "flash2", "flash3", "flash1_triton", "cudnn", "mem_efficient",
                           "unfused", "flex"]

# The backend the calibration measured (PyTorch 2.11 SDPA on an H200, see module docstring):
# only it keeps the measured residual correction, and only on Hopper.
MEASURED_BACKEND: AttentionBackend = "cudnn"

WGMMA_ATTENTION: tuple[AttentionBackend, ...] = ("cudnn", "flash3")
"""Hopper attention kernels that keep the tensor cores as busy as a GEMM does (asynchronous
``wgmma`` fed by TMA, warp-specialised: cuDNN's fused attention, FlashAttention-3, 60-75% of
the dense peak at head dim 128) and so hold the clock a busy node's GEMMs hold: they carry the
part's ``gemm_rate_factor`` too. FlashAttention-2's and Triton's ``mma.sync`` kernels (35-45%
of the peak) draw less and keep their measured rates."""


# Releases whose SDPA tries cuDNN attention first on datacenter Hopper (sm90) and, from 2.9,
# Blackwell (sm100/sm103); every other release tries FlashAttention-2 first there, and every
# release does on Ampere (cuDNN second or last). From pytorch/pytorch:
#   2.5.0       cuDNN first on H100 (PR #125343; its 2.4 cherry-pick reverted, PR #128539)
#   2.5.1-2.8   flash first: cuDNN made opt-in after 2.5.0's bugs (PR #138522, cherry-picked
#               to release/2.5); issue #142132 (2.6 nightly, H100): SDPA 329 TFLOP/s against
#               cuDNN's 631 at (1, 24, 4608, 128) -- SDPA was running FA2
#   2.9         cuDNN first on sm90 and sm100 (PR #162073, "for 2.9")
#   2.10        flash first unless the bundled cuDNN is newer than 9.15 (PR #171627 and its
#               2.10 cherry-pick #171895; ``check_prefer_cudnn_attention``); 2.10's is not
#   2.11+       cuDNN first: the bundled cuDNN passes that gate (huggingface/transformers
#               PR #48163 discussion, 2026), as the calibration H200's 612 TFLOP/s confirms
# PyTorch 2.2 replaced SDPA's FlashAttention kernel with FlashAttention-2 (release notes,
# 2024-01: "scaled_dot_product_attention (SDPA) now supports FlashAttention-2, yielding
# around 2x speedups compared to previous versions"); 2.0 and 2.1 ran the first one.
FIRST_SDPA_FLASH2 = (2, 2, 0)

SDPA_CUDNN_FIRST: tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...] = (
    ((2, 5, 0), (2, 5, 0)),
    ((2, 9, 0), (2, 9, 99)),
    ((2, 11, 0), (99, 0, 0)),
)

# Published TFLOP/s at the anchor shape (head_dim 128, 16k tokens = batch 1 x seq 16,384,
# 16 heads, bf16/fp16), H100 80GB SXM5, from the FlashAttention-3 paper (Shah et al. 2024,
# arXiv 2407.08608; the figures are Dao-AILab/flash-attention assets/flash3_fp16_fwd.png):
#   fwd: fig. 5(d), "Forward, with causal mask, head dim 128": FA2 335, cuDNN 539, FA3 616
#   bwd: fig. 6, "Attention backward speed, head dim 128" (no mask): FA2 322, cuDNN 516,
#        FA3 561
# (TFLOP/s count 4*S^2*D*H forward, halved with the causal mask; backward 2.5x that.)
# The paper's cuDNN is 9.1 of mid-2024; ``cudnn`` here is the newer one PyTorch 2.11 bundles,
# priced by the H200 measurement itself (612 fwd at the anchor), so it takes no anchor.
ANCHOR = {"seq": 16384, "heads": 16, "head_dim": 128}
PUBLISHED_H100: dict[tuple[str, str], tuple[float, bool]] = {
    # (backend, pass): (TFLOP/s, causal)
    ("flash2", "fwd"): (335.0, True),
    ("flash2", "bwd"): (322.0, False),
    ("flash3", "fwd"): (616.0, True),
    ("flash3", "bwd"): (561.0, False),
}

# On Ampere the fitted form scaled by the A100's dense peak already lands within 2% of
# FlashAttention-2's published A100 figure (forward + backward, causal, head dim 128, 16k:
# 189 TFLOP/s, Dao 2023, arXiv 2307.08691, fig. 4(d); Dao-AILab/flash-attention
# assets/flash2_a100_fwd_bwd_benchmark.png): FA2 runs at share 1 there, and so does cuDNN
# (no published A100 figure found; Transformer Engine prefers flash-attn on Ampere anyway).
# FlashAttention-2 on Blackwell runs its sm80 ``mma.sync`` kernels: the same share of the
# cuDNN kernel as on Hopper, at Hopper's per-SM rate (SMs x clock, not the doubled tensor
# cores: :func:`sim.hardware.blackwell_attention.sm80_kernel_scale`, checked against measured
# B200 FA-2 figures). Volta has no flash kernel; its
# ``mem_efficient`` kernel keeps the scaled form (share 1), as before.
_ARCH_SHARE_FROM_HOPPER = {"hopper", "blackwell"}

# FlashAttention's first CUDA kernel runs at a published share of FlashAttention-2's speed on
# the same GPU, by length and head dim (:func:`sim.hardware.flash_curves.flash1_share`, the
# FlashAttention-2 paper's bars): 0.55-0.57 at head dim 64 and 16k tokens, 0.42-0.44 at 128
# (FA2's gain came mostly at the wide head), more at short rows. Both run sm80 ``mma.sync``
# code, so the share holds across GPUs: the A100 share at 128 (0.439) gives 144 TFLOP/s on
# the H100 against 137 published.
#
# The papers' "FlashAttention Triton" bars are not the kernel llm-foundry runs: the
# FlashAttention-2 benchmark (benchmarks/benchmark_flash_attention.py, 60499abc, 2023-07)
# imports ``triton.ops.flash_attention``, OpenAI's Triton-2.1 tutorial kernel, whereas
# llm-foundry's ``attn_impl: triton`` runs ``flash_attn_triton.py`` (Tri Dao's kernel on
# triton-pre-mlir) -- which has no published benchmark of its own. Its docstring places it
# against FlashAttention's CUDA kernel: "Triton forward is generally faster than CUDA
# forward, while Triton backward is generally slower than CUDA backward. Overall Triton
# forward + backward is slightly slower than CUDA forward + backward." So ``flash1_triton``
# starts from ``flash1`` (the CUDA kernel's figures). At head dim 128, where the CUDA kernel
# keeps least of FA2's speed (0.42-0.44 against 0.55-0.57 at 64), llm-foundry's MPT steps
# leave the Triton kernel faster than it, by a factor no published figure states (the Triton
# file rewrote its head-dim-128 backward "by reducing register spilling"); fitted per GPU
# generation on llm-foundry's own tables (tools/fit_triton_attention.py: the head-dim-128
# rows of 8k tokens and more on 8 A100 80GB, and on 8 H100 those of MPT-760M to -3B;
# validated on every other row, the ``llm-foundry`` suite). At head dim 64 the CUDA kernel's
# share already meets MPT-125M's and -350M's rows: the factor runs from 1 there (log2).
TRITON_OVER_CUDA_AT_128 = {"ampere": 1.20, "hopper": 1.27}
LEGACY_BACKENDS = ("flash1", "flash1_triton")

# FlexAttention (``torch.nn.attention.flex_attention`` under ``torch.compile``: Inductor's
# Triton templates, the default ``BACKEND``) against FlashAttention-2 on the same call: "90% of
# FlashAttention2's performance in the forward pass and 85% in the backward pass" (PyTorch
# blog, "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention",
# 2024-08-07, causal attention on an A100). On Hopper the templates' matmuls are wgmma, which
# FlashAttention-2's sm80 kernels never use: tritonbench's FlexAttention operator on an H100
# (pytorch/benchmark PR 2443, 2024-08-28, forward, bf16, head dim 128, not causal) ran
# (4, 16, 4096, 128) in 1.404 ms against flash_v2's 1.559 (1.11x its speed; 1.07x at 2k, 1.14x
# at 16k): :data:`FLEX_FWD_SHARE_HOPPER`. No Hopper backward and no Blackwell figure is
# published: there the A100's share stands (an assumption, docs/calibration.md). Block
# sparsity -- a sliding window's band, a document mask -- skips whole 128 x 128 tiles as
# FlashAttention-2's windowed kernel does (:func:`causal_tiles`), so the share applies to the
# band's time.
FLEX_SHARE_OF_FLASH2 = {"fwd": 0.90, "bwd": 0.85}
FLEX_FWD_SHARE_HOPPER = 1.559 / 1.404


def flex_share(arch: str, pass_: str) -> float:
    """FlexAttention's speed over FlashAttention-2's on the same call, on a GPU generation
    (:data:`FLEX_SHARE_OF_FLASH2`, :data:`FLEX_FWD_SHARE_HOPPER`).

    Examples
    --------
    >>> flex_share("ampere", "fwd"), flex_share("ampere", "bwd"), flex_share("hopper", "bwd")
    (0.9, 0.85, 0.85)
    >>> round(flex_share("hopper", "fwd"), 3)
    1.11
    """
    if arch == "hopper" and pass_ == "fwd":
        return FLEX_FWD_SHARE_HOPPER
    return FLEX_SHARE_OF_FLASH2[pass_]


# A fused attention kernel with dropout draws a Philox random number for every score it keeps
# (the mask is regenerated in the backward, never stored), work beside the matmuls that the
# probability does not change. Forward plus backward at p = 0.1 over the same call without
# dropout, Transformer Engine issue 3312 (2026-08, ``DotProductAttention``, bf16, 4 x 4,096
# tokens, 16 heads, head_dim 128, ``sbhd``, the fused cuDNN backend): 0.614 / 0.594 ms on an
# H200 (TE 2.15), 0.525 / 0.480 ms on a B300 (TE 2.14.1); FlashAttention-2 on a GB200 (its sm80
# kernels, as on an A100), 0.728 / 0.695 ms (the maintainers' reply, ``thd``). Measured, not
# fitted; applied to both passes.
ATTENTION_DROPOUT_COST = {"hopper": 0.614 / 0.594, "blackwell": 0.525 / 0.480,
                          "ampere": 0.728 / 0.695, "volta": 0.728 / 0.695}


def attention_dropout_factor(arch: str) -> float:
    """The time of a fused attention pass with dropout over the same pass without
    (:data:`ATTENTION_DROPOUT_COST`; FlashAttention-2's own cost on GPUs older than Hopper).

    Examples
    --------
    >>> [round(attention_dropout_factor(a), 3) for a in ("hopper", "blackwell", "ampere")]
    [1.034, 1.094, 1.047]
    """
    return ATTENTION_DROPOUT_COST.get(arch, ATTENTION_DROPOUT_COST["hopper"])


# A deterministic attention backward sums each query block's dQ over the key blocks in a fixed
# order (FlashAttention: ordered, semaphore-guarded accumulation instead of free atomics; tridao
# in Dao-AILab/flash-attention issue 988: "Only dQ"), so key blocks wait on one another. Time of
# the deterministic backward over the non-deterministic one, H100, head_dim 128, causal,
# 2 x 8,192 tokens, 16 heads (Dao-AILab/flash-attention pull request 1893, 2025-09, its
# hopper/benchmark_attn.py with deterministic=True):
#   flash3: 2.900 ms (SPT schedule, the merged one) against 2.391 ms non-deterministic;
#   flash2: 8.279 ms, 166.0 TFLOP/s, where the non-deterministic kernel runs at the rate this
#           module prices it from the FlashAttention-3 paper's anchor, 315 TFLOP/s at that
#           shape (``PUBLISHED_H100``; the same run's forward, 306 against 333 priced).
# cuDNN's deterministic backward (``use_deterministic_algorithm``) has no published timing:
# not priced (1). Measured, not fitted to any validation row.
DETERMINISTIC_BACKWARD_COST = {"flash3": 2.900 / 2.391, "flash2": 315.0 / 166.0}


def deterministic_backward_factor(backend: str) -> float:
    """The time of ``backend``'s attention backward in deterministic mode over its
    non-deterministic time (:data:`DETERMINISTIC_BACKWARD_COST`; 1 where unmeasured).

    Examples
    --------
    >>> round(deterministic_backward_factor("flash2"), 2), deterministic_backward_factor("cudnn")
    (1.9, 1.0)
    """
    return DETERMINISTIC_BACKWARD_COST.get(backend, 1.0)


def share_of_flash2(backend: str, arch: str, head_dim: int = 128,
                    seq: int = 16384) -> float | None:
    """Speed of FlashAttention's first CUDA kernel (``flash1``) or its Triton kernel
    (``flash1_triton``, priced as the CUDA kernel) relative to FlashAttention-2's on a GPU
    generation at a head dim and length (:func:`sim.hardware.flash_curves.flash1_share`);
    None for other backends. One share serves both passes: the figures are forward +
    backward.

    Examples
    --------
    >>> [round(share_of_flash2("flash1", "ampere", hd), 3) for hd in (128, 64)]
    [0.439, 0.567]
    >>> [round(share_of_flash2(b, "hopper"), 3) for b in ("flash1", "flash1_triton")]
    [0.418, 0.53]
    >>> round(share_of_flash2("flash1", "ampere", 96), 3)   # 0.58 of the way from 64 in log2
    0.488
    >>> share_of_flash2("flash2", "hopper") is None
    True
    """
    if backend not in LEGACY_BACKENDS:
        return None
    share = flash1_share(arch, head_dim, seq)
    if backend == "flash1_triton":
        share *= triton_over_cuda(arch, head_dim)
    return share


def triton_over_cuda(arch: str, head_dim: int) -> float:
    """flash_attn_triton's speed over FlashAttention's CUDA kernel's at a head dim
    (:data:`TRITON_OVER_CUDA_AT_128`, fitted; 1 at head dim 64, log2 between; Blackwell
    takes Hopper's).

    Examples
    --------
    >>> triton_over_cuda("ampere", 64), triton_over_cuda("volta", 128)
    (1.0, 1.0)
    """
    at_128 = TRITON_OVER_CUDA_AT_128.get(curve_arch(arch) or "", 1.0)
    return at_128 ** head_dim_weight(head_dim)


def window_pairs(seq: int, window: int | None) -> float:
    """(query, key) pairs one head of a causal attention over ``seq`` tokens scores when a
    query sees at most ``window`` keys (itself and the ``window - 1`` before it): the
    sliding-window rule, the one home of it (model FLOPs, kernel FLOPs and the kernel's tiles
    all count through here).

    With a window shorter than the sequence, query ``i`` (from 0) scores ``min(i + 1, W)``
    keys: ``sum_i min(i + 1, W) = S W - W (W - 1) / 2`` -- the non-zeros of the band mask that
    Megatron-Bridge's ``gpt_oss_flops_calculator`` (``attention_mask_nz_elem``) counts.
    Without one (or one at least as long as the sequence) it is ``S^2 / 2``, half the score
    matrix: the dense convention of Megatron-LM's ``num_floating_point_operations`` and of the
    FlashAttention benchmarks, kept so that full-attention numbers do not move.

    Examples
    --------
    >>> window_pairs(4096, None), window_pairs(4096, 4096)
    (8388608.0, 8388608.0)
    >>> window_pairs(4096, 128)           # 128 x 4096 less the first 127 queries' shortfall
    516160.0
    >>> window_pairs(5, 2) == sum(min(i + 1, 2) for i in range(5))
    True
    """
    if window is None or window >= seq:
        return seq * seq / 2.0
    return float(seq * window - window * (window - 1) // 2)


def causal_tiles(n_blocks: int, block: int, window: int | None) -> tuple[float, int]:
    """(tiles, tiles of the longest query row) a tiled causal attention kernel computes over
    ``n_blocks`` query blocks of ``block`` tokens (as many key blocks), each ``block x block``.

    Without a window: the lower triangle, ``n (n + 1) / 2`` tiles, ``n`` in the last row.
    With one, a query block needs only the key blocks its band reaches: query block ``q``
    starts at key ``q * block - (W - 1)``, so it runs ``min(q + 1, k)`` tiles with
    ``k = ceil((W - 1) / block) + 1`` -- the same sum as :func:`window_pairs` on the block
    grid. The kernels skip the blocks left of the band as they skip those above the diagonal:
    FlashAttention-2's ``n_block_min`` for ``Is_local`` (``csrc/flash_attn/src/
    flash_fwd_kernel.h``, ``window_size_left``); cuDNN's fused attention (Transformer
    Engine's FusedAttention, the kernel Megatron-Core runs GPT-OSS's sink attention with,
    TE >= 2.8) takes the same left bound (``diagonal_band_left_bound``, cudnn-frontend
    ``SDPA_attributes``) and is assumed to skip alike.

    Examples
    --------
    >>> causal_tiles(64, 64, None), causal_tiles(64, 64, 4096)
    ((2080.0, 64), (2080.0, 64))
    >>> causal_tiles(64, 64, 128)          # k = ceil(127 / 64) + 1 = 3 tiles a row
    (189.0, 3)
    >>> causal_tiles(4, 64, 200)           # k = 5 > 4 blocks: the whole triangle
    (10.0, 4)
    """
    k = n_blocks if window is None else -(-(window - 1) // block) + 1
    if k >= n_blocks:
        return n_blocks * (n_blocks + 1) / 2.0, n_blocks
    return window_pairs(n_blocks, k), k


def version_tuple(v: str) -> tuple[int, int, int]:
    """A release string as a comparable triple (missing parts 0): PyTorch's and cuDNN's.

    Examples
    --------
    >>> version_tuple("2.8"), version_tuple("9.13.1.26")
    ((2, 8, 0), (9, 13, 1))
    """
    parts = ([int(x) for x in v.split(".")[:3]] + [0, 0, 0])[:3]
    return parts[0], parts[1], parts[2]


def release_or_newest(v: str | None) -> tuple[int, int, int] | None:
    """An optional release key (``training.transformer_engine_version``, ``cudnn_version``)
    as :func:`version_tuple`'s triple; None (unset: the newest modelled) stays None.

    Examples
    --------
    >>> release_or_newest("2.9"), release_or_newest(None)
    ((2, 9, 0), None)
    """
    return None if v is None else version_tuple(v)


def sdpa_backend(arch: str, torch_version: str = DEFAULT_TORCH_VERSION,
                 head_dims_differ: bool = False) -> AttentionBackend:
    """The kernel ``F.scaled_dot_product_attention`` runs (bf16, causal, no mask, head_dim
    <= 256) on a GPU generation under a PyTorch release (:data:`SDPA_CUDNN_FIRST`).
    ``head_dims_differ`` (MLA's 192-wide queries and keys, 128-wide values): the flash
    kernels refuse it (``check_head_dim_size_flash``), so cuDNN's attention on Hopper and
    Blackwell (first in torchtitan's backend list), the memory-efficient kernel elsewhere.

    Examples
    --------
    >>> sdpa_backend("hopper", "2.8"), sdpa_backend("hopper", "2.11")
    ('flash2', 'cudnn')
    >>> sdpa_backend("ampere", "2.11"), sdpa_backend("volta"), sdpa_backend("ampere", "2.1")
    ('flash2', 'mem_efficient', 'flash1')
    >>> sdpa_backend("hopper", "2.8", True), sdpa_backend("ampere", "2.11", True)
    ('cudnn', 'mem_efficient')
    """
    if head_dims_differ:
        return "cudnn" if arch in ("hopper", "blackwell") else "mem_efficient"
    if arch == "volta":
        return "mem_efficient"      # flash needs sm80 (sdp_utils.cpp check_sm_version)
    v = version_tuple(torch_version)
    if v < FIRST_SDPA_FLASH2:
        return "flash1"
    cudnn_archs = {"hopper"} | ({"blackwell"} if v >= (2, 9, 0) else set())
    if arch in cudnn_archs and any(lo <= v <= hi for lo, hi in SDPA_CUDNN_FIRST):
        return "cudnn"
    return "flash2"


def resolve(s: Scenario, gpu: GpuSpec, head_dims: tuple[int, int] = (128, 128),
            sinks: bool = False) -> AttentionBackend:
    """The attention kernel of a scenario: its ``training.attention_backend``, or with
    ``auto`` the one its framework's source picks, for a layer of ``head_dims`` (query/key,
    value). Queries and keys wider than values (Multi-head Latent Attention, 192 / 128),
    which PyTorch's flash kernels refuse (``sdp_utils`` ``check_head_dim_size_flash``): SDPA
    then runs cuDNN's fused attention on Hopper and Blackwell (torchtitan's
    ``ScaledDotProductAttentionWrapper`` lists it first) and the memory-efficient kernel
    elsewhere.

    * Megatron with Transformer Engine: cuDNN fused attention on Hopper and Blackwell where
      it trains the layer's ``head_dims`` (query/key, value) under the scenario's
      ``training.transformer_engine_version`` and ``cudnn_version``
      (:func:`~sim.hardware.te_fused_attention.te_fused_attention_trains`; else TE's fallback,
      unfused for Multi-head Latent Attention on Blackwell before TE 2.5 / cuDNN 9.11),
      flash-attn 2 on Ampere (TE ``dot_product_attention/utils.py`` ``get_attention_backend``:
      "Disabling FlashAttention to give FusedAttention preference on Hopper+", compute
      capability >= 9.0; below it FlashAttention stays first), and flash-attn 2 on Blackwell
      under ``training.deterministic`` with dropout (cuDNN cannot run that there; below sm90
      TE's determinism filter already leaves flash-attn). Megatron ``local`` and
      Megatron-DeepSpeed: the
      ``flash_attn`` package (``--use-flash-attn``), FA2; without flash attention, unfused.
    * FSDP2 with NeMo AutoModel's code (``model_code: automodel``): its ``te`` attention,
      Transformer Engine's choice as above (without dropout); with learned attention
      ``sinks`` (GPT-OSS) FlexAttention, the only attention AutoModel's GPT-OSS module took
      until 2026 (``GptOssAttention``: "Only Flex Attention is supported for GPT-OSS").
    * FSDP2 (torchtitan's ``F.scaled_dot_product_attention``), DDP / plain PyTorch
      (Hugging Face's ``sdpa`` attention), FairScale and DeepSpeed ZeRO (Hugging Face
      models): SDPA's own choice under ``training.torch_version`` (:func:`sdpa_backend`).

    Raises ``ValueError`` naming the key for a kernel the GPU cannot run.
    """
    qk, v = head_dims
    head_dims_differ = qk != v
    t = s.training
    choice = t.attention_backend
    version = t.torch_version or DEFAULT_TORCH_VERSION
    fw = s.framework
    if choice == "auto":
        if fw.name == "fsdp2" and fw.model_code == "automodel":
            if sinks:
                return "flex"
            # AutoModel's ``attn: te``: Transformer Engine's DotProductAttention.
            return "cudnn" if gpu.arch in ("hopper", "blackwell") else "flash2"
        if fw.name == "megatron":
            if not fw.flash_attention:
                return "unfused"
            te = fw.implementation == "transformer_engine"
            if not te or gpu.arch not in ("hopper", "blackwell"):
                return "flash2"
            # cuDNN's Blackwell attention is deterministic only without dropout (cuDNN 9.18.1+;
            # Transformer Engine PR 2584's support matrix): TE falls back to flash-attn 2.
            if t.deterministic and gpu.arch == "blackwell" and fw.dropout > 0:
                return "flash2"
            if not te_fused_attention_trains(
                    gpu.arch, qk, v,
                    release_or_newest(t.transformer_engine_version),
                    release_or_newest(t.cudnn_version)):
                return te_fallback(qk, v)
            return "cudnn"
        if fw.name == "deepspeed" and (s.parallelism.tp > 1 or s.parallelism.pp > 1):
            return "flash2" if fw.pipeline.flash_attention else "unfused"
        return sdpa_backend(gpu.arch, version, head_dims_differ)
    if choice == "sdpa":
        return sdpa_backend(gpu.arch, version, head_dims_differ)
    if head_dims_differ and fw.name != "megatron" and choice.startswith("flash"):
        raise ValueError(f"training.attention_backend: {choice} needs one head dim for "
                         "queries, keys and values; multi-head latent attention's differ "
                         "(use auto or cudnn)")
    if choice == "flash3" and gpu.arch != "hopper":
        raise ValueError("training.attention_backend: flash3 (FlashAttention-3) runs only on "
                         f"Hopper (sm90); {gpu.name} is {gpu.arch}")
    if choice in ("flash1", "flash2", "flash1_triton", "cudnn", "flex") and gpu.arch == "volta":
        raise ValueError(f"training.attention_backend: {choice} needs sm80 or newer; "
                         f"{gpu.name} is volta")
    return choice  # type: ignore[return-value]


@cache
def matmul_share(backend: str, arch: str, pass_: str) -> float:
    """The speed of a kernel's matrix work relative to the fitted form's (the measured cuDNN
    kernel without its residuals), from its published anchor figure (:data:`PUBLISHED_H100`).

    The form prices each score as ``4D`` (forward; ``10D`` backward) matmul FLOPs plus one
    exponential worth ``exp_cost_flops`` of them (the H100's 3.9 TFLOP/s of MUFU against
    989 of tensor cores, FA-3 paper section 3). What differs between kernels is the tensor
    core pipeline -- FA2's synchronous ``mma.sync`` without warp specialisation against
    FA3's and cuDNN's asynchronous ``wgmma`` with TMA -- not the exponential units, so only
    the matmul term is divided by the share: ``kD / share + e``, solved so the form gives the
    published TFLOP/s at the anchor. 1 for the measured backend and where no figure differs.

    Examples
    --------
    >>> round(matmul_share("flash2", "hopper", "fwd"), 2)   # 335 TFLOP/s of the form's ~609
    0.45
    >>> matmul_share("cudnn", "hopper", "fwd"), matmul_share("flash2", "ampere", "fwd")
    (1.0, 1.0)
    """
    if backend not in ("flash2", "flash3") or arch not in _ARCH_SHARE_FROM_HOPPER:
        return 1.0
    from sim import catalog
    from sim.hardware.compute import ComputeModel, exp_cost_flops
    from sim.hardware.power import burst_spec

    tflops, causal = PUBLISHED_H100[(backend, pass_)]
    a = ANCHOR
    flops = 4.0 * a["heads"] * a["seq"] ** 2 * a["head_dim"] * (0.5 if causal else 1.0)
    flops *= 2.5 if pass_ == "bwd" else 1.0
    # The published figures are a kernel benchmark's (burst clocks), not a node's held rate.
    form_s = ComputeModel(burst_spec(catalog.gpu("h100-sxm"))).attention_time(
        1, a["heads"], a["seq"], a["head_dim"], pass_, causal=causal,  # type: ignore[arg-type]
        measured_table=False)
    slowdown = form_s / (flops / (tflops * 1e12))      # < 1: the kernel is slower
    kd = (4 if pass_ == "fwd" else 10) * a["head_dim"]
    e = exp_cost_flops()
    return kd / ((kd + e) / slowdown - e)
