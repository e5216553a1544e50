"""Framework schedule builders: one package each (``options.py``, ``build.py``,
``search.py``, ``entry.py``), listed by :mod:`sim.frameworks.registry` (by ``framework.name``
in a scenario); ``common/`` holds what they share.

The names below load the registry on first use: the scenario schema imports each built-in's
``options.py``, which must not pull every builder (and the schema itself) in with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.frameworks.common.base import JobContext
    from sim.frameworks.registry import (
        FrameworkEntry,
        SearchSpace,
        build_program,
        framework,
        frameworks,
        register_framework,
        unregister_framework,
    )

_HOMES = {"JobContext": "sim.frameworks.common.base"}
__all__ = ["FrameworkEntry", "JobContext", "SearchSpace", "build_program", "framework",
           "frameworks", "register_framework", "unregister_framework"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'sim.frameworks' has no attribute {name!r}")
    module = importlib.import_module(_HOMES.get(name, "sim.frameworks.registry"))
    return getattr(module, name)
