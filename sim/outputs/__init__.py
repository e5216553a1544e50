"""Plots and exports of a run, drawn from :mod:`sim.analysis` (nothing computed twice)."""
