"""Compatibility shim: torchtitan's parallel blocks now live in :mod:`sim.frameworks.fsdp2`
(:mod:`~sim.frameworks.fsdp2.mesh`, :mod:`~sim.frameworks.fsdp2.tp`,
:mod:`~sim.frameworks.fsdp2.tp_pass`).

``sim.plan`` still imports :func:`stage_layers` from here; remove this module once it imports
``sim.frameworks.fsdp2.mesh`` (or the framework registry's stage split) instead.
"""

from __future__ import annotations

from sim.frameworks.fsdp2.mesh import Mesh, stage_layers
from sim.frameworks.fsdp2.tp import (
    TitanBlocks,
    kv_width,
    layer_sac_costs,
    local_dims,
    local_vocab,
    titan_blocks,
)
from sim.frameworks.fsdp2.tp_pass import Comms, TitanPass

__all__ = ["Comms", "Mesh", "TitanBlocks", "TitanPass", "kv_width", "layer_sac_costs",
           "local_dims", "local_vocab", "stage_layers", "titan_blocks"]
