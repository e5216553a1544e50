"""Per-link rates kept as changes (the recorder's ``link_series``, the splice's log).

Independent truth: the dense rates themselves. Replaying the changes must give back every
link's rate after every report, and the bytes a link carried are the integral of its step
function, computed here by hand.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.recorder import Recorder
from sim.engine.report_log import RATES, LinkRatesReplay, LogTap, link_rates_repeat

N_LINKS = 6
rates_strategy = st.lists(
    st.tuples(st.floats(0.0, 1.0), st.lists(st.sampled_from([0.0, 0.5, 2.0, 1e9]),
                                            min_size=N_LINKS, max_size=N_LINKS)),
    min_size=1, max_size=25)


def _dense_series(steps: list[tuple[float, list[float]]]) -> list[tuple[float, np.ndarray]]:
    """(time, rates) in time order, as the network reports them (repeats of a time allowed)."""
    t = 0.0
    out = []
    for dt, rates in steps:
        t += dt
        out.append((t, np.array(rates)))
    return out


@settings(max_examples=60, deadline=None)
@given(rates_strategy)
def test_recorded_changes_rebuild_every_rate_and_the_bytes(steps: list[tuple[float, list[float]]]
                                                          ) -> None:
    series = _dense_series(steps)
    rec = Recorder(keep_link_series=True)
    for t, rates in series:
        rec.on_rates(t, np.zeros(1), rates)
    # The last report at each time stands (a second solve at the same moment replaces the
    # first); rates at or below a byte per second are an emptied link's rounding.
    last_at: dict[float, np.ndarray] = {}
    for t, rates in series:
        last_at[t] = np.where(rates > 1.0, rates, 0.0).astype(np.float32)
    now = np.zeros(N_LINKS, dtype=np.float32)
    rebuilt: dict[float, np.ndarray] = {}
    for t, idx, new in rec.link_series:
        assert len(idx) and np.all(now[idx] != new)   # only real changes are kept
        now = now.copy()
        now[idx] = new
        rebuilt[t] = now
    held = np.zeros(N_LINKS, dtype=np.float32)
    for t in sorted(last_at):
        if t in rebuilt:
            held = rebuilt[t]
        assert np.array_equal(held, last_at[t])
    # Bytes: each link's step function integrated to a time past the last report.
    end = series[-1][0] + 0.25
    times = sorted(last_at)
    want = np.zeros(N_LINKS)
    for i, t in enumerate(times):
        until = times[i + 1] if i + 1 < len(times) else end
        want += last_at[t].astype(float) * (until - t)
    assert np.allclose(rec.link_bytes(end), want, rtol=1e-12, atol=1e-3)


def test_the_log_replays_every_links_rate_and_finds_whether_a_period_repeats() -> None:
    tap = LogTap(keep_link_rates=True)
    reported = [np.array([0.0, 3.0, 0.0]), np.array([5.0, 3.0, 0.0]),
                np.array([5.0, 0.0, 7.0]), np.array([5.0, 3.0, 0.0]),
                np.array([5.0, 0.0, 7.0])]
    tap._solves = lambda: 0  # type: ignore[method-assign]   # no engine behind it here
    for i, rates in enumerate(reported):
        tap.on_rates(float(i), np.zeros(1), rates)
    replay = LinkRatesReplay()
    for entry, rates in zip(tap.entries, reported, strict=True):
        assert entry[0] == RATES
        assert np.array_equal(replay.apply(entry[4][1]), rates)
    # Reports 1 -> 3 and 2 -> 4 repeat (same rates); 0 -> 2 does not.
    assert link_rates_repeat(tap.entries, 1, 2) and link_rates_repeat(tap.entries, 2, 2)
    assert not link_rates_repeat(tap.entries, 0, 2)
    # Reports 1 and 4 both change link 0 alone to 1.0, yet link 1 differs after them.
    other = LogTap(keep_link_rates=True)
    other._solves = lambda: 0  # type: ignore[method-assign]
    for i, rates in enumerate([np.zeros(2), np.array([1.0, 0.0]), np.array([1.0, 4.0]),
                               np.array([0.0, 4.0]), np.array([1.0, 4.0])]):
        other.on_rates(float(i), np.zeros(1), rates)
    assert not link_rates_repeat(other.entries, 1, 3)
    assert link_rates_repeat(other.entries, 2, 2)


@settings(max_examples=60, deadline=None)
@given(rates_strategy)
def test_reports_naming_their_changed_links_record_the_same_series(
        steps: list[tuple[float, list[float]]]) -> None:
    """A replay names the links whose rates changed (``on_rates_changed``); the recorder then
    compares those alone and must keep the very changes, bytes and class rates that comparing
    every link keeps (repeated times, sub-byte rates and float32 rounding included)."""
    series = _dense_series(steps)
    tap = LogTap(keep_link_rates=True)
    tap._solves = lambda: 0  # type: ignore[method-assign]   # no engine behind it here
    dense, named = Recorder(keep_link_series=True), Recorder(keep_link_series=True)
    for t, rates in series:
        tap.on_rates(t, np.full(1, t), rates)
        dense.on_rates(t, np.full(1, t), rates)
    replay = LinkRatesReplay()
    for _, t, _, _, (class_rates, links), _ in tap.entries:
        named.on_rates_changed(t, class_rates, replay.apply(links), links[0])
    assert len(named.link_series) == len(dense.link_series)
    for (ta, ia, ra), (tb, ib, rb) in zip(named.link_series, dense.link_series, strict=True):
        assert ta == tb and np.array_equal(ia, ib) and np.array_equal(ra, rb)
        assert ia.dtype == ib.dtype and ra.dtype == rb.dtype
    end = series[-1][0] + 0.25
    assert np.array_equal(named.link_bytes(end), dense.link_bytes(end))
    assert [t for t, _ in named.rate_series] == [t for t, _ in dense.rate_series]
