"""fabricsim: a discrete-event simulator of distributed LLM training steps.

Phases: :mod:`sim.scenario` (validated input) -> :mod:`sim.frameworks` (a
:class:`~sim.program.Program` of ops per rank class) -> :mod:`sim.engine` (simpy, with the
flow-level :mod:`sim.network` on the :mod:`sim.topology` graph) -> :mod:`sim.recorder` ->
:mod:`sim.metrics`, :mod:`sim.cost`, :mod:`sim.plot`, :mod:`sim.export`. The entry point for
programs is :func:`sim.api.simulate`.
"""

__version__ = "0.1.0"
