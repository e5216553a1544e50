"""What crossed the fabric: bytes/s per link class over time (with the cumulative, billed
bytes across zone and region boundaries) and the busiest links' utilisation.

Part of :mod:`sim.outputs.plot` (which re-exports every public name here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure

from sim.engine.recorder import Recorder
from sim.fabric.topology import LINK_KINDS, Fabric
from sim.outputs.plot.common import GB, check_window, empty, save_png, step_end

LINK_KIND_COLORS = dict(zip(LINK_KINDS, ("#4C78A8", "#B279A2", "#54A24B", "#E45756",
                                         "#F58518"), strict=True))
LOG_RATE_SPAN = 10.0
"""Bytes plots use a log rate axis when the link classes' peak rates span more than this
factor (a readability choice)."""


def cumulative_bytes(rec: Recorder, kind: str, t_end: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes carried by links of one class (:data:`~sim.fabric.topology.LINK_KINDS`) from the start
    up to each rate change: the integral of the piecewise-constant ``rate_series``, as the
    flow network counts ``class_bytes``.

    Returns
    -------
    times, bytes : numpy.ndarray
        Times of the rate changes (and ``t_end`` if later), and the bytes up to each.
    """
    if not rec.rate_series:
        return np.zeros(1), np.zeros(1)
    k = LINK_KINDS.index(kind)
    ts = np.array([t for t, _ in rec.rate_series], dtype=float)
    rates = np.array([r[k] for _, r in rec.rate_series], dtype=float)
    if t_end is not None and t_end > ts[-1]:
        ts = np.append(ts, t_end)
        rates = np.append(rates, rates[-1])
    cum = np.concatenate([[0.0], np.cumsum(rates[:-1] * np.diff(ts))])
    return ts, cum


def bytes_figure(rec: Recorder, title: str = "", *, egress_usd_per_gb: float = 0.0,
                 region_egress_usd_per_gb: float = 0.0,
                 window: tuple[float, float] | None = None) -> Figure:
    """Bytes/s per link class over the step, and what crossed zone and region boundaries.

    The top panel has one step line per link class that carried traffic (GB/s summed over
    the class's links: a flow crossing three network links counts three times, as the
    summary's ``bytes`` do). Below it, for ``cross_az`` and ``cross_region`` when they carried
    bytes, the cumulative GB (the integral of the series, which ends at the summary's bytes)
    with a second y-axis in USD at the given price per GB: the billed amount is read off the
    same curve, GB x price. The time axis is the timeline's.

    Parameters
    ----------
    rec : the run's recorder
    title : first line of the title (the scenario's name)
    egress_usd_per_gb : price per GB crossing a zone boundary (``pricing.egress_usd_per_gb``)
    region_egress_usd_per_gb : price per GB crossing a region boundary
        (``pricing.region_egress_usd_per_gb``)
    window : (start, end) in seconds to zoom to
    """
    check_window(window)
    t_end = step_end(rec)
    billed = [(k, p) for k, p in (("cross_az", egress_usd_per_gb),
                                  ("cross_region", region_egress_usd_per_gb))
              if rec.rate_series and any(r[LINK_KINDS.index(k)] > 0 for _, r in rec.rate_series)]
    fig = Figure(figsize=(14, 4.0 + 2.6 * len(billed)), layout="constrained")
    axes = fig.subplots(1 + len(billed), 1, sharex=True, squeeze=False,
                        height_ratios=[1.6] + [1.0] * len(billed))[:, 0]
    ax = axes[0]
    if not rec.rate_series:
        return empty(fig, ax, "no traffic recorded")
    ts = np.array([t for t, _ in rec.rate_series] + [max(t_end, rec.rate_series[-1][0])])
    peaks = []
    for i, kind in enumerate(LINK_KINDS):
        rate = np.array([r[i] for _, r in rec.rate_series])
        if not (rate > 0).any():
            continue
        peaks.append(rate.max() / GB)
        ax.step(ts, np.append(rate, rate[-1]) / GB, where="post", label=kind,
                color=LINK_KIND_COLORS[kind], linewidth=1.0)
    ax.set_ylabel("GB/s, summed over the\nclass's links (each hop)")
    if max(peaks) > LOG_RATE_SPAN * min(peaks):
        # Link classes an order of magnitude or more apart (NVLink bursts against a zone
        # link): a log axis keeps each readable; idle stretches (0 B/s) leave gaps.
        ax.set_yscale("log")
        ax.set_ylim(min(peaks) / LOG_RATE_SPAN, max(peaks) * 2)
    else:
        ax.set_ylim(0, max(peaks) * 1.1)
    ax.legend(title="link class", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(f"{title or 'bytes over time'}\nbytes per second by link class", fontsize=10)
    ax.grid(color="#EEEEEE", linewidth=0.5)

    names = {"cross_az": "cross-AZ", "cross_region": "cross-region"}
    for bax, (kind, price) in zip(axes[1:], billed, strict=True):
        t, cum = cumulative_bytes(rec, kind, t_end)
        bax.plot(t, cum / GB, color=LINK_KIND_COLORS[kind],
                 label=f"cumulative {names[kind]} GB")
        bax.set_ylabel(f"cumulative {names[kind]}\nGB (billed)")
        bax.set_ylim(0, max(cum[-1] / GB, 1e-12) * 1.08)
        bax.grid(color="#EEEEEE", linewidth=0.5)
        bax.set_title(f"{names[kind]}: {cum[-1] / GB:,.3f} GB"
                      + (f" x \\${price:g}/GB = \\${cum[-1] / GB * price:,.4f}" if price > 0
                         else " (no price set)"), fontsize=9, loc="left")
        if price > 0:
            usd = bax.secondary_yaxis(
                "right", functions=(lambda gb, p=price: gb * p, lambda usd, p=price: usd / p))
            usd.set_ylabel(f"USD at \\${price:g}/GB")
    axes[-1].set_xlabel("time (s)")
    ax.set_xlim(window if window is not None else (0.0, t_end))
    return fig


def bytes_over_time(path: Path, rec: Recorder, title: str = "", *,
                    egress_usd_per_gb: float = 0.0, region_egress_usd_per_gb: float = 0.0,
                    window: tuple[float, float] | None = None) -> None:
    """Write :func:`bytes_figure` as a PNG."""
    save_png(bytes_figure(rec, title, egress_usd_per_gb=egress_usd_per_gb,
                       region_egress_usd_per_gb=region_egress_usd_per_gb, window=window), path)


@dataclass
class LinkUtilisation:
    """Utilisation of the busiest links over time bins."""

    links: np.ndarray
    """Link indices into the fabric, busiest first."""
    bytes: np.ndarray
    """Bytes each carried over the whole series."""
    edges: np.ndarray
    """Bin edges, seconds (``len = bins + 1``)."""
    utilisation: np.ndarray
    """Mean rate over each bin / link capacity, shape (links, bins)."""


def link_utilisation(rec: Recorder, fabric: Fabric, top_links: int = 32, time_bins: int = 200,
                     window: tuple[float, float] | None = None) -> LinkUtilisation:
    """The ``top_links`` links that carried the most bytes, and their mean utilisation in
    each of ``time_bins`` equal bins of the step (or of ``window``).

    Utilisation is a link's rate (``rec.link_series``, piecewise constant) averaged over the
    bin, over its physical capacity (:attr:`Fabric.capacity`). The flow network runs on
    what NCCL's transports achieve (a fraction of it), so a saturated link shows below 1.
    Rates are stored as float32; they are divided by the capacity rounded the same way, so a
    link at capacity reads 1, not 1 + float32 rounding.
    """
    check_window(window)
    t_end = step_end(rec)
    if not rec.link_series:
        empty = np.zeros(0)
        return LinkUtilisation(empty.astype(int), empty, empty, np.zeros((0, 0)))
    series = rec.link_series
    ts = np.array([t for t, _, _ in series] + [max(t_end, series[-1][0])])
    dt = np.diff(ts)
    carried = rec.link_bytes(ts[-1])
    order = np.argsort(-carried, kind="stable")
    links = order[carried[order] > 0][:top_links]
    pos = np.full(fabric.n_links, -1, dtype=np.int32)
    pos[links] = np.arange(len(links))
    # The chosen links' changes (entry, column, new rate), each carried forward to the link's
    # next change: dense rates per series entry. Their running bytes are piecewise linear in
    # time, so interpolating them at the bin edges integrates each bin exactly.
    col = pos[np.concatenate([idx for _, idx, _ in series])]
    chosen = np.flatnonzero(col >= 0)
    entry = np.repeat(np.arange(len(series), dtype=np.int32),
                      [len(idx) for _, idx, _ in series])[chosen]
    rate = np.concatenate([r for _, _, r in series])[chosen].astype(float)
    last = np.zeros((len(series), len(links)), dtype=np.int64)
    last[entry, col[chosen]] = np.arange(1, len(chosen) + 1)
    last = np.maximum.accumulate(last, axis=0)
    rates = np.concatenate([[0.0], rate])[last]    # 0: no change yet, an idle link
    cum = np.vstack([np.zeros(len(links)), np.cumsum(rates * dt[:, None], axis=0)])
    t0, t1 = window if window is not None else (0.0, ts[-1])
    edges = np.linspace(t0, t1, time_bins + 1)
    at_edges = np.stack([np.interp(edges, ts, cum[:, j]) for j in range(len(links))]) \
        if len(links) else np.zeros((0, len(edges)))
    capacity = fabric.capacity[links].astype(np.float32).astype(float)
    util = np.diff(at_edges, axis=1) / np.diff(edges)[None, :] / capacity[:, None]
    return LinkUtilisation(links, carried[links], edges, util)


def _node_name(node: tuple) -> str:
    kind, *where = node
    return f"{kind} {':'.join(str(w) for w in where)}" if where else str(kind)


def link_label(fabric: Fabric, link: int) -> str:
    """``"gpu 0:1 → nvswitch 0 (nvlink)"``: a link's endpoints and kind."""
    u, v = fabric.endpoints[link]
    return f"{_node_name(u)} → {_node_name(v)} ({LINK_KINDS[int(fabric.kind[link])]})"


def links_figure(rec: Recorder, fabric: Fabric, title: str = "", *, top_links: int = 32,
                 time_bins: int = 200, window: tuple[float, float] | None = None) -> Figure:
    """A heatmap of the busiest links' utilisation over time (:func:`link_utilisation`).

    One row per link (its endpoints and kind), busiest by bytes first; colour is the mean
    rate over each time bin divided by the link's capacity, 0 to 1, on a square-root scale.

    A folded collective (one op standing for the identical groups of every replica of a rank
    class, :attr:`sim.program.ir.Op.groups`) puts only its representative group's flows on the
    fabric, counted several times: only that group's links show here, carrying one group's
    rate, and the other groups' links look idle.

    Parameters
    ----------
    rec : the run's recorder, made with ``keep_link_series=True``
    fabric : the run's fabric (:attr:`sim.api.RunResult.fabric`)
    title : first line of the title (the scenario's name)
    top_links : how many links, busiest by bytes carried
    time_bins : equal time bins over the step (or the window)
    window : (start, end) in seconds to zoom to
    """
    lu = link_utilisation(rec, fabric, top_links, time_bins, window)
    n = len(lu.links)
    fig = Figure(figsize=(14, min(22.0, max(4.0, 1.8 + 0.24 * n))), layout="constrained")
    ax = fig.add_subplot()
    head = title or "link utilisation"
    if not rec.link_series:
        ax.set_title(head, fontsize=10)
        return empty(fig, ax, "No per-link rates were recorded: simulate with "
                      "keep_link_series=True to see each link's utilisation.")
    if n == 0:
        ax.set_title(head, fontsize=10)
        return empty(fig, ax, "No link carried any traffic in this run.")
    # A square-root colour scale: links a few percent busy stand apart from idle ones.
    img = ax.imshow(lu.utilisation, aspect="auto", interpolation="nearest", cmap="magma",
                    norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                    extent=(lu.edges[0], lu.edges[-1], n, 0))
    ax.set_yticks(np.arange(n) + 0.5)
    ax.set_yticklabels([f"{link_label(fabric, int(i))}  {b / GB:,.1f} GB"
                        for i, b in zip(lu.links, lu.bytes, strict=True)],
                       fontsize=8 if n <= 40 else 6)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("link (busiest by bytes carried first)")
    ax.set_title(f"{head}\nutilisation of the {n} busiest of {fabric.n_links} links "
                 f"(mean rate per {np.diff(lu.edges)[0] * 1e3:.3g} ms bin / link capacity); "
                 "folded collectives show one representative group's links", fontsize=10)
    bar = fig.colorbar(img, ax=ax, pad=0.01, fraction=0.03)
    bar.set_label("utilisation")
    return fig


def links(path: Path, rec: Recorder, fabric: Fabric, title: str = "", *, top_links: int = 32,
          time_bins: int = 200, window: tuple[float, float] | None = None) -> None:
    """Write :func:`links_figure` as a PNG."""
    save_png(links_figure(rec, fabric, title, top_links=top_links, time_bins=time_bins,
                       window=window), path)
