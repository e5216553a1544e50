"""``framework.delay_wgrad_compute``: Megatron-Core's ``--delay-wgrad-compute`` in the
combined 1F1B schedule (:mod:`sim.frameworks.megatron.delay_wgrad`).

Independent truths: Megatron-Core's source (NVIDIA/Megatron-LM @ d98e8a6:
``TransformerLayerSchedulePlan.run`` and ``TransformerModelChunkSchedulePlan.run`` in
models/common/model_chunk_schedule_plan.py for where the two ``backward_dw`` calls are issued,
``TransformerConfig.__post_init__`` and ``validate_args`` for the refusals), Transformer
Engine's ``WeightGradStore`` (module/_common.py: the wgrad GEMM and its operands stored until
``backward_dw``), conservation (a schedule that only moves kernels changes neither the GPU
seconds nor the FLOPs of a step) and the closed form of a linear's weight gradient
(2 x tokens x n_in x n_out FLOPs).
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.analysis.metrics import busy_intervals, merge_intervals
from sim.api import simulate
from sim.config.training import Routing
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError

# The combined-schedule tests' small MoE model (test_megatron_moe_a2a_overlap): 4 layers, 16
# experts of width 2048, top-4, one shared expert, on a slow NVLink (100 GB/s).
MOE = {"layers": 4, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn_hidden": 4096,
       "vocab": 32000, "experts": 16, "experts_per_token": 4, "moe_ffn_hidden": 2048,
       "shared_experts": 1}
SEQ, H = 4096, 2048


def _scn(par: dict, model: dict | None = None, **fw: object):
    return megatron_scenario(dict({"sequence_parallel": par.get("tp", 1) > 1}, **par), 64,
                             model=model or MOE, seq=SEQ, nvlink=100,
                             framework={"name": "megatron", **fw})


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _ops(prog, cls: int = 0):
    return sorted((op for ops in prog.classes[cls].streams.values() for op in ops),
                  key=lambda o: o.index)


def _totals(prog) -> tuple[float, float]:
    ops = [(op, len(c.members)) for c in prog.classes for s in c.streams.values() for op in s]
    return (sum(op.duration * n for op, n in ops), sum(op.flops * n for op, n in ops))


PARS = [{"tp": 1, "ep": 8}, {"tp": 2, "ep": 4}, {"tp": 1, "pp": 2, "vp": 2, "ep": 4}]


# ---------------------------------------------------------------------- (a) same work
@pytest.mark.parametrize("par", PARS)
def test_delaying_moves_gemms_without_changing_time_or_flops(par) -> None:
    off = _program(_scn(par, moe_a2a_overlap=True))
    on = _program(_scn(par, moe_a2a_overlap=True, delay_wgrad_compute=True))
    assert _totals(on) == pytest.approx(_totals(off), rel=1e-12)
    # The host's share moves with them: the wgrads' Python calls and the grouped linears'
    # per-expert cuBLASLt launches (one a local expert, issued from C++).
    host = [sum(op.cpu_s * len(c.members) for c in p.classes for s in c.streams.values()
                for op in s) for p in (on, off)]
    launches = [sum(op.kernels * len(c.members) for c in p.classes
                    for s in c.streams.values() for op in s) for p in (on, off)]
    assert host[0] == pytest.approx(host[1], rel=1e-12)
    # Launches move too; a delayed op whose source op stood for one kernel counts one more.
    assert launches[0] >= launches[1]
    local = MOE["experts"] // par["ep"]
    for op in _ops(on):
        if op.name.endswith("experts delayed wgrad") and "shared" not in op.name:
            assert op.kernels == 2 * local      # fc1 and fc2 wgrad, one launch an expert
    # What moved is each layer's TE wgrad GEMMs: per MoE layer and micro-batch, the experts'
    # grouped fc1 (h -> 2 f, SwiGLU) and fc2 (f -> h), the shared expert's and the
    # attention's QKV (h -> 3h) and output projection, 2 x rows x n_in x n_out FLOPs each,
    # split over tp.
    tp = par["tp"]
    f = MOE["moe_ffn_hidden"]
    # Balanced top-4 routing: the EP group's tokens x 4 copies land on its ranks' experts,
    # SEQ x 4 rows per rank whatever ep; expert-TP (= tp) splits the width.
    experts = 2 * SEQ * 4 * (H * 2 * f + f * H) / tp
    shared = 2 * SEQ * (H * 2 * f + f * H) / tp
    attn = 2 * SEQ * (H * 3 * H + H * H) / tp
    moved = {}
    for op in _ops(on):
        if op.name.endswith("delayed wgrad") and op.micro_batch == 0:
            kind = op.name.split(" L")[0].split()[-1] + ("/shared" if "shared" in op.name else "")
            moved.setdefault(kind, []).append(op.flops)
    n_layers = MOE["layers"] // par.get("pp", 1)
    assert moved["moe"] == pytest.approx([experts] * n_layers)
    assert moved["moe/shared"] == pytest.approx([shared] * n_layers)
    assert moved["attn"] == pytest.approx([attn] * n_layers)


@pytest.mark.parametrize("par", [{"tp": 2, "ep": 4}, {"tp": 1, "pp": 2, "vp": 2, "ep": 4}])
def test_dense_first_layer_and_mtp_layer_conserve_too(par) -> None:
    """DeepSeek's shape: a leading dense layer (its MLP's fc2 and fc1 are the mlp node's
    backward_dw, MLP.backward_dw) and an MTP layer (scheduled like a decoder layer, its
    eh_proj after the attention: build_mtp_layer_callables); under
    sequence parallelism the column-parallel wgrad ops split off by the backward too."""
    m = dict(MOE, first_k_dense=1, mtp_layers=1)
    off = _program(_scn(par, model=m, moe_a2a_overlap=True))
    on = _program(_scn(par, model=m, moe_a2a_overlap=True, delay_wgrad_compute=True))
    assert _totals(on) == pytest.approx(_totals(off), rel=1e-12)
    names = {op.name for c in range(len(on.classes)) for op in _ops(on, c)}
    assert "bwd mlp L0 mb0 delayed wgrad" in names
    assert "bwd moe L4 mb0 experts delayed wgrad" in names    # the MTP layer (layers + 0)
    # Its eh_proj (2h -> h, column-parallel) joins the pre_dispatch node's backward_dw.
    proj = next(op for c in range(len(on.classes)) for op in _ops(on, c)
                if op.name == "bwd mtp proj L4 mb0 delayed wgrad")
    assert proj.flops == pytest.approx(2 * SEQ * 2 * H * H / par["tp"])
    mlp = next(op for op in _ops(on) if op.name == "bwd mlp L0 mb0 delayed wgrad")
    # fc1 (h -> 2 x 4096, SwiGLU) and fc2 (4096 -> h) over the sequence, split over tp.
    ffn = MOE["ffn_hidden"]
    assert mlp.flops == pytest.approx(2 * SEQ * (H * 2 * ffn + ffn * H) / par["tp"])


def test_skewed_routing_classes_keep_their_own_expert_time_and_flops() -> None:
    """Under Zipf routing every EP rank is its own class with its own experts' load
    (moe_ranks): each class's experts (dgrad + delayed wgrad) keep that load's backward, and
    the delayed share is its own rows' wgrad, 2 x rows x (h x 2f + f x h) FLOPs."""
    def skew(s):
        return s.model_copy(update={"training": s.training.model_copy(
            update={"routing": Routing(distribution="zipf", s=1.0)})})

    off = _program(skew(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True)))
    on = _program(skew(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True,
                            delay_wgrad_compute=True)))
    assert len(on.classes) == len(off.classes) > 1
    f = MOE["moe_ffn_hidden"]
    shares = set()
    for c_off, c_on in zip(off.classes, on.classes, strict=True):
        assert c_on.members == c_off.members
        a = {op.name: op for op in c_off.streams["compute"]}
        b = {op.name: op for op in c_on.streams["compute"]}
        main, dw = b["bwd moe L1 mb0 experts"], b["bwd moe L1 mb0 experts delayed wgrad"]
        assert main.duration + dw.duration == pytest.approx(a["bwd moe L1 mb0 experts"].duration)
        assert main.flops + dw.flops == pytest.approx(a["bwd moe L1 mb0 experts"].flops)
        # The experts' backward FLOPs are dgrad + wgrad of fc1 and fc2 (the same GEMM size).
        assert dw.flops == pytest.approx(a["bwd moe L1 mb0 experts"].flops / 2)
        shares.add(round(dw.flops / (2 * (H * 2 * f + f * H))))
    assert len(shares) > 1      # the classes' rows differ
    assert _totals(on) == pytest.approx(_totals(off), rel=1e-12)


# ---------------------------------------------------------------------- (b) issue order
def test_compute_stream_issues_wgrad_where_the_schedule_plan_calls_backward_dw() -> None:
    prog = _program(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True, delay_wgrad_compute=True))
    ops = _ops(prog)
    pair = [op for op in ops if (op.name.startswith("fwd") and " mb1" in op.name
                                 or op.name.startswith("bwd") and " mb0" in op.name)
            and (op.layer is not None or "head" in op.name or "embed" in op.name)]

    def tag(op) -> tuple[str, int | None, str] | None:
        d = op.name.split()[0]
        if op.name.endswith("delayed wgrad"):
            return (d, op.layer, "experts dw" if "experts delayed" in op.name
                    and "shared" not in op.name else "shared dw" if "shared" in op.name
                    else "attn dw")
        if op.collective == "all_to_all" and "probs" not in op.name:
            return (d, op.layer, op.name.rsplit(" ", 2)[-2])
        if op.name.endswith("experts") and "shared" not in op.name:
            return (d, op.layer, "experts")
        if op.name in (f"{d} attn L{op.layer} mb{op.micro_batch}",):
            return (d, op.layer, "attn")
        if "head+loss" in op.name or "embed" in op.name:
            return (d, None, op.name.split()[1])
        return None

    seq = [t for t in (tag(op) for op in pair) if t is not None]
    # TransformerLayerSchedulePlan.run for (f layer i, b layer 3 - i): b combine, f attn, b
    # mlp (experts dgrad), f dispatch, b mlp.backward_dw, b dispatch, f mlp, f combine, b
    # attn, [f mtp_post_process], b pre_dispatch_computation.backward_dw (shared experts,
    # then attention) unless it is the chunk's first layer; that one after every layer,
    # before the forward's output layer and the backward's embedding (phase 6).
    want = [("bwd", None, "head+loss")]
    for i in range(4):
        b = 3 - i
        want += [("bwd", b, "combine"), ("fwd", i, "attn"), ("bwd", b, "experts"),
                 ("fwd", i, "dispatch"), ("bwd", b, "experts dw"), ("bwd", b, "dispatch"),
                 ("fwd", i, "experts"), ("fwd", i, "combine"), ("bwd", b, "attn")]
        if b > 0:
            want += [("bwd", b, "shared dw"), ("bwd", b, "attn dw")]
    want += [("bwd", 0, "shared dw"), ("bwd", 0, "attn dw"), ("fwd", None, "head+loss"),
             ("bwd", None, "embed")]
    # The forward's embedding is issued first (its pre_process), not part of the layers.
    assert [t for t in seq if t != ("fwd", None, "embed")] == want
    # The delayed GEMMs run on the compute stream outside the backward's chain: the
    # dispatch's reverse all-to-all waits for the experts' dgrad, not their wgrad.
    by = {op.name: op for op in ops}
    dw = by["bwd moe L3 mb0 experts delayed wgrad"]
    assert dw.stream == "compute" and not dw.deps
    assert by["bwd moe L3 mb0 dispatch bwd"].deps == [by["bwd moe L3 mb0 experts"]]
    assert by["bwd moe L2 mb0 combine"].deps == [by["bwd attn L3 mb0"]]


# ---------------------------------------------------------------------- (c) time
@pytest.mark.parametrize("par", [{"tp": 1, "ep": 8}, {"tp": 1, "pp": 2, "vp": 2, "ep": 4}])
def test_backward_all_to_alls_start_earlier_and_hide_more(par) -> None:
    off = simulate(_scn(par, moe_a2a_overlap=True))
    on = simulate(_scn(par, moe_a2a_overlap=True, delay_wgrad_compute=True))

    def starts(res) -> dict[str, float]:
        return {r.op.name: r.start for r in res.recorder.ops if r.cls == 0
                and r.op.collective == "all_to_all" and r.op.name.startswith("bwd")}

    def exposed(res) -> float:
        mine = [r for r in res.recorder.ops if r.cls == 0]
        busy = merge_intervals(busy_intervals(mine))
        a2a = merge_intervals([(r.start, r.end) for r in mine
                               if r.op.collective == "all_to_all" and r.end > r.start])
        cover = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a2a for b0, b1 in busy)
        return sum(a1 - a0 for a0, a1 in a2a) - cover

    s_off, s_on = starts(off), starts(on)
    t0_off = min(r.start for r in off.recorder.ops)
    t0_on = min(r.start for r in on.recorder.ops)
    # Relative to the step's start, every backward dispatch all-to-all starts no later (it
    # waits for the experts' dgrad alone), most strictly earlier; where the host is the
    # bound it is issued later by at most the host time of the experts' delayed wgrad,
    # which the plan issues just before it (backward_dw, then moe_dispatch.backward).
    host = max(op.cpu_s for cls in on.program.classes for ops in cls.streams.values()
               for op in ops if op.name.endswith("experts delayed wgrad"))
    d = [(s_on[k] - t0_on) - (s_off[k] - t0_off) for k in s_off if " dispatch bwd" in k]
    assert max(d) <= host + 1e-9 and sum(x < -1e-6 for x in d) >= len(d) // 2
    assert exposed(on) <= exposed(off) * (1 + 1e-9)
    assert on.summary["step_time_s"] <= off.summary["step_time_s"] * (1 + 1e-9)
    # Lower bound: the compute stream's kernels at full speed, one after another.
    for cls in on.program.classes:
        kernels = sum(op.duration for op in cls.streams.get("compute", []))
        assert on.summary["step_time_s"] >= kernels * (1 - 1e-9)


# ---------------------------------------------------------------------- (d) memory
def test_store_holds_output_gradients_until_the_delayed_gemms() -> None:
    on = _program(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True, delay_wgrad_compute=True))
    s = megatron_shape(JobContext.from_scenario(
        _scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True), "s.yaml"))
    assert s.moe is not None
    by = {op.name: op for op in _ops(on)}
    dw = by["bwd moe L3 mb0 experts delayed wgrad"]
    # TE's grouped linears store (output gradient, saved input) per GEMM: the fc1 and fc2
    # output gradients (rows x 2f and rows x h, bf16) are new; the inputs are saved already.
    rows = SEQ * 4 / 16 * 2 * 8
    f = MOE["moe_ffn_hidden"]
    assert dw.free == (("activations", rows * (2 * f + H) * 2),)
    assert ("activations", rows * (2 * f + H) * 2) in by["bwd moe L3 mb0 experts"].alloc
    # Allocated and freed once per layer and micro-batch: the step's books still balance.
    alloc = sum(a for op in _ops(on) for c, a in op.alloc if c == "activations")
    free = sum(a for op in _ops(on) for c, a in op.free if c == "activations")
    assert alloc == pytest.approx(free, rel=1e-12)


# ---------------------------------------------------------------------- (e) refusals
@pytest.mark.parametrize("par,kw,why", [
    ({"tp": 1, "ep": 8}, {}, "overlap_moe_expert_parallel_comm must be enabled"),
    ({"tp": 2, "ep": 4}, {"moe_a2a_overlap": True, "tp_comm_overlap": True},
     "bulk wgrad"),
])
def test_refusals_name_the_key(par, kw, why) -> None:
    with pytest.raises(ScenarioError, match=f"framework.delay_wgrad_compute: .*{why}"):
        _program(_scn(par, delay_wgrad_compute=True, **kw))


def test_off_by_default_is_the_same_program() -> None:
    a = _ops(_program(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True)))
    b = _ops(_program(_scn({"tp": 1, "ep": 8}, moe_a2a_overlap=True,
                           delay_wgrad_compute=False)))
    assert [(o.name, o.duration, o.flops) for o in a] == [(o.name, o.duration, o.flops)
                                                          for o in b]
