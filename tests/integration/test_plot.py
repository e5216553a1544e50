"""The run plots show what the recorder and the summary say: rows per rank class and stream,
category colours, bubbles and exposed communication equal to the metrics' intervals, billed
bytes and their price, memory stacks up to the recorded totals, link utilisation within
capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from conftest import make_scenario
from helpers import TWO_ZONES, megatron_pipeline
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from sim.analysis.metrics import union_length
from sim.api import RunResult, simulate
from sim.fabric.topology import LINK_KINDS
from sim.outputs import plot
from sim.scenario import load_scenario

# The prices the two-zone runs (helpers.TWO_ZONES: 2 nodes x 2 H100 in two availability zones,
# FSDP2, whose all-gathers and reduce-scatters cross the zone boundary) are billed at.
PRICES: dict[str, Any] = {"egress_usd_per_gb": 0.02, "region_egress_usd_per_gb": 0.05}


def labels_of(r: RunResult) -> dict[int, str]:
    return {c.id: c.label or f"rank class {c.id}" for c in r.program.classes}


def stages_of(r: RunResult) -> int:
    return r.program.pipeline_stages


@pytest.fixture(scope="module")
def ddp() -> RunResult:
    return simulate(load_scenario("llama3.2-1b-ddp-8xh100"))


@pytest.fixture(scope="module")
def pp4() -> RunResult:
    return simulate(megatron_pipeline(4, 8, 8))


@pytest.fixture(scope="module")
def two_zones() -> RunResult:
    return simulate(make_scenario(TWO_ZONES, pricing=PRICES), keep_link_series=True)


def bars(fig: Figure, label: str | None = None) -> list[tuple[float, float, float, float]]:
    """(x0, x1, y0, y1) of every rectangle of the first axes' bar collections (optionally only
    those with this label)."""
    out = []
    for coll in fig.axes[0].collections:
        if not isinstance(coll, PolyCollection) or (label and coll.get_label() != label):
            continue
        for path in coll.get_paths():
            v = np.asarray(path.vertices)
            out.append((v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()))
    return out


def row_of(fig: Figure, y0: float, y1: float) -> str:
    """The y tick label of the row a rectangle spanning y0..y1 sits in."""
    ax = fig.axes[0]
    y = round((y0 + y1) / 2)
    return ax.get_yticklabels()[list(ax.get_yticks()).index(y)].get_text()


# ----------------------------------------------------------------------------- timeline
def test_timeline_rows_colours_and_legend(ddp: RunResult) -> None:
    fig = plot.timeline_figure(ddp.recorder, "ddp", labels_of(ddp))
    ax = fig.axes[0]
    # DDP: one rank class (all 8 ranks identical), a compute stream and the gradient
    # all-reduce stream.
    assert [t.get_text() for t in ax.get_yticklabels()] == ["all ranks · compute",
                                                           "all ranks · comm"]
    present = {r.op.category for r in ddp.recorder.ops}
    assert present == {"forward", "backward", "optimizer", "all_reduce"}
    facecolors = {tuple(np.round(c, 6)) for coll in ax.collections
                  for c in np.asarray(coll.get_facecolor())}
    assert {tuple(np.round(to_rgba(plot.CATEGORY_COLORS[c]), 6)) for c in present} <= facecolors
    legend = ax.get_legend()
    assert legend is not None
    names = [t.get_text() for t in legend.get_texts()]
    # Only the categories present, exposed communication (the last bucket's all-reduce
    # runs after backward), and no pipeline bubble: DDP has no pipeline.
    assert names == [c for c in plot.CATEGORY_COLORS if c in present] + [plot.EXPOSED_LABEL]
    assert ax.get_xlabel() == "time (s)"
    assert ax.get_xlim() == pytest.approx((0.0, ddp.summary["step_time_s"]))


@pytest.mark.parametrize("run", ["ddp", "two_zones"])
def test_exposed_strips_are_the_summarys_exposed_communication(run: str,
                                                               request: pytest.FixtureRequest
                                                               ) -> None:
    r: RunResult = request.getfixturevalue(run)
    exposed = plot.exposed_comm_intervals(r.recorder.ops)
    crit = plot.critical_class(r.recorder.ops)
    from_function = [iv for stream in exposed[crit].values() for iv in stream]
    # One computation (sim.analysis.metrics.class_exposed_comm): equal to the last bit.
    assert union_length(from_function) == r.summary["exposed_comm_s"]
    fig = plot.timeline_figure(r.recorder, run, labels_of(r))
    strips = bars(fig, plot.EXPOSED_LABEL)
    assert strips and all("· compute" not in row_of(fig, y0, y1) for *_, y0, y1 in strips)
    assert union_length((x0, x1) for x0, x1, *_ in strips) == pytest.approx(
        r.summary["exposed_comm_s"], rel=1e-9)


def test_pipeline_bubbles_are_the_summarys_bubble(pp4: RunResult) -> None:
    labels = labels_of(pp4)
    rec = pp4.recorder
    step = pp4.summary["step_time_s"]
    bubbles = plot.bubble_intervals(rec.ops)
    crit = plot.critical_class(rec.ops)
    # sim.analysis.metrics: the bubble is the critical stage's idle intervals (one computation).
    assert union_length(bubbles[crit]) / step == pp4.summary["bubble_fraction"]
    # On every stage, idle + busy (compute, copy, communication) partition the step.
    for cls, idle in bubbles.items():
        ran = [(r.start, r.end) for r in rec.ops if r.cls == cls]
        assert union_length(idle) + union_length(ran) == pytest.approx(step, rel=1e-9)
    fig = plot.timeline_figure(rec, "pp4", labels, pipeline_stages=stages_of(pp4))
    shaded = bars(fig, plot.BUBBLE_LABEL)
    on_crit = [(x0, x1) for x0, x1, y0, y1 in shaded
               if row_of(fig, y0, y1) == f"{labels[crit]} · compute"]
    assert union_length(on_crit) == pytest.approx(pp4.summary["bubble_fraction"] * step,
                                                  rel=1e-9)
    legend = fig.axes[0].get_legend()
    assert legend is not None
    assert plot.BUBBLE_LABEL in [t.get_text() for t in legend.get_texts()]
    # Rows: each stage's streams, its compute stream first, its rows together.
    got = [tuple(t.get_text().split(" · ")) for t in fig.axes[0].get_yticklabels()]
    expected = {(labels[r.cls], r.op.stream) for r in rec.ops}
    assert len(got) == len(expected) and set(got) == expected
    firsts = [i for i, (cls, _) in enumerate(got) if i == 0 or got[i - 1][0] != cls]
    assert len(firsts) == len(labels)
    assert all(got[i][1] == "compute" for i in firsts)


def test_many_rank_classes_fold_to_critical_first_last_and_sampled() -> None:
    # 64 pipeline stages on 8 nodes: 64 rank classes.
    r = simulate(megatron_pipeline(64, 16, 64, nodes=8))
    labels = labels_of(r)
    fig = plot.timeline_figure(r.recorder, "pp64", labels, pipeline_stages=stages_of(r))
    ax = fig.axes[0]
    assert "showing 16 of 64 rank classes" in ax.get_title()
    shown = {t.get_text().split(" · ")[0] for t in ax.get_yticklabels()}
    crit = plot.critical_class(r.recorder.ops)
    assert len(shown) == 16
    assert {labels[0], labels[63], labels[crit]} <= shown
    # Evenly spaced: no two neighbouring shown stages further apart than twice 63/15.
    ids = sorted(c for c, lab in labels.items() if lab in shown)
    assert max(np.diff(ids)) <= 2 * 63 / 15
    assert fig.get_size_inches()[1] <= 26.0


def test_window_zooms_and_clips(pp4: RunResult) -> None:
    step = pp4.summary["step_time_s"]
    window = (0.25 * step, 0.5 * step)
    fig = plot.timeline_figure(pp4.recorder, "pp4", labels_of(pp4), window=window,
                               pipeline_stages=stages_of(pp4))
    assert fig.axes[0].get_xlim() == pytest.approx(window)
    drawn = bars(fig)
    assert drawn and all(window[0] - 1e-12 <= x0 <= x1 <= window[1] + 1e-12
                         for x0, x1, *_ in drawn)
    with pytest.raises(ValueError, match="window"):
        plot.timeline_figure(pp4.recorder, window=(1.0, 0.5))


def test_select_rank_classes_keeps_critical_first_and_last() -> None:
    chosen = plot.select_rank_classes(list(range(100)), 41, 10)
    assert len(chosen) == 10 and {0, 41, 99} <= set(chosen) and chosen == sorted(chosen)
    assert plot.select_rank_classes([3, 1, 2], 2, 16) == [1, 2, 3]


# ----------------------------------------------------------------------------- bytes
def test_cumulative_cross_az_is_the_summarys_bytes_and_price(two_zones: RunResult) -> None:
    price = PRICES["egress_usd_per_gb"]
    fig = plot.bytes_figure(two_zones.recorder, "2az", egress_usd_per_gb=price)
    rates, billed = fig.axes[0], fig.axes[1]
    # The traffic panel: one line per link class that carried bytes, GB/s.
    carried = {k for k, v in two_zones.summary["bytes"].items() if v > 0}
    assert {ln.get_label() for ln in rates.get_lines()} == carried
    assert "GB/s" in rates.get_ylabel()
    assert billed.get_xlabel() == "time (s)"
    # The cumulative cross-AZ curve ends at the summary's billed bytes.
    (line,) = [ln for ln in billed.get_lines() if "cross-AZ" in str(ln.get_label())]
    assert "GB" in billed.get_ylabel()
    billed_gb = np.asarray(line.get_ydata())[-1]
    assert billed_gb == pytest.approx(two_zones.summary["bytes"]["cross_az"] / 1e9, rel=1e-6)
    # The USD axis is the GB axis times the price: egress = billed GB x price.
    (usd,) = billed.child_axes
    fig.draw_without_rendering()  # a secondary axis takes its limits when drawn
    assert "USD" in usd.get_ylabel()
    assert np.array(usd.get_ylim()) == pytest.approx(np.array(billed.get_ylim()) * price,
                                                     rel=1e-9)
    assert billed_gb * price == pytest.approx(
        two_zones.summary["cost"]["egress_usd_per_step"], rel=1e-6)


def test_cross_region_gets_its_own_price() -> None:
    # The two zones in two regions: every boundary crossed is a region's.
    r = simulate(make_scenario(TWO_ZONES, pricing=PRICES, cluster__regions=2))
    assert r.summary["bytes"]["cross_az"] == 0.0 < r.summary["bytes"]["cross_region"]
    price = PRICES["region_egress_usd_per_gb"]
    fig = plot.bytes_figure(r.recorder, "2 regions", egress_usd_per_gb=0.02,
                            region_egress_usd_per_gb=price)
    assert len(fig.axes) >= 2
    billed = fig.axes[1]
    (line,) = billed.get_lines()
    assert "cross-region" in str(line.get_label())
    billed_gb = np.asarray(line.get_ydata())[-1]
    assert billed_gb == pytest.approx(r.summary["bytes"]["cross_region"] / 1e9, rel=1e-6)
    fig.draw_without_rendering()
    (usd,) = billed.child_axes
    assert np.array(usd.get_ylim()) == pytest.approx(np.array(billed.get_ylim()) * price,
                                                     rel=1e-9)


# ----------------------------------------------------------------------------- memory
def test_memory_stack_tops_at_the_recorded_peak(pp4: RunResult) -> None:
    rec = pp4.recorder
    cap = pp4.summary["gpu_memory_gib"]
    labels = labels_of(pp4)
    fig = plot.memory_figure(rec, "pp4", labels, cap)
    panels = [ax for ax in fig.axes if ax.collections]
    assert len(panels) == len(pp4.program.classes)
    for ax, cls in zip(panels, sorted(rec.memory), strict=True):
        top = max(np.asarray(p.vertices)[:, 1].max() for coll in ax.collections
                  for p in coll.get_paths())
        assert top == pytest.approx(rec.memory[cls].peak / 2**30, rel=1e-9)
        assert ax.get_ylabel() == "GiB per GPU"
        assert ax.get_title(loc="left").startswith(labels[cls] + ":")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"parameters", "optimizer", "activations"} <= set(legend)
    # This narrow model uses under a tenth of the H100: the capacity is named, not drawn.
    assert pp4.summary["peak_memory_gib"] < plot.CAPACITY_AXIS_SHARE * cap
    assert f"usable GPU memory {cap:,.1f} GiB is off the scale" in fig.get_suptitle()
    # Two panels: the stages with the highest peaks, said in the title.
    fig = plot.memory_figure(rec, "pp4", labels, cap, max_panels=2)
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.collections]
    top2 = sorted(rec.memory, key=lambda c: -rec.memory[c].peak)[:2]
    assert len(titles) == 2
    assert all(any(t.startswith(labels[c] + ":") for t in titles) for c in top2)
    assert "showing 2 of 4 rank classes" in fig.get_suptitle()


def test_memory_capacity_line(ddp: RunResult) -> None:
    # Llama 3.2 1B under DDP holds most of an H100 (whole model, gradients and AdamW states
    # on every GPU): the usable memory is drawn as a dashed line above the stack.
    cap = ddp.summary["gpu_memory_gib"]
    assert ddp.summary["peak_memory_gib"] >= plot.CAPACITY_AXIS_SHARE * cap
    fig = plot.memory_figure(ddp.recorder, "ddp", labels_of(ddp), cap)
    (ax,) = [ax for ax in fig.axes if ax.collections]
    (dashed,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert np.asarray(dashed.get_ydata())[0] == pytest.approx(cap)
    assert ax.get_ylim()[1] >= cap
    assert "usable GPU memory" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_memory_stack_per_category_is_the_recorders(ddp: RunResult) -> None:
    # At the last change the stack's layers are the recorder's current bytes by category.
    ts, values = plot.memory_stack(ddp.recorder, 0)
    track = ddp.recorder.memory[0]
    for cat, v in values.items():
        assert v[-1] == pytest.approx(track.current[cat], rel=1e-12, abs=1.0)
    assert np.sum(list(values.values()), axis=0).max() == pytest.approx(track.peak, rel=1e-12)


# ----------------------------------------------------------------------------- links
def test_link_heatmap_within_capacity_and_carries_the_summarys_bytes(two_zones: RunResult
                                                                     ) -> None:
    r = two_zones
    lu = plot.link_utilisation(r.recorder, r.fabric, top_links=r.fabric.n_links)
    assert lu.utilisation.min() >= 0.0 and lu.utilisation.max() <= 1.0 + 1e-9
    # Integrating the bins gives back each link's bytes; summed by kind they are the
    # summary's bytes (no collective here is folded: one group of all four ranks).
    width = np.diff(lu.edges)
    back = (lu.utilisation * width).sum(axis=1) * r.fabric.capacity[lu.links].astype(
        np.float32)
    assert back == pytest.approx(lu.bytes, rel=1e-9)
    kinds = np.array([LINK_KINDS[k] for k in r.fabric.kind[lu.links]])
    for kind, total in r.summary["bytes"].items():
        assert lu.bytes[kinds == kind].sum() == pytest.approx(total, rel=1e-6, abs=1.0)
    fig = plot.links_figure(r.recorder, r.fabric, "2az", top_links=8, time_bins=50)
    ax = fig.axes[0]
    (img,) = ax.images
    shown = img.get_array()
    assert shown is not None and shown.shape == (8, 50)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 8 and all(f"({LINK_KINDS[r.fabric.kind[i]]})" in lab
                                    for i, lab in zip(lu.links[:8], labels, strict=True))
    assert list(lu.bytes) == sorted(lu.bytes, reverse=True)
    assert fig.axes[1].get_ylabel() == "utilisation"


def test_link_heatmap_explains_a_missing_series(ddp: RunResult, tmp_path: Path) -> None:
    fig = plot.links_figure(ddp.recorder, ddp.fabric, "ddp")
    assert not fig.axes[0].images
    assert "keep_link_series" in fig.axes[0].texts[0].get_text()
    plot.links(tmp_path / "links.png", ddp.recorder, ddp.fabric)
    assert (tmp_path / "links.png").stat().st_size > 0


def test_writers_save_png_at_120_dpi(two_zones: RunResult, tmp_path: Path) -> None:
    r = two_zones
    labels = labels_of(r)
    plot.timeline(tmp_path / "t.png", r.recorder, "2az", labels)
    plot.bytes_over_time(tmp_path / "b.png", r.recorder, "2az", egress_usd_per_gb=0.02)
    plot.memory_over_time(tmp_path / "m.png", r.recorder, "2az", labels,
                          r.summary["gpu_memory_gib"])
    plot.links(tmp_path / "l.png", r.recorder, r.fabric, "2az")
    sizes = {"t.png": plot.timeline_figure(r.recorder, "2az", labels),
             "b.png": plot.bytes_figure(r.recorder, "2az", egress_usd_per_gb=0.02),
             "m.png": plot.memory_figure(r.recorder, "2az", labels,
                                         r.summary["gpu_memory_gib"]),
             "l.png": plot.links_figure(r.recorder, r.fabric, "2az")}
    for name, fig in sizes.items():
        h, w = matplotlib.image.imread(tmp_path / name).shape[:2]
        fw, fh = fig.get_size_inches()
        # Pixels: inches x dots per inch, truncated by Agg.
        assert (w, h) == (int(fw * plot.DPI), int(fh * plot.DPI))
