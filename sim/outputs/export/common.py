"""What the trace exports share: the one rounding of simulated times to trace times, rank
lists, stream order and the arguments shown for an op.

Part of :mod:`sim.outputs.export` (which re-exports the public names):
:mod:`sim.outputs.export.perfetto` and
:mod:`sim.outputs.export.hta` write their slices through :func:`time_ns` and :func:`us_from_ns`, so
both traces place an op at the same nanosecond.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

from sim.analysis.metrics import COMM_KINDS
from sim.engine.recorder import OpRecord, Recorder
from sim.program.ir import Op

GIB = float(2**30)

# How many ranks of a group an op's arguments list before "..." (a 4,096-rank data-parallel
# group would otherwise fill the details panel).
ARG_RANKS = 8


def time_ns(t: float) -> int:
    """Simulated seconds as integer nanoseconds: the one rounding every slice goes through.

    Rounding is monotonic, so an op that starts when the previous op of its stream ends (or
    later) still does after rounding.

    Examples
    --------
    >>> time_ns(0.0013405952013191599)
    1340595
    """
    return round(t * 1e9)


def us_from_ns(ns: int) -> float:
    """Integer nanoseconds as the microseconds a trace holds: the nearest double to
    ``ns / 1000``, moved up one unit in the last place where that double times 1000 falls
    below ``ns``, so that importers which round (Perfetto: ``llround(us * 1000)``) and those
    which truncate (older Perfetto, ``static_cast<int64_t>``) both read ``ns`` back.

    Examples
    --------
    >>> us_from_ns(1340595)
    1340.595
    >>> all(int(us_from_ns(n) * 1000) == n for n in range(1, 100_000, 7))
    True
    """
    x = ns / 1000
    if x * 1000 < ns:
        x = math.nextafter(x, math.inf)
    return x


def rank_list(ranks: Sequence[int], limit: int = ARG_RANKS) -> str:
    """Ranks as ranges, at most ``limit`` items before "...".

    Examples
    --------
    >>> rank_list((0, 1, 2, 3, 4, 5, 6, 7))
    '0-7'
    >>> rank_list((0, 8, 16, 24, 32, 40, 48, 56, 64, 72), limit=4)
    '0, 8, 16, 24, ... (10 ranks)'
    """
    items: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        items.append(f"{ranks[i]}-{ranks[j]}" if j > i else str(ranks[i]))
        i = j + 1
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", ... ({len(ranks)} ranks)"
    return ", ".join(items)


@functools.lru_cache(maxsize=4096)
def _group_rank_list(group: tuple[int, ...]) -> str:
    # A step's thousands of collectives share a few groups: each is written once.
    return rank_list(group)


def stream_order(ops: Iterable[Op]) -> list[str]:
    """A class's streams, compute first, the others in the order the program first uses them."""
    first: dict[str, int] = {}
    for op in ops:
        first.setdefault(op.stream, op.index if op.index >= 0 else len(first))
    return sorted(first, key=lambda s: (s != "compute", first[s], s))


def group_args(op: Op) -> dict[str, Any]:
    """Who takes part: group size and the first ranks (collectives), or transfer pairs."""
    args: dict[str, Any] = {}
    groups = op.all_groups
    if groups:
        args["group_size"] = len(groups[0])
        args["ranks"] = _group_rank_list(tuple(groups[0]))
        if len(groups) > 1:
            args["groups"] = len(groups)
    if op.pairs:
        shown = ", ".join(f"{s}->{d}" for s, d in op.pairs[:ARG_RANKS])
        more = f", ... ({len(op.pairs)} pairs)" if len(op.pairs) > ARG_RANKS else ""
        args["pairs"] = shown + more
    return args


def op_args(r: OpRecord, rec: Recorder) -> dict[str, Any]:
    """What a trace shows about one op when it is selected."""
    op = r.op
    args: dict[str, Any] = {"category": op.category, "phase": op.phase, "kind": op.kind,
                            "step": r.step}
    if op.nbytes:
        args["bytes"] = op.nbytes
    if op.host_transfer is not None:
        args["transfer"] = op.host_transfer
    args.update(group_args(op))
    choice = rec.collective_choices.get(op.key) if op.key else None
    if choice is not None:
        args["algorithm"] = choice.algorithm
        args["protocol"] = choice.protocol
        args["predicted_us"] = choice.predicted_s * 1e6
    if op.layer is not None:
        args["layer"] = op.layer
    if op.micro_batch is not None:
        args["micro_batch"] = op.micro_batch
    if op.kernels != 1:
        args["kernels"] = op.kernels
    if op.hw_flops:
        args["flops"] = op.hw_flops
    args["ready_us"] = r.ready * 1e6
    if op.kind in COMM_KINDS:
        # Time between reaching the head of its stream and every member having arrived.
        args["wait_for_peers_us"] = (r.start - r.ready) * 1e6
    return args

