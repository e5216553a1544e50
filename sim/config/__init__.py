"""The scenario file: its schema (pydantic, unknown keys refused), loading, ``--set`` overrides,
one-line errors and the shipped files. The import surface is :mod:`sim.scenario`."""
