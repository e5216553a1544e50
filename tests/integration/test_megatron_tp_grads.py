"""The tensor-parallel all-reduce of replicated parameters' gradients (issue 14: Megatron-Core
``finalize_model_grads`` -> ``_allreduce_layernorm_grads`` /
``_allreduce_non_tensor_model_parallel_grads``).

Independent truths: which parameters Megatron-Core marks ``sequence_parallel`` (the norms,
``TELinear(parallel_mode="duplicated")``: MLA's q/kv down projections, ``TopKRouter``'s
weight) or matches by name (``q_layernorm`` / ``k_layernorm`` with ``qk_layernorm``), counted
here from the model's dimensions by hand; the bytes are that count times the ``main_grad``
element size (fp32 with ``grad_reduce_in_fp32``, else 2), once per step and stage; nothing
with tp = 1; the call comes after ``finish_grad_sync`` (every data-parallel reduce) and
before the optimizer step, as ``finalize_model_grads`` orders them.
"""

from __future__ import annotations

import pytest
from helpers import DEEP, megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program

H, E, QL, KL, ROPE = 1024, 8, 256, 128, 32
# A small DeepSeek-style model: MLA with a query latent, the first layer dense, 8 routed
# experts, one shared expert, one MTP module.
TINY = {"layers": 4, "hidden": H, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
        "experts": E, "experts_per_token": 2, "moe_ffn_hidden": 512, "shared_experts": 1,
        "first_k_dense": 1, "attention": "mla", "q_lora_rank": QL, "kv_lora_rank": KL,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": ROPE, "v_head_dim": 64, "mtp_layers": 1}


def _tp_ops(program):
    return [(c, op) for c in program.classes for ops in c.streams.values() for op in ops
            if op.name == "tp all-reduce replicated grads"]


def _program(par: dict, fw: dict | None = None, model: dict | None = None, gpn: int = 8):
    s = megatron_scenario(par, 8, model=model or TINY, framework={"name": "megatron",
                                                                  **(fw or {})}, gpn=gpn)
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _sp_layer(moe: bool) -> int:
    # input and pre-MLP RMSNorms, q_down (h x q_lora), kv_down (h x (kv_lora + rope)), the
    # two latent norms, and the router's experts x h weight on an MoE layer.
    return 2 * H + H * QL + H * (KL + ROPE) + QL + KL + (E * H if moe else 0)


@pytest.mark.parametrize("grad_fp32,elem", [(True, 4), (False, 2)])
def test_bytes_are_the_replicated_parameters_times_the_grad_element(grad_fp32, elem) -> None:
    # tp 2 with sequence parallelism, pp 2: stage 0 has layers 0 (dense) and 1, stage 1
    # layers 2, 3, the final norm and the MTP module (enorm, hnorm, its MoE layer, its norm).
    p = _program({"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                 {"grad_reduce_in_fp32": grad_fp32})
    got = {c.id: op.nbytes for c, op in _tp_ops(p)}
    want0 = _sp_layer(False) + _sp_layer(True)
    want1 = 2 * _sp_layer(True) + H + (3 * H + _sp_layer(True))
    assert got == {0: elem * want0, 1: elem * want1}
    for c, op in _tp_ops(p):
        assert op.collective == "all_reduce" and len(op.group) == 2 and op.dtype is not None
        assert len(op.groups) * 2 == len(c.members)


def test_nothing_with_one_tensor_parallel_rank() -> None:
    assert _tp_ops(_program({"tp": 1, "pp": 2, "ep": 2})) == []
    assert _tp_ops(_program({"tp": 1}, model=DEEP)) == []


def test_without_sequence_parallelism_only_the_qk_layernorm_names() -> None:
    # A dense model without per-head norms: no call at all (MLA with tp > 1 is modelled only
    # with sequence parallelism).
    assert _tp_ops(_program({"tp": 2}, model=DEEP)) == []
    # Qwen3-style per-head query/key norms (2 x head_dim per layer), 32 layers.
    qk = dict(DEEP, qk_norm=True)
    (c, op), = _tp_ops(_program({"tp": 2}, model=qk))
    assert op.nbytes == 4 * 32 * 2 * (4096 // 32)


def test_dense_model_with_sequence_parallelism_norms_and_row_parallel_biases() -> None:
    # DEEP (GPT-style, hidden 4096, 32 layers, linears with biases, LayerNorm): per layer two
    # LayerNorms (scale + shift, 2 x 4096 each) and the row-parallel biases of the output
    # projection and fc2 (4096 each; RowParallelLinear marks them sequence_parallel), plus
    # the final LayerNorm; fp32 main grads.
    (c, op), = _tp_ops(_program({"tp": 2, "sequence_parallel": True}, model=DEEP))
    per_layer = 2 * (2 * 4096) + 2 * 4096
    assert op.nbytes == 4 * (32 * per_layer + 2 * 4096)


def test_it_runs_after_every_data_parallel_reduce_and_before_the_optimizer() -> None:
    s = megatron_scenario({"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}, 8,
                          model=TINY, gpn=8,
                          framework={"name": "megatron", "distributed_optimizer": True,
                                     "overlap_grad_reduce": True})
    r = simulate(s)
    for cls in (0, 1):
        rec = [x for x in r.recorder.ops if x.cls == cls]
        tp = next(x for x in rec if x.op.name == "tp all-reduce replicated grads")
        grads = [x for x in rec if x.op.key and x.op.key.startswith(("dp/", "edp/"))
                 and x.op.collective in ("reduce_scatter", "all_reduce")]
        opt = next(x for x in rec if x.op.name == "optimizer step")
        assert grads and max(g.end for g in grads) <= tp.start
        assert tp.end <= opt.start
