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
