"""The ``layernorm`` and ``moe_act`` checkpoints' own costs, as Megatron-Core runs them.

``tensor_parallel.CheckpointWithoutOutput`` (megatron/core/tensor_parallel/random.py
L483-615, core_v0.14.0; unchanged in structure at 0d8e0714 and b0cc2706) around the pre-MLP
norm (transformer_layer.py) and the experts' activation (moe/experts.py ``TEGroupedMLP``)
saves and restores the RNG states, re-runs the function's Python, copies the recomputed
output into the storage the forward freed and keeps the recomputed tensor until its own
backward. Both are built with no argument, so ``self.fp8 = False is not None`` is true and
both enter Transformer Engine's recompute contexts. Independent truths: the call counts read
off that source (each line of :mod:`sim.workload.checkpoint_without_output`'s docstring; MLA's
hand count of 8ccd086, 15 and 38, reproduced by the same rule), the per-call costs the layer
model uses, and the tensors' shapes (T tokens, hidden h, top-k rows of expert width F, bf16).
"""

from __future__ import annotations

import pytest
from test_megatron_recompute_modules import GQA, F, H, K, T, _op, _program, _scn

from sim.hardware.compute import EAGER_FWD_OP_CPU_S
from sim.hardware.host import X86_TE_MODULE_CALL_CPU_S
from sim.workload.checkpoint_without_output import (
    LAYERNORM_IO,
    MOE_ACT_IO,
    MOE_ACT_RERUN,
    checkpoint_calls,
)
from sim.workload.megatron_mla import mla_up_checkpoint_calls

ACT = T * K * F * 2     # the activation's output, top-k rows of width F
NORM = T * H * 2        # the pre-MLP norm's output


def _acts(op, which: str) -> float:
    return sum(b for pool, b in getattr(op, which) if pool == "activations")


def test_one_rule_counts_mla_up_proj_as_its_hand_count() -> None:
    # 8ccd086 counted MLA's checkpoint call by call: 15 forward, 38 backward (fused rotary),
    # 43 with the unfused one, +3 / +2 under FP8. The shared rule gives the same.
    assert mla_up_checkpoint_calls(fp8=False, rope_fusion=True) == (15, 38)
    assert mla_up_checkpoint_calls(fp8=False, rope_fusion=False) == (15, 43)
    assert mla_up_checkpoint_calls(fp8=True, rope_fusion=True) == (18, 40)


def test_the_layernorm_and_activation_checkpoints_count_their_own_calls() -> None:
    # Norm: 8 fixed + 1 detach + 1 resize_(0) + 3 TE contexts forward; 13 fixed + 3 restore
    # calls + 1 .grad + 2 TE contexts backward (its re-run is one module call, priced apart).
    assert checkpoint_calls(*LAYERNORM_IO, 0, te_contexts=True) == (13, 19)
    # SwiGLU activation: fc1's output and the probs (the bias is None): 8 + 2 + 1 + 3; the
    # re-run's view and apply: 13 + 2 + 3 + 2 + 2.
    assert checkpoint_calls(*MOE_ACT_IO, MOE_ACT_RERUN["swiglu"], te_contexts=True) == (14, 22)


def test_the_host_pays_the_checkpoints_in_forward_and_backward() -> None:
    none, both = _program(_scn([], GQA)), _program(_scn(["moe_act", "layernorm"], GQA))
    experts_f, experts_b = "fwd moe L1 mb0 experts", "bwd moe L1 mb0 experts"
    assert _op(both, experts_f).cpu_s - _op(none, experts_f).cpu_s == \
        pytest.approx(14 * EAGER_FWD_OP_CPU_S, rel=1e-12)
    assert _op(both, experts_b).cpu_s - _op(none, experts_b).cpu_s == \
        pytest.approx(22 * EAGER_FWD_OP_CPU_S, rel=1e-12)
    # The norm's checkpoint: on the MoE layer's first forward op, and at the start of its
    # backward with the norm module called again.
    first_f = next(o.name for o in none.classes[0].streams["compute"]
                   if o.name.startswith("fwd moe L1 mb0"))
    assert _op(both, first_f).cpu_s - _op(none, first_f).cpu_s == \
        pytest.approx(13 * EAGER_FWD_OP_CPU_S, rel=1e-12)
    first_b = "bwd moe L1 mb0 combine"
    assert _op(both, first_b).cpu_s - _op(none, first_b).cpu_s == \
        pytest.approx(19 * EAGER_FWD_OP_CPU_S + X86_TE_MODULE_CALL_CPU_S, rel=1e-12)


def test_the_recomputed_outputs_live_beside_the_restored_ones() -> None:
    # The activation: the experts' backward re-allocates fc2's freed input and holds the
    # recomputed one (T k x F) too, and frees both by its end.
    act, none = _program(_scn(["moe_act"], GQA)), _program(_scn([], GQA))
    experts = "bwd moe L1 mb0 experts"
    assert _acts(_op(act, experts), "alloc") - _acts(_op(none, experts), "alloc") == \
        pytest.approx(ACT + ACT)
    assert _acts(_op(act, experts), "free") - _acts(_op(none, experts), "free") == \
        pytest.approx(ACT + ACT)
    # The norm: its output re-allocated at the layer's backward start with the recomputed
    # copy (T x h), both freed at its end; the forward held the output and its statistics
    # (2 x T x 4 bytes as the layer model saves them) less.
    norm = _program(_scn(["layernorm"], GQA))
    first = "bwd moe L1 mb0 combine"
    extra = _acts(_op(norm, first), "alloc") - _acts(_op(none, first), "alloc")
    assert extra == pytest.approx(NORM + 2 * T * 4 + NORM)


def test_a_layer_without_the_modules_pays_nothing() -> None:
    a, b = _program(_scn([], GQA)), _program(_scn(["core_attn"], GQA))
    for name in ("fwd moe L1 mb0 experts", "bwd moe L1 mb0 experts", "bwd moe L1 mb0 combine"):
        assert _op(a, name).cpu_s == _op(b, name).cpu_s
