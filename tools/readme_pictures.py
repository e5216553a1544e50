"""Draw the README's pictures, ``docs/images/*.png``, from shipped scenarios.

Each picture is the figure ``fabricsim run --out`` or ``fabricsim compare --out`` writes for
one run, built with the same public builders (:mod:`sim.outputs.plot`, :mod:`sim.apps.compare`):

=============  ==========================================================================
timeline.png   ``llama3-70b-megatron-tp8pp4-64xh100`` as 1F1B (``parallelism.vp=1``) with 8
               micro-batches per pipeline (``training.global_batch_size=16``, down from 64):
               the warm-up and drain bubbles of 4 stages, readable, in about a second
memory.png     the same run: memory per pipeline stage (stage 0 holds 4 micro-batches'
               activations, stage 3 one)
bytes.png      ``llama3-70b-fsdp2-64xh100-2az`` as shipped: bytes/s per link class and the
               cumulative cross-AZ GB with their dollars at the run's price per GB
links.png      the same two-zone run: utilisation of the 32 busiest links
compare.png    ``llama3-70b-fsdp2-64xh100`` with ``--what-if cluster.nic_gbps=100,200,400``
=============  ==========================================================================

The simulations are deterministic (a scenario gives the same numbers every run) and the PNGs
are written without matplotlib's version stamp, so an unchanged simulator and matplotlib
redraw identical files. The whole set takes about 5 s on 2 cores.

Usage::

    python tools/readme_pictures.py              # write docs/images/
    python tools/readme_pictures.py --out DIR    # write elsewhere
    python tools/readme_pictures.py --check      # draw into a temporary folder and verify

``--check`` verifies that every picture was written as a PNG of the size its figure asks for
(figure inches x DPI), that it is not blank, and that the committed picture in docs/images
has the same size (a changed size means the committed one is stale: run the tool). It
prints, for information, the share of pixels that differ from the committed picture. Exit
status 0 when all hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from sim.api import RunResult, simulate  # noqa: E402
from sim.apps import compare  # noqa: E402
from sim.outputs import plot
from sim.scenario import load_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"

PIPELINE = "llama3-70b-megatron-tp8pp4-64xh100"
PIPELINE_OVERRIDES = ["parallelism.vp=1", "training.global_batch_size=16"]
TWO_ZONES = "llama3-70b-fsdp2-64xh100-2az"
LINE_RATE = "llama3-70b-fsdp2-64xh100"
LINE_RATE_WHAT_IF = "cluster.nic_gbps=100,200,400"

COMPARE_DPI = 110
"""``sim.apps.compare.write_outputs`` saves compare.png at 110 dpi; the run plots use
:data:`sim.outputs.plot.DPI`."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_COLOURS = 8
"""A picture with fewer distinct colours than this is taken as blank (a readability check:
every figure here has at least axes, text and a few series colours)."""


@dataclass(frozen=True)
class Picture:
    """One README picture: its file name, the figure it draws and the dpi it is saved at."""

    name: str
    figure: Figure
    dpi: int

    @property
    def pixels(self) -> tuple[int, int]:
        """(width, height) the PNG will have: figure inches x dpi, truncated to whole pixels
        as matplotlib's Agg canvas sizes its buffer (``RendererAgg(int(width), ...)``)."""
        w, h = self.figure.get_size_inches()
        return int(w * self.dpi), int(h * self.dpi)


def _labels(result: RunResult) -> dict[int, str]:
    return {c.id: c.label or f"rank class {c.id}" for c in result.program.classes}


def pipeline_pictures() -> list[Picture]:
    """timeline.png and memory.png of the 1F1B Megatron-LM run."""
    run = simulate(load_scenario(PIPELINE, PIPELINE_OVERRIDES), origin=PIPELINE)
    title = f"{PIPELINE} (1F1B, 8 micro-batches per pipeline)"
    stages = run.program.pipeline_stages
    return [
        Picture("timeline.png", plot.timeline_figure(run.recorder, title, _labels(run),
                                                     pipeline_stages=stages), plot.DPI),
        Picture("memory.png", plot.memory_figure(run.recorder, title, _labels(run),
                                                 run.summary["gpu_memory_gib"]), plot.DPI),
    ]


def two_zone_pictures() -> list[Picture]:
    """bytes.png and links.png of the shipped two-zone FSDP2 run."""
    run = simulate(load_scenario(TWO_ZONES), origin=TWO_ZONES, keep_link_series=True)
    cost = run.summary["cost"]
    return [
        Picture("bytes.png", plot.bytes_figure(
            run.recorder, TWO_ZONES, egress_usd_per_gb=cost["egress_usd_per_gb"],
            region_egress_usd_per_gb=cost["region_egress_usd_per_gb"]),
            plot.DPI),
        Picture("links.png", plot.links_figure(run.recorder, run.fabric, TWO_ZONES), plot.DPI),
    ]


def compare_pictures() -> list[Picture]:
    """compare.png: the 70B FSDP2 job at 100, 200 and 400 Gb/s per NIC."""
    variants = compare.what_if_variants(LINE_RATE, LINE_RATE_WHAT_IF)
    compare.simulate_variants(variants)
    failed = [v.label for v in variants if v.summary is None]
    if failed:
        raise RuntimeError(f"compare.png: variants failed: {', '.join(failed)}")
    fig = compare.compare_figure(compare.compare_result(variants))
    # compare --out writes no title; the README picture names the job (the layout is redone
    # so the title clears the legend above the bars).
    fig.suptitle(f"{LINE_RATE}: step time and cost per NIC line rate", fontsize=10)
    fig.tight_layout()
    return [Picture("compare.png", fig, COMPARE_DPI)]


BUILDERS: tuple[Callable[[], list[Picture]], ...] = (pipeline_pictures, two_zone_pictures,
                                                      compare_pictures)
NAMES = ("timeline.png", "memory.png", "bytes.png", "links.png", "compare.png")


def draw(out: Path) -> dict[str, tuple[int, int]]:
    """Write every picture into ``out``; return each one's expected (width, height)."""
    out.mkdir(parents=True, exist_ok=True)
    expected: dict[str, tuple[int, int]] = {}
    for build in BUILDERS:
        for pic in build():
            # No "Software" stamp: the file depends on the figure, not on the version string.
            pic.figure.savefig(out / pic.name, dpi=pic.dpi, metadata={"Software": None})
            expected[pic.name] = pic.pixels
            plt.close(pic.figure)   # compare_figure's figure is registered with pyplot
    return expected


# --------------------------------------------------------------------------- checks
def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which the PNG specification (section 5.3,
    11.2.2) puts first: bytes 16-24 of the file, two big-endian 32-bit integers."""
    head = path.read_bytes()[:24]
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ValueError(f"{path}: not a PNG file")
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def distinct_colours(path: Path) -> int:
    """How many distinct RGBA values the picture has."""
    import numpy as np
    from matplotlib import image

    pixels = (image.imread(path) * 255).round().astype(np.uint64)
    # One integer per pixel (8 bits per channel), so np.unique runs on a flat array.
    weights = 256 ** np.arange(pixels.shape[-1], dtype=np.uint64)
    return len(np.unique(pixels @ weights))


def differing_share(a: Path, b: Path) -> float:
    """Share of pixels that differ between two pictures of the same size."""
    import numpy as np
    from matplotlib import image

    pa, pb = image.imread(a), image.imread(b)
    return float(np.any(pa != pb, axis=-1).mean())


def verify(fresh: Path, expected: dict[str, tuple[int, int]],
           committed: Path = IMAGES) -> list[str]:
    """Check the pictures just drawn into ``fresh`` (``expected``: :func:`draw`'s sizes)
    against their figures and against the pictures in ``committed``; return the problems."""
    problems: list[str] = []
    for name in NAMES:
        path = fresh / name
        if name not in expected or not path.is_file():
            problems.append(f"{name}: not written")
            continue
        try:
            size = png_size(path)
        except ValueError as err:
            problems.append(str(err))
            continue
        if size != expected[name]:
            problems.append(f"{name}: {size[0]}x{size[1]} px, the figure asks for "
                            f"{expected[name][0]}x{expected[name][1]}")
        colours = distinct_colours(path)
        if colours < MIN_COLOURS:
            problems.append(f"{name}: blank ({colours} distinct colours)")
        old = committed / name
        if not old.is_file():
            problems.append(f"{name}: missing from {committed} (run the tool)")
            continue
        try:
            old_size = png_size(old)
        except ValueError as err:
            problems.append(str(err))
            continue
        if old_size != size:
            problems.append(f"{name}: committed picture is {old_size[0]}x{old_size[1]} px, "
                            f"a fresh one {size[0]}x{size[1]} (stale: run the tool)")
            continue
        print(f"{name}: {size[0]}x{size[1]} px, {colours} colours, "
              f"{differing_share(path, old):.2%} of pixels differ from {old}")
    return problems


def check(committed: Path = IMAGES) -> list[str]:
    """Draw every picture into a temporary folder and :func:`verify` it."""
    with tempfile.TemporaryDirectory(prefix="readme-pictures-") as tmp:
        expected = draw(Path(tmp))
        return verify(Path(tmp), expected, committed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder to write into")
    parser.add_argument("--check", action="store_true",
                        help="draw into a temporary folder and verify instead of writing")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.check:
        problems = check()
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print(f"{'FAILED' if problems else 'ok'} in {time.perf_counter() - start:.1f} s")
        return 1 if problems else 0
    sizes = draw(args.out)
    for name, (w, h) in sizes.items():
        print(f"wrote {args.out / name} ({w}x{h} px)")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
