"""torchtitan's DeepSeek attention (``sim/workload/titan_mla.py``) and the fsdp2 builder with it.

Independent truth: the published model dimensions (DeepSeek-V3 and DeepSeek-V2-Lite
config.json, the catalogue), turned into closed forms: the block's parameters are
``ModelSpec.attention_params`` plus its norm; its forward FLOPs are 2 x tokens x the
projections' weights plus the causal scores and values, 2 x B x S x (S/2) x heads x
(qk + v) (the FLOPs ``ModelSpec._attention_layer_flops`` counts a third of); a step's model
FLOPs are ``ModelSpec.model_flops_per_token`` per token. PyTorch's flash kernels need equal
head dims, so SDPA runs cuDNN's attention for MLA on Hopper (torchtitan's backend list).
"""

from __future__ import annotations

import pytest
from helpers import with_overrides

from sim.api import simulate
from sim.frameworks.common.base import JobContext
from sim.scenario import ScenarioError, scenario_from_dict
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec
from sim.workload.moe import linear_params
from sim.workload.titan_mla import titan_mla_attention_block


@pytest.mark.parametrize("ref", ["deepseek-v3", "deepseek-v2-lite"])
def test_block_parameters_and_flops_are_the_models(ref: str) -> None:
    m = ModelSpec.from_ref(ref)
    assert m.mla is not None
    batch, seq = 2, 4096
    blk = titan_mla_attention_block(m, Style("bf16"), batch, seq)
    assert blk.params == m.attention_params + m.norm_params
    mla = m.mla
    tokens = batch * seq
    projections = 2.0 * tokens * linear_params(m.attention_shapes(), m.bias)
    scores = 2.0 * batch * seq * (seq / 2) * m.heads * (mla.qk_head_dim + mla.v_head_dim)
    assert blk.flops_fwd == pytest.approx(projections + scores, rel=1e-9)
    assert scores * 3 / tokens == pytest.approx(m.attention_flops_per_token(seq) / m.layers)
    names = [k.name for k in blk.forward]
    # The query's own latent only where the model has one (DeepSeek-V2-Lite projects directly).
    assert ("wq_a.fwd" in names) == bool(mla.q_lora_rank)
    assert {"q_cat", "k_cat", "sdpa.fwd", "wkv_b.fwd", "wo.fwd"} <= set(names)


def _dsv2_lite(**over: object) -> dict:
    d: dict = dict(name="dsv2-lite", model="deepseek-v2-lite",
                   cluster={"topology": "dgx-h100", "nodes": 1},
                   framework={"name": "fsdp2"}, parallelism={"ep": 8},
                   training={"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8,
                             "precision": "bf16", "activation_checkpointing": "full"})
    return with_overrides(d, over)


@pytest.mark.parametrize(("topology", "backend"), [("dgx-h100", "cudnn"),
                                                    ("dgx-a100", "mem_efficient")])
def test_sdpa_runs_a_kernel_that_takes_mla_head_dims(topology: str, backend: str) -> None:
    # Under every PyTorch release: flash needs one head dim (PyTorch 2.8 on an H100 would
    # pick flash2 for equal dims).
    s = scenario_from_dict(_dsv2_lite(**{"cluster.topology": topology,
                                         "training.torch_version": "2.8"}))
    assert JobContext.from_scenario(s).compute.attention_backend == backend


def test_fsdp2_trains_deepseek_v2_lite_at_the_models_flops() -> None:
    s = scenario_from_dict(_dsv2_lite())
    r = simulate(s)
    m = ModelSpec.from_ref("deepseek-v2-lite", 4096)
    tokens = 8 * 4096
    assert r.summary["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(4096) * tokens, rel=1e-3)
    assert r.summary["tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize(("over", "key"), [
    ({"parallelism.tp": 2, "parallelism.ep": 4, "parallelism.sequence_parallel": True},
     "parallelism.tp"),
    ({"framework.model_code": "huggingface"}, "framework.model_code"),
    ({"training.attention_backend": "flash2"}, "training.attention_backend"),
])
def test_fsdp2_refuses_what_it_does_not_model_with_mla(over: dict, key: str) -> None:
    with pytest.raises(ScenarioError, match=key):
        simulate(scenario_from_dict(_dsv2_lite(**over)))
