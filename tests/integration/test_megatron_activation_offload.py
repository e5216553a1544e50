"""Megatron-Core's fine-grained activation offloading of the routed experts
(``--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act``;
:mod:`sim.frameworks.megatron.activation_offload`).

Independent truths: the offloaded bytes in closed form (``expert_fc1`` saves fc1's input,
tokens x top-k x hidden 16-bit elements on a rank under balanced routing; ``moe_act`` the
activation's input, fc1's output of twice the expert width under SwiGLU), conservation (every
group that leaves comes back exactly once, after it left and before its backward uses it; the
layer's saved activations are all freed by the step's end), the order in which Megatron-Core's
offload manager reloads (NVIDIA/Megatron-LM @ d98e8a6, ``fine_grained_activation_offload.py``:
a stack, one reload per group backward, the first backward chunk's last group of each name
kept on the GPU, so later reloads run two groups ahead of their use), and the refusals of
``TransformerConfig.__post_init__``.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.activation_offload import D2H_STREAM, H2D_STREAM
from sim.scenario import ScenarioError, scenario_from_dict

# A small MoE model: 8 layers, 16 experts of width 2048, top-4, SwiGLU.
MOE = {"layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn_hidden": 4096,
       "vocab": 32000, "experts": 16, "experts_per_token": 4, "moe_ffn_hidden": 2048}
SEQ, H, K, FFN = 4096, 2048, 4, 2048
OFFLOAD = {"fine_grained_activation_offloading": True,
           "offload_modules": ["expert_fc1", "moe_act"]}


def _scn(par: dict, offload: bool = True, gb200: bool = False, gbs: int = 64,
         model: dict | None = None, ac: str = "none", precision: str = "bf16", **fw: object):
    s = megatron_scenario(par, gbs, model=model or MOE, seq=SEQ, ac=ac, precision=precision,
                          framework={"name": "megatron", **(OFFLOAD if offload else {}), **fw})
    if not gb200:
        return s
    d = s.model_dump(exclude_none=True)
    # Grace hosts: each GPU's saved activations go over NVLink-C2C, not PCIe.
    d["cluster"] = {"topology": "gb200-nvl72", "nodes": 1, "gpus_per_node": 8,
                    "nics_per_node": 8}
    return scenario_from_dict(d)


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _ops(cls):
    return sorted((o for ops in cls.streams.values() for o in ops), key=lambda o: o.index)


PIPE = {"tp": 1, "pp": 2, "ep": 4}


USER = {"attn_proj": "bwd attn {l} {mb} proj", "core_attn": "bwd attn {l} {mb} core",
        "qkv_linear": "bwd attn {l} {mb}", "mlp_norm": "bwd moe {l} {mb} router",
        "moe_act": "bwd moe {l} {mb} experts", "expert_fc1": "bwd moe {l} {mb} experts fc1"}
"""The op each module's backward starts with: it waits for the group's reload."""
ALL = ["qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]


@pytest.mark.parametrize(("fw", "mods"), [
    ({}, ["expert_fc1", "moe_act"]),
    ({"moe_a2a_overlap": True, "delay_wgrad_compute": True}, ["expert_fc1", "moe_act"]),
    ({}, ALL),
    ({"moe_a2a_overlap": True, "delay_wgrad_compute": True}, ALL),
], ids=["experts-1f1b", "experts-combined-1f1b", "all-1f1b", "all-combined-1f1b"])
def test_the_groups_are_the_closed_form_bytes_and_each_comes_back_once(fw, mods) -> None:
    p = _program(_scn(dict(PIPE, vp=2) if fw else PIPE, offload_modules=mods, **fw))
    tokens = SEQ * K                       # rows the rank's experts take a micro-batch
    # Per layer and micro-batch, 16-bit: the QKV linear's input and its fused norm's input;
    # query, key, value and output (the log-sum-exp is under the size floor); the
    # projection's input is that output, counted once; the pre-MLP norm's input; fc1's
    # input; the activation's input (fc1's output, SwiGLU's two halves).
    size = {"qkv_linear": 2 * SEQ * H * 2, "core_attn": 4 * SEQ * H * 2, "attn_proj": 0,
            "mlp_norm": SEQ * H * 2, "expert_fc1": tokens * H * 2,
            "moe_act": tokens * 2 * FFN * 2}
    attn = sum(size[m] for m in mods if m in USER and m.startswith(("qkv", "core", "attn")))
    moe = sum(size[m] for m in mods if m in ("mlp_norm", "expert_fc1", "moe_act"))
    for cls in p.classes:
        ops = _ops(cls)
        d2h = {o.name.removeprefix("offload "): o for o in ops if o.stream == D2H_STREAM}
        h2d = [o for o in ops if o.stream == H2D_STREAM]
        assert d2h and h2d
        for name, o in d2h.items():
            assert o.host_transfer == "d2h"
            assert o.nbytes == (moe if name.startswith("moe") else attn)
            assert sum(b for _, b in o.free) == o.nbytes
        # Every offloaded group is reloaded exactly once, after its copy left, and its
        # backward waits for it.
        back = {k: 0.0 for k in d2h}
        for o in h2d:
            module, layer, mb = o.name.split()[1:]
            assert o.host_transfer == "h2d" and o.alloc == (("activations", o.nbytes),)
            assert o.nbytes == size[module]
            src = next(d for d in o.deps if d.stream == D2H_STREAM)
            back[src.name.removeprefix("offload ")] += o.nbytes
            user = USER[module].format(l=layer, mb=mb)
            assert o in next(u for u in ops if u.name == user).deps
        assert back == {k: v.nbytes for k, v in d2h.items()}


def test_the_first_backward_keeps_its_last_layer_and_later_reloads_run_two_groups_ahead(
        ) -> None:
    # One stage: 1F1B runs each micro-batch's backward right after its forward, so every
    # forward keeps its last MoE layer (should_bulk_offload, the first one's also the margin);
    # the manager's stack then reloads each group when the group two ahead of it in backward
    # order ends.
    p = _program(_scn({"tp": 1, "ep": 8}, gbs=32))
    ops = _ops(p.classes[0])
    names = {o.name for o in ops}
    last = MOE["layers"] - 1
    for mb in range(4):
        assert f"offload moe L{last} mb{mb}" not in names
        assert all(f"offload moe L{la} mb{mb}" in names for la in range(last))
        for la in range(last):
            fc1 = next(o for o in ops if o.name == f"reload expert_fc1 L{la} mb{mb}")
            act = next(o for o in ops if o.name == f"reload moe_act L{la} mb{mb}")
            assert any(d.name == f"bwd moe L{la + 1} mb{mb} experts fc1" for d in fc1.deps)
            assert any(d.name == f"bwd moe L{la + 1} mb{mb} experts" for d in act.deps)


def test_on_grace_the_peak_drops_and_the_saved_activations_balance() -> None:
    on, off = simulate(_scn(PIPE, gb200=True)), simulate(_scn(PIPE, False, gb200=True))
    for a, b in zip(on.summary["memory_by_rank_class"], off.summary["memory_by_rank_class"],
                    strict=True):
        assert a["peak_gib"] < b["peak_gib"]
    for result in (on, off):
        for track in result.recorder.memory.values():
            assert abs(track.current["activations"]) < 1.0
    # What crosses the host links is the groups, out and back (over each route's links).
    p = on.program
    moved = sum(o.nbytes * len(c.members) for c in p.classes for o in _ops(c)
                if o.host_transfer)
    assert on.summary["bytes"]["pcie"] >= moved
    assert off.summary["bytes"]["pcie"] == 0.0


def test_offloading_the_attention_too_lowers_the_peak_further() -> None:
    experts = simulate(_scn(PIPE, gb200=True)).summary["memory_by_rank_class"]
    every = simulate(_scn(PIPE, gb200=True, offload_modules=ALL)).summary[
        "memory_by_rank_class"]
    for a, b in zip(every, experts, strict=True):
        assert a["peak_gib"] < b["peak_gib"]


def test_over_pcie_the_step_pays_for_copies_it_cannot_hide() -> None:
    # DGX H100: eight GPUs share their hosts' PCIe; a micro-batch's 192 MiB a layer take
    # longer to move than the layer takes to compute, so the step slows, by at most the
    # copies run one after another.
    on, off = simulate(_scn(PIPE)), simulate(_scn(PIPE, False))
    slower = on.summary["step_time_s"] - off.summary["step_time_s"]
    assert slower > 0
    moved = max(sum(o.nbytes for o in _ops(c) if o.host_transfer) for c in on.program.classes)
    # At least 2 GB/s each GPU (PCIe Gen5 x16 shared by eight), plus the host's own calls.
    assert slower <= moved / 2e9 + 0.05


@pytest.mark.parametrize(("kw", "why"), [
    ({"offload_modules": None}, "needs offload_modules"),
    ({"model": {k: v for k, v in MOE.items()
                if k not in ("experts", "experts_per_token", "moe_ffn_hidden")}},
     "the model has none"),
    ({"ac": "full"}, "full recomputation"),
    ({"precision": "fp8", "fp8_recipe": "tensorwise"}, "16-bit input"),
    ({"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "moe_router"]},
     "transformer_engine"),
    ({"offload_modules": ["attn_proj"]}, "without core_attn"),
    ({"offload_modules": ["core_attn"], "par": {"tp": 2, "ep": 4, "sequence_parallel": True}},
     "tp 1 and cp 1"),
    ({"offload_modules": ["core_attn"], "ac": "selective"}, "beside its recomputation"),
    ({"implementation": "local", "offload_modules": ["core_attn"], "model": {
        k: v for k, v in MOE.items()
        if k not in ("experts", "experts_per_token", "moe_ffn_hidden")}}, "local layer spec"),
])
def test_what_megatron_refuses_or_is_not_modelled_names_the_key(kw, why) -> None:
    par = kw.get("par", dict(PIPE) if "model" not in kw else {"tp": 1, "pp": 2})
    fw = {k: v for k, v in kw.items() if k not in ("model", "ac", "precision", "par")}
    extra = {k: kw[k] for k in ("model", "ac", "precision") if k in kw}
    if "offload_modules" in fw and fw["offload_modules"] is None:
        s = megatron_scenario(par, 64, model=MOE, seq=SEQ, framework={
            "name": "megatron", "fine_grained_activation_offloading": True})
    else:
        s = _scn(par, **extra, **fw)
    with pytest.raises(ScenarioError, match=rf"framework\.offload_modules.*{why}"):
        _program(s)


def test_a_dense_model_offloads_its_attention() -> None:
    dense = {k: v for k, v in MOE.items()
             if k not in ("experts", "experts_per_token", "moe_ffn_hidden")}
    par = {"tp": 1, "pp": 2}
    on = simulate(_scn(par, gb200=True, model=dense, offload_modules=["qkv_linear",
                                                                      "core_attn"]))
    off = simulate(_scn(par, False, gb200=True, model=dense))
    moved = [sum(o.nbytes for o in _ops(c) if o.stream == D2H_STREAM)
             for c in on.program.classes]
    back = [sum(o.nbytes for o in _ops(c) if o.stream == H2D_STREAM)
            for c in on.program.classes]
    assert all(moved) and moved == back
    for a, b in zip(on.summary["memory_by_rank_class"], off.summary["memory_by_rank_class"],
                    strict=True):
        assert a["peak_gib"] < b["peak_gib"]


def test_off_by_default_nothing_moves() -> None:
    p = _program(_scn(PIPE, False))
    assert not [o for c in p.classes for o in _ops(c) if o.host_transfer]


def test_the_offload_fraction_keeps_each_chunks_later_groups() -> None:
    # One stage, 8 MoE layers: each forward keeps its last layer (its backward runs next);
    # of the 14 other groups, activation_offload_fraction 0.5 offloads the first 7 in
    # forward order (layers 0-2 whole, layer 3's fc1 input) and keeps the rest.
    p = _program(_scn({"tp": 1, "ep": 8}, gbs=32, activation_offload_fraction=0.5))
    ops = _ops(p.classes[0])
    fc1_in = SEQ * K * H * 2
    for mb in range(4):
        moved = {int(o.name.split()[2][1:]): o.nbytes for o in ops
                 if o.stream == D2H_STREAM and o.name.endswith(f" mb{mb}")}
        assert sorted(moved) == [0, 1, 2, 3]
        assert moved[3] == fc1_in and moved[0] == moved[1] == moved[2] > fc1_in


def test_higher_pipeline_ranks_keep_their_delta_of_bytes() -> None:
    # delta_offload_bytes_across_pp_ranks: rank r keeps r x delta bytes of groups on the GPU,
    # whole groups, so what rank 1 moves falls by at least delta and less than delta plus
    # the largest group; rank 0 moves as before.
    act_in = SEQ * K * 2 * FFN * 2
    delta = 3 * act_in

    def moved(p):
        return [sum(o.nbytes for o in _ops(c) if o.stream == D2H_STREAM) for c in p.classes]

    base, kept = moved(_program(_scn(PIPE))), moved(_program(_scn(
        PIPE, delta_offload_bytes_across_pp_ranks=delta)))
    assert kept[0] == base[0]
    assert delta <= base[1] - kept[1] < delta + act_in


def test_only_the_first_backward_chunk_keeps_its_last_layer_on_an_early_stage() -> None:
    # Stage 0 of 1F1B on two stages runs F0 F1 B0 F2 B1 ...: when F0 ends the next backward
    # chunk is its own (front_backward_chunk; also post_warmup_callback's margin), so mb0
    # keeps its last MoE layer on the GPU; every later forward is followed by an earlier
    # micro-batch's backward, so it offloads that layer.
    p = _program(_scn(PIPE))
    names = {o.name for o in _ops(p.classes[0])}
    last = MOE["layers"] // 2 - 1
    assert f"offload moe L{last} mb0" not in names
    assert all(f"offload moe L{last} mb{mb}" in names for mb in range(1, 8))
    assert all(f"offload moe L{la} mb0" in names for la in range(last))
