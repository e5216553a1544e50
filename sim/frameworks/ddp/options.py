"""The ``framework:`` options of ``ddp`` (a scenario's schema; :mod:`sim.config.scenario`
puts them in the ``framework`` union). Imports only the config layer's base."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config import bounds as B
from sim.config.base import StrictModel


class DdpOptions(StrictModel):
    """PyTorch DistributedDataParallel (one GPU: plain PyTorch training, no communication)."""

    name: Literal["ddp"]
    bucket_mb: float | None = Field(default=None, gt=0, le=B.MAX_BUCKET_MB)
    """Gradient bucket cap in MiB; None = torch's default (25 MiB, first bucket 1 MiB)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the bucket buffers (saves one gradient-sized buffer and two copies)."""
    compile: bool = False
    """torch.compile: memory-bound elementwise chains fused into single kernels."""
    checkpoint_use_reentrant: bool = False
    """With full activation checkpointing, Hugging Face's gradient_checkpointing_kwargs
    use_reentrant: True re-runs each decoder layer's whole forward in backward
    (transformers 4.36 to 4.57's default); False (transformers 5's default, PR #43203) stops
    recomputing once the last saved tensor is back."""
