"""The ``framework:`` options of ``fairscale`` (FairScale's FSDP1). Imports only the config
layer's base: the scenario schema (:mod:`sim.config.scenario`) reads it."""

from __future__ import annotations

from typing import Literal

from sim.config.base import StrictModel


class FairscaleOptions(StrictModel):
    """FairScale's FullyShardedDataParallel (archived 2023), wrapped per transformer block."""

    name: Literal["fairscale"]
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gather again in backward)."""
    mixed_precision: bool = True
    """Gather and compute in 16-bit, keep fp32 shards."""
    fp32_reduce_scatter: bool = False
    """Reduce-scatter gradients in fp32 (default: in the compute dtype)."""
