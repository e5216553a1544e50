"""Fit ``INTERNODE_CALL_S`` (``sim/fabric/collectives/hybridep_kernel.py``): the fixed time of a
Hybrid-EP dispatch or combine across NVLink domains, beyond the bytes its flows move.

Data: Hybrid-EP's own H100 benchmark (``sim/catalog/reference/hybridep_benchmark.yaml``: EP 16,
32 and 64 over two to eight DGX H100 nodes, dispatch and combine, kernel time), six rows. Each
row is simulated alone (:mod:`sim.apps.validation.hybridep_benchmark`) with the constant set to
0; the measured time minus the simulated one is nearly the same at every EP size (0.25-0.47
ms), where a factor on the time would have to fall from 1.37 to 1.05: the constant is their
mean (the least-squares offset), rounded to ``--round`` seconds. The ``published-moe`` rows of
16 H100s with Hybrid-EP (Megatron-Bridge's Qwen3-30B-A3B runs) check it; none is fitted.

Usage (from the repository root; seconds)::

    python tools/fit_hybridep_internode.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.apps.validation import hybridep_benchmark as hb  # noqa: E402
from sim.fabric.collectives import hybridep_kernel  # noqa: E402


def offsets() -> list[tuple[int, str, float, float]]:
    """(ranks, call, simulated s without the fixed time, measured s) of every row."""
    saved = hybridep_kernel.INTERNODE_CALL_S
    hybridep_kernel.INTERNODE_CALL_S = 0.0
    try:
        return [(r, w, *hb.benchmark_times(r, w)) for r in sorted(hb.reference()["h100"])
                for w in hb.WHICH]
    finally:
        hybridep_kernel.INTERNODE_CALL_S = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", type=float, default=1e-5, help="rounding of the result (s)")
    args = ap.parse_args()
    rows = offsets()
    for ranks, which, sim, meas in rows:
        print(f"EP {ranks:3d} {which:13s} simulated {sim * 1e3:6.3f} ms, measured "
              f"{meas * 1e3:6.3f} ms: +{(meas - sim) * 1e3:.3f} ms (x{meas / sim:.3f})")
    mean = sum(m - s for _, _, s, m in rows) / len(rows)
    fitted = round(mean / args.round) * args.round
    print(f"INTERNODE_CALL_S = {fitted:.6g}  (mean offset {mean * 1e3:.4f} ms over {len(rows)} "
          f"rows; in the code now: {hybridep_kernel.INTERNODE_CALL_S:.6g})")


if __name__ == "__main__":
    main()
