"""Megatron-Core's real waits and overlaps: blocking pipeline transfers (a send finishes only
once the receiver has posted its receive), per-bucket parameter gathers in the forward
pre-hooks, gradient buckets as ``distributed_data_parallel.py`` assigns them, the
sequence-parallel backward overlap of ``LinearWithGradAccumulationAndAsyncCommunication``
and Transformer Engine's context-parallel ring."""

from __future__ import annotations

import pytest
from helpers import DEEP, pipeline_idle_share
from helpers import megatron_scenario as scenario

from sim.api import simulate
from sim.frameworks.megatron.pipeline import pipeline_steps, schedule


def _fwd_spans(r, cls: int) -> dict[int, tuple[float, float]]:
    """(start, end) of each micro-batch's forward compute on one rank class."""
    spans: dict[int, tuple[float, float]] = {}
    for x in r.recorder.ops:
        if x.cls == cls and x.op.phase == "fwd" and x.op.kind == "compute" and x.end > x.start:
            a, b = spans.get(x.op.micro_batch, (x.start, x.end))
            spans[x.op.micro_batch] = (min(a, x.start), max(b, x.end))
    return spans


@pytest.mark.parametrize("kind,p,vp", [("1f1b", 4, 1), ("gpipe", 3, 1), ("1f1b", 4, 2),
                                       ("1f1b", 2, 3)])
def test_every_transfer_is_posted_on_both_sides_in_the_same_order(kind, p, vp) -> None:
    # NCCL matches a send with the peer's receive in issue order; the two stages' streams
    # must carry the same transfers in the same order, each waited for after it is posted.
    m = 2 * p
    per_stage = [pipeline_steps(kind, p, s, m, vp) for s in range(p)]
    sent: dict[int, list] = {s: [] for s in range(p)}
    got: dict[int, list] = {s: [] for s in range(p)}
    for s, steps in enumerate(per_stage):
        assert [st.unit for st in steps if st.what == "unit"] == \
            schedule(kind, p, s, m, vp)
        posted, waited = set(), set()
        for st in steps:
            for role, tr in st.transfers:
                (posted if st.what == "post" else waited).add((role, tr))
                if st.what == "post":
                    (sent if role == "send" else got)[s].append((tr[0], tr))
        assert posted == waited
    for s in range(p):
        for k in "FB":
            nxt = (s + 1) % p if k == "F" else (s - 1) % p
            out = [tr for kk, tr in sent[s] if kk == k and (tr[1] + (1 if k == "F" else -1))
                   % p == nxt]
            into = [tr for kk, tr in got[nxt] if kk == k and tr[1] % p == s]
            assert out == into


def test_slow_receiver_stalls_the_sender() -> None:
    # GPipe over 2 stages with a large vocabulary: the last stage's forward (output layer and
    # loss) is several times the first stage's. Stage 0's send of micro-batch i completes
    # only once stage 1 has posted its receive, after its forward of i - 1, so stage 0
    # cannot run ahead: its forward of i + 1 starts after stage 1 finished the forward of
    # i - 1, and its forwards stretch over the receiver's pace.
    model = dict(DEEP, layers=4, vocab=256_000)
    r = simulate(scenario({"tp": 1, "pp": 2, "dp": 1}, gbs=6, gpn=2, model=model,
                          framework={"name": "megatron", "pipeline_schedule": "gpipe"}))
    f0, f1 = _fwd_spans(r, 0), _fwd_spans(r, 1)
    own = sum(b - a for a, b in f0.values())
    slow = max(b - a for a, b in f1.values())
    assert slow > 2 * own / len(f0)            # the receiver really is the slower stage
    for i in range(1, 5):
        assert f0[i + 1][0] >= f1[i - 1][1] - 1e-9
    assert f0[5][1] - f0[0][0] > 1.5 * own


def _dp(framework: dict, pp: int = 1, vp: int = 1, dp: int = 16):
    # dp ranks across two nodes on a thin network, so data-parallel traffic matters.
    fw = dict({"name": "megatron", "distributed_optimizer": True,
               "overlap_grad_reduce": True}, **framework)
    return scenario({"tp": 1, "pp": pp, "dp": dp, "vp": vp}, gbs=dp * 4 * pp, nodes=2,
                    gpn=8, nvlink=450, framework=fw)


def test_overlap_param_gather_gathers_per_bucket_in_the_forward() -> None:
    # overlap_param_gather: the parameter all-gathers move from after the optimizer into the
    # forward pre-hooks, bucket by bucket, hidden behind the forward (Megatron-Core
    # _make_forward_pre_hook / finish_param_sync); without it they follow the optimizer.
    off = simulate(_dp({"overlap_param_gather": False}))
    on = simulate(_dp({"overlap_param_gather": True}))
    gathers = [x for x in on.recorder.ops if "param all_gather" in x.op.name]
    assert len(gathers) > 1                                 # one per bucket
    fwd_end = max(x.end for x in on.recorder.ops if x.op.phase == "fwd")
    assert all(x.end < fwd_end for x in gathers)
    opt_end = max(x.end for x in off.recorder.ops if x.op.phase == "optimizer")
    assert all(x.start >= opt_end for x in off.recorder.ops if "param all_gather" in x.op.name)
    assert on.summary["exposed_comm_s"] < off.summary["exposed_comm_s"]
    assert on.summary["step_time_s"] < off.summary["step_time_s"]


def test_buckets_only_on_the_first_stage_and_first_model_chunk() -> None:
    # distributed_data_parallel.py: bucket_size = None when pp_rank > 0; training.py get_model
    # passes disable_bucketing=(model_chunk_idx > 0): every other chunk reduces in one bucket,
    # launched when that chunk's last backward is done. 32 layers of ~201M parameters over
    # 2 stages x 2 chunks, dp 8; 40M buckets split the first stage's first chunk layer by layer.
    from sim.frameworks import JobContext, build_program

    prog = build_program(JobContext.from_scenario(_dp({}, pp=2, vp=2, dp=8)))
    grads: dict[int, list[str]] = {}
    for c in prog.classes:
        grads[c.id] = [o.name for ops in c.streams.values() for o in ops
                       if o.name.startswith("grad reduce_scatter")]
    assert sorted(n.split()[3] for n in grads[1]) == ["v1", "v3"]       # one per chunk
    v0 = [n for n in grads[0] if n.split()[3] == "v0"]
    v2 = [n for n in grads[0] if n.split()[3] == "v2"]
    assert len(v0) == 8 + 1 and len(v2) == 1     # 8 layers + the embedding's own bucket
    r = simulate(_dp({}, pp=2, vp=2, dp=8))
    # Chunk 1's single bucket (v2) is reduced while chunk 0's backwards still run.
    ends = {x.op.name: x for x in r.recorder.ops if x.cls == 0}
    last_bwd = max(x.end for x in r.recorder.ops if x.cls == 0 and x.op.phase == "bwd")
    assert ends[v2[0]].start < last_bwd


def test_sequence_parallel_backward_hides_the_reduce_scatter_behind_wgrad() -> None:
    # LinearWithGradAccumulationAndAsyncCommunication.backward with sequence parallelism:
    # the input shard is all-gathered again beside the dgrad GEMM and the input gradient is
    # reduce-scattered beside the wgrad GEMM. Per layer and micro-batch backward then runs
    # 4 all-gathers (2 output-gradient gathers for the row-parallel linears, 2 input
    # re-gathers) and 2 reduce-scatters (Korthikanti et al. 2022, sec. 4.2.2).
    s = scenario({"tp": 4, "pp": 1, "dp": 2, "sequence_parallel": True}, gbs=2, gpn=8,
                 nvlink=450)
    r = simulate(s)
    bwd = [x for x in r.recorder.ops if x.op.kind == "collective" and x.cls == 0
           and x.op.layer == 3 and x.op.micro_batch == 0 and "bwd" in x.op.name]
    assert sorted(x.op.collective for x in bwd) == ["all_gather"] * 4 + ["reduce_scatter"] * 2
    compute = [(x.start, x.end) for x in r.recorder.ops
               if x.cls == 0 and x.op.kind == "compute" and x.end > x.start]
    for x in bwd:
        if x.op.stream != "tp":
            continue
        hidden = sum(max(0.0, min(b, x.end) - max(a, x.start)) for a, b in compute)
        assert hidden > 0.5 * (x.end - x.start), x.op.name
    rs = [x for x in bwd if x.op.collective == "reduce_scatter"]
    assert all(x.op.stream == "tp" for x in rs)


def test_context_parallel_ring_overlaps_attention() -> None:
    # Transformer Engine's AttnFuncWithCPAndKVP2P: cp steps of attention, each beside the
    # exchange of the next K/V chunk with the ring neighbours. Per layer and micro-batch the
    # forward sends K/V cp - 1 times (each rank's 2 x tokens x kv width, bf16: the same
    # bytes each rank receives in an all-gather of K and V), the backward K/V at the first
    # step, K/V + dK/dV in the middle and dK/dV at the last.
    cp, seq = 4, 16384
    s = scenario({"tp": 1, "pp": 1, "dp": 2, "cp": cp}, gbs=2, gpn=8, nvlink=450, seq=seq)
    r = simulate(s)
    kv = 2 * 2 * (seq // cp) * 4096            # K and V, bf16, hidden 4096 (32 x 128)
    ring = [x for x in r.recorder.ops if x.cls == 0 and x.op.layer == 5
            and x.op.micro_batch == 0 and x.op.name.startswith("cp ring")]
    fwd = [x.op.nbytes for x in ring if x.op.phase == "comm" and " fwd " in x.op.name]
    bwd = [x.op.nbytes for x in ring if " bwd " in x.op.name]
    assert fwd == [kv] * (cp - 1)
    assert bwd == [kv, 2 * kv, 2 * kv, kv]
    assert not [x for x in r.recorder.ops if x.op.collective and "K/V" in x.op.name]
    compute = [(x.start, x.end) for x in r.recorder.ops
               if x.cls == 0 and x.op.kind == "compute" and x.end > x.start]
    hidden = sum(max(0.0, min(b, x.end) - max(a, x.start)) for x in ring for a, b in compute)
    assert hidden > 0.8 * sum(x.end - x.start for x in ring)


@pytest.mark.parametrize("p,vp,m", [(4, 2, 8), (4, 2, 16), (2, 4, 8)])
def test_interleaved_bubble_matches_the_closed_form(p: int, vp: int, m: int) -> None:
    # Near-free communication: interleaving v chunks cuts the bubble to (p-1)/v micro-batch
    # times against m (Narayanan et al., SC'21, sec. 2.2.2), an idle share of the pipeline
    # phase of (p-1)/(v m + p - 1), with overlap_p2p_comm's waits before each unit.
    r = simulate(scenario({"tp": 1, "pp": p, "dp": 1, "vp": vp}, gbs=m, gpn=p))
    got = pipeline_idle_share(r)
    assert got == pytest.approx((p - 1) / (vp * m + p - 1), abs=0.02)


def test_1f1b_warmup_sends_block_until_the_next_stage_receives() -> None:
    # 1F1B warm-up on stage 0 of 4: send_forward(F1) is a blocking batch_isend_irecv that
    # completes only when stage 1 posts recv_forward for micro-batch 1, after its forward of
    # micro-batch 0 and its own send: stage 0's third forward cannot start before stage 1 has
    # finished its first (a send that needed no receiver would let it start at 2 forwards).
    r = simulate(scenario({"tp": 1, "pp": 4, "dp": 1}, gbs=8, gpn=4, nvlink=450))
    f0, f1 = _fwd_spans(r, 0), _fwd_spans(r, 1)
    assert f0[2][0] >= f1[0][1] - 1e-9
    assert f0[2][0] > f0[0][0] + (f0[0][1] - f0[0][0]) + (f0[1][1] - f0[1][0])
