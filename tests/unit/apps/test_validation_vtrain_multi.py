"""vTrain's multi-node Megatron iterations, VALIDATE half (docs/calibration.md).

In a file of its own so that pytest-xdist's ``--dist loadfile`` can run it beside the
single-node check (``test_validation.py``) on the second worker.
"""

from __future__ import annotations


def test_vtrain_multi_node_mape_within_12_percent() -> None:
    # vTrain's measured Megatron iterations on 64-512 A100s, VALIDATE half only (56 of the
    # 109 rows), every 4th of it: 14 rows from DP-only to TP8 x PP16 on all four models. The
    # issue's bar is a MAPE within 12%. The whole half runs with
    # `fabricsim validate --suite vtrain-multi`.
    from sim.apps.validation.vtrain import half_of, vtrain_cases

    cases = vtrain_cases("multi", every=4)
    mape = sum(abs(c["error"]) for c in cases) / len(cases)
    assert len(cases) == 14
    assert all(half_of("multi", int(c["id"].split(":")[0][3:])) == "validate" for c in cases)
    assert mape <= 0.12, mape
