"""One validation case: a measured figure against the simulated one (the shape every suite
returns, :mod:`sim.apps.validation`)."""

from __future__ import annotations

from typing import Any


def error_of(simulated: float, measured: float) -> float:
    """Signed relative error of a simulated figure against the measured one.

    Examples
    --------
    >>> error_of(110.0, 100.0)
    0.1
    """
    return (simulated - measured) / measured


def scored_case(suite: str, case_id: str, metric: str, measured: float, simulated: float,
                **extra: Any) -> dict[str, Any]:
    """``{suite, id, metric, measured, simulated, error, **extra}``.

    Examples
    --------
    >>> scored_case("s", "a", "t", 2.0, 3.0, source="x")["error"]
    0.5
    """
    return {"suite": suite, "id": case_id, "metric": metric, "measured": float(measured),
            "simulated": float(simulated), "error": error_of(float(simulated), float(measured)),
            **extra}
