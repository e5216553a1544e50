"""The summary's type (sim/analysis/summary.py) against a real run's summary and CONTRACT.md.

A TypedDict is only a promise to the type checker; these tests hold it to what
:func:`sim.api.simulate` really returns: every key of a run's summary is a key of its type,
recursively (nested objects and the rows of lists), every required key of the type is in the
summary, and each value has its declared type; and every key CONTRACT.md's "Summary object"
names is in the type.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from conftest import make_scenario

from sim.analysis.summary import BytesByClass, Claim, Summary, bytes_items
from sim.api import simulate
from sim.fabric.topology import LINK_KINDS


def _is_typeddict(t: Any) -> bool:
    return isinstance(t, type) and typing.is_typeddict(t)


def check(value: Any, t: Any, where: str) -> None:
    """Assert ``value`` has type ``t`` (TypedDicts key by key, both ways)."""
    if _is_typeddict(t):
        assert isinstance(value, dict), where
        hints = get_type_hints(t)
        assert set(value) <= set(hints), f"{where}: keys not in {t.__name__}: " \
            f"{sorted(set(value) - set(hints))}"
        missing = set(t.__required_keys__) - set(value)
        assert not missing, f"{where}: {t.__name__} keys missing: {sorted(missing)}"
        for k, v in value.items():
            check(v, hints[k], f"{where}.{k}")
        return
    origin, args = get_origin(t), get_args(t)
    if origin in (Union, types.UnionType):
        errors = []
        for a in args:
            try:
                check(value, a, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{where}: {value!r} is none of {args}: {errors}")
    if origin is typing.NotRequired:
        check(value, args[0], where)
    elif origin is list:
        assert isinstance(value, list), where
        for i, v in enumerate(value):
            check(v, args[0], f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict), where
        for k, v in value.items():
            check(k, args[0], where)
            check(v, args[1], f"{where}.{k}")
    elif t is type(None):
        assert value is None, where
    elif t is float:
        # JSON's numbers: an int where a float is declared is fine (mypy's rule too).
        assert isinstance(value, int | float) and not isinstance(value, bool), where
    else:
        assert isinstance(value, t) and (t is bool or not isinstance(value, bool)), \
            f"{where}: {value!r} is not {t}"


@pytest.fixture(scope="module")
def summary() -> Summary:
    # Small (4 layers, 8 GPUs): claims and tokens_total make every optional part appear.
    s = make_scenario(training={"seq_len": 1024, "micro_batch_size": 1, "tokens_total": 1e9},
                      claims={"source": "test", "mfu": 0.4, "run_hours": 1.0})
    return simulate(s).summary


def test_a_real_summary_has_its_types_keys_and_value_types(summary: Summary) -> None:
    assert "claims" in summary and summary["cost"]["run_hours"] is not None
    check(summary, Summary, "summary")


def test_without_claims_the_summary_has_no_claims_key() -> None:
    s = simulate(make_scenario()).summary
    assert "claims" not in s
    check(s, Summary, "summary")


# CONTRACT.md, "Summary object" (the project's interface document, kept beside the
# repository): its keys, nested objects' keys and the claim rows' keys, as it lists them.
CONTRACT_KEYS = """scenario, gpus,
step_time_s, tokens_per_step, tokens_per_s, tokens_per_s_per_gpu,
model_flops_per_step, mfu, hfu, model_tflops_per_gpu,
peak_memory_gib, gpu_memory_gib, oom,
compute_time_s, comm_time_s, exposed_comm_s, overlap_fraction, bubble_fraction"""
CONTRACT_NESTED = {
    "bytes": "nvlink, pcie, network, cross_az",
    "cost": "usd_per_hour, usd_per_step, egress_usd_per_step, usd_per_million_tokens, "
            "run_hours, run_usd",
    "sim": "wall_s, events, ranks_simulated",
    "claims": "metric, claimed, simulated, verdict, reason",
}


def _keys(text: str) -> set[str]:
    return {k.strip() for k in text.replace("\n", ",").split(",") if k.strip()}


def test_the_type_holds_the_contracts_keys() -> None:
    hints = get_type_hints(Summary)
    assert _keys(CONTRACT_KEYS) <= set(hints)
    for nested, keys in CONTRACT_NESTED.items():
        inner = hints[nested]
        inner = get_args(inner)[0] if get_origin(inner) is typing.NotRequired else inner
        inner = get_args(inner)[0] if get_origin(inner) is list else inner
        assert _keys(keys) <= set(get_type_hints(inner)), nested
    # Only these may be absent: claims (CONTRACT.md: "only with a claims block"), run (only
    # with a run: block, CONTRACT.md's additions), step_times (only with faults.jitter) and
    # checkpoint (only with run.checkpoint.simulate: the saves measured on the timeline).
    assert set(Summary.__optional_keys__) == {"claims", "run", "step_times", "checkpoint"}


def test_bytes_are_the_fabrics_link_classes_in_order() -> None:
    # The JSON's key order is the network's class order (sim/fabric/topology/links.py).
    assert tuple(get_type_hints(BytesByClass)) == LINK_KINDS
    b: BytesByClass = {"nvlink": 1.0, "pcie": 2.0, "network": 3.0, "cross_az": 4.0,
                       "cross_region": 5.0}
    assert bytes_items(b) == list(b.items())


def test_claim_rows_are_the_contracts(summary: Summary) -> None:
    assert [set(c) for c in summary["claims"]] == [set(get_type_hints(Claim))] * 2
