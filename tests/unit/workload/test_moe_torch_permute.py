"""Megatron-Core's unfused token permutations (``moe_permute_fusion`` off,
:mod:`sim.workload.moe_torch_permute`).

Independent truths: the permutation moves the same bytes whatever runs it (every routed copy
of a token gathered once, scattered back once: tokens x top_k x hidden x 2 bytes each way),
so the unfused path can only add time to TE's fused one: PyTorch's ``index_select``,
``index_add_``, ``scatter_add_`` and ``gather`` walk one element a thread, never faster than
streaming the same bytes; ``torch.cat`` batches 64 aligned inputs a launch (PyTorch
``Shape.cu``, ``CAT_ARRAY_BATCH_SIZE / 2``); and the chunk sort splits one view per
(source rank, local expert) chunk.
"""

from __future__ import annotations

import dataclasses

import pytest

from sim import catalog
from sim.hardware.compute import VIEW_CPU_S, ComputeModel
from sim.workload.block_pricing import kernel_time, price_block
from sim.workload.kernels import BF16
from sim.workload.model import ModelSpec
from sim.workload.moe_host_ops import MoEHostConfig, chunk_views, moe_host_calls
from sim.workload.moe_ops import STYLE, MoELayout, moe_layer_ops
from sim.workload.moe_torch_permute import cat_launches

M = ModelSpec.from_ref("qwen3-30b-a3b")
TOKENS = 4096
EP = 16


def _ops(fused: bool, **kw: object):
    return moe_layer_ops(M, MoELayout(ep=EP, permute="te" if fused else "torch", **kw),
                         tokens=TOKENS)


def test_the_gather_and_scatter_move_every_routed_copy_once() -> None:
    ops = _ops(False)
    rows = TOKENS * M.moe.top_k
    k = {k.name: k for k in ops.router.forward}["permute"]
    assert k.legacy_elements == rows * M.hidden
    assert k.writes[0].nbytes == rows * M.hidden * BF16
    u = {k.name: k for k in ops.combine.forward}["unpermute"]
    assert u.legacy_elements == rows * M.hidden
    assert u.writes[0].nbytes == TOKENS * M.hidden * BF16   # summed into each token's row
    ub = {k.name: k for k in ops.combine.backward}["unpermute.bwd"]
    assert ub.writes[0].nbytes == rows * M.hidden * BF16    # gathered back per copy


@pytest.mark.parametrize("gpu", ["h100-sxm", "b200"])
def test_unfused_never_beats_the_fused_kernels(gpu: str) -> None:
    cm = ComputeModel(catalog.gpu(gpu))
    fused, torch_ops = _ops(True), _ops(False)
    for name in ("router", "experts", "combine"):
        a = price_block(getattr(fused, name), STYLE, cm)
        b = price_block(getattr(torch_ops, name), STYLE, cm)
        assert b.fwd_s >= a.fwd_s * 0.999 and b.bwd_s >= a.bwd_s * 0.999, name
    # Element by element, the gather is slower than streaming its bytes.
    k = {k.name: k for k in torch_ops.router.forward}["permute"]
    assert kernel_time(cm, k) > cm.membound_time(k.nbytes, "elementwise")


def test_the_chunk_sort_is_split_and_cat_over_every_chunk() -> None:
    ops = _ops(False)
    local = M.moe.experts // EP
    fwd = {k.name: k for k in ops.experts.forward}
    assert fwd["sort_chunks"].launches == cat_launches(EP * local, M.hidden * BF16) == 2
    assert fwd["sort_chunks.probs"].launches == 1          # 4-byte probs: unaligned batches
    assert "sort_chunks.map" not in fwd and "unsort_chunks.map" not in fwd
    assert "unsort_chunks" in fwd
    assert {"sort_chunks.bwd", "sort_chunks.probs_bwd", "unsort_chunks.bwd"} <= {
        k.name for k in ops.experts.backward}


def test_the_splits_views_are_priced_per_chunk() -> None:
    local = M.moe.experts // EP
    c = MoEHostConfig(local_experts=local, permute_fusion=False, chunk_sources=EP)
    views = chunk_views(c)
    # Tokens and probs split in the sort, tokens in the unsort; CatBackward narrows each.
    assert views == (3 * EP * local, 3 * EP * local)
    exp = moe_host_calls(c)["experts"]
    assert (exp.views_fwd, exp.views_bwd) == views
    assert views[0] * VIEW_CPU_S == pytest.approx(576e-6)
    assert chunk_views(MoEHostConfig(local_experts=local, chunk_sources=EP)) == (0, 0)
    assert chunk_views(MoEHostConfig(local_experts=local, permute_fusion=False,
                                     chunk_sources=EP, token_drop="pad")) == (0, 0)


def test_padded_dispatch_sorts_each_experts_row_and_keeps_its_transposes() -> None:
    m = dataclasses.replace(M, moe=dataclasses.replace(M.moe, capacity_factor=1.0))
    lay = MoELayout(ep=EP, permute="torch", token_drop="pad")
    cap = -(-TOKENS * M.moe.top_k // M.moe.experts)      # get_capacity at factor 1
    rows = cap * M.moe.experts
    ops = moe_layer_ops(m, lay, tokens=TOKENS, permuted_rows=rows)
    fwd = {k.name: k for k in ops.router.forward}
    assert fwd["permute.capacity_slice"].legacy_elements == rows
    assert fwd["permute"].legacy_elements == rows * M.hidden
    # drop_and_pad's chunk sort is the transposed view's copy, not split and cat.
    exp = {k.name: k for k in ops.experts.forward}
    assert exp["sort_chunks"].legacy_elements > 0 and exp["sort_chunks"].launches == 1
