"""The registry entry of ``fairscale`` (:mod:`sim.frameworks.registry`)."""

from __future__ import annotations

from sim.frameworks.common.entry import FrameworkEntry, SearchSpace
from sim.frameworks.fairscale.build import build_fairscale
from sim.frameworks.fairscale.options import FairscaleOptions
from sim.frameworks.fairscale.search import fairscale_options
from sim.frameworks.fairscale.shape import kernel_style

ENTRY = FrameworkEntry(
    "fairscale", FairscaleOptions, build_fairscale,
    search=SearchSpace(fairscale_options, data_parallel_only=True), kernel_style=kernel_style)
