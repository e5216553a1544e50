"""GPT-OSS in Megatron-Core: alternating sliding-window layers and learned attention sinks
(issue 14).

Independent truths: a causal query ``i`` (from 0) over a ``W``-token window scores
``min(i + 1, W)`` keys, so one head's forward QK^T and PV cost ``4 x head_dim x sum_i
min(i + 1, W)`` FLOPs (Megatron-Bridge's ``gpt_oss_flops_calculator``, written here as the
plain sum); Megatron-Core's ``is_layer_window_attention`` puts the window on the 1-based layers
not divisible by ``window_attn_skip_freq`` (GPT-OSS: 2, so layers 0, 2, ... from 0); a tiled
kernel runs the tiles that hold at least one unmasked score (counted here by enumerating the
mask); TE's ``softmax_offset`` is one parameter per head; the GPT-OSS-120B checkpoint holds
116,829,156,672 parameters (the catalogue's source); the H100's dense bf16 peak bounds a step
from below.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import megatron_scenario, program

from sim import catalog
from sim.api import simulate
from sim.frameworks import JobContext
from sim.frameworks.megatron.shape import megatron_shape
from sim.hardware.attention_cost import causal_tiles, window_pairs
from sim.hardware.compute import ComputeModel
from sim.scenario import ScenarioError
from sim.workload.megatron_ops import WINDOWED, MegatronLayout, attention_key, megatron_blocks
from sim.workload.model import ModelSpec

# A small GPT-OSS-like model: 4 layers (0 and 2 windowed over 128 keys, 1 and 3 full), 8 heads
# and 2 KV heads of 64, biases, sinks, 8 experts of width 512, top-2.
OSS = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64,
       "ffn_hidden": 512, "vocab": 32000, "experts": 8, "experts_per_token": 2, "bias": True,
       "attention_sinks": True, "sliding_window": 128, "full_attention_every": 2}
SEQ = 1024


def _scn(par: dict, model: dict | str | None = None, gbs: int = 8, ac: str = "none",
         seq: int = SEQ):
    return megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), gbs,
                             model=model or OSS, seq=seq, ac=ac)


def _attn_kernels(block):
    return [k for k in block.forward + block.backward if k.klass == "attention"]


# --------------------------------------------------------------------------- the window rule
@pytest.mark.parametrize("seq,window", [(1, 1), (5, 2), (1024, 128), (1000, 999), (4096, 128),
                                        (100, 100), (100, 300)])
def test_window_pairs_are_the_sum_of_min_i_plus_1_w(seq, window) -> None:
    pairs = sum(min(i + 1, window) for i in range(seq))
    if window >= seq:
        # No window shorter than the sequence: the dense convention, half the score matrix.
        assert window_pairs(seq, window) == seq * seq / 2
    else:
        assert window_pairs(seq, window) == pairs


@pytest.mark.parametrize("seq,block,window", [(1024, 64, 128), (1024, 64, 64), (1024, 64, 65),
                                              (1000, 64, 200), (512, 128, 1), (256, 64, 10_000),
                                              (256, 64, None)])
def test_causal_tiles_are_the_tiles_the_band_touches(seq, block, window) -> None:
    # Enumerate the mask: a tile runs when one of its queries i has an unmasked key j in it
    # (i - w < j <= i, the keys of the tile's block); a row is its query block's tiles.
    n = math.ceil(seq / block)
    w = window if window is not None else 10**9

    def touched(qb: int, kb: int) -> bool:
        return any(max(kb * block, i - w + 1) <= min((kb + 1) * block - 1, i)
                   for i in range(qb * block, (qb + 1) * block))

    rows = [sum(touched(qb, kb) for kb in range(n)) for qb in range(n)]
    tiles, longest = causal_tiles(n, block, window)
    assert (tiles, longest) == (sum(rows), max(rows))


def test_full_attention_time_is_unchanged_by_a_window_at_least_the_sequence() -> None:
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    for p in ("fwd", "bwd"):
        full = cm.attention_time(2, 8, 4096, 64, p)
        assert cm.attention_time(2, 8, 4096, 64, p, window=4096) == full
        assert cm.attention_time(2, 8, 4096, 64, p, window=None) == full
        # A 128-token band runs 3 of the 64-token tiles per row instead of up to 64, but
        # each row tile still pays its fill (sim/hardware/blackwell_attention.py): on a GB200
        # cuDNN 9.22 ran the 128-key window at 4k tokens, 2 x 128 heads of 64, in 0.210 ms
        # (sim/catalog/reference/cudnn_sdpa.yaml); the model gives 0.224, and its full causal
        # call of that shape 3.3x that. Here (H100) 3.8x forward, 4.6x backward.
        assert full / 6 < cm.attention_time(2, 8, 4096, 64, p, window=128) < full / 3


# --------------------------------------------------------------------------- the blocks
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_windowed_attention_flops_closed_form(tp) -> None:
    m = ModelSpec.from_ref(_scn({"tp": 1}).model, SEQ)
    batch = 2
    blocks = megatron_blocks(m, MegatronLayout(tp=tp, sequence_parallel=tp > 1), batch, SEQ)
    heads = 8 // tp
    pairs = sum(min(i + 1, 128) for i in range(SEQ))
    fwd, bwd = _attn_kernels(blocks[WINDOWED])
    # Forward: QK^T and PV, 2 x head_dim FLOPs each per scored pair and head; backward 2.5x
    # (the FlashAttention convention of sim/workload/layer_builder.py's sdpa).
    assert fwd.flops == 4 * batch * heads * 64 * pairs
    assert bwd.flops == 2.5 * fwd.flops
    assert fwd.attn_window == bwd.attn_window == 128
    # The full layers keep the dense count, half the score matrix.
    full_fwd, _ = _attn_kernels(blocks["attn_main"])
    assert full_fwd.flops == 4 * batch * heads * 64 * SEQ * SEQ / 2
    assert full_fwd.attn_window is None
    # Everything but the core attention kernels is the same in both blocks.
    same = [(k.name, k.nbytes, k.flops) for k in blocks["attn_main"].forward
            + blocks["attn_main"].backward if k.klass != "attention"]
    assert same == [(k.name, k.nbytes, k.flops) for k in blocks[WINDOWED].forward
                    + blocks[WINDOWED].backward if k.klass != "attention"]
    # Summed over layers and tensor-parallel ranks, forward + backward = 3 x forward: the
    # model's attention FLOPs per token (ModelSpec.attention_flops_per_token).
    per_seq = sum(_attn_kernels(blocks[attention_key(m, la, blocks)])[0].flops
                  for la in range(m.layers))
    assert 3 * per_seq * tp / (batch * SEQ) == pytest.approx(
        m.attention_flops_per_token(SEQ), rel=1e-12)


def test_layers_alternate_windowed_and_full_as_megatron_core() -> None:
    m = ModelSpec.from_ref("gpt-oss-120b")
    # is_layer_window_attention: 1-based layer_number % window_attn_skip_freq != 0.
    assert [m.windowed(la) for la in range(36)] == [(la + 1) % 2 != 0 for la in range(36)]
    assert sum(m.windowed(la) for la in range(36)) == 18
    every3 = dataclasses.replace(m, full_attention_every=3)
    assert [every3.windowed(la) for la in range(6)] == [True, True, False] * 2
    assert all(dataclasses.replace(m, full_attention_every=None).windowed(la)
               for la in range(36))


def test_windowed_layers_are_cheaper_in_the_built_step() -> None:
    s = _scn({"tp": 1, "ep": 2})
    ops = [op for c in program(s).classes for op in c.streams["compute"]
           if op.micro_batch == 0 and op.name.startswith(("fwd attn L", "bwd attn L"))]
    dur = {op.name.split(" mb")[0]: op.duration for op in ops}
    for p in ("fwd", "bwd"):
        assert dur[f"{p} attn L0"] == dur[f"{p} attn L2"] < dur[f"{p} attn L1"] \
            == dur[f"{p} attn L3"]


def test_without_a_window_shorter_than_the_sequence_no_windowed_block() -> None:
    m = ModelSpec.from_ref(_scn({"tp": 1}, seq=128).model, 128)
    blocks = megatron_blocks(m, MegatronLayout(), 1, 128)
    assert WINDOWED not in blocks and attention_key(m, 0, blocks) == "attn_main"


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sinks_add_one_parameter_per_local_head(tp) -> None:
    m = ModelSpec.from_ref(_scn({"tp": 1}).model, SEQ)
    lay = MegatronLayout(tp=tp, sequence_parallel=tp > 1)
    a = megatron_blocks(m, lay, 1, SEQ)
    b = megatron_blocks(dataclasses.replace(m, attention_sinks=False), lay, 1, SEQ)
    for key in ("attn_main", WINDOWED):
        assert a[key].params - b[key].params == 8 // tp
        # The sink gradient comes out of the attention backward, an fp32 main_grad.
        assert [t.nbytes for t in a[key].weight_grads if t.name.endswith("sink.main_grad")] == \
            [4 * 8 // tp]
    assert m.attention_params - dataclasses.replace(m, attention_sinks=False).attention_params \
        == 8


def test_gpt_oss_120b_parameters_match_the_checkpoint() -> None:
    # tp = pp = ep = 1: the one rank holds the whole model (a shape only, never simulated);
    # its dense and expert parameters, biases and sinks included, add up to the checkpoint's
    # 116,829,156,672 (the catalogue's source, GGUF general.parameter_count).
    s = _scn({"tp": 1}, model="gpt-oss-120b", seq=4096)
    sh = megatron_shape(JobContext.from_scenario(s, "s.yaml"))
    assert sh.stage_params(0) + sh.stage_expert_params(0) == 116_829_156_672
    m = sh.model
    # Attention: q, k, v, o with biases plus 64 sinks; the same in windowed layers.
    attn = 2880 * (64 + 2 * 8) * 64 + (64 + 2 * 8) * 64 + 64 * 64 * 2880 + 2880 + 64
    assert sh.cost["attn_main"].params == sh.cost[WINDOWED].params == attn == m.attention_params


# --------------------------------------------------------------------------- what is refused
def test_context_parallelism_with_windows_or_sinks_is_refused() -> None:
    with pytest.raises(ScenarioError, match="parallelism.cp"):
        program(_scn({"tp": 1, "cp": 2}))
    no_sinks = dict(OSS, attention_sinks=False)
    with pytest.raises(ScenarioError, match="parallelism.cp"):
        program(_scn({"tp": 1, "cp": 2}, model=no_sinks))


def test_sinks_with_the_flash_attn_package_are_refused() -> None:
    # A dense model with sinks under Megatron's local layers (MoE layers need TE's).
    dense = {k: v for k, v in OSS.items() if k not in ("experts", "experts_per_token")}
    local = {"name": "megatron", "implementation": "local"}
    s = megatron_scenario({"tp": 1}, 8, framework=local, model=dense, seq=SEQ)
    with pytest.raises(ScenarioError, match="framework.flash_attention"):
        program(s)
    assert program(megatron_scenario({"tp": 1}, 8, framework=dict(local, flash_attention=False),
                                     model=dense, seq=SEQ)).ops
    # Megatron's unfused path takes them (the window masks a full score matrix there).
    unfused = megatron_scenario({"tp": 1, "ep": 2}, 8, framework={
        "name": "megatron", "flash_attention": False}, model=OSS, seq=SEQ)
    blocks = megatron_shape(JobContext.from_scenario(unfused, "s.yaml")).blocks
    assert [k.flops for k in blocks[WINDOWED].forward] == \
        [k.flops for k in blocks["attn_main"].forward]
    assert program(unfused).ops


@pytest.mark.parametrize("feature", ["attention_sinks", "sliding_window"])
@pytest.mark.parametrize(("framework", "key"), [
    ({"name": "ddp"}, "model.{feature}"),
    # fsdp2 models them in NeMo AutoModel's GPT-OSS module only (test_fsdp2_automodel.py).
    ({"name": "fsdp2"}, "framework.model_code"),
])
def test_other_builders_still_refuse_what_they_do_not_model(feature, framework, key) -> None:
    dense = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1024,
             "vocab": 32000, feature: True if feature == "attention_sinks" else 128}
    s = megatron_scenario({"tp": 1}, 8, framework=framework, model=dense, seq=SEQ)
    with pytest.raises(ScenarioError, match=key.format(feature=feature)):
        program(s)


# --------------------------------------------------------------------------- whole steps
@pytest.mark.parametrize("par,ac", [({"tp": 1, "ep": 4}, "none"),
                                    ({"tp": 2, "ep": 2, "etp": 1}, "selective"),
                                    # etp 1: TE's GroupedLinear refuses biases at TP > 1.
                                    ({"tp": 2, "pp": 2, "ep": 2, "etp": 1}, "full")])
def test_gpt_oss_like_step_builds_and_runs(par, ac) -> None:
    s = _scn(par, ac=ac)
    m = ModelSpec.from_ref(s.model, SEQ)
    r = simulate(s).summary
    # The summary's model FLOPs are ModelSpec's: 6 x active matmul parameters plus the
    # windowed and full layers' attention.
    assert r["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(SEQ) * 8 * SEQ, rel=1e-12)
    assert r["step_time_s"] > 0 and not r["oom"]
    assert r["hfu"] >= r["mfu"] > 0


def test_shipped_gpt_oss_120b_recipe_on_64_h100_is_physically_plausible() -> None:
    from sim.scenario import load_scenario

    s = load_scenario("gpt-oss-120b-megatron-tp2pp4ep16-64xh100")
    r = simulate(s).summary
    m = ModelSpec.from_ref("gpt-oss-120b", 4096)
    assert r["model_flops_per_step"] == pytest.approx(
        m.model_flops_per_token(4096) * 512 * 4096, rel=1e-12)
    # Lower bound: the model FLOPs per GPU at the H100 SXM's dense bf16 peak (989 TFLOP/s,
    # NVIDIA H100 datasheet).
    assert r["step_time_s"] > r["model_flops_per_step"] / 64 / 989e12
    assert 0.05 < r["mfu"] < 0.6 and not r["oom"]
    # EP 16 spans two nodes of a stage: the all-to-alls cross the network.
    assert r["bytes"]["network"] > 0 and r["model_params"] == 116_829_156_672


def test_plan_layer_profile_is_no_more_than_the_cheapest_layer() -> None:
    # The planner's two-layer copy keeps the window pattern (its layer 0 is windowed), so its
    # minimum over layers (compute plus a lower bound of the collectives blocking the stream)
    # is below what a full layer's kernels alone take: priced as full-attention layers, the
    # bound would exceed the windowed layers' time and stop being a lower bound.
    from sim.apps.plan.bound import LinkRates
    from sim.apps.plan.layouts import Layout
    from sim.apps.plan.profile import layer_profile

    s = megatron_scenario({"tp": 1, "ep": 2}, 8, model=OSS, seq=SEQ, nodes=2, gpn=4)
    lay = Layout("megatron", 1, 1, 8, 1, 1, 1, "none", (), ep=2, etp=1)
    prof = layer_profile(s, lay, LinkRates.of(s))
    ops = [op for op in program(s).classes[0].streams["compute"]
           if op.micro_batch == 0 and op.kind == "compute"
           and op.category in ("forward", "backward")]
    per_layer = [sum(op.duration for op in ops if op.layer == la) for la in range(4)]
    assert per_layer[0] < per_layer[1]            # the windowed layer is the cheaper one
    assert prof.refused is None and prof.layer_s < per_layer[1]


def test_published_gpt_oss_rows_are_no_longer_skipped() -> None:
    # The published-moe suite's GPT-OSS rows (Megatron-Bridge 25.11 on 64 B200 and 64 GB200,
    # 26.02 on 64 H100, B200 and GB200, 26.04 on 64 B200, GB200 (HybridEP), B300 and GB300,
    # 26.06 on 64 GB200 under the operation fuser, the verification cards' 64 GB200 and 64
    # GB300) build now: the builder refuses neither their sinks nor their windows.
    from sim.apps.validation import published_moe as pm

    rows = [e for e in pm.entries() if e["scenario"]["model"] == "gpt-oss-120b"
            and e["scenario"]["framework"]["name"] == "megatron"]
    assert len(rows) == 12
    for e in rows:
        prog = program(pm.scenario_of(e))
        assert prog.classes
