"""``framework.moe_a2a_overlap``: Megatron-Core's combined 1F1B schedule
(``--overlap-moe-expert-parallel-comm``; :mod:`sim.frameworks.megatron.a2a_overlap`).

Independent truths: Megatron-Core's source (NVIDIA/Megatron-LM @ d98e8a6:
``TransformerLayerSchedulePlan.run`` in models/common/model_chunk_schedule_plan.py for the
issue order and streams, ``get_pp_rank_microbatches`` in pipeline_parallel/schedules.py for
the extra warm-up forward, ``TransformerConfig.__post_init__`` for the refusals), the
issue's closed form (balanced routing: the all-to-alls carry 2 x tokens x top-k x hidden x
bytes x (ep - 1) / ep per MoE layer and pass on each rank's wire, whatever the schedule), and
two bounds: a schedule that only reorders work moves no fewer FLOPs and bytes, and a step
cannot be shorter than its compute stream's kernels at full speed.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.analysis.metrics import busy_intervals, merge_intervals
from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.a2a_overlap import COMM_STREAM, combined_warmup, pair_steps
from sim.frameworks.megatron.pipeline import pipeline_steps, schedule
from sim.scenario import ScenarioError

# A small MoE model whose all-to-alls matter on a slow NVLink (100 GB/s): 4 layers, 16
# experts of width 2048, top-4.
MOE = {"layers": 4, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn_hidden": 4096,
       "vocab": 32000, "experts": 16, "experts_per_token": 4, "moe_ffn_hidden": 2048}
SEQ, H, K = 4096, 2048, 4


def _scn(par: dict, gbs: int = 64, model: dict | None = None, ac: str = "none", **fw: object):
    return megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), gbs,
                             model=model or MOE, seq=SEQ, nvlink=100, ac=ac,
                             framework={"name": "megatron", **fw})


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _exposed_a2a(recs) -> float:
    """Seconds of class 0's all-to-alls that no compute of the class covers."""
    mine = [r for r in recs if r.cls == 0]
    busy = merge_intervals(busy_intervals(mine))
    a2a = merge_intervals([(r.start, r.end) for r in mine
                           if r.op.collective == "all_to_all" and r.end > r.start])
    covered = 0.0
    for a0, a1 in a2a:
        for b0, b1 in busy:
            covered += max(0.0, min(a1, b1) - max(a0, b0))
    return sum(a1 - a0 for a0, a1 in a2a) - covered


# ---------------------------------------------------------------------- (a) time
@pytest.mark.parametrize("par", [{"tp": 1, "ep": 8}, {"tp": 1, "pp": 2, "vp": 2, "ep": 4}])
def test_overlap_hides_all_to_all_time_within_the_compute_bound(par) -> None:
    off = simulate(_scn(par))
    on = simulate(_scn(par, moe_a2a_overlap=True))
    a_off, a_on = _exposed_a2a(off.recorder.ops), _exposed_a2a(on.recorder.ops)
    assert a_off > 0
    # Megatron-Core's point: the other micro-batch's attention and experts cover the
    # dispatch and combine (at least a third of what was exposed goes here).
    assert a_on < 0.67 * a_off
    assert on.summary["step_time_s"] < off.summary["step_time_s"]
    # Lower bound: every rank class's compute-stream kernels at full speed, one after another.
    for cls in on.program.classes:
        kernels = sum(op.duration for op in cls.streams.get("compute", []))
        assert on.summary["step_time_s"] >= kernels * (1 - 1e-9)


# ---------------------------------------------------------------------- (b) same work
def test_overlap_moves_the_same_bytes_and_flops_as_the_closed_form() -> None:
    par = {"tp": 1, "ep": 8}
    progs = {ov: _program(_scn(par, moe_a2a_overlap=ov)) for ov in (False, True)}

    def a2as(p):
        return sorted((op.name.split(" mb")[0] + op.name.split(" mb")[1][1:], op.nbytes)
                      for c in p.classes for ops in c.streams.values() for op in ops
                      if op.collective == "all_to_all")

    assert a2as(progs[True]) == a2as(progs[False])
    flops = {ov: sum(op.flops * len(c.members) for c in p.classes
                     for ops in c.streams.values() for op in ops)
             for ov, p in progs.items()}
    assert flops[True] == pytest.approx(flops[False], rel=1e-12)
    # Closed form per MoE layer, pass and micro-batch on one rank: dispatch + combine of
    # tokens x top-k copies of hidden x 2 B, (ep - 1) / ep of it off the GPU.
    ep, tokens = 8, SEQ
    ops = [op for c in progs[True].classes for ops in c.streams.values() for op in ops
           if op.collective == "all_to_all" and "probs" not in op.name]
    mbs = 64 // 8
    for phase in ("fwd", "bwd"):
        wire = sum(op.nbytes * (ep - 1) / ep for op in ops if op.name.startswith(phase))
        assert wire == pytest.approx(2 * tokens * K * H * 2 * (ep - 1) / ep * 4 * mbs)
    assert {op.stream for op in ops} == {COMM_STREAM}


# ---------------------------------------------------------------------- (c) refusals
DENSE = {k: v for k, v in MOE.items() if k not in ("experts", "experts_per_token",
                                                    "moe_ffn_hidden")}


@pytest.mark.parametrize("par,kw,why", [
    ({"tp": 1, "ep": 1}, {}, "expert model parallelism"),
    ({"tp": 1, "dp": 8}, {"model": DENSE}, "expert model parallelism"),
    ({"tp": 1, "ep": 8}, {"moe_token_dispatcher_type": "allgather"}, "alltoall or flex"),
    ({"tp": 1, "pp": 2, "ep": 4}, {}, "virtual stages"),
    ({"tp": 1, "ep": 8}, {"pipeline_schedule": "gpipe"}, "1f1b"),
    ({"tp": 1, "ep": 8}, {"ac": "full", "fine_grained_activation_offloading": True},
     "full recompute is not yet supported together with fine_grained_activation_offloading"),
    ({"tp": 1, "ep": 8}, {"model": dict(MOE, shared_experts=1),
                          "moe_shared_expert_overlap": True}, "moe_shared_expert_overlap"),
    ({"tp": 1, "ep": 8}, {"model": dict(MOE, mtp_layers=2)}, "MTP"),
])
def test_megatron_refusals_name_the_key(par, kw, why) -> None:
    par = {k: v for k, v in par.items() if k != "dp"}
    model, ac = kw.pop("model", None), kw.pop("ac", "none")
    with pytest.raises(ScenarioError, match=f"framework.moe_a2a_overlap: .*{why}"):
        _program(_scn(par, model=model, ac=ac, moe_a2a_overlap=True, **kw))


# ---------------------------------------------------------------------- (d) schedule
def test_steady_pairs_interleave_forward_and_backward_layer_by_layer() -> None:
    prog = _program(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True))
    ops = sorted((op for ops in prog.classes[0].streams.values() for op in ops),
                 key=lambda o: o.index)
    # Forward of micro-batch 1 with backward of micro-batch 0, in issue order: per layer
    # pair (f layer i, b layer 3 - i) the combine of b, then f's dispatch, b's dispatch,
    # f's combine (TransformerLayerSchedulePlan.run).
    seq = [(op.name.split()[0], op.layer, op.name.rsplit(" ", 2)[-2])
           for op in ops if op.collective == "all_to_all" and "probs" not in op.name
           and (op.name.startswith("fwd") and " mb1 " in op.name
                or op.name.startswith("bwd") and " mb0 " in op.name)]
    want = []
    for i in range(4):
        want += [("bwd", 3 - i, "combine"), ("fwd", i, "dispatch"), ("bwd", 3 - i, "dispatch"),
                 ("fwd", i, "combine")]
    assert seq == want
    # The first forward runs alone (combined_1f1b_schedule_for_no_pipelining).
    first_b = min(op.index for op in ops if op.name.startswith("bwd"))
    assert all(op.index < first_b for op in ops if " mb0 " in op.name
               and op.name.startswith("fwd"))
    assert all(op.index > first_b for op in ops if " mb1 " in op.name
               and op.name.startswith("fwd"))


def test_interleaved_steps_run_one_more_warmup_forward_then_pairs() -> None:
    p, m, vp = 2, 4, 2
    for s in range(p):
        w = combined_warmup(p, s, m, vp)
        # get_pp_rank_microbatches: (p - s - 1) * 2 + (vp - 1) * p, plus one.
        assert w == (p - s - 1) * 2 + (vp - 1) * p + 1
        order = schedule("1f1b", p, s, m, vp, 1)
        steps = pair_steps(pipeline_steps("1f1b", p, s, m, vp, extra_warmup=1), order, w)
        units = [(st.unit, st.paired) for st in steps if st.what == "unit"]
        pairs = [u for u in units if u[1] is not None]
        assert len(pairs) == m * vp - w
        assert [u for u, _ in units if u[0] == "F"] == [u for u in order if u[0] == "F"]
        assert [b or u for u, b in units if (b or u)[0] == "B"] == \
            [u for u in order if u[0] == "B"]
        # Both receives are waited for before a pair, its sends posted after it.
        for i, st in enumerate(steps):
            if st.what == "unit" and st.paired is not None:
                assert steps[i + 1].what != "wait"


# ---------------------------------------------------------------------- (e) the nodes' GPU
def test_communication_stream_kernels_take_the_sms_in_turn_with_compute() -> None:
    """The combine node's unpermutation and residual add run on the communication stream
    (``submodule_combine_forward``: ``mlp.combine``, ``mlp.postprocess``, ``mlp_bda``; their
    backward in ``moe_combine.backward``), as elementwise kernels that get SMs only between
    the compute stream's (a Hopper GEMM's CTAs fill the register file): never at the same
    time as a compute-stream kernel."""
    res = simulate(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True))
    mine = [r for r in res.recorder.ops if r.cls == 0 and r.op.kind == "compute"
            and r.end > r.start]
    side = [r for r in mine if r.op.stream == COMM_STREAM]
    comp = [r for r in mine if r.op.stream == "compute"]
    assert side and all(r.op.side_kernel for r in side)
    assert {r.op.name.split(" L")[0] for r in side} == {"fwd moe", "bwd moe"}
    for s in side:
        for c in comp:
            assert min(s.end, c.end) - max(s.start, c.start) <= 1e-12, (s.op.name, c.op.name)


@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_host_waits_for_the_counts_in_the_dispatch_node(dispatcher) -> None:
    """The host blocks for the token counts inside the forward's moe_dispatch node
    (``token_dispatch``: ``_maybe_dtoh_and_synchronize("before_ep_alltoall")``; DeepEP's
    ``Buffer.dispatch`` spins on its notify kernel's counts), so it has already issued the
    backward's mlp node (``TransformerLayerSchedulePlan.run``: ``b_layer.mlp.backward``
    before ``f_layer.moe_dispatch.forward``). The alltoall's wait follows the count
    all-gather (the copy's side stream waits for the compute stream); DeepEP's is on the
    communication stream, behind the backward's combine there."""
    par = {"tp": 1, "ep": 8}
    prog = _program(_scn(par, moe_a2a_overlap=True, moe_token_dispatcher_type=dispatcher))
    ops = sorted((op for ops in prog.classes[0].streams.values() for op in ops),
                 key=lambda o: o.index)
    by_name = {op.name: op for op in ops}
    assert not any(op.host_sync for op in ops if "token count all_gather" in op.name)
    comm = prog.classes[0].streams[COMM_STREAM]
    for i in range(4):
        f, b = f"fwd moe L{i} mb1", f"bwd moe L{3 - i} mb0"
        disp = by_name[f"{f} dispatch fwd"]
        wait = ops[ops.index(disp) - 1]
        assert wait.host_sync and wait.name.endswith(f"{f} token count wait")
        assert by_name[f"{b} experts"].index < wait.index
        if dispatcher == "alltoall":
            assert by_name[f"{f} token count all_gather"] in wait.deps
        else:
            assert wait.stream == COMM_STREAM
            assert comm.index(by_name[f"{b} combine bwd"]) < comm.index(wait)
    # Without the combined schedule the host still waits at the count all-gather.
    off = _program(_scn(par, moe_token_dispatcher_type=dispatcher))
    assert all(op.host_sync for ops in off.classes[0].streams.values() for op in ops
               if "token count all_gather" in op.name)
