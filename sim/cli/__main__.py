"""``python -m sim.cli``: the ``fabricsim`` command."""

from sim.cli.commands import main

main()
