"""Host calls of the flex dispatcher with the HybridEP backend (sim/workload/moe_host_ops.py
``HYBRIDEP``), against totals written out by hand from Megatron-Core 23265d2d
(``MoEFlexTokenDispatcher``, ``_HybridEPManager``, ``fused_a2a.HybridEPDispatch`` /
``HybridEPCombine``) and DeepEP's hybrid-ep ``hybrid_ep_buffer.py`` at a0d27f1."""

from __future__ import annotations

from sim.workload.moe_host_ops import FLEX, HYBRIDEP, MoEHostConfig, moe_host_calls

BASE = {"local_experts": 8, "dispatcher": "flex", "fp8": True}


def test_totals_written_out_from_the_source() -> None:
    c = moe_host_calls(MoEHostConfig(flex_backend="hybridep", **BASE))  # type: ignore[arg-type]
    d = moe_host_calls(MoEHostConfig(flex_backend="deepep", **BASE))  # type: ignore[arg-type]
    # The router and everything outside the dispatcher are the same for both backends.
    router_only = (d["router"].total[0] - FLEX["dispatch_preprocess"][0]
                   - FLEX["token_dispatch"][0])
    # dispatch_preprocess: view + 2 x (reshape, expand, reshape, contiguous) + 2 reshapes;
    # dispatch: apply, dispatch_with_permute, nvtx push/pop, 4 template-config calls,
    # metadata_preprocessing, the runtime's dispatch_with_permute, tokens_per_expert.sum().
    assert c["router"].total[0] == router_only + (1 + 8 + 2) + (1 + 1 + 2 + 4 + 1 + 1 + 1)
    # No multihot conversion and no permute after the dispatch: the experts' calls are
    # TEGroupedMLP's alone, DeepEP's postprocess less.
    assert c["experts"].total[0] == d["experts"].total[0] - FLEX["postprocess"][0]
    assert c["experts"].cpp_fwd == d["experts"].cpp_fwd
    # combine: apply, combine_with_unpermute, nvtx push/pop, HandleImpl, the runtime's
    # combine; the view. Backward: the Function body's dispatch_with_permute (the same four
    # calls inside it) and the view's node.
    assert c["combine"].total == (1 + 1 + 2 + 1 + 1 + 1, 1 + 2 + 1 + 1 + 1)


def test_bf16_probs_are_cast_on_every_dispatch() -> None:
    """``_HybridEPManager.dispatch``: probs not in fp32 are warned about and cast (.float())
    each call; with ``moe_router_dtype: fp32`` neither happens."""
    f32 = moe_host_calls(MoEHostConfig(flex_backend="hybridep", **BASE))  # type: ignore[arg-type]
    b16 = moe_host_calls(MoEHostConfig(flex_backend="hybridep", router_fp32=False,
                                       **BASE))  # type: ignore[arg-type]
    df = b16["router"].total[0] - f32["router"].total[0]
    db = b16["router"].total[1] - f32["router"].total[1]
    assert (df, db) == HYBRIDEP["probs_cast"] == (2, 1)
    # DeepEP's dispatch casts unconditionally (counted in its token_dispatch): no change.
    d32 = moe_host_calls(MoEHostConfig(**BASE))  # type: ignore[arg-type]
    d16 = moe_host_calls(MoEHostConfig(router_fp32=False, **BASE))  # type: ignore[arg-type]
    assert d32 == d16


def test_alltoall_unaffected_by_the_backend() -> None:
    a = moe_host_calls(MoEHostConfig(local_experts=8, flex_backend="hybridep"))
    b = moe_host_calls(MoEHostConfig(local_experts=8))
    assert a == b
