"""DeepSeek's DualPipe and DualPipeV schedules (``framework.pipeline_schedule: dualpipe`` and
``dualpipev``).

Checked against the DualPipe README's bubble, (PP/2 - 1)(F&B + B - 3W) for PP stages
(deepseek-ai/DualPipe @ 3da1bbe, "Pipeline Bubbles and Memory Usage Comparison"), by an
independent list scheduler of the schedule's units; against the engine (the same schedule's
idle share with the unit times the program holds); against its parameter memory (DualPipe 2x,
DualPipeV 1x); and by conservation (every unit once, every transfer matched, activations back
to zero).
"""

from __future__ import annotations

import pytest
from helpers import DEEP, activations_left, megatron_scenario, pipeline_idle_share
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.api import simulate
from sim.frameworks import JobContext
from sim.frameworks.megatron.dualpipe import deepseek_steps
from sim.frameworks.megatron.pipeline import Placement
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError

DPV = {"name": "megatron", "pipeline_schedule": "dualpipev"}
DP = {"name": "megatron", "pipeline_schedule": "dualpipe"}


def list_schedule(p: int, m: int, f: float, b: float, w: float, kind: str = "dualpipev"
                  ) -> float:
    """Makespan of the schedule's units on ``p`` ranks with free communication: a rank runs its
    steps in order, a unit starts once its input (the previous virtual stage's forward, the
    next one's backward; the loss's forward for the last) is done; a zero-bubble backward
    takes ``b - w`` and its ``weight`` step ``w``; an F&B pair runs its forward, then its
    backward."""
    steps = {s: [x for x in deepseek_steps(kind, p, s, m) if x.what in ("unit", "weight")]
             for s in range(p)}
    place = Placement(p, 2, v_shape=kind == "dualpipev", bidirectional=kind == "dualpipe")
    done: dict[tuple[str, int, int], float] = {}
    clock, at = dict.fromkeys(range(p), 0.0), dict.fromkeys(range(p), 0)

    def ready(s: int, u: tuple[str, int, int]) -> float | None:
        k, c, mb = u
        v = place.virtual(s, c)
        if k == "F":
            return 0.0 if place.is_first(v) else done.get(("F", v - 1, mb))
        return done.get(("F", v, mb)) if place.is_last(v) else done.get(("B", v + 1, mb))

    moved = True
    while moved:
        moved = False
        for s in range(p):
            while at[s] < len(steps[s]):
                st = steps[s][at[s]]
                if st.what == "weight":
                    clock[s] += w
                else:
                    units = [u for u in (st.unit, st.paired) if u is not None]
                    starts = [ready(s, u) for u in units]
                    if any(x is None for x in starts):
                        break
                    t = max([clock[s], *(x for x in starts if x is not None)])
                    for u in units:
                        t += f if u[0] == "F" else (b - w if st.zero_bubble else b)
                        done[(u[0], place.virtual(s, u[1]), u[2])] = t
                    clock[s] = t
                at[s] += 1
                moved = True
    assert all(at[s] == len(steps[s]) for s in range(p)), "the schedule deadlocks"
    return max(clock.values())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 20), (8, 32), (16, 40)])
def test_dualpipev_bubble_is_the_readmes_closed_form(p: int, m: int) -> None:
    # B = 2F, W = F (the README's figure): every rank computes 2m (F + B) and idles
    # (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and F&B = F + B.
    f, b, w = 1.0, 2.0, 1.0
    bubble = list_schedule(p, m, f, b, w) - 2 * m * (f + b)
    assert bubble == pytest.approx((p - 1) * (f + b + b - 3 * w))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 20), (16, 40)])
def test_dualpipe_bubble_is_the_readmes_closed_form(p: int, m: int) -> None:
    # DualPipe on p ranks = PP stages: every rank computes m (F + B) (m / 2 micro-batches in
    # each direction) and idles (PP/2 - 1)(F&B + B - 3W).
    f, b, w = 1.0, 2.0, 1.0
    bubble = list_schedule(p, m, f, b, w, "dualpipe") - m * (f + b)
    assert bubble == pytest.approx((p // 2 - 1) * (f + b + b - 3 * w))


@pytest.mark.parametrize("kind,p,m", [("dualpipev", 2, 4), ("dualpipev", 3, 6),
                                      ("dualpipev", 4, 16), ("dualpipev", 8, 20),
                                      ("dualpipe", 2, 4), ("dualpipe", 4, 10),
                                      ("dualpipe", 8, 16)])
def test_every_unit_runs_once_and_every_deferred_wgrad_is_popped(kind: str, p: int, m: int
                                                                 ) -> None:
    per_chunk = m if kind == "dualpipev" else m // 2
    for s in range(p):
        steps = deepseek_steps(kind, p, s, m)
        units = [u for x in steps if x.what == "unit" for u in (x.unit, x.paired) if u]
        assert sorted(units) == sorted((k, c, i) for k in "FB" for c in (0, 1)
                                       for i in range(per_chunk))
        assert sum(x.zero_bubble for x in steps) == sum(x.what == "weight" for x in steps)


@pytest.mark.parametrize("kind", ["dualpipev", "dualpipe"])
def test_transfers_match_between_ranks(kind: str) -> None:
    # Every send has its receive on the peer rank, with the same key, once.
    p, m = 4, 12
    place = Placement(p, 2, v_shape=kind == "dualpipev", bidirectional=kind == "dualpipe")
    sends, recvs = [], []
    for s in range(p):
        for x in deepseek_steps(kind, p, s, m):
            if x.what == "post":
                for role, (k, v, mb) in x.transfers:
                    nxt = v + 1 if k == "F" else v - 1
                    (sends if role == "send" else recvs).append((k, v, mb))
                    owner = place.stage(v) if role == "send" else place.stage(nxt)
                    assert owner == s
    assert sorted(sends) == sorted(recvs)
    assert len(set(sends)) == len(sends)
    # Nothing crosses from virtual stage p - 1 to p: DualPipeV's last rank hands chunk 0's
    # output to its own chunk 1, DualPipe's forward direction ends there.
    assert not any(v == p - 1 and k == "F" for k, v, _ in sends)
    assert not any(v == p and k == "B" for k, v, _ in sends)


def _run(p: int, m: int, fw: dict, vp: int = 2):
    return simulate(megatron_scenario({"tp": 1, "pp": p, "vp": vp, "dp": 1}, gbs=m, gpn=p,
                                      framework=fw))


@pytest.mark.parametrize("kind", ["dualpipev", "dualpipe"])
def test_engine_runs_the_schedule_it_is_given(kind: str) -> None:
    # The engine's idle share equals the list schedule's with the unit times of the program
    # (near-free communication: one node, NVLink at 45 TB/s).
    p, m = 4, 16
    r = _run(p, m, {"name": "megatron", "pipeline_schedule": kind},
             vp=2 if kind == "dualpipev" else 1)
    cls = r.program.classes[1]
    ops = [o for ops in cls.streams.values() for o in ops]
    units = 2 * (m if kind == "dualpipev" else m // 2)
    f = sum(o.duration for o in ops if o.phase == "fwd") / units
    b = sum(o.duration for o in ops if o.phase == "bwd") / units
    w = sum(o.duration for o in ops if "delayed wgrad" in o.name) / units
    assert 0 < w < b
    expect = list_schedule(p, m, f, b, w, kind)
    got = pipeline_idle_share(r)
    assert got == pytest.approx(1 - units * (f + b) / expect, abs=0.01)


def test_dualpipe_idles_less_than_interleaved_1f1b() -> None:
    p, m = 4, 16
    dp = pipeline_idle_share(_run(p, m, DP, vp=1))
    dpv = pipeline_idle_share(_run(p, m, DPV))
    inter = pipeline_idle_share(_run(p, m, {"name": "megatron"}))
    plain = pipeline_idle_share(_run(p, m, {"name": "megatron"}, vp=1))
    assert dp < dpv < inter < plain


def test_dualpipe_holds_two_copies_and_sums_their_gradients() -> None:
    # Rank s holds stage s and stage p - 1 - s: every stage twice over the pipeline, with an
    # embedding and a head on both end ranks; each rank pair all-reduces its gradients.
    p = 4
    s = megatron_scenario({"tp": 1, "pp": p, "dp": 1}, gbs=8, gpn=p, framework=DP)
    sh = megatron_shape(JobContext.from_scenario(s))
    assert [sh.stage_layers(st) for st in range(p)] == [
        [0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31],
        [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
        [16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15],
        [24, 25, 26, 27, 28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7]]
    total = sum(sh.stage_params(st) for st in range(p))
    assert total == pytest.approx(2 * sh.model.total_params, rel=1e-12)
    r = simulate(s)
    pair = [x for x in r.recorder.ops if x.op.name == "dualpipe copies grad all-reduce"]
    assert len(pair) == p
    for x in pair:
        st = next(c.id for c in r.program.classes if x.op in c.streams["dp"])
        assert x.op.nbytes == pytest.approx(sh.grad_bytes * sh.stage_params(st))


def test_v_placement_puts_embedding_and_head_on_stage_zero() -> None:
    s = megatron_scenario({"tp": 1, "pp": 4, "vp": 2, "dp": 1}, gbs=8, gpn=4, framework=DPV)
    sh = megatron_shape(JobContext.from_scenario(s))
    assert sh.place.last_stages == (0,)
    assert [sh.stage_layers(st) for st in range(4)] == [
        [0, 1, 2, 3, 28, 29, 30, 31], [4, 5, 6, 7, 24, 25, 26, 27],
        [8, 9, 10, 11, 20, 21, 22, 23], [12, 13, 14, 15, 16, 17, 18, 19]]
    total = sum(sh.stage_params(st) for st in range(4))
    assert total == pytest.approx(sh.model.total_params, rel=1e-12)
    # Stage 0 holds the embedding and the output layer; the others only layers.
    assert sh.stage_params(0) - sh.stage_params(1) == pytest.approx(
        sh.emb_params + sh.head_params, rel=1e-9)


@pytest.mark.parametrize("fw,vp", [(DPV, 2), (DP, 1)])
def test_activations_are_freed_and_bytes_conserved(fw: dict, vp: int) -> None:
    r = _run(4, 8, fw, vp=vp)
    for c in r.program.classes:
        assert activations_left(c) == pytest.approx(0.0, abs=1.0)
    sent = sum(x.op.nbytes for x in r.recorder.ops if x.op.kind == "recv"
               and x.op.name.startswith("send"))
    got = sum(x.op.nbytes for x in r.recorder.ops if x.op.kind == "recv"
              and x.op.name.startswith("recv"))
    assert sent == got > 0


@pytest.mark.parametrize("par,gbs,fw,key", [
    ({"vp": 1}, 16, DPV, "parallelism.vp"),
    ({"vp": 2}, 4, DPV, "training.global_batch_size"),
    ({"vp": 2}, 16, {**DPV, "delay_wgrad_compute": True}, "framework.delay_wgrad_compute"),
    ({"vp": 2}, 16, DP, "parallelism.vp"),
    ({"pp": 3}, 18, DP, "parallelism.pp: DualPipe needs an even pp"),
    ({}, 6, DP, "training.global_batch_size"),
    ({}, 9, DP, "training.global_batch_size: DualPipe feeds half"),
])
def test_refusals_name_the_key(par: dict, gbs: int, fw: dict, key: str) -> None:
    pp = par.get("pp", 4)
    with pytest.raises(ScenarioError, match=key):
        simulate(megatron_scenario({"tp": 1, "pp": 4, "dp": 1, **par}, gbs=gbs, gpn=pp,
                                   framework=fw, model=dict(DEEP, layers=30 if pp == 3 else 32)))


def test_megatrons_p2p_modes_are_not_read() -> None:
    # An interleaved scenario's overlap_p2p_comm / batch_p2p_comm (which Megatron refuses
    # without virtual stages) do not stop a what-if on DualPipe, which posts its own.
    fw = {**DP, "overlap_p2p_comm": True, "batch_p2p_comm": False}
    a = _run(4, 16, fw, vp=1).summary
    b = _run(4, 16, DP, vp=1).summary
    assert a["step_time_s"] == b["step_time_s"]


def test_each_dualpipe_copy_casts_its_own_fp8_weights_once_a_step() -> None:
    # Transformer Engine casts (or transposes) each FP8 weight once a step, on its first
    # micro-batch: a stage's copy under DualPipe sees m / 2 micro-batches, so its per-unit share
    # of the cast is 2 / m where 1F1B's is 1 / m (8 micro-batches: 1/4 against 1/8).
    shares = {}
    for fw in ({"name": "megatron"}, DP):
        s = megatron_scenario({"tp": 1, "pp": 2, "dp": 1}, gbs=8, gpn=2, precision="fp8",
                              framework=fw)
        shares[fw["name"] + fw.get("pipeline_schedule", "")] = \
            megatron_shape(JobContext.from_scenario(s)).lay.weight_cast_share
    assert shares == {"megatron": 1 / 8, "megatrondualpipe": 1 / 4}


@settings(max_examples=60, deadline=None)
@given(half=st.integers(1, 8), extra=st.integers(0, 24), kind=st.sampled_from(
    ["dualpipe", "dualpipev"]), f=st.floats(0.5, 2.0), w_share=st.floats(0.0, 0.9))
def test_any_rank_count_and_batch_run_to_the_end(half: int, extra: int, kind: str, f: float,
                                                  w_share: float) -> None:
    # Property: for every pp (even for DualPipe) and micro-batch count the schedule allows,
    # every rank's steps run to the end without a deadlock (list_schedule asserts it), the
    # step is never shorter than a rank's own work, and the idle time never exceeds the
    # README's bubble without any weight gradient deferred, (PP/2 - 1)(F&B + B) with
    # F&B = F + B: deferring weight gradients only fills the bubble.
    p = 2 * half
    m = 2 * p + 2 * extra
    b = 2.0 * f
    w = w_share * b
    span = list_schedule(p, m, f, b, w, kind)
    work = (2 * m if kind == "dualpipev" else m) * (f + b)
    stages = 2 * p if kind == "dualpipev" else p
    assert span >= work - 1e-9
    assert span - work <= (stages // 2 - 1) * (f + 2 * b) + 1e-9
