"""Transformer Engine's sequence-parallel all-gathers through NCCL under FP8 training
(sim/frameworks/megatron/overlap.py ``te_sp_gather_bytes``): TE quantizes before it gathers
(``gather_along_first_dim(..., quantizer=...)`` -> ``_all_gather_fp8`` in TE 2.x, the FP8
``ln_out`` / ``cast_to_fp8`` input and ``grad_output_preprocess``'s "FP8 case with gather" in
TE 1.x), so the column-parallel input gathers, their backward re-gathers and the row-parallel
output-gradient gathers move one byte per element; the reduce-scatters reduce 16-bit GEMM
outputs. Checked op by op against the closed form (tokens x width x bytes per element) and on
the wire (NVLink bytes fall by exactly one byte per gathered element)."""

from __future__ import annotations

import pytest
from helpers import megatron_scenario as scenario

from sim.api import simulate
from sim.frameworks.megatron.overlap import te_sp_gather_bytes

SMALL = {"layers": 2, "hidden": 2048, "heads": 16, "ffn_hidden": 8192, "vocab": 1024,
         "mlp": "gelu", "tied_embeddings": False}
# Dense MLA (DeepSeek-style latents, no experts): its attention gathers the query latent and the
# key/value latent (TE's up projections, FP8) and the shared rotary key (Megatron's own
# gather_from_sequence_parallel_region, 16-bit).
MLA = {"layers": 2, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 1024,
       "attention": "mla", "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
       "qk_rope_head_dim": 32, "v_head_dim": 64, "tied_embeddings": False}
TP, SEQ = 4, 4096


def _run(precision: str, sp: bool = True, model: dict | None = None, ac: str = "none"):
    par = {"tp": TP, "pp": 1, "dp": 1, "sequence_parallel": sp}
    return simulate(scenario(par, gbs=1, framework={"name": "megatron"}, gpn=TP, nvlink=450,
                             model=model or SMALL, seq=SEQ, precision=precision, ac=ac))


def _tp_ops(r, kind: str):
    """The layers' tensor-parallel collectives of ``kind`` on one rank class."""
    return [x.op for x in r.recorder.ops if x.cls == 0 and x.op.collective == kind
            and x.op.layer is not None]


def test_rule() -> None:
    assert te_sp_gather_bytes(4096.0, 2, True) == 2048.0
    assert te_sp_gather_bytes(4096.0, 2, False) == 4096.0
    # 1,000 elements of which 100 (200 bytes) Megatron gathers itself: 900 x 1 + 100 x 2.
    assert te_sp_gather_bytes(2000.0, 2, True, hp_bytes=200.0) == 1100.0


@pytest.mark.parametrize("ac", ["none", "full"])
def test_fp8_gathers_move_one_byte_per_element(ac: str) -> None:
    full = SEQ * SMALL["hidden"]                # gathered [s, b, h] elements (b = 1)
    f8, bf = _run("fp8", ac=ac), _run("bf16", ac=ac)
    # Per layer: the forward input gathers of QKV and fc1, the backward gathers of proj's
    # and fc2's output gradient, the backward input re-gathers of QKV and fc1 (6), and under
    # full recomputation the recomputed forward's two again.
    n = SMALL["layers"] * (8 if ac == "full" else 6)
    g8, g16 = _tp_ops(f8, "all_gather"), _tp_ops(bf, "all_gather")
    assert len(g8) == len(g16) == n
    assert all(g.nbytes == pytest.approx(full * 1) and g.dtype == "u8" for g in g8)
    assert all(g.nbytes == pytest.approx(full * 2) for g in g16)
    # Reduce-scatters: the row-parallel outputs forward, the column-parallel dgrads backward,
    # 16-bit under either precision (2 bytes per element, 4 per layer without recompute).
    s8, s16 = _tp_ops(f8, "reduce_scatter"), _tp_ops(bf, "reduce_scatter")
    assert [s.nbytes for s in s8] == [s.nbytes for s in s16]
    assert all(s.nbytes == pytest.approx(full * 2) and s.dtype != "u8" for s in s8)


def test_fp8_gathers_on_the_wire() -> None:
    """NVLink carries one byte per gathered element less: 6 gathers per layer, each rank
    receiving (tp-1)/tp of tokens x hidden, every byte crossing two NVLink links (GPU to
    NVSwitch, NVSwitch to GPU)."""
    f8, bf = _run("fp8"), _run("bf16")
    full, hops = SEQ * SMALL["hidden"], 2
    saved = SMALL["layers"] * 6 * full * (TP - 1) / TP * TP * hops
    assert bf.summary["bytes"]["nvlink"] - f8.summary["bytes"]["nvlink"] == \
        pytest.approx(saved, rel=1e-6)


def test_without_sequence_parallelism_nothing_changes() -> None:
    """Without sequence parallelism TE gathers nothing: the all-reduces stay 16-bit."""
    f8, bf = _run("fp8", sp=False), _run("bf16", sp=False)
    assert not _tp_ops(f8, "all_gather")
    ar8, ar16 = _tp_ops(f8, "all_reduce"), _tp_ops(bf, "all_reduce")
    assert ar8 and [a.nbytes for a in ar8] == [a.nbytes for a in ar16]


def test_mla_rotary_key_stays_16_bit() -> None:
    """MLA's forward attention gather: the two latents at one byte, the rotary key at two."""
    f8 = _run("fp8", model=MLA)
    fwd = [g for g in _tp_ops(f8, "all_gather") if g.name.startswith("all_gather fwd attn")]
    assert len(fwd) == MLA["layers"]
    latents = MLA["q_lora_rank"] + MLA["kv_lora_rank"]
    expect = SEQ * (latents * 1 + MLA["qk_rope_head_dim"] * 2)
    assert all(g.nbytes == pytest.approx(expect) for g in fwd)


def _amax(r):
    return [o for o in _tp_ops(r, "all_reduce") if o.name.startswith("amax")]


@pytest.mark.parametrize("ac", ["none", "full"])
def test_current_scaling_reduces_the_amax_before_each_quantized_gather(ac: str) -> None:
    """tensorwise (TE's Float8CurrentScaling) under sequence parallelism: one fp32 amax
    all-reduced over the tensor-parallel group before each quantize-then-gather (QKV's and
    fc1's input forward, proj's and fc2's output gradient backward: 4 per layer, 6 with the
    full recompute's forward again), blocking the compute stream; none under delayed scaling
    (scale from the amax history), none for the re-gathers (already quantized) and none
    without sequence parallelism."""
    def run(recipe: str, sp: bool = True):
        par = {"tp": TP, "pp": 1, "dp": 1, "sequence_parallel": sp}
        return simulate(scenario(par, gbs=1, framework={"name": "megatron",
                                                        "fp8_recipe": recipe},
                                 gpn=TP, nvlink=450, model=SMALL, seq=SEQ, precision="fp8",
                                 ac=ac))
    cs = _amax(run("tensorwise"))
    assert len(cs) == SMALL["layers"] * (6 if ac == "full" else 4)
    assert all(o.nbytes == 4 and o.dtype == "f32" and o.stream == "compute" for o in cs)
    assert not _amax(run("delayed"))
    assert not _amax(run("tensorwise", sp=False))


def test_current_scaling_amax_with_userbuffers() -> None:
    """With tp_comm_overlap the quantizer is the same (TE sets the reduction group by
    sequence parallelism, not by the overlap): the ring exchange leaves after the amax."""
    par = {"tp": TP, "pp": 1, "dp": 1, "sequence_parallel": True}
    r = simulate(scenario(par, gbs=1, framework={"name": "megatron", "fp8_recipe":
                                                 "tensorwise", "tp_comm_overlap": True},
                          gpn=TP, nvlink=450, model=SMALL, seq=SEQ, precision="fp8"))
    amax = _amax(r)
    assert len(amax) == SMALL["layers"] * 4
    fwd = [o for o in _tp_ops(r, "all_gather") if o.name.startswith("all_gather fwd")]
    assert fwd and all(any(d.name.startswith("amax") for d in g.deps) for g in fwd)


# A small MoE with one shared expert (a sequence-parallel TP MLP beside the routed experts,
# Megatron-Core's SharedExpertMLP on TE linears).
MOE = {"layers": 2, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 1024,
       "tied_embeddings": False,
       "moe": {"experts": 4, "top_k": 2, "shared_experts": 1, "expert_ffn_hidden": 512}}


def test_shared_expert_gathers_move_fp8_too() -> None:
    # The shared expert's fc1 input gather (forward) and fc2 output-gradient gather
    # (backward) go through TE's quantize-then-gather like the dense MLP's: tokens x hidden
    # x 1 byte under FP8, x 2 in bf16; its reduce-scatters stay 16-bit.
    def shared(r, kind):
        return [x.op for x in r.recorder.ops if x.cls == 0 and x.op.collective == kind
                and "shared" in x.op.name]

    f8, bf = _run("fp8", model=MOE), _run("bf16", model=MOE)
    full = SEQ * MOE["hidden"]
    g8, g16 = shared(f8, "all_gather"), shared(bf, "all_gather")
    assert len(g8) == len(g16) == 2 * MOE["layers"]       # forward and backward per layer
    assert all(g.nbytes == pytest.approx(full * 1) and g.dtype == "u8" for g in g8)
    assert all(g.nbytes == pytest.approx(full * 2) for g in g16)
    assert [s.nbytes for s in shared(f8, "reduce_scatter")] == \
        [s.nbytes for s in shared(bf, "reduce_scatter")]


def test_shared_expert_gathers_take_an_amax_all_reduce_under_current_scaling() -> None:
    # tensorwise (current scaling): one 4-byte amax all-reduce over the TP group before each
    # shared-expert quantize-then-gather, as before the dense MLP's; delayed scaling none.
    par = {"tp": TP, "pp": 1, "dp": 1, "sequence_parallel": True}

    def amaxes(recipe: str) -> list:
        r = simulate(scenario(par, gbs=1, framework={"name": "megatron", "fp8_recipe": recipe},
                              gpn=TP, nvlink=450, model=MOE, seq=SEQ, precision="fp8"))
        return [x.op for x in r.recorder.ops if x.cls == 0 and "shared amax" in x.op.name]

    current = amaxes("tensorwise")
    assert len(current) == 2 * MOE["layers"]
    assert all(op.nbytes == 4 and op.collective == "all_reduce" for op in current)
    assert amaxes("delayed") == []


def test_mtp_projection_input_gathers_move_fp8() -> None:
    # The MTP module's eh_proj (a TE column-parallel linear on the [embedding, hidden] concat,
    # 2h wide) gathers FP8 forward and re-gathers FP8 for its wgrad; the gathers around it
    # that Megatron issues itself (its output, the sequence scatter's backward) stay 16-bit.
    model = dict(SMALL, mtp_layers=1)

    def proj(r, which: str) -> list:
        return [x.op for x in r.recorder.ops if x.cls == 0 and x.op.collective == "all_gather"
                and "mtp proj" in x.op.name and which in x.op.name]

    f8, bf = _run("fp8", model=model), _run("bf16", model=model)
    full = SEQ * SMALL["hidden"]
    for which in ("all_gather fwd mtp proj L", "all_gather input bwd"):
        (g8,), (g16,) = proj(f8, which), proj(bf, which)
        assert (g8.nbytes, g8.dtype) == (2 * full * 1, "u8")
        assert g16.nbytes == 2 * full * 2
    for which in ("proj out", "proj grad"):
        assert [g.nbytes for g in proj(f8, which)] == [g.nbytes for g in proj(bf, which)]
