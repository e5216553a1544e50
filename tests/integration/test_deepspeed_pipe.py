"""Megatron-DeepSpeed 3D (DeepSpeed's PipelineEngine over Megatron tensor parallelism) against
closed forms: DeepSpeed's TrainSchedule, the 1F1B bubble, ZeRO-1 / BF16_Optimizer state
bytes, the bytes of the data-parallel gradient reduction and of the tensor-parallel
exchanges, and BLOOM-176B's logged step time."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import make_scenario
from helpers import DEEP, program

from sim.api import simulate
from sim.frameworks import JobContext
from sim.frameworks.deepspeed.pipe import stage_param_counts
from sim.frameworks.deepspeed.pipe_schedule import pipe_buffers, train_schedule
from sim.scenario import ScenarioError, load_scenario

# Deep and narrow-vocabulary, so the layers dominate every stage (the closed forms assume
# identical stages); GELU/LayerNorm/biases as Megatron-DeepSpeed's GPT.
SMALL = {"layers": 8, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "vocab": 2048,
         "mlp": "gelu", "tied_embeddings": True}


def scenario(par: dict, gbs: int, framework: dict | None = None, model: dict | None = None,
             ac: str = "none", mbs: int = 1, seq: int = 2048, nvlink: float = 45000):
    n = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
    return make_scenario(name=None, model=model or DEEP, cluster__gpus_per_node=n,
                         cluster__nvlink_gbytes_per_s=nvlink, cluster__nics_per_node=0,
                         framework=framework or {"name": "deepspeed", "zero_stage": 1},
                         parallelism=par,
                         training={"seq_len": seq, "micro_batch_size": mbs,
                                   "global_batch_size": gbs, "activation_checkpointing": ac})


# --------------------------------------------------------------------------- TrainSchedule
@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (4, 4), (4, 9), (5, 3), (12, 16)])
def test_train_schedule_runs_every_micro_batch_and_pairs_every_send(p: int, m: int) -> None:
    sched = [[i for step in train_schedule(m, p, s) for i in step] for s in range(p)]
    for s, instrs in enumerate(sched):
        fwd = [i.mb for i in instrs if i.kind == "fwd"]
        bwd = [i.mb for i in instrs if i.kind == "bwd"]
        assert fwd == list(range(m)) and bwd == list(range(m))
        # Micro-batches in flight (forward done, backward not yet) never exceed the buffers
        # the engine allocates (num_pipe_buffers), and reach min(p - s, m): 1F1B's depth.
        live, most = 0, 0
        for i in instrs:
            live += {"fwd": 1, "bwd": -1}.get(i.kind, 0)
            most = max(most, live)
        assert most <= pipe_buffers(m, p, s) and most == min(p - s, m)
        # Blocking p2p: stage s's sends of activations come in the order stage s+1 receives
        # them, and likewise for gradients, so matching rendezvous never cross.
        if s < p - 1:
            assert [i.mb for i in instrs if i.kind == "send_act"] == \
                [i.mb for i in sched[s + 1] if i.kind == "recv_act"] == list(range(m))
            assert [i.mb for i in sched[s + 1] if i.kind == "send_grad"] == \
                [i.mb for i in instrs if i.kind == "recv_grad"] == list(range(m))
        assert [i.kind for i in instrs[-3:]] == ["reduce_tied", "reduce_grads", "optimizer"]


# --------------------------------------------------------------------------- bubble
@pytest.mark.parametrize("p,m", [(4, 4), (4, 16), (2, 8)])
def test_bubble_matches_the_1f1b_closed_form(p: int, m: int) -> None:
    # Near-free communication (fat NVLink, one GPU per stage, no tensor or data parallelism):
    # the idle share of the pipeline phase is (p-1)/(m+p-1) (Narayanan et al., SC'21), which
    # DeepSpeed's TrainSchedule reaches with its alternating blocking sends. The summary's
    # bubble is a share of the whole step, which also holds the optimizer: rescale.
    s = scenario({"tp": 1, "pp": p, "dp": 1}, gbs=m)
    r = simulate(s)
    step = r.summary["step_time_s"]
    crit = max({x.cls for x in r.recorder.ops},
               key=lambda c: max(x.end for x in r.recorder.ops if x.cls == c))
    pipeline_end = max(x.end for x in r.recorder.ops
                       if x.cls == crit and x.op.phase in ("fwd", "bwd", "recompute"))
    got = r.summary["bubble_fraction"] * step / pipeline_end
    assert got == pytest.approx((p - 1) / (m + p - 1), abs=0.02)


def test_blocking_sends_hold_both_stages() -> None:
    # A transfer is one rendezvous: the sender's and the receiver's op start and end together.
    r = simulate(scenario({"tp": 1, "pp": 2, "dp": 1}, gbs=4))
    p2p: dict[str, list] = {}
    for x in r.recorder.ops:
        if x.op.kind == "recv":
            p2p.setdefault(x.op.key, []).append(x)
    assert len(p2p) == 2 * 4          # an activation and a gradient per micro-batch
    for recs in p2p.values():
        assert len(recs) == 2 and {x.cls for x in recs} == {0, 1}
        assert recs[0].start == recs[1].start and recs[0].end == recs[1].end


# --------------------------------------------------------------------------- memory
def _layer_params_per_tp_rank(h: int, f: int, t: int) -> int:
    """Megatron's GPT layer on one of t ranks: QKV (3h x h + 3h bias) and fc1 (f x h + f)
    split by columns; projection and fc2 split by rows, their biases (h each) whole; two
    LayerNorms (2h each) whole."""
    return (3 * h * h + 3 * h + f * h + f) // t + (h * h + h * f) // t + 2 * h + 4 * h


@pytest.mark.parametrize("t,p,dp", [(2, 2, 2), (1, 4, 2), (4, 2, 1)])
def test_zero1_states_per_stage_are_the_closed_form(t: int, p: int, dp: int) -> None:
    # ZeRO-1 (DeepSpeedZeroOptimizer): 16-bit weights of the stage's 1/t shard (2 B), fp32
    # master + Adam m and v sharded over the dp replicas (12 B / dp).
    h, f, v, layers = 1024, 4096, 2048, 8
    s = scenario({"tp": t, "pp": p, "dp": dp}, gbs=4 * dp, model=SMALL, seq=512)
    prog = program(s)
    per_layer = _layer_params_per_tp_rank(h, f, t)
    vocab_local = v // t            # 2048 is a multiple of 128 x t for t <= 16
    counts = stage_param_counts(JobContext.from_scenario(s))
    for st, cls in enumerate(prog.classes):
        n = layers // p * per_layer
        if st == 0:
            n += vocab_local * h + 512 * h          # word embedding + learned positions
        if st == p - 1:
            n += 2 * h + vocab_local * h            # final LayerNorm + tied embedding copy
        assert counts[st] == n
        assert cls.initial_memory["parameters"] == 2 * n
        assert cls.initial_memory["optimizer"] == pytest.approx(12 * n / dp)
        assert "gradients" not in cls.initial_memory       # .grad appears in backward


def test_bf16_optimizer_keeps_full_fp32_gradient_accumulators() -> None:
    # BF16_Optimizer (zero_stage 0, bf16): fp32 accumulators of the whole stage, unsharded
    # (BLOOM README: "It doesn't shard the static fp32 buffer ... 4 bytes * params"), plus the
    # bf16 .grad, master and Adam states sharded over the replicas.
    s = scenario({"tp": 2, "pp": 2, "dp": 2}, gbs=8, model=SMALL, seq=512,
                 framework={"name": "deepspeed", "zero_stage": 0})
    prog = program(s)
    counts = stage_param_counts(JobContext.from_scenario(s))
    for st, cls in enumerate(prog.classes):
        assert cls.initial_memory["gradients"] == (4 + 2) * counts[st]
        assert cls.initial_memory["optimizer"] == pytest.approx(12 * counts[st] / 2)
    r = simulate(s)
    assert r.summary["peak_memory_gib"] * 2**30 > max(
        sum(c.initial_memory.values()) for c in prog.classes)


# --------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("stage,width", [(1, 2), (0, 2)])
def test_dp_gradient_reduction_bytes(stage: int, width: int) -> None:
    # After the last micro-batch each stage all-reduces its gradients over the dp replicas in
    # the 16-bit communication dtype (ZeRO-1 bucket by bucket, BF16_Optimizer's fp32
    # accumulators cast to bf16): 2 B x the stage's parameters, then all-gathers the updated
    # 16-bit weights (2 B x parameters). Nothing reduces before the last backward.
    s = scenario({"tp": 2, "pp": 2, "dp": 2}, gbs=8, model=SMALL, seq=512,
                 framework={"name": "deepspeed", "zero_stage": stage})
    prog = program(s)
    counts = stage_param_counts(JobContext.from_scenario(s))
    for st, cls in enumerate(prog.classes):
        ops = [o for ops in cls.streams.values() for o in ops]
        ar = [o for o in ops if o.kind == "collective" and o.name.endswith("(dp)")
              and o.collective == "all_reduce"]
        ag = [o for o in ops if o.kind == "collective" and o.collective == "all_gather"
              and o.name.endswith("(dp)")]
        assert sum(o.nbytes for o in ar) == width * counts[st]
        assert sum(o.nbytes for o in ag) == 2 * counts[st]
        assert all(len(g) == 2 for o in ar + ag for g in o.all_groups)
        last_bwd = max(o.index for o in ops if o.phase == "bwd" and o.kind == "compute"
                       and o.micro_batch == 3)
        assert min(o.index for o in ar) > last_bwd


@pytest.mark.parametrize("ac,per_layer", [("none", 4), ("full", 6)])
def test_tensor_parallel_exchanges_per_layer(ac: str, per_layer: int) -> None:
    # Megatron's layer: two all-reduces of a [s, b, h] 16-bit tensor in forward (after the
    # row-parallel projection and fc2) and two in backward (the column-parallel inputs'
    # gradients); full recomputation repeats the forward's two. PartitionedTensor p2p adds
    # all-gathers of the same size: the input on every stage but the first, the output and
    # its gradient in backward on every stage but the last; the embedding's output is
    # all-reduced on the first stage, the output layer's input gradient on the last
    # (parallel_lm_logits' copy_to_tensor_model_parallel_region).
    b, seq, h, m = 1, 512, 1024, 4
    s = scenario({"tp": 2, "pp": 2, "dp": 1}, gbs=m, model=SMALL, seq=seq, ac=ac)
    prog = program(s)
    act = 2 * b * seq * h
    for st, cls in enumerate(prog.classes):
        tp = [o for ops in cls.streams.values() for o in ops
              if o.kind == "collective" and o.key.startswith("tp/")]
        assert all(o.nbytes == act for o in tp)
        kinds = Counter(o.collective for o in tp)
        layers = 8 // 2
        assert kinds["all_reduce"] == m * (layers * per_layer + 1)
        assert kinds["all_gather"] == m * (1 if st == 1 else 2)
    # The p2p moves 1/tp of the activation per rank, plus the meta tensor.
    p2p = [o for o in prog.ops if o.kind == "recv" and o.name.endswith("mb0")
           and " data " in o.name]
    assert p2p and all(o.nbytes == act / 2 for o in p2p)


# --------------------------------------------------------------------------- input
def test_three_d_layouts_are_no_longer_refused() -> None:
    r = simulate(scenario({"tp": 2, "pp": 2, "dp": 2}, gbs=8, model=SMALL, seq=512))
    assert r.program.meta["schedule"] == "deepspeed TrainSchedule"
    assert r.summary["step_time_s"] > 0 and r.summary["bubble_fraction"] > 0
    # Tensor parallelism alone: a one-stage pipeline (F, B per micro-batch), no p2p.
    r = simulate(scenario({"tp": 2, "pp": 1, "dp": 4}, gbs=8, model=SMALL, seq=512))
    assert r.summary["step_time_s"] > 0 and r.summary["bubble_fraction"] == 0
    assert not [o for o in r.program.ops if o.kind == "recv"]


@pytest.mark.parametrize("framework,par,key", [
    ({"zero_stage": 2}, {"tp": 2, "pp": 2, "dp": 2}, "framework.zero_stage"),
    ({"zero_stage": 3}, {"tp": 2, "pp": 1, "dp": 4}, "framework.zero_stage"),
    ({"zero_stage": 1}, {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True}, "parallelism"),
    ({"zero_stage": 1}, {"tp": 1, "pp": 3, "dp": 1}, "parallelism.pp"),
])
def test_what_the_pipeline_engine_refuses_names_the_key(framework, par, key) -> None:
    s = scenario(par, gbs=8, model=SMALL, seq=512, framework={"name": "deepspeed", **framework})
    with pytest.raises(ScenarioError) as err:
        program(s)
    assert key in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- BLOOM
def test_bloom_176b_against_its_logged_step_time() -> None:
    # BigScience's tr11-176B-ml README ("Important checkpoints"): at global batch 2048 on 384
    # A100 80GB, TP4 x PP12 x DP8, iteration 85376 logged 104.70 s per iteration (19.561
    # samples/s, "149.77 TFLOPs" counting recomputation). Not fitted: the simulation said
    # 100.3 s (-4.2%) when this test was written; the bound is the project's 15% for
    # published multi-node runs it was not calibrated on.
    s = load_scenario("bloom-176b-deepspeed-3d-384xa100")
    r = simulate(s)
    err = r.summary["step_time_s"] / 104.70 - 1
    assert abs(err) < 0.15, err
    # Each stage holds 1/48 of 176e9 parameters: 2 + 4 + 2 B of weights, fp32 accumulators
    # and bf16 .grad, plus 12/8 B of sharded Adam; BigScience fit it in 80 GB.
    assert not r.summary["oom"]
    assert r.summary["bubble_fraction"] >= 11 / 139 - 0.01


def test_partition_activations_keeps_one_tp_share_of_each_checkpoint() -> None:
    # deepspeed.checkpointing with partition_activations: a checkpointed layer's input is
    # split over the t tensor-parallel ranks (1/t of 2 x b x s x h bytes kept per layer and
    # micro-batch) and all-gathered before its recompute: one more all-gather per layer.
    t, seq, h = 2, 512, 1024
    fw = {"name": "deepspeed", "zero_stage": 1}
    base = scenario({"tp": t, "pp": 2, "dp": 1}, gbs=4, model=SMALL, seq=seq, ac="full",
                    framework=fw)
    part = scenario({"tp": t, "pp": 2, "dp": 1}, gbs=4, model=SMALL, seq=seq, ac="full",
                    framework={**fw, "pipeline": {"partition_activations": True}})
    held = {}
    gathers = {}
    for name, s in (("base", base), ("part", part)):
        prog = program(s)
        ops = prog.classes[1].streams["compute"]
        held[name] = sum(b for o in ops if o.phase == "fwd" and o.layer is not None
                         for c, b in o.alloc if c == "activations")
        gathers[name] = sum(1 for o in ops if o.collective == "all_gather")
    layers, m = 4, 4
    assert held["base"] - held["part"] == pytest.approx(layers * m * 2 * seq * h * (1 - 1 / t))
    assert gathers["part"] - gathers["base"] == layers * m


def test_fp16_without_zero_keeps_every_state_and_gathers_nothing() -> None:
    # zero_stage 0 with fp16 is FP16_Optimizer: each rank keeps the stage's full fp32 master
    # and Adam states (12 B/param, not sharded), all-reduces the fp16 gradients (2 B/param)
    # and has no weights to all-gather after the step.
    s = make_scenario({
        "model": SMALL, "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8,
                                    "nics_per_node": 0},
        "framework": {"name": "deepspeed", "zero_stage": 0},
        "parallelism": {"tp": 2, "pp": 2, "dp": 2},
        "training": {"seq_len": 512, "global_batch_size": 8, "precision": "fp16"}})
    prog = program(s)
    assert prog.meta["optimizer"] == "FP16_Optimizer"
    counts = stage_param_counts(JobContext.from_scenario(s))
    for st, cls in enumerate(prog.classes):
        assert cls.initial_memory["optimizer"] == 12 * counts[st]
        ops = [o for ops in cls.streams.values() for o in ops]
        dp = [o for o in ops if o.kind == "collective" and o.name.endswith("(dp)")]
        assert {o.collective for o in dp} == {"all_reduce"}
        assert sum(o.nbytes for o in dp) == 2 * counts[st]
    assert simulate(s).summary["step_time_s"] > 0
