"""Megatron-Core's selective recomputation by module (``framework.recompute_modules``).

Independent truths: Megatron-Core's source (megatron/core/transformer/transformer_config.py
``__post_init__`` refusals; transformer_layer.py, moe/experts.py, multi_latent_attention.py:
``CheckpointWithoutOutput`` frees a module's output and everything run inside it, keeping its
inputs; ``tensor_parallel.checkpoint`` keeps only a module's input); the tensors' shapes
(tokens T, hidden h, expert width F, top-k, MLA's latent ranks and head widths; 16-bit
activations, fp32 norm statistics); the GEMM FLOPs 2 x rows x n_in x n_out; conservation (every
activation byte allocated is freed in the step).
"""

from __future__ import annotations

import pytest
import yaml
from helpers import megatron_scenario
from typer.testing import CliRunner

from sim.api import simulate
from sim.cli.commands import app
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError
from sim.workload.checkpoint_without_output import restore_copy
from sim.workload.kernels import Tensor
from sim.workload.layer_ops import kernel_time
from sim.workload.model import ModelSpec

# A small DeepSeek-style model: MLA with a query latent, layer 0 dense, 8 routed experts (top-2)
# and one shared expert; and a GQA twin without MLA and without shared experts.
MLA = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
       "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512, "shared_experts": 1,
       "first_k_dense": 1, "attention": "mla", "q_lora_rank": 256, "kv_lora_rank": 128,
       "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
GQA = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn_hidden": 2048,
       "vocab": 32768, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512,
       "first_k_dense": 1}
SEQ, H, F, K, FFN = 2048, 1024, 512, 2, 2048
T = SEQ              # one sequence on one GPU
STATS = 2 * T * 4    # a block norm's per-row fp32 statistics as the layer model saves them


def _scn(mods: list[str] | None, model: dict = MLA, ac: str = "selective",
         par: dict | None = None, fw: dict | None = None, precision: str = "bf16",
         gbs: int = 1, gpn: int = 1):
    framework = dict({"name": "megatron"}, **(fw or {}))
    if mods is not None:
        framework["recompute_modules"] = mods
    return megatron_scenario(par or {"tp": 1}, gbs, model=model, seq=SEQ, ac=ac, gpn=gpn,
                             framework=framework, precision=precision)


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _ops(p):
    return [op for c in p.classes[:1] for ops in c.streams.values() for op in ops]


def _hold(p, layer: int) -> float:
    """Activation bytes layer ``layer`` of micro-batch 0 holds from its forward on."""
    op = next(o for o in _ops(p) if o.name == f"fwd attn L{layer} mb0")
    return sum(b for pool, b in op.alloc if pool == "activations")


def _op(p, name: str):
    return next(o for o in _ops(p) if o.name == name)


# --------------------------------------------------------------------------- the default
@pytest.mark.parametrize("model,par", [
    (MLA, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}),
    (GQA, {"tp": 2, "ep": 2, "sequence_parallel": True}),
])
def test_core_attn_alone_is_the_selective_granularity_of_before(model, par) -> None:
    # TransformerConfig: recompute_modules defaults to ["core_attn"].
    default = simulate(_scn(None, model, par=par, gbs=4, gpn=8)).summary
    core = simulate(_scn(["core_attn"], model, par=par, gbs=4, gpn=8)).summary
    assert {k: v for k, v in core.items() if k not in ("name", "sim")} == \
        {k: v for k, v in default.items() if k not in ("name", "sim")}


# --------------------------------------------------------------------------- memory
def test_layernorm_frees_the_pre_mlp_norm_output_of_an_moe_layer_only() -> None:
    # TE fuses the input norm into QKV and a dense layer's pre-MLP norm into fc1 (IdentityOp);
    # an MoE layer's pre-MLP norm is its own TENorm: its [s, b, h] output (saved by the router's
    # gate) and its statistics go.
    none, ln = (_program(_scn(m, GQA)) for m in ([], ["layernorm"]))
    assert _hold(none, 0) - _hold(ln, 0) == 0.0
    assert _hold(none, 1) - _hold(ln, 1) == T * H * 2 + STATS


def test_layernorm_under_mla_frees_the_input_norm_too() -> None:
    # MLA's input_layernorm is a separate TENorm: its output, which both down projections read
    # (one tensor), and its statistics go in every layer.
    none, ln = (_program(_scn(m, dict(MLA, shared_experts=0))) for m in ([], ["layernorm"]))
    assert _hold(none, 0) - _hold(ln, 0) == T * H * 2 + STATS
    assert _hold(none, 2) - _hold(ln, 2) == 2 * (T * H * 2 + STATS)


def test_moe_act_frees_fc2s_input() -> None:
    # experts.py: the weighted SwiGLU's output, [T x top-k, F] in 16 bits, is fc2's input.
    none, act = (_program(_scn(m, GQA)) for m in ([], ["moe_act"]))
    assert _hold(none, 0) == _hold(act, 0)
    assert _hold(none, 1) - _hold(act, 1) == T * K * F * 2


def test_under_fp8_the_discarded_inputs_are_what_the_linears_saved() -> None:
    # Current scaling: fc2 saves its 16-bit input instead of the 1-byte FP8 transpose it would
    # have kept (set_save_original_input), and that input is discarded: T x top-k x F bytes
    # go; the router's gate saves the norm output in 16 bits either way.
    # fc2's input is the GEMM's, each expert's rows padded to FP8's 16 (in expectation:
    # sim.workload.moe_ops.expected_aligned_rows, checked against sampled counts elsewhere).
    from sim.workload.moe_ops import expected_aligned_rows

    fw = {"fp8_recipe": "tensorwise"}
    none, rec = (_program(_scn(m, GQA, fw=fw, precision="fp8"))
                 for m in ([], ["layernorm", "moe_act"]))
    e = GQA["experts"]
    per = T * K / e
    rows = e * expected_aligned_rows(per, 16, per * (1 - K / e))
    assert _hold(none, 1) - _hold(rec, 1) == pytest.approx(T * H * 2 + STATS + rows * F,
                                                          rel=1e-12)


def test_mla_up_proj_frees_the_up_projections_and_query_key_value() -> None:
    # The checkpoint keeps the latents; the up projections' inputs (the normed latents), the
    # latent norms' statistics (RMSNorm: one fp32 per row) and the query, key and value core
    # attention saved go.
    nope, rope, vd, heads = 64, 32, 64, 8
    none, up = (_program(_scn(m)) for m in ([], ["mla_up_proj"]))
    freed = (T * (256 + 128) * 2 + 2 * T * 4
             + T * heads * (nope + rope) * 2 * 2 + T * heads * vd * 2)
    for layer in (0, 1, 2, 3):
        assert _hold(none, layer) - _hold(up, layer) == freed


def test_mlp_keeps_only_the_dense_mlps_input() -> None:
    # tensor_parallel.checkpoint of TE's MLP (norm fused into fc1): its input, the layer's
    # hidden states, stays; the norm's statistics, fc1's input, fc1's 2F-wide output and the
    # SwiGLU output go. MoE layers are not dense MLPs ("mlp" skips them).
    none, mlp = (_program(_scn(m)) for m in ([], ["mlp"]))
    assert _hold(none, 0) - _hold(mlp, 0) == STATS + T * H * 2 + T * 2 * FFN * 2 + T * FFN * 2
    assert _hold(none, 1) == _hold(mlp, 1)


def test_shared_experts_keep_only_their_input() -> None:
    none, sh = (_program(_scn(m)) for m in ([], ["shared_experts"]))
    assert _hold(none, 1) - _hold(sh, 1) == T * 2 * F * 2 + T * F * 2


def test_moe_layer_checkpoint_holds_what_a_checkpointed_dense_mlp_holds_plus_its_norm() -> None:
    # "moe" checkpoints the whole MoE layer on the pre-MLP norm's output (its input, kept),
    # "mlp" the dense MLP with the norm inside: the MoE layer keeps that output and the
    # norm's statistics more, and nothing of its routing, experts or shared experts.
    p = _program(_scn(["moe", "mlp"], dict(MLA, shared_experts=0)))
    assert _hold(p, 1) - _hold(p, 0) == T * H * 2 + STATS


@pytest.mark.parametrize("mods", [["layernorm", "moe_act"], ["mla_up_proj", "mlp"],
                                  ["moe", "layernorm"], ["shared_experts", "core_attn"]])
def test_every_activation_byte_is_freed(mods) -> None:
    r = simulate(_scn(mods, par={"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                      gbs=4, gpn=8))
    for c in r.program.classes:
        held = sum(b for ops in c.streams.values() for op in ops
                   for pool, b in op.alloc if pool == "activations") - \
            sum(b for ops in c.streams.values() for op in ops
                for pool, b in op.free if pool == "activations")
        assert held == pytest.approx(0.0, abs=1.0), c.id
    assert not r.summary["oom"]


# --------------------------------------------------------------------------- time and FLOPs
def _shape(s):
    ctx = JobContext.from_scenario(s, "s.yaml")
    return megatron_shape(ctx), ctx.compute


def test_moe_act_and_layernorm_rerun_their_kernels_in_backward() -> None:
    s = _scn(["moe_act", "layernorm"], GQA)
    none, rec = _program(_scn([], GQA)), _program(s)
    shape, cm = _shape(s)
    act = [k for k in shape.moe.ops.experts.forward if k.name == "weighted_act"]
    norm = shape.blocks["mlp_pre"].forward
    assert len(act) == 1 and len(norm) == 1
    # Each re-run also copies its output into the storage the forward freed
    # (CheckpointWithoutOutput._recompute's untyped_storage().copy_): T x F and T x h bf16.
    copy_act = restore_copy("c", [Tensor("act", T * K * F * 2)])
    copy_norm = restore_copy("c", [Tensor("norm", T * H * 2)])
    experts = "bwd moe L1 mb0 experts"
    assert _op(rec, experts).duration - _op(none, experts).duration == \
        pytest.approx(kernel_time(cm, act[0]) + kernel_time(cm, copy_act), rel=1e-12)
    first = "bwd moe L1 mb0 combine"       # the layer's first backward op
    assert _op(rec, first).duration - _op(none, first).duration == \
        pytest.approx(kernel_time(cm, norm[0]) + kernel_time(cm, copy_norm), rel=1e-12)
    # Elementwise kernels only: no GEMM FLOPs re-run.
    assert rec.hw_flops_per_step == none.hw_flops_per_step


def test_mlp_reruns_the_dense_mlps_forward_with_its_collectives() -> None:
    par = {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1}
    none, mlp = (_program(_scn(m, par=par, gpn=2)) for m in ([], ["mlp"]))
    fwd = [o for o in _ops(none) if "fwd mlp L0 mb0" in o.name]
    rec = [o for o in _ops(mlp) if "recompute mlp L0 mb0" in o.name]
    assert len(rec) == 4        # norm, all-gather, fc1 ... fc2, reduce-scatter
    kinds = sorted((o.kind, o.collective or "") for o in fwd)
    assert kinds == sorted((o.kind, o.collective or "") for o in rec)
    assert sum(o.duration for o in rec) == pytest.approx(sum(o.duration for o in fwd),
                                                         rel=1e-12)
    # Hardware FLOPs: fc1 (h -> 2F) and fc2 (F -> h) once more on the dense layer, 2 FLOPs a
    # multiply-add, summed over the two tensor-parallel ranks.
    extra = mlp.hw_flops_per_step - none.hw_flops_per_step
    assert extra == pytest.approx(6 * T * H * FFN, rel=1e-12)
    assert mlp.model_flops_per_step == none.model_flops_per_step


def test_mla_up_proj_regathers_the_latents_under_sequence_parallelism() -> None:
    par = {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1}
    s = _scn(["mla_up_proj"], par=par, gpn=2)
    none, up = _program(_scn([], par=par, gpn=2)), _program(s)
    gathers = [o for o in _ops(up) if o.name.startswith("all_gather recompute mla up L1 mb0")]
    assert len(gathers) == 1 and gathers[0].nbytes == T * (256 + 128) * 2
    # Both up projections' GEMMs run again: 2 x T x rank x width each, per tensor-parallel
    # rank's heads, summed over both ranks, in each of the four layers.
    qk, vd, heads = 96, 64, 8
    gemm = 2 * T * 256 * heads * qk + 2 * T * 128 * heads * (64 + vd)
    assert up.hw_flops_per_step - none.hw_flops_per_step == pytest.approx(4 * gemm, rel=1e-12)
    shape, cm = _shape(s)
    assert shape.recompute == {"mla_up_proj"}


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,match", [
    ({"mods": ["layernorm"], "ac": "none"}, "needs training.activation_checkpointing: selective"),
    ({"mods": ["mlp"], "ac": "full"}, "needs training.activation_checkpointing: selective"),
    ({"mods": ["moe_act"], "model": {"layers": 2, "hidden": 1024, "heads": 8,
                                     "ffn_hidden": 2048, "vocab": 32768}},
     "moe_act needs the MoE grouped GEMM"),
    ({"mods": ["mla_up_proj"], "model": GQA}, "mla_up_proj is only supported with multi-latent"),
    ({"mods": ["shared_experts"], "fw": {"moe_shared_expert_overlap": True}},
     "shared_experts recompute cannot work with moe_shared_expert_overlap"),
    ({"mods": ["layernorm"], "model": GQA, "precision": "fp8", "fw": {"fp8_recipe": "delayed"}},
     "delayed FP8 scaling does not support moe_act and layernorm"),
])
def test_megatrons_refusals_name_the_key(kw, match) -> None:
    mods = kw.pop("mods")
    s = _scn(mods, **kw)
    with pytest.raises(ScenarioError, match=f"framework.recompute_modules.*{match}"):
        simulate(s)


def test_an_unknown_module_is_a_schema_error() -> None:
    with pytest.raises(ScenarioError, match="recompute_modules"):
        _scn(["attention"])


def test_the_cli_exits_2_with_one_line(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    s = _scn(["layernorm"], GQA, ac="none")
    path.write_text(yaml.safe_dump(s.model_dump(mode="json", exclude_none=True)))
    result = CliRunner().invoke(app, ["run", str(path)], catch_exceptions=False)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "framework.recompute_modules" in lines[0]


def test_the_models_flops_do_not_move() -> None:
    m = ModelSpec.from_ref(_scn([]).model, SEQ)
    runs = [simulate(_scn(mods)).summary for mods in ([], ["mlp", "moe", "layernorm"])]
    assert runs[0]["model_flops_per_step"] == runs[1]["model_flops_per_step"] == \
        pytest.approx(m.model_flops_per_token(SEQ) * SEQ, rel=1e-12)
    assert runs[1]["hfu"] > runs[1]["mfu"]
