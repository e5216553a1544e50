"""DeepEP's path permutes once after its dispatch and unpermutes once before its combine
(Megatron-Core core_v0.14.0 ``MoEFlexTokenDispatcher``): the ``alltoall`` dispatcher's chunk
sort by source rank is not run, so a flex (DeepEP) layer moves two fewer copies of its
permuted rows each way than the same layer under ``alltoall``."""

from __future__ import annotations

from sim.frameworks.megatron.moe_flex import CHUNK_SORT_KERNELS, drop_chunk_sorts
from sim.workload.kernels import BF16
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops


def _copied_bytes(kernels) -> float:
    return sum(k.nbytes for k in kernels if k.name in CHUNK_SORT_KERNELS)


def test_deepep_drops_exactly_the_chunk_sorts() -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    tokens = 4096.0
    ops = moe_layer_ops(m, MoELayout(ep=8), tokens)
    before = {b: [k.name for k in getattr(ops.experts, b)] for b in ("forward", "backward")}
    fwd_sorted = _copied_bytes(ops.experts.forward)
    # Closed form: the sort and the unsort each read and write every permuted row once
    # (tokens x top-k rows of hidden bf16 values under balanced routing), plus probs and maps.
    rows = tokens * m.moe.top_k
    assert fwd_sorted >= 2 * 2 * rows * m.hidden * BF16
    drop_chunk_sorts(ops)
    after = {b: [k.name for k in getattr(ops.experts, b)] for b in ("forward", "backward")}
    for b in before:
        assert after[b] == [n for n in before[b] if n not in CHUNK_SORT_KERNELS]
    assert _copied_bytes(ops.experts.forward + ops.experts.backward) == 0.0
    # The GEMMs and the router's permutation (DeepEP's post-dispatch permute) stay.
    assert any(k.gemm for k in ops.experts.forward)
    assert any(k.name == "permute" for k in ops.router.forward)
