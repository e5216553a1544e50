"""Whole runs played out: interruptions, restarts, lost work and checkpoints (numpy).

The model (one synchronous job; any interruption stops every rank):

- The run needs ``work_s`` seconds of useful training (steps x simulated step time). It saves
  a checkpoint after every ``segment_s`` of useful work; each save blocks training for
  ``blocking_s`` and, when asynchronous, becomes durable ``durable_after_s`` later (the
  background write); the run ends when its last checkpoint is durable.
- Interruptions arrive as a Poisson process (exponential gaps, rate = the sum of the
  components' rates: Llama 3's 419 interruptions in 54 days are spread evenly enough for
  this, sec. 3.3.4), each of one component drawn in proportion to its rate.
- An unplanned interruption loses the work since the last *durable* checkpoint; training
  resumes after ``restart_s``. One that takes a server out (``needs_node``) swaps in a hot
  spare if one is free (the broken server comes back as a spare ``repair_s`` later), else
  waits ``replace_s`` more for a replacement.
- A planned stop saves first (``save_s``, a synchronous write): no work lost.

Exponential gaps are memoryless, so after each restart the rest of the run is a fresh start
from the durable progress: each loop iteration draws, for every simulated run at once, the
time to the next interruption and whether the run finishes first. Same seed, same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_INTERRUPTIONS = 1e6
"""Refuse a run expecting more interruptions than this (segments x (exp(rate x segment) - 1),
the renewal form's count): one loop iteration each, and a run that restarts a million times
is not one anybody would start."""


@dataclass(frozen=True)
class RunInputs:
    """Everything the Monte Carlo needs, in seconds and per-second rates."""

    work_s: float
    """Useful training time of the whole run (steps x step time)."""
    segment_s: float
    """Useful training time between checkpoints (interval steps x step time)."""
    blocking_s: float
    """Time each checkpoint stops training."""
    durable_after_s: float
    """Time after the blocking part until the checkpoint is durable (async write; 0 sync)."""
    save_s: float
    """A synchronous save before a planned stop."""
    restart_s: float
    """Interruption to training again (detection, restart, checkpoint load)."""
    replace_s: float
    """Extra wait when a server must be replaced and no hot spare is free."""
    repair_s: float
    """A replaced server's time back to the spare pool."""
    spares: int
    rates_per_s: tuple[float, ...]
    """Each component's interruption rate for the whole job, per second."""
    needs_node: tuple[bool, ...]
    planned: tuple[bool, ...]


@dataclass(frozen=True)
class Runs:
    """The simulated runs, one entry per sample."""

    wall_s: np.ndarray
    interruptions: np.ndarray
    down_s: np.ndarray
    """Time stopped: restarts, replacement waits, planned saves."""
    waits_s: float
    """Replacement waits summed over all samples."""
    unplanned: int
    """Unplanned interruptions summed over all samples."""


@dataclass
class RunState:
    """Where each simulated run stands in the loop, and the loop's totals."""

    w: np.ndarray
    """Durable useful progress."""
    t: np.ndarray
    """Wall clock."""
    down: np.ndarray
    count: np.ndarray
    spare_free: np.ndarray
    """When each hot spare is free again."""
    rows: np.ndarray
    waits: float = 0.0
    unplanned: int = 0

    @classmethod
    def start(cls, samples: int, spares: int) -> RunState:
        return cls(w=np.zeros(samples), t=np.zeros(samples), down=np.zeros(samples),
                   count=np.zeros(samples, dtype=np.int64),
                   spare_free=np.zeros((samples, spares)), rows=np.arange(samples))


def component_failure(inp: RunInputs, st: RunState, hit: np.ndarray, gap: np.ndarray,
                      is_planned: np.ndarray, node: np.ndarray) -> np.ndarray:
    """The runs in ``hit`` are interrupted ``gap`` seconds on: they keep the work of the
    checkpoints durable by then (a planned stop saves first and keeps all of it), stop for
    the restart (and the save), and wait for a server where ``node`` needs one and no hot
    spare is free. Returns the durable work at ``gap`` for every run."""
    cycle = inp.segment_s + inp.blocking_s
    # Durable checkpoints by the interruption: saves that finished their write.
    durable = np.floor(np.maximum(gap - inp.durable_after_s, 0.0) / cycle) * inp.segment_s
    full = np.floor(gap / cycle)
    kept_planned = full * inp.segment_s + np.minimum(gap - full * cycle, inp.segment_s)
    gained = np.where(is_planned, kept_planned, durable)
    stop = inp.restart_s + np.where(is_planned, inp.save_s, 0.0)
    wait = np.zeros(len(gap))
    if inp.spares > 0:
        now = st.t + gap
        first = np.argmin(st.spare_free, axis=1)
        free = st.spare_free[st.rows, first] <= now
        swap = node & free
        st.spare_free[st.rows[swap], first[swap]] = now[swap] + inp.repair_s
        wait[node & ~free] = inp.replace_s
    else:
        wait[node] = inp.replace_s
    st.w[hit] = np.minimum(st.w[hit] + gained[hit], inp.work_s)
    st.t[hit] += gap[hit] + stop[hit] + wait[hit]
    st.down[hit] += stop[hit] + wait[hit]
    st.count[hit] += 1
    st.waits += float(wait[hit].sum())
    st.unplanned += int((hit & ~is_planned).sum())
    return durable


def checkpoints_needed(remaining_s: np.ndarray, segment_s: float) -> np.ndarray:
    """Checkpoints left for ``remaining_s`` of useful work: one per full segment and one at
    the end (a final partial segment is saved too)."""
    return np.ceil(remaining_s / segment_s * (1 - 1e-12))


def simulate_runs(inp: RunInputs, samples: int, seed: int) -> Runs:
    """Play ``samples`` whole runs (vectorised over the runs; one iteration per interruption).

    Raises ValueError when the interruptions are so frequent against the checkpoint segment
    that the run would practically never finish."""
    rates = np.asarray(inp.rates_per_s, dtype=float)
    lam = float(rates.sum())
    cycle = inp.segment_s + inp.blocking_s
    segments = math.ceil(inp.work_s / inp.segment_s) if inp.work_s > 0 else 0
    expected = segments * math.expm1(min(lam * (cycle + inp.durable_after_s), 700.0))
    if expected > MAX_INTERRUPTIONS:
        raise ValueError(f"run: {lam * 3600:.3g} interruptions per hour against a checkpoint "
                         f"every {cycle / 60:.3g} min: about {expected:.2g} restarts, the run "
                         "would practically never finish (checkpoint more often)")
    rng = np.random.default_rng(seed)
    st = RunState.start(samples, inp.spares)
    active = np.ones(samples, dtype=bool)
    cum = np.cumsum(rates) / lam if lam > 0 else rates
    needs = np.asarray(inp.needs_node, dtype=bool)
    planned = np.asarray(inp.planned, dtype=bool)
    while active.any():
        remaining = inp.work_s - st.w
        finish_s = (remaining + checkpoints_needed(remaining, inp.segment_s) * inp.blocking_s
                    + inp.durable_after_s)
        if lam == 0:
            st.t[active] += finish_s[active]
            break
        gap = rng.exponential(1.0 / lam, samples)
        comp = np.minimum(np.searchsorted(cum, rng.random(samples), side="right"),
                          len(rates) - 1)
        done = active & (gap >= finish_s)
        st.t[done] += finish_s[done]
        active &= ~done
        component_failure(inp, st, active, gap, planned[comp], active & needs[comp])
    return Runs(wall_s=st.t, interruptions=st.count, down_s=st.down, waits_s=st.waits,
                unplanned=st.unplanned)


def expected_segment_s(segment_s: np.ndarray, blocking_s: np.ndarray, durable_after_s: float,
                       rate_per_s: float, downtime_s: float) -> np.ndarray:
    """Expected wall time of a checkpoint segment under Poisson interruptions (the renewal
    form of Daly, "A higher order estimate of the optimum checkpoint interval for restart
    dumps", FGCS 22 (2006), eq. 11): useful work ``segment_s`` plus ``blocking_s`` that must
    run ``L = segment_s + blocking_s + durable_after_s`` without interruption takes
    ``(1/rate + downtime)(exp(rate L) - 1)`` on average; the asynchronous tail overlaps the
    next segment, so it is taken back once. Without interruptions: segment + blocking. Exact
    for synchronous saves (what :func:`simulate_runs` plays); for async a slight overestimate
    (the tail's risk is counted against this segment)."""
    if rate_per_s <= 0:
        return segment_s + blocking_s
    span = segment_s + blocking_s + durable_after_s
    # Capped exponent: a segment expecting e**600 restarts is as good as never done, and
    # stays finite (no inf x 0 = nan in the caller's sums).
    exponent = np.minimum(rate_per_s * span, 600.0)
    return (1.0 / rate_per_s + downtime_s) * np.expm1(exponent) - durable_after_s


def expected_ettr(segment_s: np.ndarray, blocking_s: np.ndarray, durable_after_s: float,
                  rate_per_s: float, downtime_s: float) -> np.ndarray:
    """Useful work over expected wall time of one segment (:func:`expected_segment_s`)."""
    return segment_s / expected_segment_s(segment_s, blocking_s, durable_after_s, rate_per_s,
                                          downtime_s)


def young_daly_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval, sqrt(2 x checkpoint cost x MTBF)
    (Young, CACM 17(9), 1974; Daly 2006 eq. 37's leading term)."""
    return float(np.sqrt(2.0 * checkpoint_s * mtbf_s))
