"""torchtitan's FSDP2 + expert parallelism (issue 14 item 3): the all-to-alls, the expert FSDP
units over the ``efsdp`` mesh, explicit prefetching, load balancing and memory.

Independent truths: the closed form of issue 14 (balanced routing: all-to-all bytes one rank
sends per MoE layer per pass = 2 x tokens x top-k x hidden x bytes x (ep - 1) / ep);
torchtitan v0.2.2's ``ParallelDims.build_mesh`` (sparse mesh ``[pp, dp_replicate, efsdp, ep,
etp]``, row-major, ``efsdp = dp_shard x cp x tp / ep``) and ``apply_fsdp`` (routed experts
reduce-scattered over efsdp, the rest over dp_shard x cp); the model's parameter count
(every parameter sharded exactly once over the world: 4 B fp32 master each);
``ExpertParallel._token_dispatch`` (int64 counts of every expert exchanged, then a
device-to-host sync); ``build_optimizers_with_moe_load_balancing`` (one fp32 row of experts
per MoE layer all-reduced over the loss mesh).
"""

from __future__ import annotations

import pytest
from conftest import make_scenario
from helpers import program

from sim.api import simulate
from sim.config.training import Routing
from sim.scenario import Scenario, ScenarioError
from sim.workload.model import ModelSpec

# A small MoE model: 4 layers, 8 experts of width 1024, top-2 (softmax router, dropless).
TINY = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
        "vocab": 32000, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 1024}
SEQ = 2048
H, K, BF16 = 1024, 2, 2


def _scn(ep: int, nodes: int = 2, gbs: int = 32, model: dict | None = None,
         framework: dict | None = None, par: dict | None = None, **training) -> Scenario:
    tr = {"training.seq_len": SEQ, "training.micro_batch_size": 1,
          "training.global_batch_size": gbs}
    tr.update({f"training.{k}": v for k, v in training.items()})
    return make_scenario(model=model or TINY, cluster__nodes=nodes, cluster__gpus_per_node=8,
                         cluster__nics_per_node=8 if nodes > 1 else 0,
                         framework={"name": "fsdp2", **(framework or {})},
                         parallelism={"ep": ep, **(par or {})}, **tr)


def _ops(p):
    return [op for c in p.classes for ops in c.streams.values() for op in ops]


def _wire(op) -> float:
    """Bytes one member puts on the wire: its buffer less its own chunk (balanced)."""
    n = len(op.all_groups[0])
    return op.nbytes * (n - 1) / n


def _token_a2a(p):
    return [op for op in _ops(p) if op.collective == "all_to_all" and "count" not in op.name]


@pytest.mark.parametrize(("ep", "ckpt", "passes"), [(2, "none", 2), (4, "none", 2),
                                                    (8, "none", 2), (8, "full", 3)])
def test_all_to_all_bytes_follow_the_closed_form(ep: int, ckpt: str, passes: int) -> None:
    # Forward and backward each send dispatch + combine; full checkpointing re-runs the
    # forward's (ExpertParallel's hooks run again in the recomputation).
    p = program(_scn(ep, activation_checkpointing=ckpt))
    mbs = p.micro_batches
    assert mbs == 2                                   # 32 sequences over 16 ranks
    closed = 2 * SEQ * K * H * BF16 * (ep - 1) / ep   # per MoE layer per pass
    a2a = _token_a2a(p)
    assert {len(op.all_groups[0]) for op in a2a} == {ep}
    assert {op.stream for op in a2a} == {"compute"} and all(not op.peer_bytes for op in a2a)
    assert sum(_wire(op) for op in a2a) == pytest.approx(passes * closed * 4 * mbs, rel=1e-12)


def test_ep_groups_and_expert_fsdp_groups_are_torchtitans_sparse_mesh() -> None:
    # 16 ranks, dp_shard 16, ep 4: EP takes the innermost ranks (0-3, 4-7, ...), efsdp the
    # rest with stride 4 (ParallelDims: efsdp = 16 / 4).
    p = program(_scn(4))
    a2a = _token_a2a(p)
    assert {op.all_groups for op in a2a} == {tuple(tuple(range(i, i + 4))
                                                   for i in range(0, 16, 4))}
    rs_e = [op for op in _ops(p) if op.collective == "reduce_scatter" and " E" in op.name]
    rs_d = [op for op in _ops(p) if op.collective == "reduce_scatter" and " E" not in op.name]
    assert {op.all_groups for op in rs_e} == {tuple(tuple(range(i, 16, 4)) for i in range(4))}
    assert {op.all_groups for op in rs_d} == {(tuple(range(16)),)}


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_expert_gradients_reduce_over_efsdp_and_every_parameter_is_sharded_once(ep) -> None:
    s = _scn(ep)
    p = program(s)
    m = ModelSpec.from_ref(s.model, SEQ)
    assert m.moe is not None
    mbs, world = p.micro_batches, 16
    experts = m.moe.experts * m.expert_params          # routed experts of one layer
    # fp32 master parameters: every parameter once over the 16 ranks, whatever ep
    # (experts split ep ways by EP, then 16 / ep ways by FSDP).
    assert p.classes[0].initial_memory["parameters"] == pytest.approx(4 * m.total_params / world)
    rs = [op for op in _ops(p) if op.collective == "reduce_scatter"]
    rs_e = [op for op in rs if " E" in op.name]
    # Every gradient reduced once per micro-batch in fp32 (reduce_dtype), each rank's local
    # experts' (1/ep of them) over its efsdp group.
    if ep == 1:
        assert not rs_e            # the experts stay inside the block's unit
    else:
        assert {len(op.all_groups[0]) for op in rs_e} == {world // ep}
        assert sum(op.nbytes for op in rs_e) == pytest.approx(4 * 4 * experts / ep * mbs)
    dense = m.total_params - 4 * experts
    assert sum(op.nbytes for op in rs) == pytest.approx(4 * (dense + 4 * experts / ep) * mbs)


def test_expert_units_gather_only_the_local_experts_so_memory_shrinks_with_ep() -> None:
    # Each expert unit all-gathers its rank's experts / ep experts (bf16), and their bf16
    # gradients are as many. With experts that dominate the model (64 of width 2048), the
    # step's peak falls with every doubling of ep, and at the peak one layer's expert
    # gradients are held: they shrink as 1/ep. (The gathered experts themselves are not held
    # at the peak since the expert wgrad stopped being priced as a new fp32 main_grad on top
    # of the unit's gradients, block_pricing's in-place rule: the peak moved to the
    # dispatch buffers, which shrink with ep too.)
    big = dict(TINY, experts=64, moe_ffn_hidden=2048)
    m = ModelSpec.from_ref(_scn(1, model=big).model, 512)
    assert m.moe is not None
    layer = 2 * m.moe.experts * m.expert_params      # one layer's experts in bf16
    peak, held = {}, {}
    for ep in (2, 4, 8):
        r = simulate(_scn(ep, model=big, seq_len=512))
        ag_e = [op for op in r.program.ops if op.collective == "all_gather" and " E" in op.name]
        assert {op.nbytes for op in ag_e} == {layer / ep}
        peak[ep] = r.summary["peak_memory_gib"] * 2**30
        held[ep] = {k: v * 2**30 for k, v in r.summary["peak_memory_breakdown_gib"].items()}
    for ep in (2, 4):
        assert peak[2 * ep] < peak[ep]
        assert held[ep]["gradients"] - held[2 * ep]["gradients"] == pytest.approx(
            layer / (2 * ep), rel=1e-9)


def test_the_output_prefetches_the_last_block_without_its_experts() -> None:
    # apply_fsdp: model.output.set_modules_to_backward_prefetch([last block]) (and the
    # embedding's forward prefetch likewise): the experts unit is gathered when its module is
    # entered. TINY's peak is at the loss, holding that prefetched block: one layer's
    # experts (bf16) more when they are inside it (ep 1) than when they are a unit of their
    # own, whatever ep.
    m = ModelSpec.from_ref(_scn(1).model, SEQ)
    assert m.moe is not None
    layer = 2 * m.moe.experts * m.expert_params
    peaks = {ep: simulate(_scn(ep)).summary["peak_memory_gib"] * 2**30 for ep in (1, 2, 8)}
    assert peaks[1] - peaks[2] == pytest.approx(layer, rel=1e-9)
    assert peaks[1] - peaks[8] == pytest.approx(layer, rel=1e-9)
    p = program(_scn(4))
    ops = sorted(p.ops, key=lambda o: o.index)
    first_e0 = next(o for o in ops if o.collective == "all_gather" and "E0 (fwd) mb0" in o.name)
    count_l0 = next(o for o in ops if "L0 mb0 token count" in o.name)
    attn_l0 = next(o for o in ops if o.name.startswith("fwd attn L0 mb0"))
    assert attn_l0.index < first_e0.index < count_l0.index


def test_counts_all_to_all_syncs_the_host_and_prefetch_is_issued_before_it() -> None:
    # ExpertParallel._token_dispatch: the int64 count of every expert goes all-to-all, then
    # output_splits.to("cpu", non_blocking=False) makes the host wait. torchtitan prefetches
    # explicitly with EP, so the next block's and its experts' all-gathers are issued before
    # that wait (in program order, which is the host's issue order).
    p = program(_scn(4))
    ops = sorted(p.classes[0].streams["compute"] + p.classes[0].streams["ag"],
                 key=lambda o: o.index)
    counts = [o for o in ops if "token count all_to_all" in o.name]
    assert counts and all(o.host_sync and o.nbytes == 8 * 8 and o.dtype == "i64"
                          for o in counts)
    assert all(o.phase == "comm" and o.name.startswith("fwd") for o in counts)
    for layer in range(3):
        # From the first block on, each prefetches the next block and its experts.
        sync = next(o for o in counts if f"L{layer} mb0" in o.name)
        for unit in (f"L{layer + 1}", f"E{layer + 1}"):
            ag = next(o for o in ops if o.collective == "all_gather"
                      and o.name.startswith(f"all-gather {unit} (fwd) mb0"))
            assert ag.index < sync.index, unit


def test_expert_bias_counts_are_all_reduced_once_before_the_optimizer() -> None:
    s = _scn(8)
    p = program(s)
    ar = [op for op in _ops(p) if "expert token counts" in op.name]
    assert len(ar) == 1
    assert ar[0].nbytes == 4 * 4 * 8                 # fp32, 4 MoE layers x 8 experts
    assert ar[0].all_groups == (tuple(range(16)),)
    opt = next(op for op in _ops(p) if op.phase == "optimizer")
    assert ar[0] in opt.deps


def test_skewed_routing_is_never_faster_and_moves_the_same_tokens() -> None:
    base = _scn(8)
    steps = {}
    for name, routing in (("balanced", None), ("zipf", {"distribution": "zipf", "s": 1.2})):
        tr = base.training.model_copy(update={"routing": Routing(**(routing or {}))})
        s = base if routing is None else base.model_copy(update={"training": tr})
        r = simulate(s)
        steps[name] = r.summary["step_time_s"]
        if routing is not None:
            a2a = _token_a2a(r.program)
            assert all(op.peer_bytes for op in a2a)
            # Every rank still sends tokens x top-k copies: the matrix holds the balanced
            # total, only its spread changes.
            for op in a2a:
                total = sum(sum(row) for row in op.peer_bytes)
                assert total == pytest.approx(8 * SEQ * K * H * BF16, rel=1e-9)
    assert steps["zipf"] >= steps["balanced"]


def test_refusals_name_the_key() -> None:
    with pytest.raises(ScenarioError, match=r"training\.precision: with mixture-of-experts "):
        program(_scn(4, precision="fp8"))
    with pytest.raises(ScenarioError, match=r"parallelism\.ep: ep=2 must be a multiple of tp=4"):
        program(_scn(2, par={"tp": 4, "etp": 1}))
    with pytest.raises(ScenarioError,
                       match=r"parallelism\.ep: ep=4 must divide dp_shard x cp x tp = 2 x 1 x 1"):
        program(_scn(4, framework={"hsdp_shard_size": 2}))
    with pytest.raises(ScenarioError, match=r"training\.activation_checkpointing"):
        program(_scn(4, activation_checkpointing="selective"))
    # DeepSeek-V3's multi-token prediction is still Megatron's only (its latent attention
    # is torchtitan's too since the thirty-sixth session: sim/workload/titan_mla.py).
    with pytest.raises(ScenarioError, match=r"model\.mtp_layers: fsdp2 does not model"):
        program(make_scenario(model="deepseek-v3", framework={"name": "fsdp2"}))


def test_hsdp_reduces_expert_shards_across_replicas() -> None:
    # HSDP 2 x 8 with ep 4: experts sharded over efsdp = 2 inside a node, then their reduced
    # shard all-reduced over the two replicas (the same replicate groups as the dense units).
    p = program(_scn(4, framework={"hsdp_shard_size": 8}))
    ar_e = [op for op in _ops(p) if op.collective == "all_reduce" and " E" in op.name]
    rs_e = [op for op in _ops(p) if op.collective == "reduce_scatter" and " E" in op.name]
    assert ar_e and {op.all_groups for op in ar_e} == {tuple((i, i + 8) for i in range(8))}
    assert {op.all_groups for op in rs_e} == {((0, 4), (1, 5), (2, 6), (3, 7),
                                               (8, 12), (9, 13), (10, 14), (11, 15))}


def test_qk_norm_weights_are_counted_and_priced() -> None:
    m = dict(TINY, qk_norm=True)
    s = _scn(4, model=m)
    p = program(s)
    spec = ModelSpec.from_ref(s.model, SEQ)
    assert p.classes[0].initial_memory["parameters"] == pytest.approx(4 * spec.total_params / 16)
    base = simulate(_scn(4)).summary["step_time_s"]
    assert simulate(s).summary["step_time_s"] > base


def test_shipped_qwen3_scenario_runs() -> None:
    from sim.config.load import load_scenario

    s = load_scenario("qwen3-30b-a3b-torchtitan-ep8-16xh100")
    r = simulate(s)
    summary = r.summary
    assert r.program.meta["ep"] == 8 and r.program.meta["efsdp_shards"] == 2
    assert not summary["oom"]
    # The model's FLOPs at the H100 SXM's dense bf16 peak (989 TFLOP/s, NVIDIA datasheet)
    # bound the step from below.
    assert summary["step_time_s"] > summary["model_flops_per_step"] / (16 * 989e12)
    # Every all-to-all stays inside a node (EP 8 = one DGX's GPUs).
    a2a = [op for op in r.program.ops if op.collective == "all_to_all"]
    assert a2a and all(g[-1] - g[0] == 7 and g[0] % 8 == 0 for op in a2a
                       for g in op.all_groups)


@pytest.mark.parametrize("ep", [1, 4, 8])
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_every_byte_allocated_in_the_step_is_freed(ep: int, ckpt: str) -> None:
    # Conservation: activations, gathered parameters, gradients and buffers the MoE ops and
    # the expert units allocate are all released by the end of the step.
    p = program(_scn(ep, activation_checkpointing=ckpt))
    held: dict[str, float] = {}
    for op in p.ops:
        for cat, b in op.alloc:
            held[cat] = held.get(cat, 0.0) + b
        for cat, b in op.free:
            held[cat] = held.get(cat, 0.0) - b
    assert all(abs(v) < 1e-3 for v in held.values()), held


@pytest.mark.parametrize(("ep", "schedule"), [(4, "1f1b"), (2, "gpipe")])
def test_pipeline_stages_accumulate_expert_gradients_and_reduce_them_once(ep, schedule) -> None:
    # torch.distributed.pipelining: no gradient sync in the micro-batches' backwards; after a
    # chunk's last backward every unit, a block before its experts, is reduce-scattered once.
    # 2 stages of 8 ranks (layers 0-1 and 2-3, no embedding/output weighting).
    s = _scn(ep, par={"pp": 2}, framework={"pipeline_schedule": schedule,
                                           "pipeline_first_stage_less_layers": 0,
                                           "pipeline_last_stage_less_layers": 0})
    p = program(s)
    m = ModelSpec.from_ref(s.model, SEQ)
    mbs = p.micro_batches
    closed = 2 * SEQ * K * H * BF16 * (ep - 1) / ep
    states = 0.0
    for c, first in zip(p.classes, (0, 2), strict=True):
        ops = [op for ops in c.streams.values() for op in ops]
        a2a = [op for op in ops if op.collective == "all_to_all" and "count" not in op.name]
        assert sum(_wire(op) for op in a2a) == pytest.approx(2 * closed * 2 * mbs, rel=1e-12)
        rs = [op.name.split()[1] for op in ops if op.collective == "reduce_scatter"]
        units = [f"L{first}", f"E{first}", f"L{first + 1}", f"E{first + 1}"]
        assert sorted(rs) == sorted(units + ["embed" if first == 0 else "head"])
        assert rs.index(f"L{first}") < rs.index(f"E{first}")
        states += c.initial_memory["parameters"]
    assert states == pytest.approx(4 * m.total_params / 8)


@pytest.mark.parametrize(("tp", "cp", "ep", "ckpt", "qk"), [
    (2, 1, 4, "none", False), (2, 1, 8, "full", True), (4, 1, 8, "none", False),
    (2, 1, 2, "full", False), (1, 2, 4, "none", False), (2, 2, 8, "full", False),
    (1, 2, 4, "full", True), (2, 2, 8, "none", True)])
def test_tensor_and_context_parallel_ranks_route_their_share_of_the_tokens(tp, cp, ep, ckpt,
                                                                           qk) -> None:
    # apply_moe_ep_tp with expert TP 1: EP borrows the tensor-parallel ranks (innermost), the
    # MoE module's input is all-gathered over tp and ReordererSequenceParallel gives each
    # rank 1/tp of the tokens to dispatch; under context parallelism each rank routes its
    # seq / cp shard. The closed form holds with tokens / (tp x cp). Qwen3's query/key norms
    # run on each rank's own tokens and heads (torchtitan v0.2.2's parallelize_qwen3 applies CP
    # with SDPA, its only refusal being FlexAttention and varlen attention under CP).
    s = _scn(ep, par={"tp": tp, "cp": cp, "etp": 1}, model=dict(TINY, qk_norm=qk),
             activation_checkpointing=ckpt)
    p = program(s)
    m = ModelSpec.from_ref(s.model, SEQ)
    assert m.moe is not None
    mbs, passes = p.micro_batches, 3 if ckpt == "full" else 2
    closed = 2 * SEQ / (tp * cp) * K * H * BF16 * (ep - 1) / ep
    a2a = _token_a2a(p)
    assert sum(_wire(op) for op in a2a) == pytest.approx(passes * closed * 4 * mbs, rel=1e-12)
    tp_groups = {g for op in _ops(p) if op.name.startswith("tp ") for g in op.all_groups}
    assert all(any(set(t) <= set(g) for g in a2a[0].all_groups) for t in tp_groups)
    # Every parameter once over the world, except what each tensor-parallel rank holds
    # whole: the norms (and Qwen3's per-head q/k norms), the router gate and the final norm.
    replicated = 4 * (2 * H + m.moe.experts * H + (2 * m.head_dim if qk else 0)) + H
    states = p.classes[0].initial_memory["parameters"] / 4 * 16
    assert states == pytest.approx(m.total_params + (tp - 1) * replicated)
    # Routed experts: their FSDP group is what is left of dp_shard x tp after ep.
    rs_e = [op for op in _ops(p) if op.collective == "reduce_scatter" and " E" in op.name]
    assert {len(op.all_groups[0]) for op in rs_e} == {16 // ep}
    held: dict[str, float] = {}
    for op in p.ops:
        for cat, b in op.alloc:
            held[cat] = held.get(cat, 0.0) + b
        for cat, b in op.free:
            held[cat] = held.get(cat, 0.0) - b
    assert all(abs(v) < 1e-3 for v in held.values()), held
    # q_norm and k_norm gradients are all-reduced over tp like the block norms'.
    norm_ar = [op for op in _ops(p) if "norm grad" in op.name and " L0 " in op.name]
    assert sorted(op.nbytes for op in norm_ar) == (sorted(
        [2.0 * H] * 2 * mbs + ([2.0 * m.head_dim] * 2 * mbs if qk else [])) if tp > 1 else [])


@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_deepep_under_tensor_parallelism_routes_every_gathered_token_on_each_rank(ckpt) -> None:
    # torchtitan's DeepEPMoE (v0.2.2, and 1a36996b of the PyTorch/Nebius DeepSeek-V3 run) sets
    # its reorderer to None, so apply_moe_ep_tp's ReordererSequenceParallel splits nothing:
    # each tensor-parallel rank routes, dispatches and computes all the all-gathered tokens,
    # as a rank without TP does with its own sequence. The routed part of a TP 2 rank is then
    # a TP 1 rank's (twice the hardware's work for the same model FLOPs); the shared experts
    # stay split.
    deepep = {"expert_parallel_comm_backend": "deepep"}
    model = dict(TINY, shared_experts=1)
    runs = {tp: simulate(_scn(4, model=model, framework=deepep, par={"tp": tp, "etp": 1},
                              activation_checkpointing=ckpt)) for tp in (1, 2)}
    ops = {tp: [op for op in _ops(r.program) if op.name.endswith("dispatch fwd")]
           for tp, r in runs.items()}
    # Per op (a TP 2 rank runs twice the micro-batches of the same global batch).
    sent = {tp: {round(sum(map(sum, op.peer_bytes))) for op in o} for tp, o in ops.items()}
    assert len(sent[1]) == 1 and sent[2] == sent[1]

    def fwd(tp: int, part: str) -> set[float]:
        return {op.hw_flops for op in _ops(runs[tp].program)
                if op.name.endswith(f" {part}") and op.phase == "fwd"}
    assert fwd(2, "experts") == fwd(1, "experts") and min(fwd(1, "experts")) > 0
    assert {2 * f for f in fwd(2, "shared")} == fwd(1, "shared") and fwd(1, "shared")
    if ckpt == "full":     # the recomputed copies count in the hardware's FLOPs
        hfu = {tp: r.summary["hfu"] / r.summary["mfu"] for tp, r in runs.items()}
        assert hfu[2] > hfu[1]
    # The standard path splits the tokens over the TP ranks: half the dispatch per rank.
    std = [op for op in _ops(program(_scn(4, model=model, par={"tp": 2, "etp": 1})))
           if op.name.endswith("dispatch fwd")]
    assert std[0].nbytes == pytest.approx(SEQ / 2 * K * H * BF16, rel=1e-12)


@pytest.mark.parametrize("before", [True, False])
def test_scores_keep_an_fp32_copy_of_the_routed_tokens_where_torchtitan_applies_them(before):
    # MoE.forward: score_before_experts multiplies the routed rows in fp32 before the
    # dispatch (the product keeps its fp32 input and the scores); otherwise an fp32 bmm
    # weights the unsorted copies after the combine (keeping the fp32 copies and the scores).
    # Either way the unsort keeps its int64 token indices. Per MoE layer and micro-batch:
    rows = SEQ * K
    p = program(_scn(4, framework={"moe_score_before_experts": before}))
    fwd = {op.name.split(" L0 mb0 ")[1]: op for op in _ops(p)
           if op.name.startswith("fwd moe L0 mb0 ")}
    saved = {k: sum(b for cat, b in op.alloc if cat == "activations") for k, op in fwd.items()}
    fp32_copy = 4 * rows * H + 4 * rows
    assert ("score" in saved) == before
    if before:
        assert saved["score"] == fp32_copy
        assert saved["combine"] == 8 * rows
    else:
        assert saved["combine"] == fp32_copy + 8 * rows
