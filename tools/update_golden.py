"""Regenerate the golden outputs in ``tests/golden/`` (``make golden``).

Runs every case of ``tests/integration/test_golden.py`` (the slow shipped scenarios too; about two
minutes on 2 cores), writes each output whose value changed, deletes golden files no case
produces, and prints what moved: per case, how many values changed and the headline figure
before -> after, the lines a commit that changes goldens quotes in its message
(docs/golden.md).

Usage::

    python tools/update_golden.py               # regenerate every golden
    python tools/update_golden.py run/fsdp2 ... # only the cases whose name starts so
    python tools/update_golden.py --check       # write nothing; exit 1 if any moved
    python tools/update_golden.py --fast        # leave out the slow shipped scenarios

A case whose command fails is reported and its golden left as it was (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The test module holds the cases; found wherever under tests/ it lives.
sys.path.insert(0, str(next(ROOT.glob("tests/**/test_golden.py")).parent))
sys.path.insert(0, str(ROOT))

import test_golden as g  # noqa: E402  (the cases live with the test)

HEADLINES = ("step_time_s", "peak_memory_gib")


def headline(case: g.Case, old: Any, new: Any) -> str:
    """The case's step time and peak memory before -> after, where it has them."""
    parts = []
    for key in HEADLINES:
        if isinstance(old, dict) and isinstance(new, dict) and key in old and key in new \
                and old[key] != new[key]:
            rel = (new[key] - old[key]) / old[key] if old[key] else float("inf")
            parts.append(f"{key} {old[key]!r} -> {new[key]!r} ({rel:+.2%})")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefixes", nargs="*", help="Only the cases whose name starts so.")
    ap.add_argument("--check", action="store_true", help="Write nothing; exit 1 if any moved.")
    ap.add_argument("--fast", action="store_true",
                    help="Leave out the slow shipped scenarios (those make test skips).")
    args = ap.parse_args(argv)
    cases = [c for c in g.all_cases()
             if (not args.prefixes or any(c.name.startswith(p) for p in args.prefixes))
             and not (args.fast and c.slow)]
    moved = added = failed = rewritten = 0
    for case in cases:
        t0 = time.perf_counter()
        try:
            new = g.produce(case)
        except RuntimeError as exc:
            failed += 1
            print(f"FAILED   {case.name}: {exc}", flush=True)
            continue
        took = time.perf_counter() - t0
        if not case.path.is_file():
            added += 1
            print(f"new      {case.name} ({took:.1f} s)", flush=True)
        elif case.path.read_text() == g.dumps(case, new):
            print(f"same     {case.name} ({took:.1f} s)", flush=True)
            continue
        else:
            old = g.load(case)
            diffs = list(g.differences(old, new))
            if not diffs:
                # Same output; the command line or the file's layout changed.
                print(f"rewrite  {case.name} (same output)", flush=True)
                rewritten += 1
                if not args.check:
                    case.path.write_text(g.dumps(case, new))
                continue
            moved += 1
            print(f"MOVED    {case.name}: {len(diffs)} value(s); "
                  f"{headline(case, old, new) or diffs[0][0]}", flush=True)
        if not args.check:
            case.path.parent.mkdir(parents=True, exist_ok=True)
            case.path.write_text(g.dumps(case, new))
    stray: list[Path] = []
    if not args.prefixes and not args.fast:
        known = {c.path for c in g.all_cases()}
        stray = [p for p in sorted(g.GOLDEN.rglob("*.json")) if p not in known]
        for p in stray:
            print(f"stray    {p.relative_to(g.GOLDEN)}" + ("" if args.check else " (deleted)"))
            if not args.check:
                p.unlink()
    print(f"{len(cases)} cases: {moved} moved, {added} new, {rewritten} rewritten with the "
          f"same output, {len(stray)} stray, {failed} failed"
          + (" (nothing written)" if args.check else ""))
    return 1 if failed or (args.check and (moved or added or rewritten or stray)) else 0


if __name__ == "__main__":
    sys.exit(main())
