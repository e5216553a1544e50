"""Framework schedule builders, registered by name (``framework.name`` in a scenario)."""

from sim.frameworks import ddp, deepspeed, fairscale, fsdp2, megatron  # noqa: F401  (registration on import)
from sim.frameworks.base import REGISTRY, JobContext, build_program, register

__all__ = ["REGISTRY", "JobContext", "build_program", "register"]
