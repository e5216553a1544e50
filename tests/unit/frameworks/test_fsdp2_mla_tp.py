"""torchtitan's DeepSeek-V3 attention under tensor parallelism (fsdp2;
``sim/frameworks/fsdp2/tp.py`` ``attn_latent`` / ``attn_heads``,
``tp_pass.TitanPass._mla_backward``).

Independent truth: torchtitan's plan (``models/deepseek_v3/infra/parallelize.py``,
``apply_non_moe_tp``: ``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm`` NoParallel, i.e. whole on
every rank over the all-gathered tokens; ``wq_b`` and ``wkv_b`` colwise, ``wo`` rowwise) turned
into closed forms from the published DeepSeek-V3 dimensions: each rank's parameters and FLOPs
of the two segments, and the bytes of the collectives a layer issues (the input all-gathered
and the output reduce-scattered as for any TP block; in backward each latent's partial
gradient all-reduced, and no reduce-scatter of the input gradient, which the replicated
latent projections leave the same on every rank).
"""

from __future__ import annotations

import pytest
from helpers import with_overrides

from sim import catalog
from sim.api import simulate
from sim.config.load import catalogue_model_with_overrides
from sim.frameworks.fsdp2.tp import titan_blocks
from sim.hardware.compute import ComputeModel
from sim.scenario import ScenarioError, scenario_from_dict
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec

BF16 = 2


def _latent_weights(m: ModelSpec) -> int:
    mla = m.mla
    assert mla is not None
    return m.hidden * mla.q_lora_rank + m.hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim)


def _head_weights(m: ModelSpec, heads: int) -> int:
    mla = m.mla
    assert mla is not None
    return heads * (mla.q_lora_rank * mla.qk_head_dim
                    + mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim)
                    + mla.v_head_dim * m.hidden)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_rank_runs_the_latents_whole_and_its_share_of_the_heads(tp: int) -> None:
    m = ModelSpec.from_ref("deepseek-v3")
    mla = m.mla
    assert mla is not None
    batch, seq = 1, 4096
    tokens = batch * seq
    tb = titan_blocks(m, Style("bf16"), ComputeModel(catalog.gpu("h100-sxm")), batch, seq, tp, 1,
                      "allgather")
    assert tb.layer_segments()[:4] == ["attn_norm", "attn_latent", "attn_heads", "attn_resid"]
    latent, heads = tb.seg["attn_latent"], tb.seg["attn_heads"]
    h_local = m.heads // tp
    # Parameters: the latent projections and their norms whole, 1/tp of the head projections.
    assert latent.params == _latent_weights(m) + mla.q_lora_rank + mla.kv_lora_rank
    assert heads.params == _head_weights(m, h_local)
    assert latent.params + tp * heads.params + m.hidden == m.attention_params + m.norm_params
    # FLOPs: 2 per weight and token, over every gathered token; causal scores of the local heads.
    assert latent.flops_fwd == pytest.approx(2.0 * tokens * _latent_weights(m), rel=1e-9)
    scores = 2.0 * batch * seq * (seq / 2) * h_local * (mla.qk_head_dim + mla.v_head_dim)
    assert heads.flops_fwd == pytest.approx(2.0 * tokens * _head_weights(m, h_local) + scores,
                                            rel=1e-9)
    assert tb.mla_latent_bytes == (tokens * mla.q_lora_rank * BF16,
                                   tokens * (mla.kv_lora_rank + mla.qk_rope_head_dim) * BF16)


def _small_dsv3(**over: object) -> dict:
    model = {**catalogue_model_with_overrides({"name": "deepseek-v3", "mtp_layers": 0}),
             "layers": 4, "first_k_dense": 1, "experts": 16, "moe_ffn_hidden": 512}
    d: dict = dict(name="dsv3-small-tp", model=model,
                   cluster={"topology": "dgx-h100", "nodes": 1},
                   framework={"name": "fsdp2"},
                   parallelism={"tp": 2, "ep": 4, "sequence_parallel": True},
                   training={"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 4,
                             "precision": "bf16", "activation_checkpointing": "full"})
    return with_overrides(d, over)


def test_a_layer_issues_the_plans_collectives_and_the_step_its_model_flops() -> None:
    d = _small_dsv3()
    r = simulate(scenario_from_dict(d))
    m = ModelSpec.from_ref("deepseek-v3")
    mla = m.mla
    assert mla is not None
    tokens = 4096
    ops = [o.op for o in r.recorder.ops if o.cls == 0 and " L1 " in o.op.name
           and o.op.kind == "collective" and o.op.name.startswith("tp ")]
    by_name = {o.name.replace(" L1 mb0", ""): o.nbytes for o in ops}
    gathered = float(tokens * m.hidden * BF16)
    assert by_name["tp all_gather attn"] == gathered
    assert by_name["tp reduce_scatter attn"] == gathered
    assert by_name["tp all_gather grad attn"] == gathered
    assert by_name["tp all_reduce grad q latent"] == tokens * mla.q_lora_rank * BF16
    assert by_name["tp all_reduce grad kv latent"] == \
        tokens * (mla.kv_lora_rank + mla.qk_rope_head_dim) * BF16
    # The latent projections' input gradient is the same on every rank: no reduce-scatter.
    assert "tp reduce_scatter grad attn" not in by_name
    # The model FLOPs of a token do not depend on the layout.
    r1 = simulate(scenario_from_dict({**d, "parallelism": {"ep": 4},
                                      "training": {**d["training"], "global_batch_size": 8}}))
    per_token = r.summary["model_flops_per_step"] / r.summary["tokens_per_step"]
    assert per_token == pytest.approx(
        r1.summary["model_flops_per_step"] / r1.summary["tokens_per_step"], rel=1e-12)


def _dense_mla(**over: object) -> dict:
    """DeepSeek-V3's attention on dense blocks: what reaches fsdp2's own MLA checks past the
    mixture-of-experts ones (16-bit only, full or no checkpointing)."""
    d = _small_dsv3(**over)
    d["model"] = {k: v for k, v in d["model"].items()
                  if k not in ("experts", "experts_per_token", "shared_experts",
                               "moe_ffn_hidden", "first_k_dense", "router")}
    d["parallelism"] = {k: v for k, v in d["parallelism"].items() if k != "ep"}
    return d


@pytest.mark.parametrize(("over", "key"), [
    ({"training.precision": "fp8"}, "training.precision"),
    ({"training.activation_checkpointing": "selective"}, "training.activation_checkpointing"),
    ({"framework.async_tp": True, "framework.compile": True}, "framework.async_tp"),
])
def test_what_is_not_modelled_with_it_is_refused_naming_the_key(over: dict, key: str) -> None:
    with pytest.raises(ScenarioError, match=rf"{key}: .*multi-head latent attention"):
        simulate(scenario_from_dict(_dense_mla(**over)))
