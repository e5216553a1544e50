"""The ``fabricsim`` command: typer commands that parse, call an app and render.

``fabricsim = "sim.cli:main"`` (pyproject.toml) and ``python -m sim.cli`` both start
:func:`sim.cli.commands.main`; :data:`app` is the typer application tests drive.
"""

from sim.cli.commands import app, main

__all__ = ["app", "main"]
