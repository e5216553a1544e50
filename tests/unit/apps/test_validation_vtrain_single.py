"""vTrain's single-node Megatron iterations, VALIDATE half (docs/calibration.md).

In a file of its own so that pytest-xdist's ``--dist loadfile`` can run it beside the other
long validation test on the second worker.
"""

from __future__ import annotations


def test_vtrain_single_node_mape_within_10_percent() -> None:
    # vTrain's measured Megatron iterations on 2-8 A100s, VALIDATE half only (720 of 1,440
    # rows; MEGATRON_CPU_S_PER_OP is fitted on the other half, docs/calibration.md), every
    # 4th of it, spread over all layouts: the bar is a MAPE within 10%.
    from sim.apps.validation.vtrain import half_of, vtrain_cases

    cases = vtrain_cases("single", every=4)
    mape = sum(abs(c["error"]) for c in cases) / len(cases)
    assert len(cases) == 180
    assert all(half_of("single", int(c["id"].split(":")[0][3:])) == "validate" for c in cases)
    assert mape <= 0.10, mape
