"""FairScale FSDP: what it communicates, what waits for what, and what it holds in memory.

Expected values come from closed forms of ZeRO-3 sharding and from the waits that
``fairscale/nn/data_parallel/fully_sharded_data_parallel.py`` (commit 146f1602) issues; each
test says which.
"""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim.api import simulate
from sim.fabric.collectives.chain import ring_bytes_per_rank
from sim.frameworks import JobContext, build_program
from sim.frameworks.fairscale.build import (
    bucket_shard_capacity,
    gradient_divide_factors,
    shard_numel,
)
from sim.scenario import ScenarioError
from sim.workload.model import ModelSpec

MIB = 2**20
# 8 layers of 4,195,328 parameters (attention 4 x 512 x 512, SwiGLU 3 x 512 x 2048, two
# norms of 512), an untied 32000-word vocabulary: embedding + final norm + LM head =
# 32,768,512 parameters in the root unit. Every count divides by 8 (no shard padding).
SMALL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
         "vocab": 32000, "mlp": "swiglu"}
LAYER = 4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512
ROOT = 2 * 32000 * 512 + 512


def scenario(framework: dict | None = None, model: object = None, nodes: int = 1,
             gpus: int = 8, nic_gbps: float = 400.0, nccl: dict | None = None,
             cluster: dict | None = None, **training: object):
    return make_scenario(model=SMALL if model is None else model, cluster__gpu="h200",
                         cluster__nodes=nodes, cluster__gpus_per_node=gpus,
                         cluster__nics_per_node=8 if nodes > 1 else 0, cluster__nic_gbps=nic_gbps,
                         **{f"cluster.{k}": v for k, v in (cluster or {}).items()},
                         framework=framework or {"name": "fairscale"}, nccl=nccl or None,
                         **{f"training.{k}": v for k, v in training.items()})


def records(result):
    """Recorded (start, end) of every op of the first step, by op."""
    return {r.op.index: r for r in result.recorder.ops if r.step == 0}


def ops_named(result, prefix: str):
    return [op for op in result.program.ops if op.name.startswith(prefix)]


def test_small_model_counts_match_the_comment() -> None:
    m = ModelSpec.from_ref(scenario().model)
    assert m.layer_params == LAYER == 4_195_328
    assert m.embedding_params + m.norm_params + m.lm_head_params == ROOT
    assert m.total_params == 8 * LAYER + ROOT


def test_initial_memory_is_16_bytes_per_parameter_over_ranks() -> None:
    # fp32 shard (4 B) + fp32 gradient shard (4 B) + AdamW exp_avg and exp_avg_sq (2 x 4 B),
    # each 1/n of the model.
    for gpus in (2, 8):
        s = scenario(gpus=gpus)
        cls = build_program(JobContext.from_scenario(s)).classes[0]
        p = ModelSpec.from_ref(s.model).total_params
        assert sum(cls.initial_memory.values()) == pytest.approx(16 * p / gpus, rel=1e-12)
        assert cls.initial_memory["optimizer"] == pytest.approx(8 * p / gpus, rel=1e-12)


def test_gathers_and_reduce_scatters_move_zero3_bytes() -> None:
    p = 8 * LAYER + ROOT

    def moved(fw: dict) -> tuple[float, float]:
        r = simulate(scenario(fw))
        ag = sum(x.op.nbytes for x in r.recorder.ops if x.op.category == "all_gather")
        rs = sum(x.op.nbytes for x in r.recorder.ops if x.op.category == "reduce_scatter")
        return ag, rs

    # 16-bit gathers: every parameter once in forward, the layers again in backward (the
    # root is not resharded: disable_reshard_on_root); 16-bit gradients reduce-scattered once.
    assert moved({"name": "fairscale"}) == (2 * (p + 8 * LAYER), 2 * p)
    # Without resharding each unit is gathered once per micro-batch.
    assert moved({"name": "fairscale", "reshard_after_forward": False}) == (2 * p, 2 * p)
    # fp32_reduce_scatter doubles only the reduce-scatter bytes; without mixed precision the
    # fp32 weights themselves are gathered.
    assert moved({"name": "fairscale", "fp32_reduce_scatter": True}) == (
        2 * (p + 8 * LAYER), 4 * p)
    assert moved({"name": "fairscale", "mixed_precision": False}) == (4 * (p + 8 * LAYER), 4 * p)
    # FSDP2 in the same dtypes moves the same reduce-scatter bytes; it gathers the embedding
    # again in backward (its own unit, resharded), which FairScale's root keeps.
    ag2, rs2 = moved({"name": "fsdp2", "param_dtype": "bf16", "reduce_dtype": "bf16"})
    ag, rs = moved({"name": "fairscale"})
    assert rs2 == rs
    assert ag2 - ag == 2 * 32000 * 512


def test_on_the_wire_zero3_over_ddp_all_reduce() -> None:
    # Ring collectives: an all-reduce sends 2(n-1)/n of its buffer per rank, an all-gather
    # or reduce-scatter (n-1)/n. DDP all-reduces the fp32 gradients once (2 x 4P); FairScale
    # without mixed precision gathers 4 x (P + layers) and reduce-scatters 4P, so the ratio is
    # (2P + layers) / 2P: just under ZeRO-3's 1.5 because the root is not gathered again.
    p = 8 * LAYER + ROOT
    ring = {"algo": "ring", "proto": "simple"}
    fs = simulate(scenario({"name": "fairscale", "mixed_precision": False}, nccl=ring))
    ddp = simulate(scenario({"name": "ddp"}, nccl=ring))
    assert fs.recorder.transfer_bytes / ddp.recorder.transfer_bytes == pytest.approx(
        (2 * p + 8 * LAYER) / (2 * p), rel=1e-9)
    assert ddp.recorder.transfer_bytes == pytest.approx(
        8 * ring_bytes_per_rank("all_reduce", 4 * p, 8), rel=1e-9)


def test_every_wait_is_the_sources() -> None:
    r = simulate(scenario(global_batch_size=16))   # two micro-batches
    rec = records(r)
    ops = r.program.ops

    def t(op) -> tuple[float, float]:
        return rec[op.index].start, rec[op.index].end

    eps = 1e-12
    for ag in (op for op in ops if op.collective == "all_gather"):
        unit, phase, mb = ag.name.split()[1], ag.name.split()[2], ag.micro_batch
        # _cast_fp32_param_shards_to_fp16: the all_gather stream waits for the cast.
        cast = next(op for op in ops if op.name == f"cast fp32->16-bit shard {unit} {phase} mb{mb}")
        assert t(ag)[0] >= t(cast)[1] - eps
        # _rebuild_full_params ends with current_stream().wait_stream(all_gather): the unit's
        # first compute op waits for its gather.
        if unit == "root":
            first = f"fwd embed mb{mb}"
        else:
            first = (f"fwd attn {unit} mb{mb}" if phase == "(fwd)" else f"bwd mlp {unit} mb{mb}")
        user = next(op for op in ops if op.name == first)
        assert t(user)[0] >= t(ag)[1] - eps, (ag.name, first)
    for rs in (op for op in ops if op.collective == "reduce_scatter"):
        words, mb = rs.name.split(), rs.micro_batch
        units = words[2].split("+") if words[1] == "bucket" else [words[1]]
        for unit in units:
            # _post_backward_hook: post_backward.wait_stream(current_stream) after the
            # unit's backward (the root's gradient is complete only after the embedding's).
            last = f"bwd embed mb{mb}" if unit == "root" else f"bwd attn {unit} mb{mb}"
            bwd = next(op for op in ops if op.name == last)
            assert t(rs)[0] >= t(bwd)[1] - eps
    # _wait_for_post_backward, then the root's _wait_for_previous_optim_step: the second
    # micro-batch's first cast starts after every reduce-scatter of the first one, and the
    # optimizer after every reduce-scatter.
    rs_end = {mb: max(t(op)[1] for op in ops if op.collective == "reduce_scatter"
                      and op.micro_batch == mb) for mb in (0, 1)}
    cast1 = next(op for op in ops if op.name == "cast fp32->16-bit shard root (fwd) mb1")
    assert t(cast1)[0] >= rs_end[0] - eps
    opt = next(op for op in ops if op.category == "optimizer")
    assert t(opt)[0] >= rs_end[1] - eps
    # FairScale's streams, shared by every unit (_setup_streams).
    assert {op.stream for op in ops} == {"compute", "fp32_to_fp16", "all_gather",
                                         "post_backward"}


def test_gathers_run_ahead_as_far_as_the_host_allows() -> None:
    # No wait of the gather streams on the compute stream inside a forward: the next layer's
    # gather starts while the current layer still computes (one node, NVLink). Nothing limits
    # how far ahead: on llama3.2-1b (16 x 121 MB layers), every backward gather is done before
    # the first layer's backward ends, so at that moment the whole model is gathered in
    # 16-bit: the fp32 shard (4P/8) plus 2 bytes x every (padded) parameter. At 2,048 tokens a
    # micro-batch the backward's compute outlasts the host's issue of every gather; at 1,024 an
    # x86 DGX host's in-job op cost (sim.hardware.host.X86_TRAINING_HOST_FACTOR) keeps the last
    # one behind the first layer's backward.
    r = simulate(scenario(model="llama3.2-1b", seq_len=2048))
    rec = records(r)
    m = ModelSpec.from_ref("llama3.2-1b")
    for k in range(m.layers - 1):
        ag_next = ops_named(r, f"all-gather L{k + 1} (fwd)")[0]
        mlp_k = ops_named(r, f"fwd mlp L{k} ")[0]
        assert rec[ag_next.index].start < rec[mlp_k.index].end
    last_bwd_gather = ops_named(r, "all-gather L0 (bwd)")[0]
    first_layer_bwd = ops_named(r, f"bwd attn L{m.layers - 1} ")[0]
    assert rec[last_bwd_gather.index].end < rec[first_layer_bwd.index].end
    padded = sum(shard_numel(u, 8) * 8 for u in
                 [m.embedding_params + m.norm_params + m.lm_head_params]
                 + [m.layer_params] * m.layers)
    peak_params = max(state["parameters"] for _, state in r.recorder.memory[0].series)
    assert peak_params == pytest.approx(4 * m.total_params / 8 + 2 * padded, rel=1e-12)


def test_root_gather_and_reduce_scatter_are_exposed() -> None:
    # The chain the source imposes per micro-batch: root cast -> root all-gather -> embedding
    # forward -> ... every compute-stream op ... -> embedding backward -> root gradient
    # preparation -> root reduce-scatter -> post-reduction -> compute waits -> next
    # micro-batch's root cast (or the optimizer). The step can be no shorter than that chain.
    for nic in (400.0, 25.0):
        r = simulate(scenario(nodes=2, nic_gbps=nic, global_batch_size=32))
        dur = {i: x.end - x.start for i, x in records(r).items()}
        chain = sum(dur[op.index] for op in r.program.ops
                    if op.stream == "compute" or "root" in op.name.split())
        assert r.summary["step_time_s"] >= chain - 1e-12
        # Nothing computes beside the root's reduce-scatter: it is exposed in full.
        root_rs = sum(dur[op.index] for op in ops_named(r, "reduce-scatter root"))
        assert root_rs > 0
        assert r.summary["exposed_comm_s"] >= root_rs - 1e-12


def test_on_a_fast_network_compute_idles_only_where_the_source_waits() -> None:
    # One node (NVLink): a layer's gather (121 MB) is faster than its compute, so every
    # layer's gather and reduce-scatter hides. The compute stream idles only where the source
    # makes it wait with nothing to hide behind: before the embedding (the root's gather,
    # after _wait_for_previous_optim_step), before the first layer (its gather queues behind
    # the root's on the all_gather stream), and in _wait_for_post_backward (the root's
    # gradient is complete only after the embedding's backward, so its reduce-scatter is last).
    r = simulate(scenario(model="llama3.2-1b"))
    comp = sorted((x for x in records(r).values() if x.op.stream == "compute"),
                  key=lambda x: x.start)
    gaps = {}
    prev = 0.0
    for x in comp:
        if x.start - prev > 20e-6:
            gaps[x.op.name] = x.start - prev
        prev = x.end
    assert set(gaps) == {"fwd embed mb0", "fwd attn L0 mb0", "wait for post-backward mb0"}
    root_ag = ops_named(r, "all-gather root (fwd)")[0]
    rec = records(r)
    assert gaps["fwd embed mb0"] >= rec[root_ag.index].end - rec[root_ag.index].start
    # The same model on a slow network (two nodes, 25 Gb/s NICs): gathers fall behind and
    # the compute stream waits before most layers.
    slow = simulate(scenario(model="llama3.2-1b", nodes=2, nic_gbps=25.0))
    comp = sorted((x for x in records(slow).values() if x.op.stream == "compute"),
                  key=lambda x: x.start)
    waits = sum(1 for a, b in zip(comp, comp[1:], strict=False) if b.start - a.end > 20e-6)
    assert waits > ModelSpec.from_ref("llama3.2-1b").layers


def test_reshard_saves_memory_only_when_gathers_cannot_run_ahead() -> None:
    m = ModelSpec.from_ref("llama3.2-1b")
    gathered_layers = 2 * m.layers * m.layer_params
    # Slow network (25 Gb/s per NIC, 2 nodes): gathers fall behind compute, so the layers
    # freed after their forward are not all back when backward starts.
    slow = {ra: simulate(scenario({"name": "fairscale", "reshard_after_forward": ra},
                                  model="llama3.2-1b", nodes=2, nic_gbps=25.0))
            for ra in (True, False)}
    saved = slow[False].recorder.memory[0].peak - slow[True].recorder.memory[0].peak
    assert 0 < saved <= gathered_layers
    # Fast network: backward gathers catch up with all of it (see the run-ahead test, whose
    # micro-batch this is), so the peaks differ by at most one unit's 16-bit shard in flight.
    fast = {ra: simulate(scenario({"name": "fairscale", "reshard_after_forward": ra},
                                  model="llama3.2-1b", seq_len=2048)).recorder.memory[0].peak
            for ra in (True, False)}
    assert abs(fast[True] - fast[False]) <= 2 * shard_numel(m.layer_params, 8) + 1


def test_bucketer_groups_small_gradients() -> None:
    # ReduceScatterBucketer: 25 MiB of bf16 over 8 ranks = 1,638,400 elements per rank. A
    # layer's chunk is LAYER / 8 = 524,416: three fit (1,573,248), a fourth does not, so the
    # bucket is flushed when it arrives. The root's chunk (4,096,064) is larger than a bucket
    # and is reduce-scattered directly, without flushing; the last two layers go at the final
    # flush of _wait_for_post_backward.
    cap = bucket_shard_capacity(2, 8)
    assert cap == 25 * MIB // 2 // 8
    chunk = LAYER // 8
    assert 3 * chunk <= cap < 4 * chunk and ROOT // 8 > cap
    r = simulate(scenario())
    rs = [op for op in r.program.ops if op.collective == "reduce_scatter"]
    assert [op.name for op in rs] == [
        "reduce-scatter bucket L7+L6+L5 mb0", "reduce-scatter bucket L4+L3+L2 mb0",
        "reduce-scatter root mb0", "reduce-scatter bucket L1+L0 mb0"]
    assert [op.nbytes for op in rs] == [2 * 3 * LAYER, 2 * 3 * LAYER, 2 * ROOT, 2 * 2 * LAYER]
    # Bucket buffers (data world x shard + one output shard) live through the backward.
    bucket = 2 * cap * 9
    buffers = [state["buffers"] for _, state in r.recorder.memory[0].series]
    assert max(buffers) >= bucket
    # In fp32 a bucket holds 819,200 elements per rank: one layer at a time.
    r32 = simulate(scenario({"name": "fairscale", "fp32_reduce_scatter": True}))
    assert bucket_shard_capacity(4, 8) < 2 * chunk
    names = [op.name for op in r32.program.ops if op.collective == "reduce_scatter"]
    assert names[:2] == ["reduce-scatter bucket L7 mb0", "reduce-scatter bucket L6 mb0"]
    assert len(names) == 9


def test_gradient_accumulation_reduce_scatters_every_micro_batch() -> None:
    # Without no_sync() FairScale reduce-scatters after every micro-batch's backward and
    # gathers again in every forward: bytes scale with the micro-batch count.
    one = simulate(scenario(model="llama3.2-1b"))
    four = simulate(scenario(model="llama3.2-1b", global_batch_size=32))
    assert four.program.micro_batches == 4

    def total(r, cat: str) -> float:
        return sum(x.op.nbytes for x in r.recorder.ops if x.op.category == cat)

    for cat in ("all_gather", "reduce_scatter"):
        assert total(four, cat) == pytest.approx(4 * total(one, cat), rel=1e-12)


@pytest.mark.parametrize("framework,training", [
    ({"name": "fairscale"}, {}),
    ({"name": "fairscale", "reshard_after_forward": False}, {"global_batch_size": 16}),
    ({"name": "fairscale", "mixed_precision": False}, {}),
    ({"name": "fairscale", "fp32_reduce_scatter": True}, {"activation_checkpointing": "full"}),
])
def test_memory_returns_to_its_start_after_a_step(framework: dict, training: dict) -> None:
    for gpus in (1, 8):
        r = simulate(scenario(framework, gpus=gpus, **training))
        start = sum(r.program.classes[0].initial_memory.values())
        assert r.recorder.memory[0].total == pytest.approx(start, rel=1e-9, abs=1.0)


def test_single_gpu_has_no_collectives() -> None:
    p = build_program(JobContext.from_scenario(scenario(gpus=1)))
    assert not [op for op in p.ops if op.kind == "collective"]
    assert p.ops[-1].category == "optimizer"


def test_gradient_divide_factors_average_over_the_world() -> None:
    # _get_gradient_predivide_factor's loop run by hand: the factor doubles while it divides
    # the world and world / factor > factor (2: 1 -> 2; 8: 1 -> 2 -> 4; 24: 1 -> 2 -> 4 -> 8);
    # the post-division factor is the rest.
    expected = {1: (1, 1), 2: (2, 1), 8: (4, 2), 16: (4, 4), 24: (8, 3), 64: (8, 8)}
    for world, (pre, post) in expected.items():
        assert gradient_divide_factors(world) == (pre, post)


def test_bad_input_is_refused_naming_the_key() -> None:
    s = make_scenario({"model": SMALL, "cluster": {"gpus_per_node": 8, "nics_per_node": 0},
                       "framework": {"name": "fairscale"}, "parallelism": {"tp": 2}})
    with pytest.raises(ScenarioError, match="parallelism"):
        build_program(JobContext.from_scenario(s))
    s = scenario({"name": "fairscale", "mixed_precision": False, "fp32_reduce_scatter": True})
    with pytest.raises(ScenarioError, match="framework.fp32_reduce_scatter"):
        build_program(JobContext.from_scenario(s))
    s = scenario(precision="fp32")
    with pytest.raises(ScenarioError, match="training.precision"):
        build_program(JobContext.from_scenario(s))
