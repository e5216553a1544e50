"""Megatron-Core's CUDA graphs (:mod:`sim.frameworks.megatron.cuda_graphs`).

Independent truths: a captured region replays as one graphed call (its Python autograd
function and the static-input ``copy_``) plus one ``cudaGraphLaunch``, so the host seconds of
the region's ops sum to that closed form whatever the kernels inside; ops outside every
region keep their eager host time; a host-bound step (tiny layers, one GPU) gets faster and
never beats the GPU's own busy time; Megatron-Core's ``TransformerConfig.__post_init__``
(core_v0.16.0) refuses the combinations tested below; 1F1B keeps ``pp - stage`` micro-batches
in flight (Narayanan et al. 2021), the runners ``CudaGraphManager`` holds per layer.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario, program

from sim.api import simulate
from sim.config.base import ScenarioError
from sim.frameworks.megatron.cuda_graphs import (
    _NAME,
    GRAPH_LAUNCH_CPU_S,
    REPLAY_PY_CALLS,
    _mean_in_flight,
)
from sim.hardware.host import X86_TE_MODULE_CALL_CPU_S
from sim.program.ir import Program

# 4 layers, 8 experts of width 1024, top-2 (test_moe_rank_memory.py's small model).
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
DROP = {**TINY, "capacity_factor": 1.0}
PAD = {"moe_pad_expert_input_to_capacity": True}
DENSE = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn_hidden": 1536,
         "vocab": 32000}
# A replay's Python calls are Transformer Engine module calls on an x86 host (the newest TE).
FWD = REPLAY_PY_CALLS * X86_TE_MODULE_CALL_CPU_S + GRAPH_LAUNCH_CPU_S
BWD = REPLAY_PY_CALLS * X86_TE_MODULE_CALL_CPU_S / 2 + GRAPH_LAUNCH_CPU_S


def _mega(model: dict, fw: dict | None = None, pp: int = 1, ep: int = 8, gbs: int = 8,
          ac: str = "none", gpn: int = 8, seq: int = 2048):
    return megatron_scenario({"tp": 1, "ep": ep, "pp": pp}, gbs, model=model, gpn=gpn,
                             framework={"name": "megatron", **(fw or {})}, ac=ac, seq=seq)


def _region_host(p: Program, block: str | None) -> dict[tuple[str, int, int], float]:
    """Host seconds of each (pass, layer, micro-batch)'s ops of ``block`` (all blocks: None)
    in stage 0."""
    out: dict[tuple[str, int, int], float] = {}
    for op in (o for ops in p.classes[0].streams.values() for o in ops):
        m = _NAME.search(op.name)
        if m is None or (block is not None and m.group(2) != block):
            continue
        k = ("fwd" if m.group(1) == "fwd" else "bwd", int(m.group(3)), int(m.group(4)))
        out[k] = out.get(k, 0.0) + op.cpu_s
    return out


def _others(p: Program, block: str) -> list[tuple[str, float]]:
    return [(o.name, o.cpu_s) for o in p.ops
            if not ((m := _NAME.search(o.name)) and m.group(2) == block)]


def test_whole_layer_region_costs_one_replay() -> None:
    # Drop-and-pad MoE: the whole layer (attention, router, all-to-alls, experts) is one
    # graph a pass; its host seconds are one replay's, the embedding and loss stay eager.
    eager = program(_mega(DROP, PAD))
    graphed = program(_mega(DROP, {**PAD, "cuda_graph_impl": "local"}))
    per_layer: dict[tuple[str, int, int], float] = {}
    for block in ("attn", "moe"):
        for k, v in _region_host(graphed, block).items():
            per_layer[k] = per_layer.get(k, 0.0) + v
    assert per_layer and all(v == pytest.approx(FWD if k[0] == "fwd" else BWD)
                             for k, v in per_layer.items())
    # Eager, the same layer costs one Python call a kernel: far more than one replay.
    layer = _region_host(eager, None)
    assert layer.keys() == per_layer.keys()
    assert all(v > 3 * per_layer[k] for k, v in layer.items())
    embed = [(o.name, o.cpu_s) for o in eager.ops if "embed" in o.name or "head" in o.name]
    assert embed == [(o.name, o.cpu_s) for o in graphed.ops
                     if "embed" in o.name or "head" in o.name]


def test_attn_scope_on_dropless_moe_leaves_the_experts_eager() -> None:
    eager = program(_mega(TINY))
    graphed = program(_mega(TINY, {"cuda_graph_impl": "transformer_engine",
                                   "cuda_graph_scope": ["attn"]}))
    attn = _region_host(graphed, "attn")
    assert attn and all(v == pytest.approx(FWD if k[0] == "fwd" else BWD)
                        for k, v in attn.items())
    assert _others(eager, "attn") == _others(graphed, "attn")


def test_router_scope_captures_only_the_router() -> None:
    eager = program(_mega(TINY))
    graphed = program(_mega(TINY, {"cuda_graph_impl": "transformer_engine",
                                   "cuda_graph_scope": ["moe_router", "moe_preprocess"]}))
    e = {o.name: o.cpu_s for o in eager.ops}
    g = {o.name: o.cpu_s for o in graphed.ops}
    routers = [n for n in g if n.endswith(" router") and " moe L" in n]
    assert routers and all(g[n] == pytest.approx(FWD if n.startswith("fwd") else BWD)
                           for n in routers)
    assert all(g[n] == e[n] for n in g if n not in routers)
    # the dropless dispatcher's token-count read stays a host synchronisation
    assert any(o.host_sync for o in graphed.ops)


def test_host_bound_step_gets_faster_never_below_gpu_time() -> None:
    # One GPU, tiny layers, short sequence: eager, the host's Python sets the pace.
    s = _mega(DENSE, ep=1, gbs=4, gpn=1, seq=256)
    eager = simulate(s).summary
    graphed = simulate(s.model_copy(update={"framework": s.framework.model_copy(
        update={"cuda_graph_impl": "local"})})).summary
    assert graphed["step_time_s"] < 0.8 * eager["step_time_s"]
    assert graphed["step_time_s"] >= graphed["compute_time_s"] > 0
    assert graphed["compute_time_s"] == pytest.approx(eager["compute_time_s"], rel=1e-6)


def test_local_runners_follow_1f1b_in_flight_micro_batches() -> None:
    # pp 2, 8 micro-batches: stage 0 holds 2 forward micro-batches at most, stage 1 one.
    p = program(_mega(DROP, {**PAD, "cuda_graph_impl": "local"}, pp=2, ep=4, gbs=32))
    for st, want in ((0, 2.0), (1, 1.0)):
        ops = [o for ops in p.classes[st].streams.values() for o in ops
               if _NAME.search(o.name)]
        ops.sort(key=lambda o: o.index)
        assert _mean_in_flight(ops) == want
    te = program(_mega(DROP, {**PAD, "cuda_graph_impl": "transformer_engine"}, pp=2, ep=4,
                      gbs=32))
    eager = program(_mega(DROP, PAD, pp=2, ep=4, gbs=32))

    def held(q: Program) -> float:
        return q.classes[0].initial_memory.get("buffers", 0.0)

    # TE's make_graphed_callables shares one pool: less than local's pool per runner; both
    # hold at least the static input and output-gradient buffers (2 x tokens x hidden x 2 B).
    assert held(p) > held(te) >= held(eager) + 2 * 2048 * 1024 * 2


@pytest.mark.parametrize(("model", "fw", "ac", "words"), [
    (TINY, {"cuda_graph_scope": ["moe"]}, "none", "drop-padding"),
    (DROP, {**PAD, "cuda_graph_scope": ["moe", "moe_router"]}, "none", "both moe and"),
    (TINY, {"cuda_graph_scope": ["moe_preprocess"]}, "none", "only supported with moe_router"),
    (DROP, {"cuda_graph_scope": ["moe_router", "moe_preprocess"]}, "none", "DtoH"),
    (TINY, {"cuda_graph_scope": ["mlp"]}, "none", "dense layers"),
    (DENSE, {"cuda_graph_scope": ["moe_router"]}, "none", "only supported for MoE"),
    (TINY, {}, "none", "captured whole"),
    (DENSE, {"cuda_graph_scope": ["attn"]}, "full", "full recompute"),
    (DENSE, {"cuda_graph_scope": ["full", "attn"]}, "none", "full scope cannot"),
])
def test_refusals_name_the_key(model: dict, fw: dict, ac: str, words: str) -> None:
    with pytest.raises(ScenarioError, match=f"framework.cuda_graph_scope.*{words}"):
        program(_mega(model, {"cuda_graph_impl": "transformer_engine", **fw},
                      ep=1 if model is DENSE else 8, ac=ac))


def test_full_iteration_needs_local() -> None:
    with pytest.raises(ScenarioError, match="framework.cuda_graph_impl.*local"):
        program(_mega(DENSE, {"cuda_graph_impl": "transformer_engine",
                              "cuda_graph_scope": ["full_iteration"]}, ep=1))
    p = program(_mega(DENSE, {"cuda_graph_impl": "local",
                              "cuda_graph_scope": ["full_iteration"]}, ep=1))
    # one launch for the forward-backward of each rank class; the optimizer stays eager
    paid = [o for o in p.ops if o.cpu_s > 0 and o.phase != "optimizer"]
    assert len(paid) == len(p.classes)


def test_local_takes_moe_preprocess_as_router_and_preprocess() -> None:
    # core_v0.16.0: "local impl doesn't currently distinguish between moe_preprocess or
    # moe_router so just set both" -- so moe_preprocess alone is not refused under local.
    alone = program(_mega(TINY, {"cuda_graph_impl": "local",
                                 "cuda_graph_scope": ["moe_preprocess"]}))
    both = program(_mega(TINY, {"cuda_graph_impl": "transformer_engine",
                                "cuda_graph_scope": ["moe_router", "moe_preprocess"]}))
    assert [o.cpu_s for o in alone.ops] == [o.cpu_s for o in both.ops]
