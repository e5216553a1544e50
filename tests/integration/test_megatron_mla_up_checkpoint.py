"""The ``mla_up_proj`` checkpoint's own costs, as Megatron-Core core_v0.14.0 runs it.

``CheckpointWithoutOutput`` (megatron/core/tensor_parallel/random.py) around MLA's
``qkv_up_proj_and_rope_apply`` does more than re-run the up projections' kernels: it saves and
restores the RNG states, re-runs the function's Python (two TE module calls among plain torch
calls), copies each recomputed output into the storage the forward freed
(``untyped_storage().copy_``) and keeps the recomputed tensors until its own backward. The
numbers below are the closed forms of those: the call counts of
:func:`sim.workload.megatron_mla.mla_up_checkpoint_calls` at the per-call costs the layer model
uses, and the query, key and value bytes of the small MLA model.
"""

from __future__ import annotations

import pytest
from test_megatron_recompute_modules import MLA, SEQ, _op, _program, _scn, _shape

from sim.hardware.compute import EAGER_FWD_OP_CPU_S
from sim.hardware.host import X86_TE_MODULE_CALL_CPU_S
from sim.workload.layer_ops import kernel_time
from sim.workload.megatron_mla import mla_up_checkpoint_calls, mla_up_restore

T, HEADS, NOPE, ROPE, VD = SEQ, 8, 64, 32, 64
QKV = T * HEADS * ((NOPE + ROPE) * 2 + VD) * 2   # query, key (nope + rope), value; bf16


def _acts(op, which: str) -> float:
    return sum(b for pool, b in getattr(op, which) if pool == "activations")


@pytest.mark.parametrize("fusion", [False, True])
def test_the_checkpoint_costs_its_calls_on_the_host(fusion) -> None:
    fw = {"apply_rope_fusion": fusion}
    none, up = (_program(_scn(m, fw=fw)) for m in ([], ["mla_up_proj"]))
    f, b = mla_up_checkpoint_calls(fp8=False, rope_fusion=fusion)
    # Unfused rotary embedding: the re-run makes the five calls the fused kernels save.
    assert (f, b) == (15, 43 if not fusion else 38)
    for layer in (0, 1):
        fwd, bwd = f"fwd attn L{layer} mb0", f"bwd attn L{layer} mb0"
        assert _op(up, fwd).cpu_s - _op(none, fwd).cpu_s == \
            pytest.approx(f * EAGER_FWD_OP_CPU_S, rel=1e-12)
        assert _op(up, bwd).cpu_s - _op(none, bwd).cpu_s == \
            pytest.approx(b * EAGER_FWD_OP_CPU_S + 2 * X86_TE_MODULE_CALL_CPU_S, rel=1e-12)


def test_fp8_adds_the_recompute_contexts() -> None:
    assert mla_up_checkpoint_calls(fp8=True, rope_fusion=True) == (18, 40)


def test_the_restored_outputs_are_a_copy_of_query_key_value() -> None:
    s = _scn(["mla_up_proj"])
    shape, cm = _shape(s)
    restore = mla_up_restore(shape.blocks["attn_main"])
    assert sum(t.nbytes for t in restore.reads) == QKV
    assert sum(t.nbytes for t in restore.writes) == QKV
    none, up = _program(_scn([])), _program(s)
    bwd = "bwd attn L1 mb0"
    rerun = sum(kernel_time(cm, k) for k in shape.blocks["attn_main"].forward
                if k.name.split(".")[0] in {"q_latent_norm", "q_up", "kv_latent_norm", "kv_up",
                                            "rope", "cat_query", "cat_key",
                                            "value_contiguous"})
    assert _op(up, bwd).duration - _op(none, bwd).duration == \
        pytest.approx(rerun + kernel_time(cm, restore), rel=1e-9)
    assert kernel_time(cm, restore) > 0


def test_both_copies_live_through_the_attention_backward_only() -> None:
    # The attention's backward re-allocates what the checkpoint freed plus the recomputed
    # query, key and value, and frees both at its end (the layer's forward held that much
    # less): the layer still frees every byte, the recomputed copy included.
    none, up = _program(_scn([])), _program(_scn(["mla_up_proj"]))
    bwd = "bwd attn L2 mb0"
    extra_alloc = _acts(_op(up, bwd), "alloc") - _acts(_op(none, bwd), "alloc")
    freed_fwd = _acts(_op(none, "fwd attn L2 mb0"), "alloc") - \
        _acts(_op(up, "fwd attn L2 mb0"), "alloc")
    assert extra_alloc == pytest.approx(freed_fwd + QKV)
    assert _acts(_op(up, bwd), "free") - _acts(_op(none, bwd), "free") == pytest.approx(QKV)


def test_an_mla_model_without_the_module_pays_nothing() -> None:
    a, b = _program(_scn([])), _program(_scn(["moe_act"]))
    assert _op(a, "fwd attn L1 mb0").cpu_s == _op(b, "fwd attn L1 mb0").cpu_s
    assert MLA["attention"] == "mla"
