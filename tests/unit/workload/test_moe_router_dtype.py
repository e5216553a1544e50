"""``moe_router_dtype`` (sim/workload/moe_router_ops.py): the routing tensors' bytes follow it.

Megatron-Core core_v0.14.0 ``router.py`` ``TopKRouter.gating``: ``router_dtype =
input.dtype`` unless ``moe_router_dtype`` is ``fp32``; the logits come out of
``RouterGatingLinearFunction`` in it and every routing tensor after them keeps it (TE 2.7
``router.cpp`` allocates the fused top-k's outputs in the logits' dtype; ``permutation.py`` the
permuted probs in the probs' dtype). Megatron-Bridge's Qwen3-MoE provider leaves it unset.
"""

from __future__ import annotations

import dataclasses

import pytest

from sim.workload.kernels import BF16, FP32
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops
from sim.workload.moe_router_ops import router_dtype_bytes

TOKENS = 4096


def _ops(router_bytes: int, **kw: object):
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    return m, moe_layer_ops(m, MoELayout(ep=8, router_bytes=router_bytes, permute="te",
                                         **kw), TOKENS)  # type: ignore[arg-type]


def _kernel(block, name):
    return next(k for k in block.forward + block.backward if k.name == name)


def test_option_to_bytes():
    assert router_dtype_bytes("fp32") == FP32
    assert router_dtype_bytes(None) == BF16


@pytest.mark.parametrize("fusion", [True, False])
def test_logits_and_probs_halve_in_bf16(fusion):
    m, f32 = _ops(FP32, router_fusion=fusion)
    _, b16 = _ops(BF16, router_fusion=fusion)
    assert m.moe is not None
    e = m.moe.experts
    # The gate GEMM writes [tokens, experts] logits: 4 bytes each in fp32, 2 in bf16; its
    # bf16 operands (input and weight) are the same either way.
    g32, g16 = _kernel(f32.router, "gate.fwd"), _kernel(b16.router, "gate.fwd")
    assert g32.nbytes - g16.nbytes == pytest.approx(TOKENS * e * (FP32 - BF16))
    # The permutation reads the dense probs [tokens, experts] and writes one prob a routed
    # copy (tokens x top-k), both in the probs' dtype.
    p32, p16 = _kernel(f32.router, "permute"), _kernel(b16.router, "permute")
    assert p32.nbytes - p16.nbytes == pytest.approx(
        TOKENS * (e + m.moe.top_k) * (FP32 - BF16))
    # Every router kernel moves no more bytes in bf16 than in fp32.
    for k16 in b16.router.forward + b16.router.backward:
        k32 = next((k for k in f32.router.forward + f32.router.backward
                    if k.name == k16.name), None)
        assert k32 is not None and k16.nbytes <= k32.nbytes, k16.name


def test_bf16_router_casts_no_weight():
    _, f32 = _ops(FP32)
    _, b16 = _ops(BF16)
    names32 = [k.name for k in f32.router.backward]
    names16 = [k.name for k in b16.router.backward]
    # weight.to(fp32) is a kernel; weight.to(bf16) of a bf16 weight returns it.
    assert "gate.w_to_fp32" in names32 and "gate.w_to_fp32" not in names16
    assert len(names32) == len(names16) + 1


def test_probs_alltoall_bytes_closed_form():
    """The probs all-to-all sends one prob per routed copy: tokens x top-k x bytes in all
    (its own chunk included), 2 bytes each when the router runs in bf16."""
    m, f32 = _ops(FP32)
    _, b16 = _ops(BF16)
    assert m.moe is not None
    for ops, nb in ((f32, FP32), (b16, BF16)):
        a = ops.alltoall["dispatch_probs_fwd"]
        assert sum(a.send_bytes) == pytest.approx(TOKENS * m.moe.top_k * nb)
    # The tokens' all-to-all does not depend on the router's dtype.
    assert f32.alltoall["dispatch_fwd"].send_bytes == b16.alltoall["dispatch_fwd"].send_bytes


def test_token_drop_masks_in_the_probs_dtype():
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    assert m.moe is not None
    m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=1.0))
    blocks = {rb: moe_layer_ops(m, MoELayout(ep=8, router_bytes=rb, token_drop="pad"), TOKENS)
              for rb in (FP32, BF16)}
    k32 = _kernel(blocks[FP32].router, "drop.mask_probs")
    k16 = _kernel(blocks[BF16].router, "drop.mask_probs")
    # Reads the dense probs and writes the masked ones: 2 x tokens x experts elements.
    e = m.moe.experts
    assert k32.nbytes - k16.nbytes == pytest.approx(2 * TOKENS * e * (FP32 - BF16))
