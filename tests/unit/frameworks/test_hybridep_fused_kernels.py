"""Hybrid-EP permutes inside its dispatch and combine (sim/frameworks/megatron/moe_hybridep.py
``drop_fused_kernels``): Megatron-Core 23265d2d's flex dispatcher runs no TE permutation before
the dispatch nor TE unpermutation after the combine; DeepEP hybrid-ep a0d27f1's
``dispatch_with_permute`` / ``combine_with_unpermute`` permute locally (the experts block's
chunk sort and unsort stand for them); under FP8 the dispatch pads each expert's rows to the
quantization alignment (core_r0.16 b0cc2706 ``hybrid_ep_dispatch(pad_multiple=...)``), so the
experts' padding copies are no-ops."""

from __future__ import annotations

from sim.frameworks.megatron.moe_hybridep import FUSED_KERNELS, drop_fused_kernels
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops


def _ops():
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    return moe_layer_ops(m, MoELayout(ep=16, permute="te", fp8="tensorwise"), 4096)


def _names(block):
    return [k.name for k in block.forward + block.backward]


def test_the_permutations_go_and_the_local_sorts_stay() -> None:
    ops = _ops()
    experts_before = _names(ops.experts)
    drop_fused_kernels(ops)
    for name, drop in FUSED_KERNELS.items():
        assert not set(_names(getattr(ops, name))) & drop
    # The router keeps its gate, top-k and aux loss; the experts block keeps everything but
    # the FP8 padding copies (Hybrid-EP's dispatch pads to the alignment: pad_multiple), its
    # chunk sort and unsort (the local permute / unpermute Hybrid-EP runs) included.
    assert "gate.fwd" in _names(ops.router) and "topk_fused" in _names(ops.router)
    assert _names(ops.experts) == [n for n in experts_before if n not in FUSED_KERNELS["experts"]]
    assert {"sort_chunks", "unsort_chunks"} <= set(experts_before)
    assert {"fp8_pad", "fp8_unpad"} <= set(experts_before)


def test_the_gemms_still_run_the_aligned_rows() -> None:
    ops = _ops()
    rows = [k.gemm[0] for k in ops.experts.forward if k.klass == "gemm"]
    drop_fused_kernels(ops)
    assert [k.gemm[0] for k in ops.experts.forward if k.klass == "gemm"] == rows
    assert all(r > 4096 * 8 for r in rows)        # the routed rows, padded to FP8's 16


def test_only_the_dropped_kernels_and_their_saved_tensors_go() -> None:
    ops = _ops()
    before = {n: (len(getattr(ops, n).forward) + len(getattr(ops, n).backward),
                  {t.name for t in getattr(ops, n).saved}) for n in FUSED_KERNELS}
    present = {n: set(_names(getattr(ops, n))) & FUSED_KERNELS[n] for n in FUSED_KERNELS}
    drop_fused_kernels(ops)
    for n in FUSED_KERNELS:
        b = getattr(ops, n)
        assert len(b.forward) + len(b.backward) == before[n][0] - len(present[n])
    # The permutation's row-id map was saved for its backward only.
    assert "moe_router.row_id_map" in before["router"][1]
    assert "moe_router.row_id_map" not in {t.name for t in ops.router.saved}
    assert {t.name for t in ops.router.saved} < before["router"][1]


def test_router_padding_spares_deepep_the_padding_copies() -> None:
    # --moe-router-padding-for-quantization (the model zoo's PR=fp8 / mxfp8): the router pads
    # each expert's count to the alignment, so the experts' Fp8Padding has nothing to copy.
    from helpers import megatron_scenario

    from sim.frameworks import JobContext
    from sim.frameworks.megatron.moe_plan import moe_plan
    from sim.hardware.compute import ComputeModel

    model = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
             "vocab": 32000, "experts": 32, "experts_per_token": 4, "moe_ffn_hidden": 512}

    def experts(**fw: object):
        s = megatron_scenario({"tp": 1, "ep": 8}, 8, model=model, seq=1024, nodes=1, gpn=8,
                              precision="fp8", framework={
                                  "name": "megatron", "moe_token_dispatcher_type": "flex",
                                  **fw})
        ctx = JobContext.from_scenario(s, "s.yaml")
        cm = ComputeModel(ctx.gpu)
        pl = moe_plan(ctx, 1, 1, 1024, cm, fp8="tensorwise")
        return set(_names(pl.ops.experts)), pl.cost["experts"]

    (plain, c0), (padded, c1) = experts(), experts(moe_router_padding_for_quantization=True)
    assert plain - padded == {"fp8_pad", "fp8_pad.bwd", "fp8_unpad", "fp8_unpad.bwd"}
    assert not padded - plain
    assert c1.fwd_gpu_s < c0.fwd_gpu_s and c1.flops_fwd == c0.flops_fwd
