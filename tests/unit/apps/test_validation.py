"""The nccl validation suite: every published nccl-tests point within 10% (issue #3's bar)."""

from __future__ import annotations

import pytest

from sim.apps.validation import run_suites
from sim.apps.validation.nccl import nccl_cases

CASES = nccl_cases()

# The maintainers' all-to-all rule across nodes (46-48 GB/s a NIC times the node-count factor,
# nccl.yaml), never measured as such: the one measured plateau of that setup, 16 H100 on 2
# nodes (nccl-tests issue 355: about 80 GB/s against the rule's 92-96), sits 15% below it, as
# NVIDIA/nccl issue 1138's A100 pair does below its own; the simulation follows the two
# measurements (sim.fabric.collectives.alltoall.P2P_NETWORK_SHARE), 12-15% under the rule.
RULE_NOT_MEASURED = ("ndr400-alltoall-2node/", "ndr400-alltoall-4node/", "cx7-alltoall-6node/")


def _param(case):
    if case["id"].startswith(RULE_NOT_MEASURED):
        return pytest.param(case, id=case["id"], marks=pytest.mark.xfail(
            strict=True, reason="the maintainers' all-to-all rule, 15% above the measured "
                                "two-node plateau the simulation follows"))
    return pytest.param(case, id=case["id"])


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_published_nccl_points_within_10_percent(case) -> None:
    assert abs(case["error"]) <= 0.10, case


def test_the_rule_points_sit_between_the_measured_plateau_and_the_rule() -> None:
    # Below the rule (the ideal a NIC can give), and not further below it than the measured
    # two-node plateau's 15% with some room (20%).
    rule = [c for c in CASES if c["id"].startswith(RULE_NOT_MEASURED)]
    assert len(rule) == 3
    for c in rule:
        assert -0.20 < c["error"] < 0.0, c


def test_nvls_is_chosen_for_large_in_node_all_reduce() -> None:
    # NCCL picks NVLS on H100 for large all-reduce inside a node (reference.yaml note).
    curve = [c for c in CASES if c["id"].startswith("dgx-h100-8gpu-allreduce-curve")]
    assert curve and all(c["algorithm"] == "nvls" for c in curve)


def test_suite_summary_is_consistent() -> None:
    out = run_suites(["nccl"])
    s = out["suites"]["nccl"]
    errors = [abs(c["error"]) for c in out["cases"]]
    assert s["cases"] == len(out["cases"]) == len(CASES)
    assert s["mape"] == pytest.approx(sum(errors) / len(errors))
    assert s["max_abs_error"] == pytest.approx(max(errors))


def test_vtrain_single_node_mape_within_10_percent() -> None:
    # vTrain's measured Megatron iterations on 2-8 A100s, VALIDATE half only (720 of 1,440
    # rows; MEGATRON_CPU_S_PER_OP is fitted on the other half, docs/calibration.md), every
    # 4th of it, spread over all layouts: the issue's bar is a MAPE within 10%.
    from sim.apps.validation.vtrain import half_of, vtrain_cases

    cases = vtrain_cases("single", every=4)
    mape = sum(abs(c["error"]) for c in cases) / len(cases)
    assert len(cases) == 180
    assert all(half_of("single", int(c["id"].split(":")[0][3:])) == "validate" for c in cases)
    assert mape <= 0.10, mape


def test_fit_suites_run_only_when_named() -> None:
    # The fit halves are registered (`--suite vtrain-single-fit`) but are not validation:
    # the default run leaves them out.
    import sim.apps.validation as validation

    assert {"vtrain-single-fit", "vtrain-multi-fit", "moe-layer-fit", "llm-foundry-fit"} <= set(
        validation.SUITES)
    assert validation.FIT_SUITES == {"vtrain-single-fit", "vtrain-multi-fit", "moe-layer-fit",
                                     "llm-foundry-fit"}
    seen: list[str] = []
    saved = dict(validation.SUITES)
    for name in saved:
        validation.SUITES[name] = lambda progress, _n=name: seen.append(_n) or []
    try:
        out = validation.run_suites()
    finally:
        validation.SUITES.update(saved)
    assert sorted(seen) == sorted(set(saved) - validation.FIT_SUITES) == sorted(out["suites"])


@pytest.fixture(scope="module")
def published_ci() -> tuple[dict, list[tuple[str, int, int]]]:
    """The published suite's CI entries simulated once for the module, through run_suites
    with a progress callback: its result and the reports it made. The two tests below read
    the same runs (7 simulations, ~3 s on 2 cores)."""
    import sim.apps.validation as validation

    seen: list[tuple[str, int, int]] = []
    original = validation.SUITES["published"]
    validation.SUITES["published"] = lambda progress: \
        validation.published_cases(ci_only=True, progress=progress)
    try:
        result = run_suites(["published"], lambda s, d, t: seen.append((s, d, t)))
    finally:
        validation.SUITES["published"] = original
    return result, seen


def test_published_runs_within_the_issue_bar(published_ci) -> None:
    # Throughput published by torchtitan and NVIDIA (Megatron-Bridge performance summary)
    # for named setups, simulated from the setup alone: the mean absolute error within 15%
    # (issue 4's bar for published runs), no case beyond 20%. The large setups (1,024 H100,
    # 128 B200) run with `fabricsim validate --suite published`.
    from sim.apps.validation.published import entries

    cases = published_ci[0]["cases"]   # published_cases(ci_only=True), every one scored
    assert len(cases) == sum(len(e["measured"]) for e in entries() if e.get("ci"))
    errors = [abs(c["error"]) for c in cases]
    assert sum(errors) / len(errors) < 0.15
    # The GB200 Llama 3 8B rows were beyond it (+20.6% / +20.0%) until the Blackwell parts
    # held their GEMMs at the power limit's clock (sim/hardware/power.py): +13.3% / +12.8%.
    assert max(errors) < 0.20


def test_run_suites_reports_progress_per_case_up_to_the_total(published_ci) -> None:
    # The published suite's CI runs, one report before each and one at the end.
    from sim.apps.validation.published import entries

    result, seen = published_ci
    n = sum(1 for e in entries() if e.get("ci"))
    assert result["suites"]["published"]["cases"] == \
        sum(len(e["measured"]) for e in entries() if e.get("ci"))
    assert [d for _, d, _ in seen] == list(range(n + 1))
    assert {(s, t) for s, _, t in seen} == {("published", n)}


def test_published_with_workers_gives_the_same_cases(published_ci, monkeypatch) -> None:
    # `fabricsim validate --workers 2`: the entries simulated in two processes, the same cases
    # to the bit and in the entries' order (each simulation is deterministic and alone).
    import sim.apps.executor as executor
    from sim.apps.validation.published import published_cases

    pools: list[int] = []

    class Spy(executor.Pool):
        def __init__(self, workers: int) -> None:
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(executor, "Pool", Spy)
    assert published_cases(ci_only=True, workers=2) == published_ci[0]["cases"]
    assert pools == [2]                 # the processes ran them, not this one
