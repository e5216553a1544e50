"""FP8 fused attention (Transformer Engine's ``fp8_dpa``, Megatron's
``--fp8-dot-product-attention``): how much faster cuDNN's FP8 SDPA runs than its BF16 one.

No unit model predicts it: by FlashAttention-4's units (:mod:`sim.hardware.blackwell_attention`)
FP8 halves the tensor-core cycles and the operand bytes in shared memory and leaves the
exponentials, which would give 1.21x forward and 1.73x backward at head dim 128. cuDNN 9.22
measured on a GB200 gives 1.26-1.35x forward and 0.94-1.38x backward (causal, 2k-32k tokens):
the backward's extra work (quantizing dP and dS with their scales) is not in those units. So
the gain is read from cuDNN's own benchmark (``sim/catalog/reference/cudnn_sdpa.yaml``,
cudnn-frontend ``benchmark/sdpa_benchmark_training``): BF16 time over FP8 time of the same
shape, per GPU generation (GB200 for Blackwell, H200 for Hopper), pass and mask (full, causal,
sliding window), at the measured head dim nearest the call's, interpolated in log2 of the
sequence length and held at the ends.

The FP8 format follows the recipe as Transformer Engine maps it
(``attention/dot_product_attention/utils.py`` and ``dot_product_attention.py`` @ d0067d0):
delayed and current (tensorwise) scaling run per-tensor FP8 attention (the benchmark's ``fp8``
rows); the MXFP8 recipe runs cuDNN's MXFP8 attention (1 x 32 block scales, sm100 and cuDNN
>= 9.21: the ``mxfp8`` rows, 4-31% slower than ``fp8``). Where cuDNN measured none (Ampere
and older; a sliding window on Hopper, where cuDNN 9.19 refused the FP8 graph) the gain is 1.
Sliding windows: cuDNN 9.22's FP8 forward skips the band's outside as its BF16 one does (gain
1.07-1.08 at a 128-key window), but its FP8 backward does not: it grows 4x per doubling of the
length (0.54, 1.73, 6.18, 23.2 ms from 2k to 16k tokens), the whole causal triangle's work,
where the BF16 one grows 2x. So a windowed FP8 backward is priced as the causal call without
a window at the causal FP8 gain (:meth:`sim.hardware.compute.ComputeModel.attention_time`):
0.89-1.01 of measured from 2k to 8k tokens (0.79 at 16k); a later cuDNN may skip it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cache
from typing import Literal

from sim.catalog import CATALOG_DIR, GpuSpec, load_yaml
from sim.hardware.blackwell_attention import fp8_unit_gain

Kind = Literal["full", "causal", "window"]
Format = Literal["fp8", "mxfp8"]

# The part each generation's figures were measured on.
MEASURED_PART = {"blackwell": "gb200", "hopper": "h200"}

# Sliding-window rows beyond this length are left out: cuDNN 9.22's 32,768-token BF16 window
# forward took 3.2x its 16k time for 2x the rows (the row fill's fit leaves it out too).
WINDOW_MAX_SEQ = 16384


@cache
def _gains() -> dict[tuple[str, str, str, str], dict[int, list[tuple[float, float]]]]:
    """(part, format, pass, kind) -> head_dim_qk -> sorted [(log2 seq, bf16 ms / fp8 ms)]."""
    with open(CATALOG_DIR / "reference" / "cudnn_sdpa.yaml") as fh:
        ref = load_yaml(fh)
    rows = [dict(zip(ref["columns"], r, strict=True)) for r in ref["rows"]]
    shape = ("gpu", "model", "mask", "batch", "seq", "q_heads", "kv_heads", "head_dim_qk",
             "head_dim_vo", "window", "pass")
    bf16 = {tuple(r[k] for k in shape): r["ms"] for r in rows if r["dtype"] == "bfloat16"}
    out: dict[tuple[str, str, str, str], dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        twin = bf16.get(tuple(r[k] for k in shape))
        if r["dtype"] == "bfloat16" or twin is None:
            continue
        kind = "window" if r["window"] is not None else r["mask"]
        if kind == "window" and r["seq"] > WINDOW_MAX_SEQ:
            continue
        out[(r["gpu"], r["dtype"], r["pass"], kind)][r["head_dim_qk"]].append(
            (math.log2(r["seq"]), twin / r["ms"]))
    return {key: {hd: sorted(pts) for hd, pts in by_hd.items()} for key, by_hd in out.items()}


def fp8_attention_gain_on(gpu: GpuSpec, fmt: Format, pass_: Literal["fwd", "bwd"],
                          kind: Kind, head_dim: int, seq: int) -> float:
    """:func:`fp8_attention_gain` carried to ``gpu`` from the part it was measured on: times
    the units' FP8 gain on ``gpu`` over theirs on that part
    (:func:`~sim.hardware.blackwell_attention.fp8_unit_gain`). The measured part's forward
    is bound by its exponentials in FP8; Blackwell Ultra's doubled MUFU (B300, GB300,
    ``sfu_exp_per_clock_sm`` 32) lifts that bound, its BF16 forward staying MMA-bound, so its
    FP8 forward gains more: x1.65 at head dim 128, x1.32 at MLA's 160, x1.21 at 64; the
    backward, bound by shared memory, gains the same. Checked against NVIDIA's own figure,
    "~35%" more FP8 forward-pass throughput for DeepSeek-V3's attention on GB300 than on GB200
    (NVIDIA technical blog "Making Softmax More Efficient with NVIDIA Blackwell Ultra",
    2026-02), where this gives 1.32 times the SMs x clock ratio 1.004
    (``tests/unit/hardware/test_fp8_attention.py``).

    Examples
    --------
    >>> from sim import catalog
    >>> g = lambda part, hd: fp8_attention_gain_on(catalog.gpu(part), "fp8", "fwd", "causal",
    ...                                            hd, 4096)
    >>> g("gb200", 128) == g("b200", 128) == fp8_attention_gain("blackwell", "fp8", "fwd",
    ...                                                         "causal", 128, 4096)
    True
    >>> round(g("gb300", 160) / g("gb200", 160), 2)
    1.32
    """
    gain = fp8_attention_gain(gpu.arch, fmt, pass_, kind, head_dim, seq)
    part = MEASURED_PART.get(gpu.arch)
    if gain == 1.0 or gpu.arch != "blackwell" or part is None:
        return gain
    from sim import catalog
    measured = catalog.gpu(part).sfu_exp_per_clock_sm
    if gpu.sfu_exp_per_clock_sm == measured:
        return gain
    return gain * (fp8_unit_gain(pass_, head_dim, gpu.sfu_exp_per_clock_sm)
                   / fp8_unit_gain(pass_, head_dim, measured))


def fp8_attention_gain(arch: str, fmt: Format, pass_: str, kind: Kind, head_dim: int,
                       seq: int) -> float:
    """BF16 time over FP8 time of cuDNN's fused attention for one call (module docstring).

    Examples
    --------
    >>> round(fp8_attention_gain("blackwell", "fp8", "fwd", "causal", 128, 4096), 2)  # 0.391/0.305
    1.28
    >>> round(fp8_attention_gain("blackwell", "mxfp8", "fwd", "causal", 128, 4096), 2)
    1.2
    >>> round(fp8_attention_gain("hopper", "fp8", "bwd", "causal", 128, 16384), 2)  # slower
    0.65
    >>> fp8_attention_gain("hopper", "fp8", "fwd", "window", 64, 4096)   # none: 16-bit
    1.0
    >>> round(fp8_attention_gain("blackwell", "fp8", "fwd", "causal", 160, 4096), 2)  # MLA
    1.49
    """
    part = MEASURED_PART.get(arch)
    by_hd = _gains().get((part, fmt, pass_, kind)) if part else None
    if not by_hd:
        return 1.0
    # The nearest measured head dim, the wider on a tie: MLA's FLOP-weighted widths (160
    # forward, 166 backward) stand for DeepSeek's 192/128 rows.
    pts = by_hd[min(by_hd, key=lambda hd: (abs(hd - head_dim), -hd))]
    x = math.log2(seq)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable: x is within the points")
