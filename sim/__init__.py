"""fabricsim: a discrete-event simulator of distributed LLM training steps.

One folder per layer, imports only downward (``ARCHITECTURE.md``, "Layout";
``docs/layers.md``):

* :mod:`sim.config` (:mod:`sim.scenario` is its import surface) and :mod:`sim.catalog`;
* :mod:`sim.workload` (what is computed), :mod:`sim.hardware` (how long it takes),
  :mod:`sim.program` (the IR), :mod:`sim.frameworks` (one package per framework, by name in
  :mod:`sim.frameworks.registry`);
* :mod:`sim.fabric` (topology, flows, NCCL), :mod:`sim.engine` (simpy, recorder);
* :mod:`sim.analysis` (pure functions of a run), :mod:`sim.outputs` (plots, exports);
* :mod:`sim.api` (:func:`sim.api.simulate`: build -> run -> collect), :mod:`sim.apps`
  (compare, sweep, plan, validation) and :mod:`sim.cli` (the ``fabricsim`` command).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__version__ = "0.1.0"

# Modules that lived at the top of the package before the layers had folders; ``from sim
# import plot`` (the README's and notebooks' older form) keeps working.
_MOVED = {"plot": "sim.outputs.plot", "export": "sim.outputs.export",
          "compare": "sim.apps.compare", "sweep": "sim.apps.sweep", "plan": "sim.apps.plan"}


def __getattr__(name: str) -> ModuleType:
    if name in _MOVED:
        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
