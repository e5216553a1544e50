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
    return moe_layer_ops(m, MoELayout(ep=16, te_permute=True, fp8="tensorwise"), 4096)


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
    assert all(r % 16 == 0 for r in rows)         # FP8's 16-row alignment


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
