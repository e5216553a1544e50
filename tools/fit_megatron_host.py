"""Fit ``MEGATRON_CPU_S_PER_OP`` (Megatron's host seconds per Python-level torch op) on vTrain's
FIT half, and report the VALIDATE half it is then checked on.

The constant is the one free parameter of the host side of the Megatron builder
(:mod:`sim.frameworks.megatron.build`): the host issues ``PYTHON_OPS`` ops per block at this cost
each, and a step of a small model on few GPUs is bound by it. It is fitted here, and only
here, on the rows of ``half_of(kind, i) == "fit"`` (:mod:`sim.apps.validation.vtrain`); the
``vtrain-single`` / ``vtrain-multi`` validation suites report the other half.

Method: the MAPE of the simulated iteration time over the chosen fit rows is minimised by a
golden-section search on [``--lo``, ``--hi``] microseconds (the MAPE is unimodal in the
constant over that range: below it the host hides behind the GPU on every row, above it the
overhead-bound rows run slow), then rounded to ``--round`` microseconds (the precision the
data supports). The single-node fit half (720 rows, about 0.01-0.05 s each) is the default
fit set: its small models are the rows the constant moves. Multi-node rows (64-512 GPUs)
take seconds to minutes each and barely depend on the constant; add them with
``--multi-every``.

Usage (from the repository root; a few CPU-minutes with the defaults)::

    python tools/fit_megatron_host.py                      # fit on every 2nd fit-half row
    python tools/fit_megatron_host.py --every 1            # the whole single-node fit half
    python tools/fit_megatron_host.py --evaluate 34 --half validate --multi-every 4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sim.frameworks.megatron.build as megatron  # noqa: E402
from sim.api import simulate  # noqa: E402
from sim.apps.validation.vtrain import MEASURED, row_indices, rows, scenario_for  # noqa: E402
from sim.scenario import scenario_from_dict  # noqa: E402

GOLDEN = (math.sqrt(5) - 1) / 2


def errors(kind: str, indices: list[int], cpu_s_per_op: float) -> list[float]:
    """Signed relative errors of the simulated iteration time of the rows ``indices`` of
    ``kind`` with the constant set to ``cpu_s_per_op``."""
    saved = megatron.MEGATRON_CPU_S_PER_OP
    megatron.MEGATRON_CPU_S_PER_OP = cpu_s_per_op
    try:
        table = rows(kind)
        out = []
        for i in indices:
            sc = scenario_from_dict(scenario_for(table[i]), origin=f"vtrain-{kind} row {i}")
            measured = float(table[i][MEASURED]) / 1e3
            out.append((simulate(sc).summary["step_time_s"] - measured) / measured)
        return out
    finally:
        megatron.MEGATRON_CPU_S_PER_OP = saved


def summary(errs: list[float]) -> dict[str, float]:
    n = len(errs)
    return {"rows": n, "mape": sum(abs(e) for e in errs) / n if n else 0.0,
            "mean_signed": sum(errs) / n if n else 0.0}


def fit(sets: list[tuple[str, list[int]]], lo_us: float, hi_us: float, tol_us: float,
        log: bool = True) -> tuple[float, list[tuple[float, float]]]:
    """Golden-section minimum of the pooled MAPE over ``sets`` ((kind, row indices) pairs);
    returns the minimiser in seconds and the (microseconds, MAPE) points evaluated."""
    seen: dict[float, float] = {}

    def mape(us: float) -> float:
        if us not in seen:
            errs = [e for kind, idx in sets for e in errors(kind, idx, us * 1e-6)]
            seen[us] = sum(abs(e) for e in errs) / len(errs)
            if log:
                print(f"  {us:7.3f} us/op: MAPE {seen[us]:.4%}", file=sys.stderr, flush=True)
        return seen[us]

    a, b = lo_us, hi_us
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    while b - a > tol_us:
        if mape(c) <= mape(d):
            b, d = d, c
            c = b - GOLDEN * (b - a)
        else:
            a, c = c, d
            d = a + GOLDEN * (b - a)
    best = min(seen, key=lambda k: seen[k])
    return best * 1e-6, sorted(seen.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=int, default=2,
                    help="use every N-th single-node row of the half (default 2: 360 rows)")
    ap.add_argument("--multi-every", type=int, default=0,
                    help="also use every N-th multi-node row of the half (0: none)")
    ap.add_argument("--lo", type=float, default=5.0, help="search range, us per op")
    ap.add_argument("--hi", type=float, default=80.0, help="search range, us per op")
    ap.add_argument("--tol", type=float, default=0.5, help="search tolerance, us per op")
    ap.add_argument("--round", type=float, default=1.0, help="report to this many us")
    ap.add_argument("--evaluate", type=float, default=None,
                    help="no fit: report this value (us per op) on --half")
    ap.add_argument("--half", choices=("fit", "validate", "all"), default="fit",
                    help="rows to fit on (or evaluate with --evaluate); default fit")
    args = ap.parse_args(argv)

    sets = [("single", row_indices("single", args.half, args.every))]
    if args.multi_every:
        sets.append(("multi", row_indices("multi", args.half, args.multi_every)))
    t0 = time.time()
    if args.evaluate is not None:
        out: dict[str, object] = {"half": args.half, "us_per_op": args.evaluate}
        for kind, idx in sets:
            out[kind] = summary(errors(kind, idx, args.evaluate * 1e-6))
    else:
        if args.half == "validate":
            ap.error("fitting on the validate half is what this split exists to prevent")
        best, points = fit(sets, args.lo, args.hi, args.tol)
        rounded = round(best * 1e6 / args.round) * args.round
        out = {"half": args.half, "rows": {k: len(i) for k, i in sets},
               "fitted_us_per_op": best * 1e6, "rounded_us_per_op": rounded,
               "points": [[us, m] for us, m in points]}
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
