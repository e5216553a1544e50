"""Megatron-Core's token dropping in the router (``apply_router_token_dropping``,
``megatron/core/transformer/moe/moe_utils.py`` at core_v0.14.0), counted from the source:
``torch.topk`` over the tokens with ``k`` = capacity, ``zeros_like``, ``scatter``, ``bool``,
(without padding) ``logical_and`` with the top-k map, and the probs masked by a multiply;
``MoEAlltoAllTokenDispatcher.preprocess`` returns before counting tokens with padding."""

from __future__ import annotations

import dataclasses

import pytest

from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

FWD = {"drop": ["drop.topk", "drop.zeros", "drop.scatter", "drop.to_bool",
                "drop.logical_and", "drop.mask_probs"],
       "pad": ["drop.topk", "drop.zeros", "drop.scatter", "drop.to_bool", "drop.mask_probs"]}


def _model(cf: float | None) -> ModelSpec:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    assert m.moe is not None
    return dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=cf))


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_token_drop_kernels_as_the_source_runs_them(mode: str) -> None:
    m = _model(1.0)
    ops = moe_layer_ops(m, MoELayout(ep=8, token_drop=mode), 4096)   # type: ignore[arg-type]
    names = [k.name for k in ops.router.forward]
    assert [n for n in names if n.startswith("drop.")] == FWD[mode]
    assert ("count_tokens" in names) == (mode == "drop")
    # get_capacity(4096 x 8 tokens, 128 experts, factor 1) = 256 a column: topk's values
    # (fp32) and indices (int64) over every expert.
    topk = next(k for k in ops.router.forward if k.name == "drop.topk")
    assert sum(t.nbytes for t in topk.writes) == 256 * 128 * (4 + 8)
    # The masking multiply is the only differentiable op: one backward kernel, between the
    # permutation's probs gradient and the top-k's.
    bwd = [k.name for k in ops.router.backward]
    assert [n for n in bwd if n.startswith("drop.")] == ["drop.mask_probs.bwd"]
    assert bwd.index("permute.probs_bwd") < bwd.index("drop.mask_probs.bwd") \
        < bwd.index("topk_fused.bwd")


def test_no_token_drop_without_the_option() -> None:
    # torchtitan and DeepSpeed build the router without Megatron's dropping (token_drop None),
    # whatever the model's capacity factor.
    for cf in (None, 1.0):
        ops = moe_layer_ops(_model(cf), MoELayout(ep=8), 4096)
        assert not any(k.name.startswith("drop.") for k in ops.router.forward)


def test_te_fused_permutation_kernels() -> None:
    # TE 2.7 pytorch/triton/permutation.py: make_row_id_map's three passes before the permute
    # kernel, its map [tokens, 2 x experts + 1] int32 kept for backward; the chunk sort builds
    # its map first (make_chunk_sort_map); with drop_and_pad the dispatcher copies the tokens
    # and then the probs (transpose(0, 1).contiguous(), two kernels) instead.
    m = _model(1.0)
    ops = moe_layer_ops(m, MoELayout(ep=8, permute="te"), 4096)
    names = [k.name for k in ops.router.forward]
    assert names[-4:] == ["row_id_map.pass_1", "row_id_map.pass_2", "row_id_map.pass_3",
                          "permute"]
    rid = next(t for t in ops.router.saved if t.name.endswith("row_id_map"))
    assert rid.nbytes == 4096 * (2 * 128 + 1) * 4
    ex = [k.name for k in ops.experts.forward]
    assert ex[:2] == ["sort_chunks.map", "sort_chunks"]
    assert "unsort_chunks.map" in ex
    pad = moe_layer_ops(m, MoELayout(ep=8, permute="te", token_drop="pad"), 4096)
    ex = [k.name for k in pad.experts.forward]
    assert ex[:2] == ["sort_chunks", "sort_chunks.probs"]
    assert "unsort_chunks.map" not in ex
    # Without the fusion (torchtitan's pricing) the permutation stays one kernel.
    plain = [k.name for k in moe_layer_ops(m, MoELayout(ep=8), 4096).router.forward]
    assert not any(n.startswith("row_id_map") for n in plain)
