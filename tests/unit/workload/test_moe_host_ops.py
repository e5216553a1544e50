"""Host calls of a Megatron-Core MoE layer (sim/workload/moe_host_ops.py).

Independent truths: every kernel a component launches from Python is issued by at least one
Python-level call (so the counts can never be below the kernels of sim/workload/moe_ops.py,
which were counted from the same source independently); the totals written out by hand from
core_v0.14.0's ``TopKRouter`` / ``MoEAlltoAllTokenDispatcher`` / ``TEGroupedMLP``; TE 2.7's
``GroupedLinear`` builds its per-expert objects once per local expert and linear; host time
binds only when the GPU's work is short (a tiny layer slows, a large-token one does not).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks.megatron import moe_plan as megatron_moe_plan
from sim.workload.model import ModelSpec
from sim.workload.moe_host_ops import (
    ALLTOALL,
    EXPERTS,
    PER_EXPERT,
    ROUTER,
    MoEHostConfig,
    moe_host_calls,
)
from sim.workload.moe_ops import MoELayout, moe_layer_ops


def _cfg(m: ModelSpec, lay: MoELayout, dispatcher: str = "alltoall") -> MoEHostConfig:
    assert m.moe is not None
    return MoEHostConfig(local_experts=m.moe.experts // lay.ep, dispatcher=dispatcher,  # type: ignore[arg-type]
                         fp8=lay.fp8 is not None, router=m.moe.router,
                         router_fusion=lay.router_fusion, aux_loss=lay.aux_loss,
                         z_loss=lay.z_loss, token_drop=lay.token_drop,
                         permute_fusion=lay.permute != "torch", bias=m.bias,
                         clamp=m.activation_clamp is not None, shared=m.moe.shared > 0)


@pytest.mark.parametrize("name,lay,tokens", [
    ("qwen3-30b-a3b", MoELayout(ep=8, router_fusion=False, z_loss=True), 4096),
    ("qwen3-30b-a3b", MoELayout(ep=8, permute="te", token_drop="pad", fp8="tensorwise"),
     4096),
    ("deepseek-v3", MoELayout(ep=64, router_fusion=False, permute="te"), 4096),
    ("mixtral-8x7b", MoELayout(ep=8, tp=2, token_drop="drop"), 2048),
    ("gpt-oss-120b", MoELayout(ep=8, permute="te"), 4096),
    ("qwen3-235b-a22b", MoELayout(ep=8, tp=4, permute="te"), 1024),
    # moe_permute_fusion off: PyTorch's argsort permutation, scatter_add_, split and cat.
    ("qwen3-30b-a3b", MoELayout(ep=16, permute="torch"), 4096),
    ("qwen3-30b-a3b", MoELayout(ep=8, permute="torch", token_drop="pad"), 4096),
])
@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_calls_cover_the_kernels_they_launch(name, lay, tokens, dispatcher) -> None:
    m = ModelSpec.from_ref(name)
    assert m.moe is not None
    if lay.token_drop is not None:
        m = replace(m, moe=replace(m.moe, capacity_factor=1.0))
    ops = moe_layer_ops(m, lay, tokens)
    calls = moe_host_calls(_cfg(m, lay, dispatcher))
    blocks = {"router": ops.router, "experts": ops.experts, "combine": ops.combine,
              "shared": ops.shared}
    for comp, block in blocks.items():
        if block is None:
            assert comp not in calls
            continue
        f, b = calls[comp].total
        assert f >= len(block.forward), (comp, f, [k.name for k in block.forward])
        assert b >= len(block.backward), (comp, b, [k.name for k in block.backward])


def test_totals_written_out_from_the_source() -> None:
    # Qwen3-30B-A3B, 25.09 defaults of the Bridge provider: fused router and permutation,
    # aux loss, dropless, bf16, 16 local experts (EP8).
    c = moe_host_calls(MoEHostConfig(local_experts=16))
    # gate 6 + fused top-k 3 + fused aux loss 12; preprocess 15, dispatch_preprocess 17,
    # fused permute 8, two all-to-all wrappers 4.
    assert c["router"].total == (6 + 3 + 12 + 15 + 17 + 8 + 4, 10 + 2 + 6 + 0 + 1 + 3 + 4)
    assert c["router"].mod_fwd == 1            # the router module itself
    # TEGroupedMLP 20 (3 of them module calls), fused chunk sort 6 and unsort 5; bf16: 3
    # objects an expert and linear.
    assert c["experts"].total[0] == 20 + 6 + 5 and c["experts"].mod_fwd == 3
    assert c["experts"].cpp_fwd == 3 * 2 * 16
    assert c["experts"].cpp_bwd == 6 * 2 * 16
    assert "shared" not in c
    # The padded (token drop) path skips the count gather and the host's copies.
    p = moe_host_calls(MoEHostConfig(local_experts=16, token_drop="pad"))
    assert c["router"].total[0] - p["router"].total[0] == (
        ALLTOALL["preprocess"][0] + ALLTOALL["dispatch_preprocess"][0]
        - ALLTOALL["preprocess_pad"][0] - 1 - ROUTER["pad"][0])


def test_only_the_experts_scale_with_local_experts() -> None:
    a = moe_host_calls(MoEHostConfig(local_experts=4, fp8=True))
    b = moe_host_calls(MoEHostConfig(local_experts=16, fp8=True))
    assert a["router"] == b["router"] and a["combine"] == b["combine"]
    assert a["experts"].total == b["experts"].total
    assert b["experts"].cpp_fwd - a["experts"].cpp_fwd == 2 * 12 * PER_EXPERT["fp8"][0]
    assert b["experts"].cpp_bwd - a["experts"].cpp_bwd == 2 * 12 * PER_EXPERT["fp8"][1]
    bf = moe_host_calls(MoEHostConfig(local_experts=16))
    assert b["experts"].total[0] - bf["experts"].total[0] == EXPERTS["fp8"][0]


# The small MoE model of test_megatron_moe_dispatch.py: 4 layers, 8 experts of width 1024.
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}


def _step(seq: int, monkeypatch: pytest.MonkeyPatch | None = None) -> float:
    if monkeypatch is not None:   # the kernel-count pricing this module replaced
        monkeypatch.setattr(megatron_moe_plan, "megatron_host_calls", lambda ctx, lay: None)
    s = megatron_scenario({"tp": 1, "ep": 8}, 8, model=TINY, seq=seq,
                          framework={"name": "megatron"})
    return simulate(s).summary["step_time_s"]


def test_host_binds_a_tiny_layer_not_a_large_one(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny, large = _step(256), _step(32768)
    with monkeypatch.context() as mp:
        tiny0, large0 = _step(256, mp), _step(32768, mp)
    # 256 tokens a rank: a few microseconds of GPU work a kernel, the host paces the step.
    assert tiny > 1.2 * tiny0
    # 32k tokens a rank: the GPU runs far behind the host, whose extra calls hide, but for
    # those between the dropless dispatcher's host sync (the token counts, each layer) and
    # the next kernel: 2.2% here.
    assert large0 <= large < 1.03 * large0
    assert large / large0 - 1 < (tiny / tiny0 - 1) / 10
