"""The combined 1F1B's schedule-node wrappers cost host time
(:mod:`sim.frameworks.megatron.schedule_nodes`, issued by
:func:`sim.frameworks.megatron.a2a_overlap.issue_pair`).

Independent truth: NVIDIA/Megatron-LM @ core_v0.14.0. ``TransformerLayerSchedulePlan.
_build_callable_nodes`` (models/common/model_chunk_schedule_plan.py) gives a MoE layer five
real nodes (``attn``, ``post_attn``, ``moe_dispatch``, ``mlp``, ``moe_combine``; its
``mtp_post_process`` is a ``NoopScheduleNode`` without MTP) and a dense layer two (``attn``,
``mlp``); ``TransformerLayerSchedulePlan.run`` runs each real node once forward and once
backward; a ``NoopScheduleNode`` costs nothing. So a (forward, backward) pair of one MoE layer
adds exactly 5 forward and 5 backward wrappers, a dense layer's 2 and 2; and the wrapper only
adds host time, so the host's total grows by exactly that and nothing else moves.
"""

from __future__ import annotations

from sim.frameworks.megatron.a2a_overlap import issue_pair
from sim.frameworks.megatron.schedule_nodes import (
    BWD_NODE_CALLS,
    FWD_NODE_CALLS,
    NodeHost,
    node_host,
)
from sim.program.ir import Op

CALL = 10e-6    # a plain torch call's host time: EAGER_FWD_OP_CPU_S (sim/hardware/compute.py),
# not MEGATRON_CPU_S_PER_OP's 34 us for a whole layer op with its module wrappers


def _c(name: str, mb: int, layer: int) -> Op:
    return Op(name=f"{name} L{layer}", kind="compute", stream="compute", phase="forward",
              duration=1e-4, layer=layer, micro_batch=mb, cpu_s=1e-5)


def _a2a(name: str, mb: int, layer: int) -> Op:
    return Op(name=f"{name} L{layer}", kind="collective", stream="compute", phase="comm",
              collective="all_to_all", group=(0, 1), layer=layer, micro_batch=mb,
              cpu_s=1e-5)


def _moe_fwd(mb: int, layer: int) -> list[Op]:
    return [_c("fwd attn", mb, layer), _c("fwd router", mb, layer),
            _a2a("fwd dispatch", mb, layer), _c("fwd experts", mb, layer),
            _a2a("fwd combine", mb, layer)]


def _moe_bwd(mb: int, layer: int) -> list[Op]:
    return [_a2a("bwd combine", mb, layer), _c("bwd experts", mb, layer),
            _a2a("bwd dispatch", mb, layer), _c("bwd router", mb, layer),
            _c("bwd attn", mb, layer)]


def _dense_fwd(mb: int, layer: int) -> list[Op]:
    return [_c("fwd attn", mb, layer), _c("fwd mlp", mb, layer)]


def _dense_bwd(mb: int, layer: int) -> list[Op]:
    return [_c("bwd mlp", mb, layer), _c("bwd attn", mb, layer)]


def _host_s(f: list[Op], b: list[Op], node_cpu: NodeHost | None) -> float:
    out: list[Op] = []
    issue_pair(f, b, out.append, "t", node_cpu=node_cpu)
    return sum(o.cpu_s for o in out)


def test_wrapper_calls_follow_core_0_14_schedule_node() -> None:
    # ScheduleNode._forward: event wait + record, stream enter + exit, detach, requires_grad;
    # _backward: the same four bookkeeping calls, .grad reads, run_backward, record_stream.
    assert (FWD_NODE_CALLS, BWD_NODE_CALLS) == (6, 8)
    h = node_host(fp8=False)
    assert (h.fwd_s, h.bwd_s) == (6 * CALL, 8 * CALL)
    # fp8_autocast enter and exit around every forward node only.
    h8 = node_host(fp8=True)
    assert (h8.fwd_s, h8.bwd_s) == (8 * CALL, 8 * CALL)


def test_moe_layer_pair_pays_five_nodes_each_way() -> None:
    h = node_host(fp8=False)
    base = _host_s(_moe_fwd(1, 3), _moe_bwd(0, 3), None)
    with_nodes = _host_s(_moe_fwd(1, 3), _moe_bwd(0, 3), h)
    assert abs((with_nodes - base) - (5 * h.fwd_s + 5 * h.bwd_s)) < 1e-12


def test_dense_layer_pair_pays_two_nodes_each_way() -> None:
    h = node_host(fp8=True)
    base = _host_s(_dense_fwd(1, 0), _dense_bwd(0, 0), None)
    with_nodes = _host_s(_dense_fwd(1, 0), _dense_bwd(0, 0), h)
    assert abs((with_nodes - base) - (2 * h.fwd_s + 2 * h.bwd_s)) < 1e-12


def test_lone_forward_pays_only_forward_nodes() -> None:
    # A warm-up forward (backward None in TransformerLayerSchedulePlan.run): no backward
    # wrappers, and the wrapper adds no GPU time.
    h = node_host(fp8=False)
    f = _moe_fwd(0, 2)
    gpu = sum(o.duration for o in f)
    out: list[Op] = []
    issue_pair(f, [], out.append, "t", node_cpu=h)
    assert abs(sum(o.cpu_s for o in out) - (5 * 1e-5 + 5 * h.fwd_s)) < 1e-12
    assert sum(o.duration for o in out) == gpu


def test_the_builder_charges_each_overlapped_layer_its_wrappers(monkeypatch) -> None:
    # The builder takes the wrapper cost from node_host (the rule's one home), with the
    # scenario's precision: a bf16 job asks for the bf16 wrappers.
    from helpers import megatron_scenario

    import sim.frameworks.megatron.build as build
    from sim.frameworks import JobContext, build_program

    seen: list[bool] = []

    def spy(fp8: bool) -> NodeHost:
        seen.append(fp8)
        return node_host(fp8)

    monkeypatch.setattr(build, "node_host", spy)
    model = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
             "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
    s = megatron_scenario({"tp": 1, "ep": 8}, 8, model=model, seq=1024,
                          framework={"name": "megatron", "moe_a2a_overlap": True})
    build_program(JobContext.from_scenario(s, "s.yaml"))
    assert seen and set(seen) == {False}
