"""A simulated run's checkpoint saves, measured on its timeline (``run.checkpoint.simulate``).

The window starts at a checkpoint step (:class:`sim.engine.checkpointing.CheckpointSetup`), so
its first step's training work (every op but the save's) runs with nothing before it: its
span is the clean step. The first save has no earlier write to wait for: what it adds to its
step is the save's own blocking time (the whole write when synchronous, the device-to-host
staging copy when asynchronous). Every later step's training span above the clean step is
what the background writes cost the training by contending for links (the steps' own
variation, ``faults.jitter``, adds to it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sim.analysis.metrics import step_spans
from sim.analysis.summary import CheckpointFigures
from sim.engine.recorder import OpRecord, Recorder
from sim.program.checkpoint_ops import is_checkpoint_op

__all__ = ["checkpoint_figures"]


def _training_ends(records: Iterable[OpRecord]) -> dict[int, float]:
    ends: dict[int, float] = {}
    for r in records:
        if not is_checkpoint_op(r.op) and r.end > ends.get(r.step, -1.0):
            ends[r.step] = r.end
    return ends


def checkpoint_figures(rec: Recorder, saves_after: Callable[[int], bool], bytes_total: float,
                       asynchronous: bool, storage: str, cross_az_bytes: float = 0.0,
                       cross_region_bytes: float = 0.0) -> CheckpointFigures:
    """The summary's ``checkpoint`` object (:class:`CheckpointFigures`).

    ``saves_after(i)``: whether step ``i`` (0-based) ended with a save; ``bytes_total`` the
    bytes of one save; ``cross_*_bytes`` what one save puts on zone and region links."""
    spans = step_spans(rec.ops)
    ends = _training_ends(rec.ops)
    steps = len(spans)
    t0, e0 = spans[0]
    clean = ends[0] - t0
    blocking = e0 - ends[0]
    saves = sum(1 for i in range(steps) if saves_after(i))
    first = [r for r in (*rec.ops, *rec.background_ops)
             if r.step == 0 and is_checkpoint_op(r.op) and r.op.nbytes > 0]
    begin = min(r.start for r in first)
    write_end = max(r.end for r in first)
    stage = [r for r in first if r.op.host_transfer == "d2h"]
    # The longest rank class's copy (pipeline stages reach the save at different times).
    d2h = max((r.end - r.start for r in stage), default=0.0)
    # Training time the background writes took from the steps (none when synchronous).
    slowed = sum(ends.get(i, spans[i][1]) - spans[i][0] - clean for i in range(1, steps))
    if abs(slowed) <= 1e-12 * steps * clean:   # rounding of equal steps, not a slowdown
        slowed = 0.0
    write_s = write_end - begin
    return {
        "saves": saves,
        "window_steps": steps,
        "storage": storage,
        "asynchronous": asynchronous,
        "gb_per_save": bytes_total / 1e9,
        "clean_step_s": clean,
        "blocking_s": blocking,
        "d2h_s": d2h,
        "write_s": write_s,
        "write_gbytes_per_s": bytes_total / write_s / 1e9 if write_s > 0 else 0.0,
        "contention_s_per_save": slowed / saves if saves else 0.0,
        "write_ends_in_window": write_end <= spans[-1][1],
        "cross_az_gb_per_save": cross_az_bytes / 1e9,
        "cross_region_gb_per_save": cross_region_bytes / 1e9,
    }
