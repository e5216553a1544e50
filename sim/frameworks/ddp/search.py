"""What ``fabricsim plan`` searches for DDP (the ``search`` of its registry entry): the
recipe only (:func:`sim.frameworks.common.search.no_options`)."""

from __future__ import annotations

from sim.frameworks.common.search import Options

DDP_BEST_PRACTICE: Options = (
    # Gradients alias the bucket buffers: one gradient-sized buffer and two copies less, as
    # PyTorch's DDP notes recommend for memory.
    ("gradient_as_bucket_view", True),
)
