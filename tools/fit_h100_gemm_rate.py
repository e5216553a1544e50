"""Fit ``h100-sxm.gemm_rate_factor`` (``sim/catalog/gpus.yaml``) on Megatron-LM's bf16 MoE layer
timings on eight H100s, and report the blockwise FP8 timings it is then checked on.

The factor is the GEMM throughput an H100 SXM5 holds in a node whose eight GPUs all run, over
what the compute model fitted on the lent H200 gives it
(:func:`sim.hardware.power.sustained_gemm_flops`; fused attention keeps its own kernel
measurements). It is fitted here, and only here, on the
``moe-layer-fit`` cases (:mod:`sim.apps.validation.moe_layer`: six bf16 layers, forward and
backward); the ``moe-layer`` suite (blockwise FP8) and the end-to-end ``published`` and
``published-moe`` H100 rows check it.

Method: the sum of squared log errors of the twelve simulated pass times is minimised by a
golden-section search on [``--lo``, ``--hi``], then rounded to ``--round`` (the precision
twelve timings of one machine support).

Usage (from the repository root; seconds)::

    python tools/fit_h100_gemm_rate.py
    python tools/fit_h100_gemm_rate.py --evaluate 0.86 --half validate
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim import catalog  # noqa: E402
from sim.apps.validation.moe_layer import moe_layer_cases  # noqa: E402

GOLDEN = (math.sqrt(5) - 1) / 2
GPU = "h100-sxm"


def errors(factor: float, half: str) -> list[float]:
    """Signed relative errors of the ``half`` cases' pass times with the H100's
    ``gemm_rate_factor`` set to ``factor`` (the catalogue entry restored after)."""
    entry = catalog._load("gpus.yaml")[GPU]
    saved = entry.get("gemm_rate_factor")
    entry["gemm_rate_factor"] = factor
    try:
        return [c["error"] for c in moe_layer_cases(half)]
    finally:
        if saved is None:
            del entry["gemm_rate_factor"]
        else:
            entry["gemm_rate_factor"] = saved


def loss(errs: list[float]) -> float:
    return sum(math.log1p(e) ** 2 for e in errs)


def report(label: str, errs: list[float]) -> None:
    mape = 100 * sum(abs(e) for e in errs) / len(errs)
    mean = 100 * sum(errs) / len(errs)
    print(f"{label}: {len(errs)} pass times, MAPE {mape:.2f}%, mean {mean:+.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lo", type=float, default=0.70)
    ap.add_argument("--hi", type=float, default=1.05)
    ap.add_argument("--round", type=float, default=0.01)
    ap.add_argument("--evaluate", type=float, help="report this factor instead of fitting")
    ap.add_argument("--half", choices=["fit", "validate"], default="fit")
    args = ap.parse_args()
    if args.evaluate is not None:
        report(f"{GPU} factor {args.evaluate} on {args.half}", errors(args.evaluate, args.half))
        return
    lo, hi = args.lo, args.hi
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    fa, fb = loss(errors(a, "fit")), loss(errors(b, "fit"))
    while hi - lo > args.round / 10:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - GOLDEN * (hi - lo)
            fa = loss(errors(a, "fit"))
        else:
            lo, a, fa = a, b, fb
            b = lo + GOLDEN * (hi - lo)
            fb = loss(errors(b, "fit"))
    best = round((lo + hi) / 2 / args.round) * args.round
    print(f"fitted {GPU}.gemm_rate_factor = {best:.2f} (optimum {(lo + hi) / 2:.4f})")
    report("fit (bf16)", errors(best, "fit"))
    report("validate (blockwise FP8)", errors(best, "validate"))
    report("factor 1 on fit", errors(1.0, "fit"))


if __name__ == "__main__":
    main()
