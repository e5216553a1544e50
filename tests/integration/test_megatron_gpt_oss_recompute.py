"""Megatron-Core's ``moe_act`` recomputation on a GPT-OSS-style layer (clamped gated
activation, biased experts): the clamp and the cat run inside the checkpointed
``bias_act_func`` (megatron/core/transformer/moe/experts.py, ``CheckpointWithoutOutput``), so
their output is freed with fc2's input and they re-run in backward; ``_apply_bias`` runs after
fc2, outside the checkpoint, and is not re-run.

Independent truths: the tensors' shapes (T tokens x top-k rows, expert width F, 16-bit) and
the kernels' own prices (``kernel_time``).
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.shape import megatron_shape
from sim.workload.checkpoint_without_output import restore_copy
from sim.workload.kernels import Tensor
from sim.workload.layer_ops import kernel_time

# A small GPT-OSS twin: biases, the clamp, 8 experts (top-2) of width 512; layer 0 dense.
OSS = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn_hidden": 2048,
       "vocab": 32768, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512,
       "first_k_dense": 1, "bias": True, "activation_clamp": 7.0}
SEQ, K, F = 2048, 2, 512


def _scn(mods):
    fw = {"name": "megatron"}
    if mods is not None:
        fw["recompute_modules"] = mods
    return megatron_scenario({"tp": 1}, 1, model=OSS, seq=SEQ, ac="selective", gpn=1,
                             framework=fw)


def _ops(s):
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    return {op.name: op for c in p.classes[:1] for ops in c.streams.values() for op in ops}


def _hold(ops, layer):
    op = ops[f"fwd attn L{layer} mb0"]
    return sum(b for pool, b in op.alloc if pool == "activations")


def test_moe_act_frees_the_clamped_input_and_fc2s_input() -> None:
    none, act = _ops(_scn([])), _ops(_scn(["moe_act"]))
    # fc2's input (T k x F) and the clamped concatenation the activation saved (T k x 2F).
    assert _hold(none, 1) - _hold(act, 1) == SEQ * K * F * 2 + SEQ * K * 2 * F * 2


def test_moe_act_reruns_the_clamp_with_the_activation() -> None:
    s = _scn(["moe_act"])
    ctx = JobContext.from_scenario(s, "s.yaml")
    shape = megatron_shape(ctx)
    rerun = [k for k in shape.moe.ops.experts.forward if k.name.startswith("weighted_act")]
    assert [k.name for k in rerun] == ["weighted_act.clamp_gate", "weighted_act.clamp_linear",
                                       "weighted_act.cat", "weighted_act"]
    none, act = _ops(_scn([])), _ops(s)
    name = "bwd moe L1 mb0 experts"
    # ... and the recomputed activation (T k x F, bf16) is copied into the freed storage.
    copy = restore_copy("c", [Tensor("act", SEQ * K * F * 2)])
    assert act[name].duration - none[name].duration == pytest.approx(
        sum(kernel_time(ctx.compute, k) for k in rerun) + kernel_time(ctx.compute, copy),
        rel=1e-12)


def test_biased_experts_need_expert_tp_one() -> None:
    # TE GroupedLinear.__init__ (v2.9, v2.12): "GroupedLinear doesn't support bias when TP > 1".
    from sim.scenario import ScenarioError
    s = megatron_scenario({"tp": 2, "etp": 2, "sequence_parallel": True}, 2, model=OSS, seq=SEQ,
                          gpn=2)
    with pytest.raises(ScenarioError, match="parallelism.etp"):
        build_program(JobContext.from_scenario(s, "s.yaml"))
    ok = megatron_scenario({"tp": 2, "etp": 1, "sequence_parallel": True}, 2, model=OSS, seq=SEQ,
                           gpn=2)
    assert build_program(JobContext.from_scenario(ok, "s.yaml")).classes
