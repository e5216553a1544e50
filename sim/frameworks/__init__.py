"""Framework schedule builders, one entry each in :mod:`sim.frameworks.registry` (by
``framework.name`` in a scenario)."""

from sim.frameworks.base import REGISTRY, JobContext, register
from sim.frameworks.registry import (
    FrameworkEntry,
    SearchSpace,
    build_program,
    framework,
    frameworks,
    register_framework,
    unregister_framework,
)

__all__ = ["REGISTRY", "FrameworkEntry", "JobContext", "SearchSpace", "build_program",
           "framework", "frameworks", "register", "register_framework",
           "unregister_framework"]
