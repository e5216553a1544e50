"""FSDP2 as torchtitan runs it: HSDP, CPU offload, and tensor, pipeline and context parallelism
around it, against closed forms derived from what the source code issues."""

from __future__ import annotations

import pytest
from conftest import SMALL_MODEL, make_scenario
from helpers import program

from sim.api import simulate
from sim.fabric.collectives.chain import ring_bytes_per_rank
from sim.fabric.topology import NETWORK, PCIE
from sim.frameworks.fsdp2.mesh import stage_layers
from sim.hardware.host import HostSpec, cpu_adam_s
from sim.scenario import ScenarioError
from sim.workload.model import ModelSpec

SMALL = SMALL_MODEL
GIB = 2**30


def scenario(framework: dict | None = None, par: dict | None = None, nodes: int = 1,
             gpus: int = 8, model: dict | None = None, nccl: dict | None = None,
             nvlink: float | None = None, **training):
    return make_scenario(model=model or SMALL, cluster__nodes=nodes, cluster__gpus_per_node=gpus,
                         cluster__nics_per_node=8 if nodes > 1 else 0,
                         cluster__nvlink_gbytes_per_s=nvlink or None,
                         framework={"name": "fsdp2", **(framework or {})},
                         parallelism=par or {}, nccl=nccl or {},
                         **{f"training.{k}": v for k, v in training.items()})


def spec(s) -> ModelSpec:
    return ModelSpec.from_ref(s.model, s.training.seq_len)


# --------------------------------------------------------------------------- HSDP
def test_hsdp_reduce_scatters_in_the_node_and_all_reduces_the_shard_across_replicas() -> None:
    # 2 nodes x 8 GPUs, shard groups of 8: foreach_reduce reduce-scatters the fp32 gradient
    # (4 B/param) inside each node, then all-reduces the reduced 1/8 across the 2 replicas,
    # every micro-batch (torchtitan leaves requires_all_reduce on).
    s = scenario({"hsdp_shard_size": 8}, nodes=2, nccl={"proto": "simple"},
                 global_batch_size=32)
    r = simulate(s)
    p = r.program
    n = spec(s).total_params
    mbs = p.micro_batches
    assert mbs == 2
    rs = [op for op in p.ops if op.collective == "reduce_scatter"]
    ar = [op for op in p.ops if op.collective == "all_reduce"]
    ag = [op for op in p.ops if op.collective == "all_gather"]
    assert sum(op.nbytes for op in rs) == pytest.approx(4 * n * mbs)
    assert sum(op.nbytes for op in ar) == pytest.approx(4 * n / 8 * mbs)
    assert len(ar) == len(rs)
    assert {op.all_groups for op in rs + ag} == {(tuple(range(8)), tuple(range(8, 16)))}
    assert {op.all_groups for op in ar} == {tuple((i, i + 8) for i in range(8))}
    assert {op.stream for op in ar} == {"ar"} and all(op.deps[0] in rs for op in ar)
    # Only the all-reduce leaves the node: every byte its 2-rank ring sends crosses the
    # network links between two GPUs of different nodes (Simple protocol: no wire overhead).
    hops = sum(1 for link in r.fabric.route(0, 8) if r.fabric.kind[link] == NETWORK)
    sent = sum(ring_bytes_per_rank("all_reduce", op.nbytes, 2) * 16 for op in ar)
    assert r.summary["bytes"]["network"] == pytest.approx(sent * hops, rel=1e-9)


def test_hsdp_states_shard_over_the_shard_group_not_dp() -> None:
    # fp32 parameters, gradients and two AdamW moments: 16 B per parameter over s ranks.
    n = spec(scenario()).total_params
    peaks = {}
    for shard in (4, 8):
        s = scenario({"hsdp_shard_size": shard}, nodes=2)
        mem = program(s).classes[0].initial_memory
        assert sum(mem.values()) == pytest.approx(16 * n / shard)
        peaks[shard] = simulate(s).summary["peak_memory_gib"]
    assert peaks[4] - peaks[8] == pytest.approx(16 * n * (1 / 4 - 1 / 8) / GIB, rel=0.02)


def test_bad_layouts_are_refused_naming_the_key() -> None:
    with pytest.raises(ScenarioError, match="framework.hsdp_shard_size"):
        program(scenario({"hsdp_shard_size": 6}, nodes=2))
    with pytest.raises(ScenarioError, match="parallelism.tp"):
        program(scenario(par={"tp": 3}, gpus=6))            # 16 heads
    with pytest.raises(ScenarioError, match="parallelism.tp"):
        program(scenario(par={"tp": 8}))                    # 4 key/value heads
    with pytest.raises(ScenarioError, match="training.seq_len"):
        program(scenario(par={"cp": 4}, seq_len=1028))      # not a multiple of 2 x cp
    with pytest.raises(ScenarioError, match="training.global_batch_size"):
        program(scenario(par={"pp": 4}, global_batch_size=4))  # 1F1B: 2 < pp micro-batches


# --------------------------------------------------------------------------- TP
@pytest.mark.parametrize("ac,per_layer", [("none", 8), ("full", 12)])
def test_tensor_parallel_gathers_and_scatters_twice_per_block_and_pass(ac, per_layer) -> None:
    # apply_tp with sequence parallelism: per block an all-gather of the normalised input and
    # a reduce-scatter of the rowwise output, both of the full [b, s, h] bf16 activation,
    # in forward and mirrored in backward (2 blocks x 2 x 2 = 8); recomputation repeats the
    # forward's four.
    s = scenario(par={"tp": 4}, activation_checkpointing=ac, micro_batch_size=2)
    p = program(s)
    m = spec(s)
    act = 2 * 2 * 1024 * m.hidden
    for layer in range(m.layers):
        tp = [op for op in p.ops if op.layer == layer and op.kind == "collective"
              and op.stream == "compute"]
        assert len(tp) == per_layer
        assert sum(op.collective == "all_gather" for op in tp) == per_layer // 2
        assert all(op.nbytes == act for op in tp)
        assert {op.all_groups for op in tp} == {((0, 1, 2, 3), (4, 5, 6, 7))}


def test_tensor_parallel_fsdp_shards_the_local_shard_over_dp() -> None:
    # FSDP over the dp mesh dimension shards each rank's DTensor local shard: 1/tp of every
    # linear (and of the vocabulary), the norms replicated.
    t, dp = 2, 4
    s = scenario(par={"tp": t})
    m = spec(s)
    h, v = m.hidden, m.vocab
    local = (v * h / t + m.layers * ((m.layer_params - 2 * h) / t + 2 * h) + h + v * h / t)
    p = program(s)
    assert sum(p.classes[0].initial_memory.values()) == pytest.approx(16 * local / dp)
    fsdp_ag = [op for op in p.ops if op.stream == "ag" and "L0 (fwd)" in op.name]
    assert fsdp_ag[0].nbytes == 2 * ((m.layer_params - 2 * h) / t + 2 * h)
    assert fsdp_ag[0].all_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


# --------------------------------------------------------------------------- PP
def test_pipeline_split_follows_torchtitan() -> None:
    # _generate_llm_fqn_per_model_part's own example: 3 layers over 2 stages with the
    # embedding and the output each weighted as 2 layers.
    assert stage_layers(3, 2, 2, 2) == [[0, 1], [2]]
    assert stage_layers(8, 4) == [[0, 1], [2, 3, 4], [5, 6], [7]]
    assert stage_layers(8, 4, 0, 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]


DEEP = {"layers": 16, "hidden": 2048, "heads": 16, "ffn_hidden": 8192, "vocab": 1024,
        "mlp": "swiglu"}
BALANCED = {"pipeline_first_stage_less_layers": 0, "pipeline_last_stage_less_layers": 0}


def pipeline(p: int, m: int, vp: int = 1, framework: dict | None = None):
    return scenario({**BALANCED, **(framework or {})}, {"pp": p, "dp": 1, "vp": vp},
                    gpus=p, model=DEEP, nvlink=45000, seq_len=2048, global_batch_size=m)


@pytest.mark.parametrize("p,m", [(4, 4), (4, 16), (2, 8)])
def test_1f1b_bubble_matches_the_closed_form(p: int, m: int) -> None:
    # Near-free communication (fat NVLink, one rank per stage, nothing to shard): the idle
    # share of the pipeline phase is (p-1)/(m+p-1) (Narayanan et al., 2021). The summary's
    # bubble is a share of the whole step, which also holds the optimizer: rescale.
    r = simulate(pipeline(p, m))
    crit = max(r.program.classes, key=lambda c: max(x.end for x in r.recorder.ops
                                                    if x.cls == c.id)).id
    end = max(x.end for x in r.recorder.ops
              if x.cls == crit and x.op.phase in ("fwd", "bwd", "recompute"))
    got = r.summary["bubble_fraction"] * r.summary["step_time_s"] / end
    assert got == pytest.approx((p - 1) / (m + p - 1), abs=0.02)


@pytest.mark.parametrize("p,m,rounds", [(4, 4, 4), (2, 4, 2)])
def test_local_batch_rounds_each_pay_the_bubble(p: int, m: int, rounds: int) -> None:
    """torchtitan's and AutoModel's train loops run one pipeline schedule per
    gradient-accumulation step (``local_batch_size / micro_batch_size`` micro-batches):
    each of the ``rounds`` schedules fills and drains the pipeline, so the pipeline phase is
    ``rounds x (m + p - 1)`` micro-batch times against ``rounds x m + p - 1`` for one
    schedule over the same batch (Narayanan et al., 2021)."""
    one = simulate(pipeline(p, m * rounds))
    many = simulate(pipeline(p, m * rounds, framework={"local_batch_size": m}))

    def phase(r) -> float:
        return max(x.end for x in r.recorder.ops if x.op.phase in ("fwd", "bwd", "recompute"))
    ratio = phase(many) / phase(one)
    assert ratio == pytest.approx(rounds * (m + p - 1) / (rounds * m + p - 1), rel=0.03)

def test_each_local_batch_reduces_and_gathers_again() -> None:
    """Two schedules of two micro-batches (pp 2, dp 4): each ends in the chunk's
    post_backward (reduce-scatter, reshard), so every unit is gathered and reduced twice."""
    s = scenario({"local_batch_size": 2}, {"pp": 2, "dp": 4}, global_batch_size=16)
    for cls in program(s).classes:
        ops = [op for stream in cls.streams.values() for op in stream]
        rs = [op for op in ops if op.collective == "reduce_scatter"]
        ag = [op for op in ops if op.collective == "all_gather"]
        assert {op.micro_batch for op in rs} == {1, 3}
        assert {op.micro_batch for op in ag} == {0, 2}
        assert len(rs) == len(ag) == 2 * len({op.name.split()[1] for op in rs})


@pytest.mark.parametrize("fw, par, match", [
    ({"local_batch_size": 3}, {"pp": 2}, "multiple of training.micro_batch_size|divide"),
    ({"local_batch_size": 4}, {"pp": 1}, "needs parallelism.pp > 1"),
])
def test_local_batch_size_is_checked(fw: dict, par: dict, match: str) -> None:
    with pytest.raises(ScenarioError, match="framework.local_batch_size"):
        program(scenario(fw, {"dp": 1, **par}, gpus=par["pp"], model=DEEP,
                         global_batch_size=8))


def test_interleaving_shrinks_the_bubble_and_gpipe_holds_every_micro_batch() -> None:
    plain = simulate(pipeline(4, 8))
    inter = simulate(pipeline(4, 8, vp=2))
    gpipe = simulate(pipeline(4, 8, framework={"pipeline_schedule": "gpipe"}))
    assert inter.summary["bubble_fraction"] < plain.summary["bubble_fraction"]
    # Activations of the first stage: GPipe keeps all m micro-batches in flight, 1F1B at
    # most p (Narayanan et al., 2021, sec. 2.2).
    act = [max(c["activations"] for _, c in r.recorder.memory[0].series)
           for r in (gpipe, plain)]
    assert act[0] / act[1] == pytest.approx(8 / 4, rel=0.05)


def test_pipeline_reduce_scatters_once_per_step() -> None:
    # The pipelining stage turns off gradient sync and resharding for every backward and runs
    # post_backward once after the chunk's last backward; torchtitan's default policy does
    # not reshard after forward with PP: one all-gather and one reduce-scatter per unit.
    mbs = 4
    s = scenario(par={"pp": 2, "dp": 4}, global_batch_size=4 * mbs)
    p = program(s)
    assert p.micro_batches == mbs
    for cls in p.classes:
        ops = [op for stream in cls.streams.values() for op in stream]
        rs = [op for op in ops if op.collective == "reduce_scatter"]
        ag = [op for op in ops if op.collective == "all_gather"]
        units = {op.name.split()[1] for op in rs}
        assert len(rs) == len(units) == len(ag)
        assert {op.micro_batch for op in rs} == {mbs - 1}
        assert {op.micro_batch for op in ag} == {0}
    # The unsharded gradients accumulate in fp32 (to_accumulated_grad_if_needed) until then:
    # at least 4 B per parameter of the stage on top of the 4 B sharded fp32 gradient.
    r = simulate(s)
    stage = sum(op.nbytes / 4 for op in p.ops if op.collective == "reduce_scatter"
                and op.key.startswith("fsdp2/0/"))
    grads = r.recorder.memory[0].peak_breakdown["gradients"]
    assert grads >= 4 * stage + 4 * stage / 4
    # Resharding after forward asked for explicitly: every backward gathers again, while
    # the parameters its backward left gathered (reshard_after_backward off) serve the next
    # forward: units x (1 + micro-batches) all-gathers per step.
    again = program(scenario({"reshard_after_forward": True}, par={"pp": 2, "dp": 4},
                             global_batch_size=4 * mbs))
    ag = [op for op in again.classes[0].streams["ag"]]
    assert len(ag) == 3 * (1 + mbs)        # embedding, layers 0 and 1


# --------------------------------------------------------------------------- CP
def test_context_parallel_ring_exchanges_and_fsdp_over_dp_x_cp() -> None:
    cp, dp = 2, 4
    s = scenario(par={"cp": cp})
    p = program(s)
    m = spec(s)
    # bf16 keys and values of the local chunk, heads wide: torchtitan repeats the key/value
    # heads before SDPA (repeat_kv, until 2026; the default torch_version 2.8 is before that).
    local_kv = 2 * (1024 // cp) * m.q_dim * 2
    layer = [op for op in p.ops if op.layer == 1 and op.stream == "cp"]
    gathers = [op for op in layer if op.collective == "all_gather"]
    shifts = [op for op in layer if op.kind == "send"]
    # allgather rotater: once in forward, once in backward, cp chunks each; the fp32 key/value
    # gradients are shifted round the ring once per step.
    assert [op.nbytes for op in gathers] == [cp * local_kv] * 2
    assert [op.nbytes for op in shifts] == [2 * local_kv] * cp
    assert {op.pairs for op in shifts} == {tuple((g, g ^ 1) for g in range(8))}
    # FSDP's mesh is dp_shard x cp flattened: states shard over all 8 ranks.
    rs = [op for op in p.ops if op.collective == "reduce_scatter"]
    assert {len(g) for op in rs for g in op.all_groups} == {dp * cp}
    assert sum(p.classes[0].initial_memory.values()) == pytest.approx(
        16 * m.total_params / (dp * cp))
    # alltoall rotater: cp-1 shifts of the local keys and values in forward.
    a2a = program(scenario({"cp_rotate_method": "alltoall"}, par={"cp": 4}))
    fwd = [op for op in a2a.ops if op.layer == 1 and op.kind == "send"
           and "K/V" in op.name and "bwd" not in op.name and "dK" not in op.name]
    assert len(fwd) == 4 - 1


# --------------------------------------------------------------------------- offload
def test_cpu_offload_moves_states_to_the_host_and_copies_over_pcie() -> None:
    on = scenario(global_batch_size=16)
    off = scenario({"cpu_offload": True}, global_batch_size=16)
    r_on, r_off = simulate(on), simulate(off)
    n = spec(on).total_params
    ranks = 8
    # GPU memory drops by the fp32 shards (parameters, gradients) and both AdamW moments.
    drop = (r_on.summary["peak_memory_gib"] - r_off.summary["peak_memory_gib"]) * GIB
    assert drop == pytest.approx(16 * n / ranks, rel=0.05)
    # PCIe carries what CPUOffloadPolicy copies: the fp32 shard of every unit before each
    # all-gather (its bf16 output is 2 B per parameter) and the fp32 reduced shard after each
    # reduce-scatter (fp32 input, 4 B per parameter), each over its host route.
    p = r_off.program
    fab = r_off.fabric
    h2d_hops = sum(1 for link in fab.route_from_host(0) if fab.kind[link] == PCIE)
    d2h_hops = sum(1 for link in fab.route_to_host(0) if fab.kind[link] == PCIE)
    h2d = sum(4 * op.nbytes / 2 / ranks for op in p.ops if op.collective == "all_gather")
    d2h = sum(4 * op.nbytes / 4 / ranks for op in p.ops if op.collective == "reduce_scatter")
    expected = ranks * (h2d * h2d_hops + d2h * d2h_hops)
    assert r_off.summary["bytes"]["pcie"] == pytest.approx(expected, rel=1e-9)
    assert r_on.summary["bytes"]["pcie"] == 0
    # torch.optim.AdamW steps the host shard on the CPU.
    opt = [op for op in p.ops if op.phase == "optimizer" and op.stream == "cpu"]
    assert opt[0].duration == pytest.approx(
        cpu_adam_s(HostSpec.from_scenario(off), n / ranks, "torch"))


# --------------------------------------------------------------------------- all layouts
LAYOUTS = [
    ({"hsdp_shard_size": 4}, {}, 2),
    ({}, {"tp": 2}, 1),
    ({"compile": True}, {"tp": 2, "cp": 2}, 1),
    ({"cp_rotate_method": "alltoall"}, {"cp": 4}, 1),
    ({}, {"pp": 2, "vp": 2}, 1),
    ({"pipeline_schedule": "gpipe", "reduce_dtype": "bf16"}, {"pp": 2, "tp": 2}, 1),
    ({"cpu_offload": True, "hsdp_shard_size": 8}, {}, 2),
]


@pytest.mark.parametrize("framework,par,nodes", LAYOUTS)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_returns_to_its_start_after_a_step(framework, par, nodes, ac) -> None:
    r = simulate(scenario(framework, par, nodes=nodes, activation_checkpointing=ac,
                          global_batch_size=8 * nodes * 2 // (par.get("tp", 1)
                                                              * par.get("cp", 1))))
    for cls in r.program.classes:
        end = r.recorder.memory[cls.id].total
        assert end == pytest.approx(sum(cls.initial_memory.values()), rel=1e-9, abs=1.0)


@pytest.mark.parametrize("par", [{}, {"tp": 2}])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_eager_rmsnorm_of_older_torch_keeps_the_checkpointed_input(par, ac) -> None:
    """Before PyTorch's fused RMSNorm (torch_version < 2.8) torchtitan's norm is eager and
    saves an fp32 copy of its input rather than the input; a checkpointed layer still holds
    its input (torch.utils.checkpoint keeps the function's inputs), so the layer's memory is
    the fused norm's plus that copy's extra, and every byte comes back by the step's end."""
    runs = {v: simulate(scenario({}, par, activation_checkpointing=ac, torch_version=v,
                                 global_batch_size=16 // par.get("tp", 1)))
            for v in ("2.6", "2.8")}
    for r in runs.values():
        for cls in r.program.classes:
            end = r.recorder.memory[cls.id].total
            assert end == pytest.approx(sum(cls.initial_memory.values()), rel=1e-9, abs=1.0)
    # The eager norm runs more kernels (casts, pow, mean, rsqrt, products) than one fused.
    assert runs["2.6"].summary["step_time_s"] > runs["2.8"].summary["step_time_s"]
    # Its peak is not below the fused one's: the checkpoint's input is held either way.
    assert runs["2.6"].summary["peak_memory_gib"] >= runs["2.8"].summary["peak_memory_gib"]


def test_compile_fuses_under_tensor_parallelism_too() -> None:
    for par in ({}, {"tp": 2}):
        eager = simulate(scenario({}, par, seq_len=4096)).summary
        compiled = simulate(scenario({"compile": True}, par, seq_len=4096)).summary
        assert compiled["step_time_s"] < eager["step_time_s"]
        assert compiled["peak_memory_gib"] <= eager["peak_memory_gib"]


# --------------------------------------------------------------------------- selective AC
def test_op_sac_recomputes_every_second_matmul_of_each_layer() -> None:
    # torchtitan's op-level SAC counts a layer's matmuls in forward order (q, k, v, o, gate,
    # up, down) and recomputes the even ones: k, o and up run again in backward, attention
    # and the odd matmuls do not. Extra hardware FLOPs per step = layers x micro-batches x
    # dp x 2 x tokens x (h x kv_dim + q_dim x h + h x ffn).
    s = scenario(activation_checkpointing="selective", micro_batch_size=2)
    p = program(s)
    m = spec(s)
    tokens = 2 * 1024
    per_layer = 2 * tokens * (m.hidden * m.kv_dim + m.q_dim * m.hidden
                              + m.hidden * m.ffn_hidden)
    dp = 8
    extra = p.hw_flops_per_step - p.model_flops_per_step
    assert extra == pytest.approx(m.layers * p.micro_batches * dp * per_layer)


def test_op_sac_memory_and_time_sit_between_none_and_full() -> None:
    # Memory: the layer input plus the cached outputs (q, v, attention out and logsumexp,
    # gate, down) lie between nothing recomputed and only the input kept; time: recomputing
    # three of seven matmuls and the elementwise ops costs less than the whole layer.
    runs = {ac: simulate(scenario(activation_checkpointing=ac, micro_batch_size=4)).summary
            for ac in ("none", "selective", "full")}
    mem = {ac: r["peak_memory_breakdown_gib"]["activations"] for ac, r in runs.items()}
    step = {ac: r["step_time_s"] for ac, r in runs.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert step["none"] < step["selective"] < step["full"]
    # Memory returns to its start after the step.
    r = simulate(scenario(activation_checkpointing="selective", micro_batch_size=4))
    for track in r.recorder.memory.values():
        assert track.current.get("activations", 0.0) == pytest.approx(0.0, abs=1.0)


def test_op_sac_with_tensor_parallelism_recomputes_local_matmuls_and_all_gathers() -> None:
    # Under TP the policy sees each rank's local matmuls (1/tp of the widths) and the
    # functional collectives: reduce-scatters are saved, all-gathers re-run. Extra hardware
    # FLOPs are the same every-second-matmul closed form as without TP (each of the tp ranks
    # re-runs 1/tp of it); the recompute re-issues exactly two all-gathers per layer and
    # micro-batch (before attention and before the MLP), and no reduce-scatter.
    tp = 2
    s = scenario(par={"tp": tp}, activation_checkpointing="selective", micro_batch_size=2)
    p = program(s)
    m = spec(s)
    tokens = 2 * 1024
    per_layer = 2 * tokens * (m.hidden * m.kv_dim + m.q_dim * m.hidden
                              + m.hidden * m.ffn_hidden)
    extra = p.hw_flops_per_step - p.model_flops_per_step
    dp = 8 // tp
    assert extra == pytest.approx(m.layers * p.micro_batches * dp * per_layer)
    ops = [o for ops_ in p.classes[0].streams.values() for o in ops_]
    again = [o for o in ops if o.kind == "collective" and "(recompute)" in o.name]
    assert {o.collective for o in again} == {"all_gather"}
    assert len(again) == 2 * m.layers * p.micro_batches
    assert all(len(o.group) == tp for o in again)


def test_op_sac_with_tp_and_cp_sits_between_none_and_full_and_frees_what_it_keeps() -> None:
    # The ring attention is one saved op: nothing of the ring re-runs, so the context-
    # parallel exchanges happen as often as without checkpointing, fewer than with full
    # recomputation (which re-runs the whole layer, ring included).
    par = {"tp": 2, "cp": 2}
    runs = {ac: simulate(scenario(par=par, activation_checkpointing=ac, micro_batch_size=2))
            for ac in ("none", "selective", "full")}
    mem = {ac: r.summary["peak_memory_breakdown_gib"]["activations"] for ac, r in runs.items()}
    step = {ac: r.summary["step_time_s"] for ac, r in runs.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert step["none"] < step["selective"] < step["full"]
    cp_ops = {ac: len(r.program.classes[0].streams.get("cp", []))
              for ac, r in runs.items()}
    assert cp_ops["selective"] == cp_ops["none"] < cp_ops["full"]
    for track in runs["selective"].recorder.memory.values():
        assert track.current.get("activations", 0.0) == pytest.approx(0.0, abs=1.0)


# --------------------------------------------------------------------------- float8
def test_float8_runs_fp8_gemms_in_the_blocks_but_not_the_output_layer() -> None:
    # torchtitan's float8 converter swaps every nn.Linear but `output` for torchao's
    # Float8Linear: 7 linears per Llama layer x 3 GEMMs run on FP8 operands; the LM head's
    # stay bf16. Autograd keeps the bf16 inputs (torchao saves the high-precision tensors),
    # so activation memory is unchanged; the step is faster, by less than the 2x of the
    # GEMM peaks (casts, attention, norms and communication stay as they were).
    from sim.workload.layer_ops import Style, model_blocks

    m = spec(scenario())
    _, attn, mlp, head = model_blocks(m, Style("bf16", float8=True), 1, 1024, False)
    fp8 = [k for b in (attn, mlp) for k in b.forward + b.backward if k.fp8]
    assert len(fp8) == 7 * 3
    assert not any(k.fp8 for k in head.forward + head.backward)
    # Llama 3 8B widths (float8 pays off only on large GEMMs: torchao's own guidance), two
    # layers to keep the test fast.
    wide = {"layers": 2, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336,
            "vocab": 8192, "mlp": "swiglu", "tied_embeddings": False}
    results = {p: simulate(scenario(model=wide, precision=p, micro_batch_size=2,
                                    seq_len=4096)) for p in ("bf16", "fp8")}
    runs = {p: r.summary for p, r in results.items()}
    assert runs["bf16"]["step_time_s"] / 2 < runs["fp8"]["step_time_s"] \
        < runs["bf16"]["step_time_s"]

    # The activations' own peak over the step (the breakdown at the total peak depends on
    # which gathered parameters happen to be alive then, i.e. on timing).
    def activation_peak(p: str) -> float:
        return max(c["activations"] for tr in results[p].recorder.memory.values()
                   for _, c in tr.series)

    assert activation_peak("fp8") == pytest.approx(activation_peak("bf16"))


def test_float8_all_gather_halves_the_blocks_gathers_and_drops_the_weight_casts() -> None:
    # torchao's FSDP float8 all-gather casts each shard to E4M3 before the gather: every
    # transformer block's all-gather moves 1 byte per parameter instead of bf16's 2 (the
    # embedding and output units stay bf16), and the linears cast no weights themselves.
    from sim.workload.layer_ops import Style, model_blocks

    def gathers(ag: bool) -> dict[str, float]:
        p = program(scenario({"float8_all_gather": ag}, precision="fp8"))
        return {o.name: o.nbytes for o in p.ops if o.collective == "all_gather"}

    plain, fp8 = gathers(False), gathers(True)
    assert plain.keys() == fp8.keys()
    for name, nbytes in plain.items():
        unit = name.split()[1]
        assert fp8[name] == (nbytes / 2 if unit.startswith("L") else nbytes), name
    m = spec(scenario())
    _, attn, _, _ = model_blocks(m, Style("bf16", float8=True, float8_weights=True), 1,
                                 1024, False)
    assert not [k for k in attn.forward + attn.backward if "cast_w" in k.name]
    with pytest.raises(ScenarioError, match="framework.float8_all_gather"):
        program(scenario({"float8_all_gather": True}))


# --------------------------------------------------------------------------- fused loss
def test_a_fused_cross_entropy_is_faster_and_smaller_than_torchs_and_refused_with_tp() -> None:
    # flash-attn's xentropy on the bf16 logits (llm-foundry's default loss): no fp32 copy of
    # the logits, so the step is shorter and the peak lower; with tp > 1 the logits are
    # vocabulary-sharded (torch's loss_parallel), which a fused kernel is not modelled for.
    torch_ce, fused = (simulate(scenario({"cross_entropy": ce})).summary
                       for ce in ("torch", "fused"))
    assert fused["step_time_s"] < torch_ce["step_time_s"]
    assert fused["peak_memory_gib"] < torch_ce["peak_memory_gib"]
    with pytest.raises(ScenarioError, match="framework.cross_entropy"):
        simulate(scenario({"cross_entropy": "fused"}, par={"tp": 2}))
    cp = simulate(scenario({"cross_entropy": "fused"}, par={"cp": 2}, seq_len=256)).summary
    assert cp["step_time_s"] < simulate(scenario(par={"cp": 2}, seq_len=256)).summary[
        "step_time_s"]
