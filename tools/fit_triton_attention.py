"""Fit flash_attn_triton's head-dim-128 speed over FlashAttention's CUDA kernel's, per GPU
generation, on llm-foundry's MPT benchmark rows (``sim.hardware.attention_cost``
``TRITON_OVER_CUDA_AT_128``).

The fit rows are :func:`sim.apps.validation.llm_foundry.half_of`'s "fit" half: head dim 128,
8k tokens and more, 8 GPUs; A100 80GB for Ampere, MPT-760M to -3B on H100 for Hopper. For
each generation the factor minimising the mean absolute throughput error over its fit rows is
found on a 0.01 grid between 1.00 and 1.50 (the error is smooth and single-minimum there).
Every other row is the ``llm-foundry`` validation suite. Prints the factors and both halves'
MAPE; writes nothing: copy the factors into ``attention_cost.py``.

    python tools/fit_triton_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.apps.validation import llm_foundry as lf  # noqa: E402
from sim.hardware import attention_cost  # noqa: E402

ARCH = {"a100_80gb": "ampere", "a100_40gb": "ampere", "h100_80gb": "hopper"}


def errors(rows: list[dict[str, str]]) -> list[float]:
    return [lf.row_case(r)["error"] for r in rows]


def mape(rows: list[dict[str, str]]) -> float:
    e = errors(rows)
    return sum(abs(x) for x in e) / len(e)


def fit(arch: str, rows: list[dict[str, str]]) -> float:
    """Golden-section search of the factor on [1.0, 1.5], rounded to 0.01."""
    lo, hi = 1.0, 1.5
    g = (5 ** 0.5 - 1) / 2

    def at(f: float) -> float:
        attention_cost.TRITON_OVER_CUDA_AT_128[arch] = f
        return mape(rows)

    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = at(a), at(b)
    while hi - lo > 0.005:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = at(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = at(b)
    best = round((lo + hi) / 2, 2)
    attention_cost.TRITON_OVER_CUDA_AT_128[arch] = best
    return best


def main() -> None:
    all_rows = lf.rows()
    fit_rows = [r for r in all_rows if lf.half_of(r) == "fit"]
    for arch in ("ampere", "hopper"):
        mine = [r for r in fit_rows if ARCH[r["gpu"]] == arch]
        before = dict(attention_cost.TRITON_OVER_CUDA_AT_128)
        attention_cost.TRITON_OVER_CUDA_AT_128[arch] = 1.0
        start = mape(mine)
        best = fit(arch, mine)
        print(f"{arch}: {len(mine)} fit rows, MAPE {start:.1%} at 1.00 -> {mape(mine):.1%} "
              f"at {best:.2f} (code has {before[arch]:.2f})")
    val = [r for r in all_rows if lf.half_of(r) == "validate"]
    for arch in ("ampere", "hopper"):
        mine = [r for r in val if ARCH[r["gpu"]] == arch]
        print(f"{arch}: {len(mine)} validation rows, MAPE {mape(mine):.1%}")


if __name__ == "__main__":
    main()
