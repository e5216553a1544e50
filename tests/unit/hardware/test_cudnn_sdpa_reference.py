"""cuDNN's fused attention as NVIDIA measured it (sim/catalog/reference/cudnn_sdpa.yaml:
cudnn-frontend's training-shape SDPA benchmark, cuDNN 9.22 on a GB200 and 9.19 on an H200)
against :meth:`sim.hardware.compute.ComputeModel.attention_time`.

One constant is fitted here and nowhere else: Blackwell's row fill
(:data:`sim.hardware.blackwell_attention.ROW_FILL_CYCLES`), on the GB200 sliding-window rows
of 2,048-16,384 tokens. Every other row validates: Llama 3.1's shape (head dim 128, full and
causal, 2,048-32,768 tokens) on the GB200, the same on the H200 (whose fitted form was set on
PyTorch's SDPA, not on these), the H200's sliding windows (the GB200's fill carried over in SM
cycles), DeepSeek-V3's (192/128) and flash-attention PR #2605's head-dim-64 cuDNN rows on
another Blackwell part. The gaps left are recorded as strict xfails. The benchmarks ran one
GPU in bursts, so the parts are priced at their burst clock
(:func:`sim.hardware.power.burst_spec`).
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import yaml

from sim import catalog
from sim.catalog import CATALOG_DIR
from sim.hardware import blackwell_attention as bw
from sim.hardware.compute import ComputeModel
from sim.hardware.power import burst_spec
from sim.workload.megatron_mla import attention_head_dims

GPUS = {key: burst_spec(catalog.gpu(key)) for key in ("gb200", "h200")}


def _rows() -> list[dict[str, Any]]:
    with open(CATALOG_DIR / "reference" / "cudnn_sdpa.yaml") as fh:
        ref = yaml.safe_load(fh)
    return [dict(zip(ref["columns"], r, strict=True)) for r in ref["rows"]]


ROWS = _rows()


def _select(**want: Any) -> list[dict[str, Any]]:
    return [r for r in ROWS if all(r[k] == v for k, v in want.items())]


def _model_s(r: dict[str, Any]) -> float:
    """The model's seconds for a row: MLA's two head widths pass as their FLOP-weighted mean,
    as :mod:`sim.workload.megatron_mla` passes them."""
    cm = ComputeModel(GPUS[r["gpu"]], attention_backend="cudnn")
    widths = attention_head_dims(r["head_dim_qk"], r["head_dim_vo"])
    head_dim = round(widths[0] if r["pass"] == "fwd" else widths[1])
    return cm.attention_time(r["batch"], r["q_heads"], r["seq"], head_dim, r["pass"],
                             causal=r["mask"] == "causal", window=r["window"])


def _ratio(r: dict[str, Any]) -> float:
    return _model_s(r) / (r["ms"] * 1e-3)


def _fit_rows(pass_: str) -> list[dict[str, Any]]:
    return [r for r in _select(gpu="gb200", model="gpt_oss", dtype="bfloat16", **{"pass": pass_})
            if r["seq"] <= 16384]


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_row_fill_is_the_fit_of_the_sliding_window_rows(pass_: str) -> None:
    # A window of 128 keys leaves two score tiles a row: 70% of those calls is the fill. The
    # constant is the median, over the fit rows, of (measured - score tiles' time) per row
    # tile an SM runs, in SM cycles. (The 32,768-token forward, 3.2x the 16k time for 2x the
    # rows, is left out of the fit and of every check.)
    gb200 = GPUS["gb200"]
    cycles = bw.sustained_cycles_per_s(gb200)
    per_tile = []
    for r in _fit_rows(pass_):
        groups = r["batch"] * r["q_heads"]
        fill = bw.row_fill_seconds(gb200, pass_, r["seq"], groups)
        tiles_per_sm = -(-groups * -(-r["seq"] // bw.TILE_M) // gb200.sm_count)
        per_tile.append((r["ms"] * 1e-3 - (_model_s(r) - fill)) / tiles_per_sm * cycles)
    assert statistics.median(per_tile) == pytest.approx(bw.ROW_FILL_CYCLES[pass_], rel=0.01)
    assert all(_ratio(r) == pytest.approx(1.0, abs=0.06) for r in _fit_rows(pass_))


@pytest.mark.parametrize("r", _select(gpu="gb200", model="llama3.1", dtype="bfloat16"),
                         ids=lambda r: f"{r['mask']}-{r['seq']}-{r['pass']}")
def test_gb200_llama_shapes_validate(r: dict[str, Any]) -> None:
    # Not fitted on: head dim 128, GQA 64/8, batch 2. Model over measured 0.89-1.07 (the
    # 2,048-token causal backward the lowest); within 12% each.
    assert _ratio(r) == pytest.approx(1.0, abs=0.12)


def test_gb200_llama_shapes_mean_error() -> None:
    ratios = [_ratio(r) for r in _select(gpu="gb200", model="llama3.1", dtype="bfloat16")]
    assert statistics.mean(abs(x - 1.0) for x in ratios) < 0.05


@pytest.mark.parametrize("pass_", ["fwd", pytest.param("bwd", marks=pytest.mark.xfail(
    strict=True, reason="DeepSeek's 192/128 backward runs 13-26% faster in the model than "
    "cuDNN measured: its shared-memory count passes one mean head width for every operand"))])
def test_gb200_deepseek_shapes(pass_: str) -> None:
    rows = _select(gpu="gb200", model="dsv3", dtype="bfloat16", **{"pass": pass_})
    assert all(_ratio(r) == pytest.approx(1.0, abs=0.15) for r in rows)


def test_h200_llama_shapes() -> None:
    # Hopper keeps the form fitted on PyTorch 2.11's SDPA (calibration/h200-kernels.json,
    # 16 heads x 2,048-16,384 tokens); cuDNN 9.19 called directly at 64/8 heads: model over
    # measured 0.85-1.25, the median within 10%.
    ratios = [_ratio(r) for r in _select(gpu="h200", model="llama3.1", dtype="bfloat16")]
    assert all(0.8 < x < 1.3 for x in ratios)
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.10)


def test_h200_sliding_window_shapes_take_blackwells_fill() -> None:
    # Not fitted on: Hopper's form (fitted on whole causal rows) with Blackwell's row fill in
    # SM cycles, the share a window's band leaves unpaid. cuDNN 9.19, 1,024-key window, head
    # dim 64: model over measured 0.63-0.85 without the fill; with it 0.82-1.08 from 4,096
    # tokens and 0.72-0.87 at 2,048 (short rows, as the H200's causal 2,048 rows: 0.85).
    rows = _select(gpu="h200", model="gpt_oss", dtype="bfloat16")
    assert all(0.8 < _ratio(r) < 1.15 for r in rows if r["seq"] >= 4096)
    assert all(0.7 < _ratio(r) < 1.0 for r in rows if r["seq"] < 4096)


def test_hopper_window_cost_grows_with_the_window() -> None:
    # The fill a band pays shrinks as the band grows, to nothing at the whole row: the cost
    # never falls as the window widens, and a window of the whole sequence is no window.
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    for p in ("fwd", "bwd"):
        t = [cm.attention_time(2, 8, 4096, 64, p, window=w) for w in (128, 1024, 2048, 4000)]
        assert t == sorted(t)
        assert t[-1] <= cm.attention_time(2, 8, 4096, 64, p)


def _pr2605(causal: bool) -> list[tuple[int, float]]:
    with open(CATALOG_DIR / "reference" / "blackwell_attention.yaml") as fh:
        ref = yaml.safe_load(fh)
    key = "causal" if causal else "noncausal"
    return [(r["seqlen"], r["cudnn"]) for r in ref[f"cudnn_vs_fa4_fwd_pr2605_hdim64_{key}"]]


def _pr2605_time_ratio(seq: int, tflops: float, causal: bool) -> float:
    """Model time over measured for flash-attention PR #2605's cuDNN forward (head dim 64,
    32 heads, batch x seq = 32k, a 2,500 TFLOP/s Blackwell part: priced as the GB200)."""
    batch, heads, hd = 32768 // seq, 32, 64
    flops = 4.0 * batch * heads * seq * seq * hd * (0.5 if causal else 1.0)
    cm = ComputeModel(GPUS["gb200"], attention_backend="cudnn")
    return cm.attention_time(batch, heads, seq, hd, "fwd", causal=causal) / (flops / tflops / 1e12)


@pytest.mark.parametrize("causal", [False, True])
def test_pr2605_head_dim_64_from_4k_tokens(causal: bool) -> None:
    # A second GPU and cuDNN release, not fitted on: model over measured 1.12-1.20 from 4,096
    # tokens (the exponential-bound head-dim-64 tiles and the fill both a little slow).
    for seq, tflops in _pr2605(causal):
        if seq >= 4096:
            assert 1.0 < _pr2605_time_ratio(seq, tflops, causal) < 1.25


@pytest.mark.xfail(strict=True, reason="PR #2605's kernel pays about a third of cuDNN 9.22's "
                   "fill a row (0.5-1.2 us beyond its score tiles, against 2.7-3.1 us in every "
                   "cuDNN 9.22 row, windowed or not): 1,024-2,048 tokens run 1.28-1.49x slower "
                   "in the model")
def test_pr2605_head_dim_64_short_rows() -> None:
    for causal in (False, True):
        for seq, tflops in _pr2605(causal):
            if seq < 4096:
                assert _pr2605_time_ratio(seq, tflops, causal) < 1.25


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_forward_steps_each_pay_their_fill(cp: int) -> None:
    # Transformer Engine issues the forward ring's cp calls on two alternating streams: half
    # the score rectangle in all, and 1 + 0.75 (cp - 1) local rows' fills over the steps (the
    # diagonal step every local row, the others all or half of them). Hopper keeps its
    # fitted form.
    local, groups = 4096, 16
    gb200 = ComputeModel(GPUS["gb200"], attention_backend="cudnn")
    whole = gb200.attention_time(1, groups, local, 128, "fwd", kv_seq=cp * local, causal=False)
    scores = whole - bw.row_fill_seconds(GPUS["gb200"], "fwd", local, groups)
    fill = bw.row_fill_seconds(GPUS["gb200"], "fwd", local, groups)
    got = gb200.cp_attention_time(1, groups, local, 128, "fwd", cp * local)
    assert got == pytest.approx(0.5 * scores + (1 + 0.75 * (cp - 1)) * fill, rel=1e-9)
    h200 = ComputeModel(GPUS["h200"], attention_backend="cudnn")
    assert h200.cp_attention_time(1, groups, local, 128, "fwd", cp * local) == pytest.approx(
        0.5 * h200.attention_time(1, groups, local, 128, "fwd", kv_seq=cp * local,
                                  causal=False), rel=1e-12)


@pytest.mark.parametrize("gpu", ["gb200", "h200"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_backward_runs_its_steps_in_turn(gpu: str, cp: int) -> None:
    # AttnFuncWithCPAndKVP2P.backward: one stream, one call a step: the diagonal step causal
    # over the local rows, then cp - 1 steps each as slow as the slower of all queries on
    # half the keys and half the queries on all the keys.
    local, groups = 4096, 16
    cm = ComputeModel(GPUS[gpu], attention_backend="cudnn")
    diag = cm.attention_time(1, groups, local, 128, "bwd", causal=True)
    up = cm.attention_time(1, groups, local // 2, 128, "bwd", kv_seq=local, causal=False)
    lo = cm.attention_time(1, groups, local, 128, "bwd", kv_seq=local // 2, causal=False)
    got = cm.cp_attention_time(1, groups, local, 128, "bwd", cp * local)
    assert got == pytest.approx(diag + (cp - 1) * max(up, lo), rel=1e-12)
    # The same work as half the whole rectangle, at no better a rate.
    half = 0.5 * cm.attention_time(1, groups, local, 128, "bwd", kv_seq=cp * local,
                                   causal=False)
    assert half <= got <= 1.25 * half
