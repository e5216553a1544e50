"""Megatron-Core's mixture-of-experts path (issue 14 item 2): expert parallelism's all-to-alls,
parallel folding's groups, expert parameters sharded over ep and reduced over the
expert-data-parallel group, and a Mixtral 8x7B step end to end.

Independent truths: the closed form of issue 14 (balanced routing: all-to-all bytes per rank
per MoE layer per pass = 2 x tokens x top-k x hidden x bytes x (ep - 1) / ep); Megatron-Core's
``parallel_state.initialize_model_parallel`` groups (``RankGenerator`` over
``tp-cp-ep-dp-pp``); the model's published parameter counts (Mixtral 8x7B: 8 experts of
3 x 4096 x 14336 per layer, 32 layers); 6 x active parameters per token for the FLOPs; the H100's
dense bf16 peak for a lower bound on the step.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.scenario import ScenarioError
from sim.workload.model import ModelSpec

# A small MoE model: 4 layers, 8 experts of width 1024, top-2 (softmax router, dropless).
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048


def _scn(par: dict, gbs: int = 8, model: dict | None = None, framework: dict | None = None,
         nodes: int = 1):
    return megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), gbs,
                             model=model or TINY, seq=SEQ, nodes=nodes,
                             framework=framework or {"name": "megatron"})


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _ops(program):
    """(rank class, op) of every op of the step."""
    return [(c, op) for c in program.classes for ops in c.streams.values() for op in ops]


def _a2a(program):
    return [(c, op) for c, op in _ops(program) if op.collective == "all_to_all"]


def _wire(op) -> float:
    """Bytes one member puts on the wire: its buffer less its own chunk (balanced)."""
    n = len(op.all_groups[0])
    return op.nbytes * (n - 1) / n


@pytest.mark.parametrize("par", [{"tp": 1, "ep": 8}, {"tp": 1, "ep": 4},
                                 {"tp": 2, "ep": 4}, {"tp": 2, "ep": 2, "etp": 1},
                                 {"tp": 1, "pp": 2, "ep": 4}, {"tp": 1, "cp": 2, "ep": 4}])
def test_all_to_all_bytes_follow_the_closed_form(par) -> None:
    s = _scn(par)
    p = _program(s)
    ep, tp, pp, cp = par["ep"], par["tp"], par.get("pp", 1), par.get("cp", 1)
    tokens = 1 * SEQ // (cp * tp)        # micro-batch 1, the context- and sequence-parallel shard
    k, h, bf16 = 2, 1024, 2
    closed = 2 * tokens * k * h * bf16 * (ep - 1) / ep     # per MoE layer per pass
    mbs = 8 // (8 // (tp * pp * cp))     # micro-batches per step: gbs / dp
    layers_per_rank = 4 // pp
    tokens_a2a = [(c, op) for c, op in _a2a(p) if "probs" not in op.name]
    per_rank = {c.id: 0.0 for c in p.classes}
    for c, op in tokens_a2a:
        per_rank[c.id] += _wire(op)
        assert len(op.all_groups[0]) == ep and op.stream == "compute"
    for total in per_rank.values():
        # forward: dispatch + combine; backward: the same again
        assert total == pytest.approx(2 * closed * layers_per_rank * mbs, rel=1e-12)
    # The routing probs travel too (fp32, one per token copy): 4 / (h x 2) of the tokens'.
    probs = sum(_wire(op) for _, op in _a2a(p) if "probs" in op.name)
    assert probs == pytest.approx(sum(per_rank.values()) / 2 * 4 / (h * bf16), rel=1e-12)


def test_ep_groups_are_megatron_core_parallel_folding_groups() -> None:
    # parallel_state: the experts' RankGenerator(tp=etp, ep, dp=world/(etp*ep*pp), pp, cp=1)
    # over "tp-cp-ep-dp-pp": 8 GPUs, tp=2 (etp defaults to tp: Megatron-LM validate_args),
    # ep=2: expert-TP groups (0,1),(2,3).., EP groups (0,2),(1,3),(4,6),(5,7), expert-dp 2
    # (0,4),... while the attention's data-parallel groups are (0,2,4,6),(1,3,5,7).
    s = _scn({"tp": 2, "ep": 2})
    p = _program(s)
    ops = [op for c, op in _ops(p)]
    a2a = next(op for op in ops if op.collective == "all_to_all")
    assert sorted(a2a.all_groups) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    etp = next(op for op in ops if "etp all_gather" in op.name)
    assert sorted(etp.all_groups) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    count = next(op for op in ops if "token count" in op.name)
    assert sorted(count.all_groups) == [(0, 1, 2, 3), (4, 5, 6, 7)] and count.host_sync
    grads = next(op for op in ops if op.key.startswith("edp/") and op.name.startswith("grad"))
    assert sorted(grads.all_groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_ep_1_has_no_all_to_all_and_one_expert_group_per_dp_rank() -> None:
    p = _program(_scn({"tp": 1, "ep": 1}))
    assert not _a2a(p)
    assert not [op for c, op in _ops(p) if "token count" in op.name]
    # expert-dp = 8: the experts' gradients are reduced like the dense ones, over all 8 ranks
    grads = [op for _, op in _ops(p) if op.key.startswith("edp/")]
    assert grads and all(g.all_groups == ((0, 1, 2, 3, 4, 5, 6, 7),) for g in grads)


def test_model_flops_are_active_parameter_flops() -> None:
    # The summary's model FLOPs: 6 x active matmul parameters per token + causal attention.
    s = _scn({"tp": 1, "ep": 4})
    m = ModelSpec.from_ref(s.model, SEQ)
    p = _program(s)
    tokens = 8 * SEQ
    assert p.model_flops_per_step == pytest.approx(m.model_flops_per_token(SEQ) * tokens,
                                                   rel=1e-12)
    assert m.active_matmul_params < m.matmul_params
    # The MoE ops' FLOPs (balanced routing): 6 x tokens x (router E x h + top-k experts of
    # 3 x h x f) per layer: what a token multiplies with, not all 8 experts.
    moe = sum(op.flops * len(c.members) for c, op in _ops(p) if " moe " in op.name)
    active = 8 * 1024 + 2 * 3 * 1024 * 1024
    assert moe == pytest.approx(6 * tokens * active * 4, rel=1e-12)


def test_mixtral_expert_memory_falls_as_one_over_ep() -> None:
    from sim.frameworks.megatron.shape import megatron_shape

    # Mixtral 8x7B: 32 layers x 8 experts x (3 x 4096 x 14336) parameters (config.json).
    experts_total = 32 * 8 * 3 * 4096 * 14336
    dist = {"name": "megatron", "distributed_optimizer": True}
    for ep in (1, 2, 4, 8):
        s = _scn({"tp": 1, "ep": ep}, gbs=8, model="mixtral-8x7b", framework=dist)
        sh = megatron_shape(JobContext.from_scenario(s, "s.yaml"))
        assert sh.stage_expert_params(0) * ep == experts_total
        mem = sh.initial_memory(0)
        dense = sh.stage_params(0)
        # bf16 params, fp32 grads, 12 B of optimizer state sharded over expert-dp = 8 / ep
        assert mem["parameters"] == pytest.approx(2 * (dense + experts_total / ep))
        assert mem["optimizer"] == pytest.approx(12 * dense / 8 + 12 * experts_total / 8)


@pytest.mark.parametrize("par,key", [
    ({"tp": 1, "ep": 3}, "parallelism.ep"),          # 3 does not divide 8 GPUs
    ({"tp": 2, "ep": 8}, "parallelism.ep"),          # etp x ep x pp = 16 > 8 GPUs
])
def test_layouts_the_world_cannot_hold_are_refused(par, key) -> None:
    with pytest.raises(ScenarioError, match=key):
        _scn(par)


def test_bad_expert_layouts_name_the_key() -> None:
    with pytest.raises(ScenarioError, match=r"^s\.yaml: parallelism\.ep: 6 experts do not "
                       r"split over ep=4$"):
        _program(_scn({"tp": 1, "ep": 4}, model=dict(TINY, experts=6)))
    dense = {k: v for k, v in TINY.items() if k not in ("experts", "experts_per_token",
                                                       "moe_ffn_hidden")}
    with pytest.raises(ScenarioError, match=r"parallelism\.ep: .* has no experts"):
        _program(_scn({"tp": 1, "ep": 2}, model=dense))
    with pytest.raises(ScenarioError, match=r"parallelism\.sequence_parallel"):
        _program(_scn({"tp": 2, "ep": 2, "sequence_parallel": False}))


def test_dense_first_layers_stay_dense() -> None:
    p = _program(_scn({"tp": 1, "ep": 4}, model=dict(TINY, first_k_dense=1)))
    layers = {op.layer for c, op in _ops(p) if op.collective == "all_to_all"}
    assert layers == {1, 2, 3}


def test_mixtral_8x7b_on_64_h100_is_physically_plausible() -> None:
    from sim.scenario import load_scenario

    s = load_scenario("mixtral-8x7b-megatron-ep8-64xh100")
    r = simulate(s).summary
    # Lower bound: the model FLOPs per GPU at the H100 SXM's dense bf16 peak (989 TFLOP/s,
    # NVIDIA H100 datasheet), the FLOPs of Mixtral's active parameters (12.9B of 46.7B).
    per_gpu = r["model_flops_per_step"] / 64
    assert r["step_time_s"] > per_gpu / 989e12
    assert 0.3 < r["mfu"] < 0.7 and not r["oom"]
    # Each EP group is one node (tp=1, ep=8 innermost): the all-to-alls ride NVLink. Per GPU
    # per step: 8 MoE layers x 16 micro-batches x 2 passes x the closed form (4096 tokens,
    # top-2, h=4096, bf16, 7/8) = 30.1 GB, which at NVLink 4's 450 GB/s per direction is
    # 0.07 s, far under the step.
    a2a = 8 * 16 * 2 * 2 * 4096 * 2 * 4096 * 2 * 7 / 8
    assert a2a / 450e9 < 0.05 * r["step_time_s"]
    assert r["bytes"]["nvlink"] > 64 * a2a


def test_summary_nvlink_bytes_conserve_the_all_to_all_bytes() -> None:
    # One node, ep = 8: the step's NVLink bytes with top-k experts per token less those with
    # top-1 are exactly the extra all-to-all bytes (everything else, gradients and counts,
    # is the same): (k - 1) x (tokens x h x 2 B, dispatch and combine, forward and backward,
    # + tokens x 4 B of fp32 probs, dispatch forward and backward) x 7/8 on the wire, per
    # rank, layer and micro-batch, each byte over two NVLink hops (GPU -> NVSwitch -> GPU;
    # the summary counts every hop).
    nv = {}
    for k in (1, 2, 4):
        s = _scn({"tp": 1, "ep": 8}, model=dict(TINY, experts_per_token=k))
        r = simulate(s).summary
        nv[k] = r["bytes"]["nvlink"]
        assert r["bytes"]["network"] == 0.0
    for k in (2, 4):
        per_rank = 4 * 1 * (2 * 2 * SEQ * (k - 1) * 1024 * 2 + 2 * SEQ * (k - 1) * 4) * 7 / 8
        assert nv[k] - nv[1] == pytest.approx(2 * 8 * per_rank, rel=1e-9)


@pytest.mark.parametrize("fw", [
    {"name": "megatron"},
    {"name": "megatron", "distributed_optimizer": True, "overlap_grad_reduce": True,
     "overlap_param_gather": True}])
def test_gradient_buckets_conserve_dense_and_expert_parameters(fw) -> None:
    from sim.frameworks.megatron.shape import megatron_shape

    # tp=2 (etp=2), ep=2 on 8 GPUs: dense gradients over dp=4, experts' over expert-dp 2.
    s = _scn({"tp": 2, "ep": 2}, framework=fw)
    ctx = JobContext.from_scenario(s, "s.yaml")
    sh = megatron_shape(ctx)
    p = build_program(ctx)
    grads = [op for _, op in _ops(p) if op.name.startswith("grad ")]
    dense = sum(op.nbytes for op in grads if op.key.startswith("dp/"))
    expert = sum(op.nbytes for op in grads if op.key.startswith("edp/"))
    assert dense == pytest.approx(4 * sh.stage_params(0), rel=1e-12)     # fp32 grad buffers
    # TINY: 4 layers x 8 experts / ep 2 x 3 x 1024 x 1024 / etp 2, fp32.
    assert expert == pytest.approx(4 * 4 * 4 * 3 * 1024 * 1024 / 2, rel=1e-12)
    assert {len(op.all_groups[0]) for op in grads if op.key.startswith("edp/")} == {2}
    if fw.get("overlap_grad_reduce"):
        # issued from the backward hooks, before the stage's last backward op
        last_bwd = max(op.index for _, op in _ops(p) if op.phase == "bwd")
        assert min(op.index for op in grads if op.key.startswith("edp/")) < last_bwd


def test_full_recomputation_reruns_the_dispatch() -> None:
    # activation_checkpointing full re-runs each layer's forward in backward, the MoE
    # layer's all-to-alls included (Megatron-Core's CheckpointFunction over the whole
    # TransformerLayer): three passes' all-to-alls instead of two, hardware FLOPs above model.
    base = _scn({"tp": 1, "ep": 4})
    full = megatron_scenario({"tp": 1, "ep": 4}, 8, model=TINY, seq=SEQ, ac="full")
    b, f = _program(base), _program(full)
    wire = [sum(_wire(op) for _, op in _a2a(p) if "probs" not in op.name) for p in (b, f)]
    assert wire[1] == pytest.approx(1.5 * wire[0], rel=1e-12)
    # The recomputed FLOPs are the layers' forward FLOPs once more (the MoE part: 2 x tokens
    # x active MoE parameters per layer, not all experts').
    layer_fwd = sum(op.flops * len(c.members) for c, op in _ops(b)
                    if op.phase == "fwd" and op.layer is not None)
    assert b.hw_flops_per_step == b.model_flops_per_step
    assert f.hw_flops_per_step - f.model_flops_per_step == pytest.approx(layer_fwd, rel=1e-12)
    moe_fwd = sum(op.flops * len(c.members) for c, op in _ops(b)
                  if op.phase == "fwd" and " moe " in op.name)
    assert moe_fwd == pytest.approx(4 * 2 * 8 * SEQ * (8 * 1024 + 2 * 3 * 1024 * 1024),
                                    rel=1e-12)


def test_shared_experts_run_on_every_token_with_tensor_parallelism() -> None:
    # One shared expert (DeepSeek/Qwen-style) beside the routed ones, tp=2 sequence parallel:
    # a TP MLP over the gathered sequence, its output reduce-scattered; its FLOPs count once
    # per token: 6 x (router + (top-k + shared) experts) per token and layer.
    s = _scn({"tp": 2, "ep": 2}, model=dict(TINY, shared_experts=1))
    p = _program(s)
    tokens = 8 * SEQ
    moe = sum(op.flops * len(c.members) for c, op in _ops(p) if " moe " in op.name)
    assert moe == pytest.approx(6 * tokens * 4 * (8 * 1024 + 3 * 3 * 1024 * 1024), rel=1e-12)
    names = {op.name.split(" mb")[1].split(" ", 1)[1] for _, op in _ops(p)
             if op.name.startswith("fwd moe L0 ")}
    assert {"shared all_gather", "shared experts", "shared reduce_scatter"} <= names
    assert simulate(s).summary["step_time_s"] > 0


def test_router_options_follow_megatron_core_defaults() -> None:
    from sim.frameworks.megatron.shape import megatron_shape

    def router(**fw):
        s = _scn({"tp": 1, "ep": 4}, framework={"name": "megatron", **fw})
        return megatron_shape(JobContext.from_scenario(s, "s.yaml")).moe.ops.router

    def names(b):
        return {k.name for k in b.forward}

    # TransformerConfig defaults: moe_aux_loss_coeff 0 (no aux loss), moe_z_loss_coeff None,
    # moe_router_fusion False (PyTorch top-k and scatter ops).
    plain = names(router())
    assert "aux.loss" not in plain and "z_loss" not in plain and "topk" in plain
    assert {"aux.loss", "z_loss"} <= names(router(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3))
    assert "topk_fused" in names(router(moe_router_fusion=True))


def test_fp8_runs_the_expert_gemms_in_fp8_and_keeps_their_fp8_weights() -> None:
    from sim.frameworks.megatron.shape import megatron_shape

    def shape(precision, model=TINY):
        s = megatron_scenario({"tp": 1, "ep": 4}, 8, model=model, seq=SEQ, precision=precision)
        return megatron_shape(JobContext.from_scenario(s, "s.yaml"))

    b16, f8 = shape("bf16"), shape("fp8")
    gemms = [k for k in f8.moe.ops.experts.forward if k.klass == "gemm"]
    assert gemms and all(k.fp8 for k in gemms)
    # The H100's FP8 rate is twice its bf16 rate: Mixtral's experts (4,096-row GEMMs 4,096 x
    # 28,672 per expert here) run faster despite the casts (the weights' cast, once per
    # micro-batch here, eats much of the forward's gain).
    mix = {p: shape(p, "mixtral-8x7b").moe.cost["experts"] for p in ("bf16", "fp8")}
    assert mix["fp8"].fwd_gpu_s < mix["bf16"].fwd_gpu_s
    assert mix["fp8"].bwd_gpu_s < 0.8 * mix["bf16"].bwd_gpu_s
    # 1,024 rows per local expert (2,048 tokens x top-2 x ep 4 / 8 experts), a multiple of
    # the FP8 alignment: no padding, the same FLOPs.
    assert f8.moe.flops_fwd == b16.moe.flops_fwd
    # Transformer Engine keeps each FP8 weight and its transpose: 2 B per linear parameter,
    # attention's and the 2 local experts' (3 x 1024 x 1024 each), 4 layers; no router.
    attn = f8.cost["attn_main"].params
    assert f8.initial_memory(0)["buffers"] == 2 * 4 * (attn + 2 * 3 * 1024 * 1024)
    # The dispatch stays 16-bit (the alltoall dispatcher does not quantise tokens).
    a2a = [op for _, op in _a2a(_program(megatron_scenario(
        {"tp": 1, "ep": 4}, 8, model=TINY, seq=SEQ, precision="fp8")))]
    assert {op.dtype for op in a2a if "probs" not in op.name} == {"bf16"}


def test_summary_counts_the_active_parameters() -> None:
    # CONTRACT.md: the summary adds active_params. TINY per layer: 8 experts of 3 x 1024 x
    # 1024 of which a token uses 2; model_params counts all 8, active_params 2 of them.
    s = _scn({"tp": 1, "ep": 8}, model={**{k: v for k, v in TINY.items()
                                            if k not in ("experts", "experts_per_token",
                                                         "moe_ffn_hidden")},
                                         "moe": {"experts": 8, "top_k": 2,
                                                 "expert_ffn_hidden": 1024}})
    r = simulate(s).summary
    per_layer_unused = 6 * 3 * 1024 * 1024
    assert r["model_params"] - r["active_params"] == TINY["layers"] * per_layer_unused
    assert r["active_params"] == ModelSpec.from_dims(s.model).active_params
