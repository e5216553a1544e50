"""FlashAttention's published speed over sequence length, and what the model takes from it.

The attention form (:meth:`sim.hardware.compute.ComputeModel.attention_time`) was fitted on
cuDNN's kernel; FlashAttention-2 runs it at one published anchor (16k tokens,
:func:`sim.hardware.attention_cost.matmul_share`). Its causal kernel loses more than cuDNN's
at short rows: at 2k tokens the form ran FA2 12% faster than published, at 512 33%. The
FlashAttention-2 paper times FA2 and FlashAttention's first CUDA kernel at six lengths
(forward + backward, causal, 16k tokens a batch: batch x seq = 16,384, 2,048 hidden), head
dims 64 and 128, on an A100 and an H100 (Dao 2023, arXiv 2307.08691, fig. 4(c)/(d) and the
H100 figure; Dao-AILab/flash-attention ``assets/flash2_a100_fwd_bwd_benchmark.png``,
``flash2_h100_fwd_bwd_benchmark.png``). From them:

* :func:`flash2_causal_speedup`: FA2's causal calls run at the published curve, as a factor
  on the form at that length and head dim (the form's own TFLOP/s at the benchmark shape on
  the benchmarked part, at burst clocks, against the bar);
* :func:`flash1_share`: the first kernel's speed as a share of FA2's at that length and head
  dim (0.44 at 16k and head dim 128 on the A100, 0.56 at 512).

Between the published points both run linearly in log2 of the length and of the head dim;
outside them they hold the nearest point (the curves flatten by 16k). Hopper's curve serves
Blackwell, where FA2 runs the same sm80 kernels (:mod:`sim.hardware.blackwell_attention`);
only causal calls take it (the non-causal panels are partly unreadable and training's calls
are causal).
"""

from __future__ import annotations

import math
from functools import cache

# The benchmark's lengths (batch = 16,384 / seq, heads = 2,048 / head_dim).
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
BENCHMARK_TOKENS = 16384
BENCHMARK_HIDDEN = 2048

# Forward + backward, causal, TFLOP/s as the papers count them (4 S^2 D H / 2 forward, 2.5x
# that backward), read from the bars.
FLASH2_CAUSAL_FWD_BWD: dict[tuple[str, int], tuple[float, ...]] = {
    ("ampere", 64): (88, 119, 140, 156, 165, 171),       # fig. 4(c)
    ("ampere", 128): (99, 133, 155, 173, 182, 189),      # fig. 4(d)
    ("hopper", 64): (141, 192, 232, 257, 273, 284),      # H100 figure (c)
    ("hopper", 128): (163, 221, 265, 294, 308, 328),     # H100 figure (d)
}
FLASH1_CAUSAL_FWD_BWD: dict[tuple[str, int], tuple[float, ...]] = {
    ("ampere", 64): (58, 70, 77, 87, 92, 97),
    ("ampere", 128): (55, 62, 69, 76, 80, 83),
    ("hopper", 64): (104, 123, 136, 138, 149, 156),
    ("hopper", 128): (98, 109, 108, 126, 135, 137),
}

# The parts the figures were drawn on.
BENCHMARK_GPU = {"ampere": "a100-80gb", "hopper": "h100-sxm"}


def curve_arch(arch: str) -> str | None:
    """The published curve a GPU generation takes (None: no FlashAttention curve).

    Examples
    --------
    >>> curve_arch("ampere"), curve_arch("blackwell"), curve_arch("volta")
    ('ampere', 'hopper', None)
    """
    if arch == "ampere":
        return "ampere"
    if arch in ("hopper", "blackwell"):
        return "hopper"
    return None


def _position(values: tuple[float, ...], x: float) -> tuple[int, int, float]:
    """Bracketing indices and the fraction between them of ``x`` on a log2 grid, clamped."""
    lx = math.log2(min(max(x, values[0]), values[-1]))
    for i in range(len(values) - 1):
        lo, hi = math.log2(values[i]), math.log2(values[i + 1])
        if lx <= hi:
            return i, i + 1, (lx - lo) / (hi - lo)
    return len(values) - 1, len(values) - 1, 0.0


def head_dim_weight(head_dim: int) -> float:
    """How far a head dim sits from :data:`HEAD_DIMS`' first toward its last, in log2,
    clamped to [0, 1]: the weight every per-head-dim table here interpolates by.

    Examples
    --------
    >>> head_dim_weight(64), round(head_dim_weight(96), 3), head_dim_weight(256)
    (0.0, 0.585, 1.0)
    """
    return _position(HEAD_DIMS, head_dim)[2]


def interpolate_log(grid: dict[int, tuple[float, ...]], head_dim: int, seq: int) -> float:
    """Bilinear interpolation of log values given at (:data:`HEAD_DIMS`, :data:`SEQS`) in
    log2 of the head dim and of the length, each clamped to the grid.

    Examples
    --------
    >>> g = {64: tuple(0.0 for _ in SEQS), 128: tuple(1.0 for _ in SEQS)}
    >>> round(interpolate_log(g, 96, 4096), 4), interpolate_log(g, 256, 100)
    (0.585, 1.0)
    """
    h0, h1, fh = _position(HEAD_DIMS, head_dim)
    s0, s1, fs = _position(SEQS, seq)

    def along_seq(hd: int) -> float:
        row = grid[hd]
        return (1 - fs) * row[s0] + fs * row[s1]

    return (1 - fh) * along_seq(HEAD_DIMS[h0]) + fh * along_seq(HEAD_DIMS[h1])


@cache
def _form_fwd_bwd_tflops(arch: str, head_dim: int, seq: int) -> float:
    """The form's FA2 forward + backward TFLOP/s at the benchmark shape, on the part the
    figure was drawn on, at burst clocks (a kernel benchmark's), without the curve."""
    from sim import catalog
    from sim.hardware.compute import ComputeModel
    from sim.hardware.power import burst_spec

    cm = ComputeModel(burst_spec(catalog.gpu(BENCHMARK_GPU[arch])), attention_backend="flash2")
    batch, heads = BENCHMARK_TOKENS // seq, BENCHMARK_HIDDEN // head_dim
    t = sum(cm.attention_time(batch, heads, seq, head_dim, p, causal=True,  # type: ignore[arg-type]
                              published_curve=False) for p in ("fwd", "bwd"))
    return 3.5 * 4.0 * batch * heads * seq * seq * head_dim * 0.5 / t / 1e12


@cache
def _speedup_grid(arch: str) -> dict[int, tuple[float, ...]]:
    return {hd: tuple(math.log(FLASH2_CAUSAL_FWD_BWD[(arch, hd)][i]
                               / _form_fwd_bwd_tflops(arch, hd, s))
                      for i, s in enumerate(SEQS)) for hd in HEAD_DIMS}


def flash2_causal_speedup(arch: str, head_dim: int, seq: int) -> float:
    """FlashAttention-2's causal kernel at its published curve, as a speed factor on the
    form at that length and head dim (below 1: the form ran it faster than published); 1
    where no curve applies (:func:`curve_arch`).

    Examples
    --------
    >>> round(flash2_causal_speedup("ampere", 128, 2048), 2)      # 155 published
    0.9
    >>> round(flash2_causal_speedup("hopper", 128, 16384), 2)     # the anchor's length
    1.01
    >>> flash2_causal_speedup("volta", 64, 2048)
    1.0
    """
    ca = curve_arch(arch)
    if ca is None:
        return 1.0
    return math.exp(interpolate_log(_speedup_grid(ca), head_dim, seq))


@cache
def _share_grid(arch: str) -> dict[int, tuple[float, ...]]:
    pairs = {hd: zip(FLASH1_CAUSAL_FWD_BWD[(arch, hd)], FLASH2_CAUSAL_FWD_BWD[(arch, hd)],
                     strict=True) for hd in HEAD_DIMS}
    return {hd: tuple(math.log(a / b) for a, b in pairs[hd]) for hd in HEAD_DIMS}


def flash1_share(arch: str, head_dim: int, seq: int = SEQS[-1]) -> float:
    """FlashAttention's first CUDA kernel's speed as a share of FlashAttention-2's at a
    length and head dim, from the published pairs (the A100's where a generation has no
    figure: the sm80 kernels keep their share, as the A100 and H100 figures agree).

    Examples
    --------
    >>> [round(flash1_share("ampere", hd), 3) for hd in (128, 64)]
    [0.439, 0.567]
    >>> round(flash1_share("ampere", 128, 512), 3), round(flash1_share("hopper", 128), 3)
    (0.556, 0.418)
    """
    return math.exp(interpolate_log(_share_grid(curve_arch(arch) or "ampere"), head_dim, seq))
