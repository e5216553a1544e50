"""The registry entry of ``ddp`` (:mod:`sim.frameworks.registry`)."""

from __future__ import annotations

from sim.frameworks.common.entry import FrameworkEntry, SearchSpace
from sim.frameworks.common.search import no_options
from sim.frameworks.ddp.build import build_ddp, kernel_style
from sim.frameworks.ddp.options import DdpOptions
from sim.frameworks.ddp.search import DDP_BEST_PRACTICE

ENTRY = FrameworkEntry(
    "ddp", DdpOptions, build_ddp,
    search=SearchSpace(no_options, recipe=DDP_BEST_PRACTICE, data_parallel_only=True),
    # Without gradient_as_bucket_view the fp32 .grad tensors are allocated in backward
    # and freed by zero_grad(set_to_none=True) (build.py): no initial memory, but there.
    step_gradient_bytes_per_param=4.0, kernel_style=kernel_style)
