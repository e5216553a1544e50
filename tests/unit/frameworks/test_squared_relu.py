"""Nemotron-4's squared-ReLU MLP (``mlp: relu2``) under Megatron-Core, and its refusal
elsewhere.

Independent truths: Megatron-Core ``megatron/core/activations.py`` ``squared_relu``
(``torch.pow(F.relu(x), 2)`` under ``jit_fuser``: one fused kernel each way) inside
``MLP.forward`` (not gated: fc1 is ``ffn_hidden`` wide, not twice it); a layer's matrix
FLOPs are 2 per parameter per token forward (6 with the backward).
"""

from __future__ import annotations

import pytest

from sim.config.base import ScenarioError
from sim.frameworks import JobContext, build_program
from sim.scenario import scenario_from_dict
from sim.workload.megatron_ops import MegatronLayout, mlp_block
from sim.workload.model import ModelSpec

SEQ = 4096


def _scenario(framework: dict) -> dict:
    return {"name": "nemotron", "model": "nemotron-4-15b",
            "cluster": {"topology": "dgx-h100", "nodes": 1},
            "framework": framework, "parallelism": {"tp": 2, "sequence_parallel": True},
            "training": {"seq_len": SEQ, "micro_batch_size": 1, "global_batch_size": 8,
                         "precision": "bf16", "activation_checkpointing": "none"}}


def test_megatron_mlp_is_not_gated() -> None:
    m = ModelSpec.from_ref("nemotron-4-15b")
    main = mlp_block(m, MegatronLayout(), 1, SEQ)[1]
    fc1 = next(k for k in main.forward if k.name == "fc1.fwd")
    fc2 = next(k for k in main.forward if k.name == "fc2.fwd")
    # (tokens, in, out): fc1 h -> f, fc2 f -> h.
    assert fc1.gemm[:3] == (SEQ, m.hidden, m.ffn_hidden)
    assert fc2.gemm[:3] == (SEQ, m.ffn_hidden, m.hidden)
    acts = [k for k in main.forward if k.name == "bias_act"]
    assert len(acts) == 1 and acts[0].nbytes == pytest.approx(2 * 2 * SEQ * m.ffn_hidden)
    # Matrix FLOPs of the block: 2 per weight per token.
    gemm_flops = sum(k.flops for k in main.forward if k.klass == "gemm")
    assert gemm_flops == pytest.approx(2 * SEQ * 2 * m.hidden * m.ffn_hidden)


def test_megatron_simulates_nemotron() -> None:
    sc = scenario_from_dict(_scenario({"name": "megatron"}), origin="test")
    program = build_program(JobContext.from_scenario(sc))
    assert program.ops


@pytest.mark.parametrize("framework", ["fsdp2", "ddp"])
def test_other_frameworks_refuse_it_by_key(framework: str) -> None:
    d = _scenario({"name": framework})
    d["parallelism"] = {"tp": 1}
    sc = scenario_from_dict(d, origin="test")
    with pytest.raises(ScenarioError, match=r"model\.mlp: .* squared-ReLU MLP yet$"):
        build_program(JobContext.from_scenario(sc))
