"""Megatron-Core / Megatron-Bridge overlap knobs as their source runs them:
``align_param_gather`` (``training.py`` sets ``param_sync_func``; ``schedules.py`` dispatches
chunks 0-1 on every stage before anything else), ``overlap_p2p_comm`` / ``batch_p2p_comm``
(``schedules.py``, ``p2p_communication.py`` ``_communicate``) and
``overlap_param_gather_with_optimizer_step`` (``ChainedOptimizer._step``)."""

from __future__ import annotations

import pytest
from helpers import megatron_scenario as scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.pipeline import pipeline_steps, schedule
from sim.scenario import ScenarioError


def _pp(framework: dict | None = None, pp: int = 4, vp: int = 2, dp: int = 4):
    # One pipeline stage per node, dp over a thin NVLink (50 GB/s) so that the data-parallel
    # parameter gathers (8 layers of ~201M parameters, bf16: ~3.2 GB per stage) take several
    # micro-batch forwards: when they are dispatched shows in the step.
    fw = dict({"name": "megatron", "distributed_optimizer": True, "overlap_grad_reduce": True,
               "overlap_param_gather": True}, **(framework or {}))
    return scenario({"tp": 1, "pp": pp, "dp": dp, "vp": vp}, gbs=dp * 2 * pp, nodes=pp,
                    gpn=dp, nvlink=50, framework=fw)


def _gathers(r):
    return [x for x in r.recorder.ops if x.op.name.startswith("param all_gather")]


def _first_fwd_end(r, cls: int) -> float:
    return min(x.end for x in r.recorder.ops if x.cls == cls and x.op.phase == "fwd"
               and x.op.kind == "compute" and x.end > x.start)


def test_align_param_gather_starts_every_stage_gathers_together_at_step_start() -> None:
    # schedules.py (interleaved) calls param_sync_func[0] and [1] before the warm-up loop on
    # every stage, before the first (blocking) receive: all stages' gathers of chunks 0-1 start
    # at t = 0. Without it (--no-align-param-gather) each chunk's first bucket is dispatched at
    # its own forward pre-hook: with blocking batch_p2p_comm calls (torch.cuda.synchronize) a
    # stage after the first reaches it only once its first input has arrived, after stage 0's
    # first forward, and its first forward then waits for the whole chunk's gather.
    blocking = {"overlap_p2p_comm": False}
    on = simulate(_pp(dict(blocking, align_param_gather=True)))
    off = simulate(_pp(dict(blocking, align_param_gather=False)))
    first = _first_fwd_end(on, 0)
    for r, aligned in ((on, True), (off, False)):
        spans: dict[int, list[tuple[float, float]]] = {}
        for x in _gathers(r):
            if int(x.op.name.split()[3][1:]) // 4 < 2:     # chunks 0 and 1 (v // p)
                spans.setdefault(x.cls, []).append((x.start, x.end))
        assert set(spans) == {0, 1, 2, 3}
        for cls, sp in spans.items():
            sp.sort()
            if aligned:
                # all issued at once, at step start: they run back to back from t = 0
                assert sp[0][0] < 1e-3, cls
                assert all(b[0] - a[1] < 1e-6 for a, b in zip(sp, sp[1:], strict=False))
            elif cls > 0:
                assert sp[0][0] >= first - 1e-9, cls        # after the first receive
    prog = build_program(JobContext.from_scenario(_pp(dict(blocking, align_param_gather=True))))
    for c in prog.classes:                # issued before the stage's first transfer
        names = [o.name for o in sorted((o for ops in c.streams.values() for o in ops),
                                        key=lambda o: o.index)]
        first_p2p = min(i for i, n in enumerate(names) if n.startswith(("send", "recv")))
        assert sum(n.startswith("param all_gather") for n in names[:first_p2p]) >= 2
    assert on.summary["exposed_comm_s"] < off.summary["exposed_comm_s"]
    assert on.summary["step_time_s"] < off.summary["step_time_s"]


def test_align_param_gather_defaults_as_megatron_lm() -> None:
    # Megatron-LM's --no-align-param-gather: on by default; validate_args turns it off
    # without virtual stages. Megatron-Bridge's CommOverlapConfig: on with pp > 1 and vp > 1.
    def order(fw: dict, vp: int) -> list[str]:
        prog = build_program(JobContext.from_scenario(_pp(fw, vp=vp)))
        return [o.name for o in prog.ops if o.name.startswith("param all_gather")
                or o.name.startswith(("fwd", "send", "recv"))][:40]

    assert order({}, 2) == order({"align_param_gather": True}, 2)
    assert order({}, 2) != order({"align_param_gather": False}, 2)
    assert order({"align_param_gather": True}, 1) == order({}, 1) == \
        order({"align_param_gather": False}, 1)


@pytest.mark.parametrize("p,vp,m", [(4, 2, 8), (4, 3, 8), (3, 2, 6), (2, 4, 4), (4, 2, 4)])
def test_blocking_interleaved_calls_pair_up(p: int, vp: int, m: int) -> None:
    # Without overlap_p2p_comm every call posts and waits at once; NCCL matches a send with
    # the peer's receive in issue order, so both stages must carry the same transfers in the
    # same order, and each stage's units keep the interleaved order.
    per_stage = [pipeline_steps("1f1b", p, s, m, vp, overlap=False) for s in range(p)]
    sent: dict[int, list] = {s: [] for s in range(p)}
    got: dict[int, list] = {s: [] for s in range(p)}
    for s, steps in enumerate(per_stage):
        assert [st.unit for st in steps if st.what == "unit"] == schedule("1f1b", p, s, m, vp)
        for a, b in zip(steps, steps[1:], strict=False):
            if a.what == "post":                 # blocking: every post is waited for at once
                assert b.what == "wait" and b.transfers == a.transfers and b.sync
        for st in steps:
            if st.what == "post":
                for role, tr in st.transfers:
                    (sent if role == "send" else got)[s].append(tr)
    for s in range(p):
        for k, d in (("F", 1), ("B", -1)):
            out = [tr for tr in sent[s] if tr[0] == k and (tr[1] + d) % p == (s + d) % p]
            into = [tr for tr in got[(s + d) % p] if tr[0] == k and tr[1] % p == s]
            assert out == into


def test_overlap_p2p_comm_off_blocks_and_costs_time() -> None:
    # --no-overlap-p2p-communication: batch_p2p_comm = not overlap_p2p_comm
    # (argument_utils.py), so each call is batch_isend_irecv + wait + torch.cuda.synchronize:
    # the pipeline waits where the overlapped schedule would compute. Plain isend/irecv
    # (batch_p2p_comm off, Megatron-Bridge's override) waits without the synchronize.
    s = {"tp": 1, "pp": 4, "dp": 1, "vp": 2}
    over = simulate(scenario(s, gbs=8, gpn=4, nvlink=450)).summary
    batch = simulate(scenario(s, gbs=8, gpn=4, nvlink=450, framework={
        "name": "megatron", "overlap_p2p_comm": False})).summary
    plain = simulate(scenario(s, gbs=8, gpn=4, nvlink=450, framework={
        "name": "megatron", "overlap_p2p_comm": False, "batch_p2p_comm": False})).summary
    assert batch["step_time_s"] > over["step_time_s"]
    assert plain["step_time_s"] <= batch["step_time_s"] + 1e-12
    syncs = [o for o in build_program(JobContext.from_scenario(scenario(
        s, gbs=8, gpn=4, framework={"name": "megatron", "overlap_p2p_comm": False}))).ops
        if o.host_sync]
    assert syncs


@pytest.mark.parametrize("fw,par", [
    ({"overlap_p2p_comm": True}, {"pp": 2}),                       # schedules.py ValueError
    ({"overlap_p2p_comm": True, "batch_p2p_comm": True}, {"pp": 2, "vp": 2}),
    ({"overlap_p2p_comm": False}, {"pp": 2, "vp": 2}),             # validate_args: pp > 2
    ({"distributed_optimizer": True, "overlap_param_gather": True,
      "overlap_param_gather_with_optimizer_step": True}, {"pp": 2}),   # validate_args
])
def test_megatron_refuses_what_megatron_refuses(fw: dict, par: dict) -> None:
    with pytest.raises(ScenarioError):
        build_program(JobContext.from_scenario(scenario(
            dict({"tp": 1, "dp": 1}, **par), gbs=4, gpn=par["pp"],
            framework=dict({"name": "megatron"}, **fw))))


def test_overlap_param_gather_with_optimizer_step() -> None:
    # ChainedOptimizer._step: chunk 0's optimizer, then its gathers (start_param_sync(
    # force_dispatch=True)) beside the other chunks' optimizer steps. In the steady state
    # the step starts at that dispatch: the other chunks' optimizer work opens it beside
    # chunk 0's gathers, chunk 0's optimizer ends it; the optimizer's total is unchanged.
    base = simulate(_pp())
    r = simulate(_pp({"overlap_param_gather_with_optimizer_step": True}))
    # (GPU time as priced: beside the gathers the optimizer also runs slower, interference)
    opt = {c: sum(x.op.duration for x in base.recorder.ops if x.cls == c
                  and x.op.phase == "optimizer") for c in range(4)}
    for c in range(4):
        mine = [x for x in r.recorder.ops if x.cls == c and x.op.phase == "optimizer"]
        assert len(mine) == 2 and mine[0].start < 1e-3    # after the gathers are issued
        assert sum(x.op.duration for x in mine) == pytest.approx(opt[c], rel=1e-9)
        chunk0 = [x for x in _gathers(r) if x.cls == c and int(x.op.name.split()[3][1:]) < 4]
        assert chunk0 and min(x.start for x in chunk0) < mine[0].end   # beside it
    assert r.summary["step_time_s"] <= base.summary["step_time_s"] + 1e-9


def test_partial_distributed_optimizer_instances() -> None:
    # num_distributed_optimizer_instances k: parallel_state.py splits each dp-cp group into k
    # contiguous intra-instance groups; start_grad_sync reduce-scatters a bucket in its
    # intra-instance group, then all-reduces the local shard (1/(dp/k) of the bucket) across
    # instances; parameters are gathered in the intra-instance group and the optimizer states
    # are sharded over dp/k ranks (k times the memory of the full distributed optimizer).
    def prog(k: int):
        return build_program(JobContext.from_scenario(_pp(
            {"num_distributed_optimizer_instances": k}, pp=2, vp=1, dp=8)))

    one, two = prog(1), prog(2)
    ops = {o.name: o for o in two.ops}
    rs = [o for o in two.ops if o.name.startswith("grad reduce_scatter")]
    ar = [o for o in two.ops if o.name.startswith("grad all_reduce instances")]
    assert rs and len(ar) == len(rs)
    for o in rs:
        assert all(len(g) == 4 for g in o.groups)
        mate = ops[o.name.replace("reduce_scatter", "all_reduce instances")]
        assert mate.deps == [o] and mate.nbytes == pytest.approx(o.nbytes / 4)
        assert all(len(g) == 2 for g in mate.groups)
        assert mate.groups[0] == (o.groups[0][0], o.groups[1][0])     # same place, 2 groups
    gathers = [o for o in two.ops if o.name.startswith("param all_gather")]
    assert gathers and all(len(g) == 4 for o in gathers for g in o.groups)
    for a, b in zip(one.classes, two.classes, strict=True):
        assert b.initial_memory["optimizer"] == pytest.approx(2 * a.initial_memory["optimizer"])
    assert not [o for o in one.ops if "instances" in o.name]
    assert simulate(_pp({"num_distributed_optimizer_instances": 2}, pp=2, vp=1,
                        dp=8)).summary["step_time_s"] > 0
    with pytest.raises(ScenarioError):
        build_program(JobContext.from_scenario(_pp(
            {"num_distributed_optimizer_instances": 3}, pp=2, vp=1, dp=8)))
