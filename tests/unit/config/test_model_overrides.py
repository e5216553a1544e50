"""A catalogue model with some fields overridden (``--set model.mtp_layers=0``)."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.api import simulate
from sim.config.load import load_scenario, scenario_from_dict
from sim.scenario import ScenarioError


def test_set_on_a_catalogue_model_keeps_its_other_fields() -> None:
    # `model: deepseek-v3` becomes {name: deepseek-v3, mtp_layers: 0}: the catalogue's
    # dimensions with the one field changed, as torchtitan's DeepSeek-V3 needs it.
    s = load_scenario("deepseek-v3-megatron-tp2pp16ep64-1024xh100", ["model.mtp_layers=0"])
    entry = catalog.model_entry("deepseek-v3")
    assert not isinstance(s.model, str)
    assert s.model.mtp_layers == 0 and entry["mtp_layers"] == 1
    assert (s.model.layers, s.model.hidden, s.model.experts) == \
        (entry["layers"], entry["hidden"], entry["experts"])


def test_the_catalogue_model_as_a_mapping_simulates_as_its_name() -> None:
    base = {"cluster": {"nodes": 1}, "framework": {"name": "megatron"},
            "parallelism": {"ep": 8},
            "training": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8}}
    by_name = simulate(scenario_from_dict({**base, "model": "qwen3-30b-a3b"})).summary
    by_map = simulate(scenario_from_dict({**base, "model": {"name": "qwen3-30b-a3b"}})).summary
    by_name.pop("sim")
    by_map.pop("sim")
    assert by_map == by_name


def test_an_unknown_field_on_a_catalogue_model_is_one_line_naming_it() -> None:
    with pytest.raises(ScenarioError, match="model.*experts_per_tokn"):
        load_scenario("deepseek-v3-megatron-tp2pp16ep64-1024xh100",
                      ["model.experts_per_tokn=4"])
