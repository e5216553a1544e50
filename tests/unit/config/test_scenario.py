"""Tests of scenario loading (sim/scenario.py, sim/config/resources.py): shipped names and paths,
``--set`` overrides, topology files, one-line errors that name the file and the key path, and
the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sim.config import resources
from sim.config.key_hints import FOREIGN_KEYS
from sim.scenario import (
    Claims,
    Cluster,
    DdpOptions,
    Fsdp2Options,
    ModelDims,
    Nccl,
    Parallelism,
    Pricing,
    Scenario,
    ScenarioError,
    Training,
    json_schema,
    load_scenario,
    parse_set,
    scenario_from_dict,
    set_dotted,
)

TINY = "llama3.2-1b-1xh200"  # the shipped single-H200 scenario


def write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def one_gpu(**extra) -> dict:
    """A valid one-GPU scenario mapping."""
    data = {"name": "t", "model": "llama3.2-1b",
            "cluster": {"gpu": "h200", "nodes": 1, "gpus_per_node": 1, "nics_per_node": 0},
            "framework": {"name": "ddp"}}
    data.update(extra)
    return data


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario(str(path), list(overrides))
    message = str(info.value)
    assert "\n" not in message, "a ScenarioError must be one line"
    return message


# --------------------------------------------------------------------------- loading
def test_every_shipped_scenario_loads_by_name():
    names = resources.available("scenarios")
    assert TINY in names
    for name in names:
        assert load_scenario(name).gpus >= 1


def test_shipped_tiny_scenario_values():
    # scenarios/llama3.2-1b-1xh200.yaml: 1 H200, ddp, 4 sequences of 4,096 tokens.
    s = load_scenario(TINY)
    assert (s.model, s.cluster.gpu, s.gpus, s.framework.name) == ("llama3.2-1b", "h200", 1, "ddp")
    assert (s.training.seq_len, s.training.micro_batch_size, s.training.global_batch_size) == (
        4096, 4, 4)
    assert s.dp == 1


def test_load_by_name_with_suffix_by_relative_and_absolute_path(tmp_path, monkeypatch):
    by_name = load_scenario(TINY)
    assert load_scenario(TINY + ".yaml") == by_name
    src = resources.resolve("scenarios", TINY)
    assert src is not None and src.name == TINY + ".yaml"
    copy = tmp_path / "copy.yaml"
    copy.write_text(src.read_text())
    assert load_scenario(str(copy)) == by_name
    monkeypatch.chdir(tmp_path)
    assert load_scenario("copy.yaml") == by_name
    # Shipped names still resolve from a folder that is not the repository.
    assert load_scenario(TINY) == by_name


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    # A path that exists is read as a path, even when a shipped file has the same name.
    write(tmp_path / f"{TINY}.yaml", one_gpu(name="local"))
    monkeypatch.chdir(tmp_path)
    assert load_scenario(f"{TINY}.yaml").name == "local"


# --------------------------------------------------------------------------- --set
@pytest.mark.parametrize("raw, value", [
    ("cluster.nic_gbps=100", 100),         # YAML int
    ("training.tokens_total=1.5", 1.5),    # YAML float
    ("framework.compile=true", True),      # YAML bool
    ("nccl.algo=ring", "ring"),            # plain string
    ("pricing.gpu_hour_usd=null", None),   # YAML null
    ("name=a=b", "a=b"),                   # split at the first '='
    ("name=", ""),                         # empty value
    (" cluster.nodes =2", 2),              # the key is stripped
])
def test_parse_set_reads_yaml_scalars(raw, value):
    key, parsed = parse_set(raw)
    assert key == raw.split("=", 1)[0].strip()
    assert parsed == value and type(parsed) is type(value)


def test_parse_set_needs_an_equals_sign():
    with pytest.raises(ScenarioError, match=r"--set nodes: expected KEY=VALUE"):
        parse_set("nodes")


def test_set_dotted_creates_nested_mappings_and_expands_shorthand():
    d: dict = {"framework": "ddp", "model": "llama3-8b"}
    set_dotted(d, "pricing.gpu_hour_usd", 2.5)
    set_dotted(d, "a.b.c", 1)
    set_dotted(d, "framework.compile", True)
    assert d["pricing"] == {"gpu_hour_usd": 2.5}
    assert d["a"] == {"b": {"c": 1}}
    assert d["framework"] == {"name": "ddp", "compile": True}


@pytest.mark.parametrize("key, message", [
    ("cluster.nodes.x", "--set cluster.nodes.x: cluster.nodes is not a mapping"),
    ("a..b", "--set a..b: empty key path"),
    (".a", "--set .a: empty key path"),
])
def test_set_dotted_refuses_bad_paths(key, message):
    with pytest.raises(ScenarioError) as info:
        set_dotted({"cluster": {"nodes": 1}}, key, 1)
    assert str(info.value) == message


def test_overrides_change_values():
    s = load_scenario(TINY, ["cluster.nic_gbps=100", "training.seq_len=2048",
                             "training.activation_checkpointing=full", "framework.compile=true",
                             "training.tokens_total=1e12"])
    assert s.cluster.nic_gbps == 100.0
    assert s.training.seq_len == 2048
    assert s.training.activation_checkpointing == "full"
    assert s.framework.compile is True
    # PyYAML reads "1e12" as a string (YAML 1.1 floats need a dot); pydantic still parses it.
    assert s.training.tokens_total == 1e12


def test_override_creates_a_missing_section():
    s = load_scenario(TINY, ["pricing.gpu_hour_usd=2.5", "claims.source=blog",
                             "claims.tokens_per_s_per_gpu=1000"])
    assert s.pricing.gpu_hour_usd == 2.5
    assert s.claims is not None and s.claims.source == "blog"
    assert s.claims.tokens_per_s_per_gpu == 1000.0


def test_framework_string_shorthand():
    s = load_scenario(TINY, ["framework=fsdp2"])
    assert isinstance(s.framework, Fsdp2Options)
    assert s.framework.reshard_after_forward is True  # FSDP2's default
    s = load_scenario(TINY, ["framework=fsdp2", "framework.reshard_after_forward=false"])
    assert s.framework.reshard_after_forward is False
    s = scenario_from_dict({"model": "llama3-8b", "framework": "ddp"})
    assert isinstance(s.framework, DdpOptions)


def test_model_override_replaces_the_catalogue_name():
    assert load_scenario(TINY, ["model=llama3-8b"]).model == "llama3-8b"


def test_inline_model_mapping():
    dims = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
            "vocab": 32000}
    s = scenario_from_dict(one_gpu(model=dims))
    assert isinstance(s.model, ModelDims)
    assert (s.model.kv_heads, s.model.mlp, s.model.tied_embeddings) == (2, "swiglu", False)


def test_dp_fills_the_remaining_gpus():
    # 2 nodes x 8 GPUs = 16; tp 2 x pp 2 leaves dp = 4.
    s = scenario_from_dict({"model": "llama3-8b", "cluster": {"nodes": 2},
                            "parallelism": {"tp": 2, "pp": 2}})
    assert s.gpus == 16 and s.dp == 4


def test_defaults():
    # One 8-GPU H100 node, ddp, 4,096-token sequences, bf16 (the schema's documented defaults).
    s = scenario_from_dict({"model": "llama3-8b"})
    assert (s.cluster.gpu, s.gpus, s.framework.name, s.training.seq_len, s.training.precision) \
        == ("h100-sxm", 8, "ddp", 4096, "bf16")
    assert s.dp == 8 and s.claims is None


# --------------------------------------------------------------------------- topology
def test_topology_file_fills_cluster_fields():
    # topologies/dgx-h100.yaml: h100-sxm, 8 GPUs per node, 450 GB/s NVLink, 8 x 400 Gb/s,
    # 32 nodes per leaf; the scenario itself only says nodes: 2.
    s = load_scenario("llama3-8b-fsdp2-16xh100")
    c = s.cluster
    assert (c.topology, c.gpu, c.gpus_per_node, c.nvlink_gbytes_per_s, c.nics_per_node,
            c.nic_gbps, c.nodes_per_leaf, c.rail_optimized, c.nodes) == (
        "dgx-h100", "h100-sxm", 8, 450.0, 8, 400.0, 32, True, 2)
    assert s.gpus == 16


def test_inline_cluster_fields_override_the_topology():
    s = load_scenario("llama3-8b-fsdp2-16xh100", ["cluster.nic_gbps=100", "cluster.gpu=h200"])
    assert s.cluster.nic_gbps == 100.0 and s.cluster.gpu == "h200"
    assert s.cluster.nodes_per_leaf == 32  # still from the file
    # The one-H200 scenario keeps its inline gpu/nodes/NICs under dgx-a100's other fields.
    t = load_scenario(TINY, ["cluster.topology=dgx-a100"])
    assert (t.cluster.gpu, t.gpus, t.cluster.nics_per_node) == ("h200", 1, 0)
    assert (t.cluster.nic_gbps, t.cluster.nodes_per_leaf, t.cluster.nvlink_gbytes_per_s) == (
        200.0, 20, 300.0)  # dgx-a100.yaml: HDR 200 Gb/s, 20 nodes per SU, NVLink 3


def test_topology_by_path(tmp_path):
    topo = write(tmp_path / "my-fabric.yaml", {"name": "mine", "description": "x",
                                               "sources": ["y"], "gpu": "b200", "nic_gbps": 800})
    s = scenario_from_dict({"model": "llama3-8b", "cluster": {"topology": str(topo)}})
    assert (s.cluster.gpu, s.cluster.nic_gbps) == ("b200", 800.0)


def test_a_topology_file_read_again_after_it_changes(tmp_path):
    # Topology files are remembered (fabricsim plan loads tens of thousands of scenarios on
    # the same one) by path, modification time and size: an edit is seen.
    import os

    topo = write(tmp_path / "fab.yaml", {"gpu": "h100-sxm", "nic_gbps": 400, "nics_per_node": 8})
    first = scenario_from_dict({"model": "llama3-8b", "cluster": {"topology": str(topo)}})
    again = scenario_from_dict({"model": "llama3-8b", "cluster": {"topology": str(topo)}})
    assert first.cluster.nic_gbps == again.cluster.nic_gbps == 400.0
    write(topo, {"gpu": "h100-sxm", "nic_gbps": 800, "nics_per_node": 8})
    stamp = topo.stat().st_mtime_ns + 10**9
    os.utime(topo, ns=(stamp, stamp))
    edited = scenario_from_dict({"model": "llama3-8b", "cluster": {"topology": str(topo)}})
    assert edited.cluster.nic_gbps == 800.0


def test_unknown_key_in_a_topology_file_names_that_file(tmp_path):
    topo = write(tmp_path / "bad-fabric.yaml", {"gpu": "h200", "nic_gpbs": 400})
    scen = write(tmp_path / "s.yaml", {"model": "llama3-8b", "cluster": {"topology": str(topo)}})
    assert error_of(scen) == f"{topo}: nic_gpbs: unknown key"


def test_every_shipped_topology_has_only_cluster_fields():
    for name in resources.available("topologies"):
        s = scenario_from_dict({"model": "llama3-8b", "cluster": {"topology": name}})
        assert s.cluster.topology == name


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("mutate, expected", [
    # unknown key at the top level and nested
    (lambda d: d.update(bogus=1), "bogus: unknown key"),
    (lambda d: d["cluster"].update(nic_gpbs=400), "cluster.nic_gpbs: unknown key"),
    (lambda d: d.update(training={"seqlen": 1}), "training.seqlen: unknown key"),
    (lambda d: d.update(framework={"name": "fsdp2", "zero_stage": 3}),
     "framework.zero_stage: unknown key"),
    # wrong type
    (lambda d: d.update(training={"seq_len": "long"}), "training.seq_len: "),
    (lambda d: d["cluster"].update(nodes=[1, 2]), "cluster.nodes: "),
    (lambda d: d.update(parallelism={"sequence_parallel": "maybe"}),
     "parallelism.sequence_parallel: "),
    (lambda d: d["cluster"].update(gpu="rtx4090"), "cluster.gpu: "),
    # unknown model, framework, topology
    (lambda d: d.update(model="llama9-1t"), "model: unknown model 'llama9-1t'"),
    (lambda d: d.update(framework={"name": "notaframework"}),
     "framework.name: unknown framework 'notaframework'"),
    (lambda d: d.update(framework="notaframework"),
     "framework.name: unknown framework 'notaframework'"),
    (lambda d: d.update(framework={"compile": True}), "framework.name: missing"),
    (lambda d: d["cluster"].update(topology="no-such-fabric"),
     "cluster.topology: no topology 'no-such-fabric'"),
    # tp*pp*dp*cp must equal the GPU count (1 here)
    (lambda d: d.update(parallelism={"tp": 2, "dp": 1}),
     "parallelism: tp*pp*dp*cp = 2 but the cluster has 1 GPUs"),
    (lambda d: d.update(parallelism={"cp": 2}), "parallelism: tp*pp*cp = 2 does not divide"),
    # out-of-range values
    (lambda d: d["cluster"].update(nodes=0), "cluster.nodes: "),
    (lambda d: d.update(training={"precision": "int4"}), "training.precision: "),
])
def test_bad_input_is_one_line_naming_file_and_key(tmp_path, mutate, expected):
    data = one_gpu()
    mutate(data)
    path = write(tmp_path / "bad.yaml", data)
    message = error_of(path)
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_tp_times_dp_mismatch_on_a_shipped_scenario():
    # 2 x 8 H100 = 16 GPUs; tp 4 x dp 8 = 32.
    with pytest.raises(ScenarioError) as info:
        load_scenario("llama3-8b-fsdp2-16xh100", ["parallelism.tp=4", "parallelism.dp=8"])
    message = str(info.value)
    assert message.endswith("llama3-8b-fsdp2-16xh100.yaml: parallelism: tp*pp*dp*cp = 32 but "
                            "the cluster has 16 GPUs")


def test_override_errors_name_the_file_and_key():
    message = str(pytest.raises(ScenarioError, load_scenario, TINY, ["training.bogus=1"]).value)
    assert message.endswith(f"{TINY}.yaml: training.bogus: unknown key")


@pytest.mark.parametrize("override, hint", [
    # A launch script's own flag: where the setting lives here (sim/config/key_hints.py).
    ("framework.moe_expert_capacity_factor=1.0", "; it is model.capacity_factor here"),
    ("parallelism.expert_model_parallel_size=8", "; it is parallelism.ep here"),
    ("training.seq_length=8192", "; it is training.seq_len here"),
    # A near spelling of a key of the same section (the framework's own options).
    ("framework.overlap_grad_reduc=true", "; did you mean framework.overlap_grad_reduce?"),
    ("cluster.nic_gbs=200", "; did you mean cluster.nic_gbps?"),
    # Nothing close: the plain refusal.
    ("training.bogus=1", ""),
])
def test_an_unknown_key_names_the_key_it_likely_meant(override, hint):
    key = override.split("=")[0]
    message = str(pytest.raises(ScenarioError, load_scenario,
                                "qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100", [override]).value)
    assert message.endswith(f"qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100.yaml: {key}: unknown key"
                            f"{hint}")


def test_unknown_model_lists_the_catalogue(tmp_path):
    message = error_of(write(tmp_path / "m.yaml", one_gpu(model="llama9")))
    assert "llama3-8b" in message and "llama3.2-1b" in message


def test_missing_file(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    message = error_of(missing)
    assert message.startswith(f"{missing}: no such file or shipped scenario")
    assert TINY in message  # the shipped names are listed


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path / "broken.yaml", "name: ok\nmodel: [unclosed\n")
    message = error_of(path)
    assert message.startswith(f"{path}:") and "not valid YAML" in message
    assert "line 3" in message  # PyYAML reports the unclosed flow sequence at end of input


def test_top_level_must_be_a_mapping(tmp_path):
    assert error_of(write(tmp_path / "list.yaml", "- 1\n- 2\n")).endswith(
        "top level must be a mapping")


def test_an_empty_file_reports_the_missing_model(tmp_path):
    path = write(tmp_path / "empty.yaml", "")
    assert error_of(path).startswith(f"{path}: model: ")


# Keys that pydantic uses as union tags must still be named in the error path.
TAG_NAMES = ("ddp", "fsdp2", "str", "ModelDims")


@pytest.mark.parametrize("section", [None, "cluster"])
def test_junk_key_named_like_a_union_tag_is_named(section):
    data = one_gpu()
    (data if section is None else data[section])["fsdp2"] = True
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data, "s.yaml")
    where = "fsdp2" if section is None else f"{section}.fsdp2"
    assert str(info.value) == f"s.yaml: {where}: unknown key"


@pytest.mark.parametrize("change, key", [
    ({"bogus": 1}, "model.bogus"),         # unknown key
    ({"layers": "many"}, "model.layers"),  # wrong type
    ({"mlp": "relu"}, "model.mlp"),        # not swiglu|gelu
])
def test_errors_inside_an_inline_model_name_the_key(tmp_path, change, key):
    dims = {"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100}
    dims.update(change)
    path = write(tmp_path / "m.yaml", one_gpu(model=dims))
    message = error_of(path)
    assert message.startswith(f"{path}: {key}: ")
    assert "valid string" not in message


# Each section with a valid body and the pydantic model that forbids extra keys in it.
SECTIONS: dict[str, tuple[dict | None, type]] = {
    "top": (None, Scenario),
    "cluster": ({"gpu": "h200", "nodes": 1, "gpus_per_node": 1}, Cluster),
    "framework:ddp": ({"name": "ddp"}, DdpOptions),
    "framework:fsdp2": ({"name": "fsdp2"}, Fsdp2Options),
    "nccl": ({}, Nccl),
    "parallelism": ({}, Parallelism),
    "training": ({}, Training),
    "pricing": ({}, Pricing),
    "claims": ({"source": "x"}, Claims),
}
KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,19}", fullmatch=True)
VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2))


@pytest.mark.parametrize("section", sorted(SECTIONS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(key=KEYS, value=VALUES)
def test_random_junk_keys_are_rejected_naming_the_key(section, key, value):
    body, model = SECTIONS[section]
    # Real field names are not junk.
    assume(key not in model.model_fields)
    data = one_gpu(cluster={"gpu": "h200", "nodes": 1, "gpus_per_node": 1})
    if body is None:
        data[key] = value
        where = key
    else:
        name = section.split(":")[0]
        data[name] = {**body, key: value}
        where = f"{name}.{key}"
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data, "junk.yaml")
    # One line naming the key; a hint, if any, names a real key of the same section (a near
    # spelling) or where a framework's own flag lives (sim/config/key_hints.py).
    prefix = where.rsplit(".", 1)[0] + "." if "." in where else ""
    hints = {""} | {f"; did you mean {prefix}{k}?" for k in model.model_fields}
    if key in FOREIGN_KEYS:
        hints.add(f"; it is {FOREIGN_KEYS[key]} here")
    assert str(info.value) in {f"junk.yaml: {where}: unknown key{h}" for h in hints}


# --------------------------------------------------------------------------- schema
CONTRACT_TOP = {"name", "model", "cluster", "framework", "nccl", "parallelism", "training",
                "pricing", "claims"}
CONTRACT_CLUSTER = {"topology", "gpu", "nodes", "gpus_per_node", "nvlink_gbytes_per_s",
                    "nics_per_node", "nic_gbps", "azs", "az_link_gbps", "az_latency_ms"}
CONTRACT_TRAINING = {"seq_len", "micro_batch_size", "global_batch_size", "precision",
                     "activation_checkpointing", "tokens_total"}


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref")
    if ref is None:
        return node
    assert ref.startswith("#/$defs/")
    return schema["$defs"][ref.removeprefix("#/$defs/")]


def test_json_schema_has_the_contract_keys():
    schema = json_schema()
    assert json.loads(json.dumps(schema)) == schema  # plain JSON
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False  # unknown keys are errors
    assert CONTRACT_TOP <= set(schema["properties"])
    assert schema["required"] == ["model"]
    cluster = _resolve(schema, schema["properties"]["cluster"])
    assert CONTRACT_CLUSTER <= set(cluster["properties"])
    assert cluster["additionalProperties"] is False
    training = _resolve(schema, schema["properties"]["training"])
    assert CONTRACT_TRAINING <= set(training["properties"])


def test_json_schema_refs_all_resolve():
    schema = json_schema()
    text = json.dumps(schema)
    refs = {part.split('"')[0] for part in text.split('"$ref": "')[1:]}
    assert refs, "the schema has nested definitions"
    for ref in refs:
        assert ref.removeprefix("#/$defs/") in schema["$defs"]


def test_json_schema_lists_the_contract_gpus():
    schema = json_schema()
    cluster = _resolve(schema, schema["properties"]["cluster"])
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200"} <= set(
        cluster["properties"]["gpu"]["enum"])



def test_several_nodes_need_nics():
    # Servers without a network adapter cannot reach each other: refused, naming the key.
    data = one_gpu(cluster={"gpu": "h200", "nodes": 2, "gpus_per_node": 1, "nics_per_node": 0})
    with pytest.raises(ScenarioError, match=r"s\.yaml: cluster\.nics_per_node: "):
        scenario_from_dict(data, "s.yaml")
