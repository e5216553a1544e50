"""CONTRACT.md's nested mixture-of-experts keys (``model.moe``, ``model.mla``,
``model.attention: mha``, ``training.moe_routing``) read as the flat keys they stand for.

Truth: the flat form the catalogue writes (sim/catalog/models.yaml, Hugging Face config.json
names); the same model or routing written either way must validate to the same object, and
writing both is one clear error naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import fabricsim_in_process

from sim.catalog import model_entry
from sim.scenario import ModelDims, ScenarioError, Training, load_scenario, scenario_from_dict


def _dims(name: str) -> dict:
    d = dict(model_entry(name))
    d.pop("source", None)
    return d


def test_mixtral_nested_is_the_flat_catalogue_entry() -> None:
    flat = _dims("mixtral-8x7b")
    nested = {k: v for k, v in flat.items() if k not in ("experts", "experts_per_token")}
    nested["moe"] = {"experts": 8, "top_k": 2}
    assert ModelDims.model_validate(nested) == ModelDims.model_validate(flat)


def test_deepseek_v2_lite_nested_moe_and_mla_are_the_flat_entry() -> None:
    flat = _dims("deepseek-v2-lite")
    moe = {"experts": flat.pop("experts"), "top_k": flat.pop("experts_per_token"),
           "shared_experts": flat.pop("shared_experts"),
           "expert_ffn_hidden": flat.pop("moe_ffn_hidden"),
           "dense_layers": flat.pop("first_k_dense")}
    mla = {k: flat.pop(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                     "v_head_dim")}
    nested = ModelDims.model_validate({**flat, "moe": moe, "mla": mla})
    assert nested == ModelDims.model_validate(_dims("deepseek-v2-lite"))
    # Normalised: what it writes back loads again (a sweep's variant, --json).
    assert ModelDims.model_validate(nested.model_dump()) == nested


def test_mha_is_gqa_with_every_head_its_own_key_value_head() -> None:
    base = {"layers": 2, "hidden": 512, "heads": 8, "ffn_hidden": 1024, "vocab": 1000}
    assert ModelDims.model_validate({**base, "attention": "mha"}) == \
        ModelDims.model_validate(base)
    assert ModelDims.model_validate({**base, "attention": "mha", "kv_heads": 8}) == \
        ModelDims.model_validate({**base, "kv_heads": 8})


@pytest.mark.parametrize("model, blamed", [
    ({"moe": {"experts": 8, "top_k": 2}, "experts": 8, "experts_per_token": 2},
     "model.moe: the experts are given twice"),
    ({"moe": {"experts": 8, "top_k": 0}}, "model.moe.top_k"),
    ({"moe": {"experts": 8, "top_k": 9}}, "model.experts_per_token: 9 is more than"),
    ({"moe": {"experts": 8, "top_k": 2, "k": 2}}, "model.moe.k: unknown key"),
    ({"attention": "mha", "kv_heads": 2}, "model.kv_heads: 2 with model.attention: mha"),
    ({"mla": {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
              "v_head_dim": 32}}, "model.mla: only with model.attention: mla"),
])
def test_bad_nested_keys_get_one_line_naming_the_key(model, blamed) -> None:
    base = {"layers": 2, "hidden": 512, "heads": 8, "ffn_hidden": 1024, "vocab": 1000}
    data = {"name": "x", "model": {**base, **model},
            "cluster": {"topology": "dgx-h100", "nodes": 1}, "framework": {"name": "fsdp2"},
            "parallelism": {"dp": 8}}
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data, origin="x.yaml")
    assert blamed in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("x.yaml: ")


def test_moe_routing_is_the_routing_it_names(tmp_path: Path) -> None:
    zipf = Training.model_validate({"moe_routing": {"distribution": "zipf", "skew": 1.2,
                                                    "seed": 3}})
    assert zipf == Training.model_validate({"routing": {"distribution": "zipf", "s": 1.2,
                                                        "seed": 3}})
    assert Training.model_validate({"moe_routing": {"distribution": "zipf"}}).routing.s == 1.0
    assert Training.model_validate({"moe_routing": {}}) == Training()
    # A file of per-expert loads beside the scenario, named relative to it.
    (tmp_path / "loads.txt").write_text("# tokens per expert\n4, 1, 1, 2\n")
    shipped = Path(__file__).resolve().parents[3] / "scenarios"
    base = yaml.safe_load((shipped / "mixtral-8x7b-megatron-ep8-64xh100.yaml").read_text())
    base["training"]["moe_routing"] = {"distribution": "file", "file": "loads.txt"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(base))
    s = load_scenario(str(tmp_path / "s.yaml"))
    assert s.training.routing.distribution == "histogram"
    assert s.training.routing.histogram == [4.0, 1.0, 1.0, 2.0]
    assert s.training.moe_routing is None


@pytest.mark.parametrize("training, blamed", [
    ({"moe_routing": {"distribution": "balanced", "skew": 2}},
     "training.moe_routing.skew: only with distribution: zipf"),
    ({"moe_routing": {"distribution": "file"}}, "training.moe_routing.file: give it"),
    ({"moe_routing": {"distribution": "file", "file": "/nonexistent/loads.txt"}},
     "training.moe_routing.file: cannot read /nonexistent/loads.txt"),
    ({"moe_routing": {"distribution": "zipf"}, "routing": {"distribution": "zipf"}},
     "training.moe_routing: the routing is given twice"),
    ({"moe_routing": {"distribution": "gauss"}}, "training.moe_routing.distribution"),
])
def test_bad_moe_routing_gets_one_line(training, blamed) -> None:
    data = {"name": "x", "model": "mixtral-8x7b",
            "cluster": {"topology": "dgx-h100", "nodes": 1}, "framework": {"name": "megatron"},
            "parallelism": {"ep": 8}, "training": training}
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(data, origin="x.yaml")
    assert blamed in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_both_forms_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "name": "bad", "cluster": {"topology": "dgx-h100", "nodes": 1},
        "framework": {"name": "megatron"}, "parallelism": {"ep": 8},
        "model": {"layers": 2, "hidden": 512, "heads": 8, "ffn_hidden": 1024, "vocab": 1000,
                  "experts": 8, "moe": {"experts": 8, "top_k": 2}}}))
    # In-process through the command's entry point (tests/helpers.py); test_cli.py runs
    # `fabricsim run`'s bad input as a true subprocess.
    out = fabricsim_in_process("run", str(bad), "--json")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "model.moe" in out.stderr
    assert "Traceback" not in out.stderr
