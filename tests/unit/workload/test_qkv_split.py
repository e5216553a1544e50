"""Megatron-Core's split of the fused QKV projection (sim/workload/qkv_split.py) against the
layout rule it follows and closed forms.

Independent truths: Megatron-Core ``SelfAttention.get_query_key_value_tensors``
(``megatron/core/transformer/attention.py``, core_v0.14.0 through 0.16: view as ``[s, b, ng,
(np/ng + 2) hn]``, split, ``query.reshape(s, b, -1, hn)``); PyTorch's rule for when a reshape
is a view (merging two dimensions needs ``stride[i] == size[i + 1] x stride[i + 1]``), checked
here on real tensors; Little's law for the non-vectorised copy (``ComputeModel.legacy_loop_time``,
one element a resident thread in flight).
"""

from __future__ import annotations

import numpy as np
import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.memory_bound import RESIDENT_THREADS_PER_SM, STRIDED_LOAD_LATENCY_S
from sim.workload.block_pricing import kernel_time
from sim.workload.layer_ops import BF16, Style, _Builder
from sim.workload.megatron_ops import MegatronLayout, attention_block
from sim.workload.model import ModelSpec
from sim.workload.qkv_split import qkv_split

SEQ = 4096


def _main(model: str, tp: int):
    m = ModelSpec.from_ref(model)
    return m, attention_block(m, MegatronLayout(tp=tp, sequence_parallel=tp > 1), 1, SEQ)[1]


def _named(ks, name):
    return [k for k in ks if k.name.endswith(name)]


def _reshape_is_a_view(groups: int, heads_per_group: int, head_dim: int = 4) -> bool:
    # The query view exactly as Megatron takes it, on a real (numpy) array: numpy's reshape
    # copies when a view is impossible, and which it does is the same stride rule PyTorch's.
    width = (heads_per_group + 2) * head_dim
    mixed = np.zeros((3, 2, groups, width), dtype=np.float32)
    query = mixed[..., : heads_per_group * head_dim]
    out = query.reshape(3, 2, groups * heads_per_group, head_dim)
    return np.shares_memory(out, mixed)


@pytest.mark.parametrize("groups,per_group", [(4, 8), (2, 16), (1, 8), (8, 1), (4, 1)])
def test_the_copy_is_priced_exactly_when_the_reshape_cannot_be_a_view(groups, per_group):
    # The builder's decision against the strided-array truth, layout by layout.
    b = _Builder("attn_main", Style("bf16"))
    tokens, hd = 16, 128
    qd, kvd = groups * per_group * hd, groups * hd
    qkv = b.t("qkv.out", tokens * (qd + 2 * kvd), BF16)
    g = b.t("qkv.g_out", tokens * (qd + 2 * kvd), BF16)
    qkv_split(b, qkv, g, tokens, qd, kvd, heads=groups * per_group, groups=groups)
    priced = any(k.name == "q_reshape_copy" for k in b.block.forward)
    assert priced == (not _reshape_is_a_view(groups, per_group))


@pytest.mark.parametrize("model,tp,copies", [
    ("qwen3-30b-a3b", 1, True),      # 32 heads in 4 groups on the rank
    ("qwen3-30b-a3b", 2, True),      # 2 groups of 8
    ("qwen3-30b-a3b", 4, False),     # one group a rank: a view
    ("llama3-70b", 8, False),        # 8 groups over TP 8
    ("llama3-70b", 4, True),
    ("gpt3-175b", 8, False),         # multi-head attention: one head a group
])
def test_which_layouts_copy_the_query(model, tp, copies):
    m, blk = _main(model, tp)
    ks = _named(blk.forward, "q_reshape_copy")
    assert bool(ks) == copies
    if copies:
        # Every local query element once, read and written in bf16.
        q_elems = SEQ * m.heads // tp * m.head_dim
        assert ks[0].legacy_elements == q_elems
        assert ks[0].nbytes == pytest.approx(2 * 2 * q_elems)


@pytest.mark.parametrize("model,tp", [("qwen3-30b-a3b", 1), ("llama3-70b", 8),
                                      ("gpt3-175b", 8)])
def test_the_split_backward_concatenates_every_gradient_once(model, tp):
    # Reads the query, key and value gradients and writes the projection's output gradient:
    # 2 x tokens x (q + 2 kv width) bf16 elements, whatever the layout.
    m, blk = _main(model, tp)
    (cat,) = _named(blk.backward, "split_qkv.bwd")
    width = (m.heads + 2 * m.kv_heads) // tp * m.head_dim
    assert cat.nbytes == pytest.approx(2 * 2 * SEQ * width)
    assert cat.klass == "elementwise" and not cat.legacy_elements
    # It runs just before the QKV projection's backward (GPT-3's bias gradient too) and writes
    # what both of its GEMMs read.
    names = [k.name for k in blk.backward]
    after = names[names.index("split_qkv.bwd") + 1:]
    assert after[:2] == ["qkv.dgrad", "qkv.wgrad"] and set(after[2:]) <= {"qkv.g_bias"}
    for k in _named(blk.backward, "qkv.dgrad") + _named(blk.backward, "qkv.wgrad"):
        assert cat.writes[0] in k.reads


def test_the_copy_runs_at_littles_law_not_at_the_stream_rate_on_b200():
    # Qwen3-30B-A3B's query on one B200 (TP 1): 16.8M elements, one in flight a resident
    # thread for 624 ns: 16,777,216 x 624e-9 / (148 x 2,048) = 34.5 us, against 67 MB read
    # and written at the B200's elementwise stream rate (about 12 us).
    cm = ComputeModel(catalog.gpu("b200"))
    _, blk = _main("qwen3-30b-a3b", 1)
    (k,) = _named(blk.forward, "q_reshape_copy")
    latency = k.legacy_elements * STRIDED_LOAD_LATENCY_S / (
        cm.gpu.sm_count * RESIDENT_THREADS_PER_SM)
    assert latency == pytest.approx(34.5e-6, rel=0.01)
    t = kernel_time(cm, k)
    assert t == pytest.approx(latency + cm.kernel_min_s, rel=0.01)
    assert t > 2 * (cm.membound_time(k.nbytes))
