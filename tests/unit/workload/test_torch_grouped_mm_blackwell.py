"""torchtitan's expert GEMMs (``torch._grouped_mm``, bf16, and torchao's MXFP8 grouped GEMM)
on a B200 against torchao's timing.

Truth: ``sim/catalog/reference/torchao_grouped_mm.yaml`` (pytorch/ao README at ff163084e,
BSD-3-Clause): forward plus backward of one ``torch._grouped_mm`` over 128,000 rows in 1-8
groups, Llama 4 Scout's and DeepSeek-V3's expert shapes, torch 2.10 nightly, compiled. The
simulator prices torchtitan's grouped GEMM with :func:`sim.workload.grouped_gemm.grouped_gemm_time`
(one launch) times ``TORCH_GROUPED_MM_SLOWDOWN["blackwell"]``, fitted on the Llama 4 Scout rows
(``tools/fit_torch_grouped_mm.py``); the DeepSeek-V3 rows check it. The benchmark's loss and
gradient accumulation are priced as the memory-bound kernels they are. The measured kernel ran
at 0.71-0.86 PFLOP/s, a third of the B200's bf16 peak even with one group (one plain GEMM that
cuBLAS runs at about twice that).

The same table times torchao's MXFP8 grouped GEMM (torchtitan's ``quantize.grouped_mm.mx``):
:func:`sim.workload.mx_grouped_mm.mx_grouped_linear` builds its casts, scale rearrangements and
three block-scaled GEMMs from rules set elsewhere (Blackwell's MXFP8 GEMM rate, the bf16
grouped kernel's slowdown above, memory-bound casts); nothing was fitted to these rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.power import burst_spec
from sim.workload.block_pricing import kernel_time
from sim.workload.grouped_gemm import grouped_gemm_time, torch_grouped_mm_slowdown
from sim.workload.layer_builder import _Builder
from sim.workload.moe_ops import STYLE, MoELayout
from sim.workload.mx_grouped_mm import mx_grouped_linear

REF = yaml.safe_load((Path(catalog.__file__).parent / "reference"
                      / "torchao_grouped_mm.yaml").read_text())
BF16 = 2


def _b200() -> ComputeModel:
    # A kernel benchmark: the part at its burst clock (sim/hardware/power.py, burst_spec).
    return ComputeModel(burst_spec(catalog.gpu("b200")), precision="bf16")


def _harness_us(cm: ComputeModel, m: int, n: int, k: int, g: int) -> float:
    """What the benchmark times besides the grouped GEMM call itself."""
    out = m * n * BF16
    # mse_loss forward (a reduction over out and labels), its backward (reads both, writes
    # grad_out), and A.grad += dA, B.grad += dB (read, read, write).
    loss = cm.membound_time(2 * out, "reduction") + cm.membound_time(3 * out)
    accumulate = cm.membound_time(3 * m * k * BF16) + cm.membound_time(3 * g * n * k * BF16)
    return (loss + accumulate) * 1e6


def _mxfp8_us(cm: ComputeModel, m: int, n: int, k: int, g: int) -> float:
    """One ``_MXFP8GroupedMM`` call's kernels, forward and backward, as the module builds them
    (the wgrad's accumulation is the harness's own)."""
    b = _Builder("bench", STYLE)
    x = b.t("a", m * k, BF16)
    mx_grouped_linear(b, x, (m / g,) * g, k, n, "mm", MoELayout(torch_grouped_mm=True,
                                                                torchao_mx=True))
    block = b.finish()
    return sum(kernel_time(cm, kk) for kk in block.forward + block.backward) * 1e6


def _simulated_us(cm: ComputeModel, m: int, n: int, k: int, g: int) -> float:
    rows = [m / g] * g
    gemms = sum(grouped_gemm_time(cm, rows, k, n, p) for p in ("fwd", "dgrad", "wgrad")) \
        * torch_grouped_mm_slowdown(cm.gpu.arch)
    return gemms * 1e6 + _harness_us(cm, m, n, k, g)


def _cases(column: str = "us"):
    for model, rows in REF["shapes"].items():
        for r in rows:
            yield pytest.param(r["n"], r["k"], r["g"], r[column], id=f"{model}-g{r['g']}")


def test_measured_rate_is_a_third_of_peak() -> None:
    # The reference itself: 3 GEMMs of 2 x M x N x K FLOPs in the measured time.
    m = REF["total_m"]
    rates = [3 * 2 * m * r["n"] * r["k"] / (r["us"] * 1e-6)
             for rows in REF["shapes"].values() for r in rows]
    peak = catalog.gpu("b200").peak_flops("bf16")
    assert 0.30 < min(rates) / peak and max(rates) / peak < 0.40


@pytest.mark.parametrize("n,k,g,measured_us", list(_cases()))
def test_grouped_mm_forward_backward(n: int, k: int, g: int, measured_us: float) -> None:
    # Fitted on the Llama 4 Scout rows; DeepSeek-V3's (-7% to +12%) are the check.
    assert _simulated_us(_b200(), REF["total_m"], n, k, g) == pytest.approx(measured_us,
                                                                            rel=0.15)


def test_simulated_gemms_dominate_the_benchmark() -> None:
    # The loss and gradient accumulation the benchmark also times are a few percent of it in
    # the simulation too, so the gap above is the GEMMs'.
    cm = _b200()
    m, n, k, g = REF["total_m"], 8192, 5120, 4
    gemms = sum(grouped_gemm_time(cm, [m / g] * g, k, n, p)
                for p in ("fwd", "dgrad", "wgrad")) * torch_grouped_mm_slowdown("blackwell") * 1e6
    assert gemms / _simulated_us(cm, m, n, k, g) > 0.85


@pytest.mark.parametrize("n,k,g,measured_us", list(_cases("mxfp8_us")))
def test_mxfp8_grouped_mm_forward_backward(n: int, k: int, g: int, measured_us: float) -> None:
    # torchao's scaled_fwd_bwd_us: Llama 4 Scout's shapes +1% to +12% simulated, DeepSeek-V3's
    # -14% to -1% (its casts weigh more beside fewer FLOPs a row); nothing fitted to them.
    cm = _b200()
    m = REF["total_m"]
    simulated = _mxfp8_us(cm, m, n, k, g) + _harness_us(cm, m, n, k, g)
    assert simulated == pytest.approx(measured_us, rel=0.15)


def test_mxfp8_gains_over_bf16_as_measured() -> None:
    # Measured, MXFP8 takes 0.55-0.61 of bf16's time on Llama 4 Scout's shapes and 0.63-0.84
    # on DeepSeek-V3's, where the casts weigh more; the simulated ratios keep that order and
    # lie in the measured span of each family give or take 0.1.
    cm, m = _b200(), REF["total_m"]
    for family, rows in REF["shapes"].items():
        for r in rows:
            n, k, g = r["n"], r["k"], r["g"]
            harness = _harness_us(cm, m, n, k, g)
            ratio = (_mxfp8_us(cm, m, n, k, g) + harness) / _simulated_us(cm, m, n, k, g)
            lo = min(x["mxfp8_us"] / x["us"] for x in rows)
            hi = max(x["mxfp8_us"] / x["us"] for x in rows)
            assert lo - 0.1 < ratio < hi + 0.1, (family, g, ratio)


def _moe_layer_ms(cm: ComputeModel, dim: int, hidden: int, mx: bool) -> float:
    """torchtitan's MoE module as torchao's layer benchmark runs it (see the reference file):
    router, scoring before the experts, the experts' grouped GEMMs, the shared expert and the
    unsort-and-sum, forward and backward, plus the benchmark's mse_loss."""
    from sim.frameworks.fsdp2.moe import (
        MXFP8_GROUP_ALIGNMENT_SIZE,
        TOKEN_GROUP_ALIGN_SIZE_M,
        _aligned,
    )
    from sim.frameworks.fsdp2.moe_blocks import combine_block, score_block
    from sim.scenario import scenario_from_dict
    from sim.workload.block_pricing import price_block
    from sim.workload.model import ModelSpec
    from sim.workload.moe_ops import balanced_tokens_per_expert, moe_layer_ops

    model = {"layers": 1, "hidden": dim, "heads": 8, "kv_heads": 8, "ffn_hidden": hidden,
             "vocab": 32000, "experts": 8, "experts_per_token": 1, "shared_experts": 1,
             "moe_ffn_hidden": hidden, "router": "sigmoid"}
    sc = scenario_from_dict({"name": "torchao-moe-layer", "model": model,
                             "cluster": {"topology": "dgx-b200", "nodes": 1},
                             "framework": {"name": "fsdp2", "compile": True},
                             "training": {"seq_len": 8192, "micro_batch_size": 16,
                                          "global_batch_size": 128, "precision": "bf16"}})
    m = ModelSpec.from_ref(sc.model, 8192)
    tokens = REF["moe_layer"]["total_m"]
    lay = MoELayout(router_fusion=False, aux_loss=False, z_loss=False, permute="plain",
                    torch_grouped_mm=True, torchao_mx=mx)
    rows = _aligned(balanced_tokens_per_expert(tokens, 1, 8, 1),
                    MXFP8_GROUP_ALIGNMENT_SIZE if mx else TOKEN_GROUP_ALIGN_SIZE_M)
    ops = moe_layer_ops(m, lay, tokens=tokens, tokens_per_expert=rows, recv_tokens=(tokens,))
    blocks = [*ops.blocks, score_block(m, tokens), combine_block(m, tokens, tokens, True)]
    costs = [price_block(b, STYLE, cm) for b in blocks]
    out = tokens * dim * BF16
    loss = cm.membound_time(2 * out, "reduction") + cm.membound_time(3 * out)
    return (sum(c.fwd_s + c.bwd_s for c in costs) + loss) * 1e3


def _layer_rows():
    for r in REF["moe_layer"]["rows"]:
        yield pytest.param(r, id=r["model"])


@pytest.mark.parametrize("row", list(_layer_rows()))
def test_mxfp8_gain_on_a_whole_moe_layer(row: dict) -> None:
    # Measured 1.431x (Llama 4 Scout's shapes) and 1.148x (DeepSeek-V3's); simulated 1.292x
    # and 1.178x: the whole layer's gain within 10%, the casts' weight against the GEMMs' FLOPs
    # ordering them the same way.
    cm = _b200()
    bf16 = _moe_layer_ms(cm, row["dim"], row["hidden"], mx=False)
    mx = _moe_layer_ms(cm, row["dim"], row["hidden"], mx=True)
    assert bf16 / mx == pytest.approx(row["bf16_ms"] / row["mxfp8_ms"], rel=0.10)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_deepseek_v3_shaped_moe_layer_time(recipe: str) -> None:
    # bf16 87.9 ms simulated against 92.0 measured (-4.5%), MXFP8 74.6 against 80.2 (-7.0%).
    row = next(r for r in REF["moe_layer"]["rows"] if r["model"] == "deepseek_v3")
    simulated = _moe_layer_ms(_b200(), row["dim"], row["hidden"], mx=recipe == "mxfp8")
    assert simulated == pytest.approx(row[f"{recipe}_ms"], rel=0.10)


@pytest.mark.xfail(strict=True, reason="the layer around Llama 4 Scout's experts: bf16 "
                   "205.1 ms simulated against 275.3 measured (-25.5%), MXFP8 158.7 against "
                   "192.4 (-17.5%), where its grouped GEMMs alone come within 12% (above): "
                   "the rest of the layer, not found (docs/calibration.md, fifty-sixth "
                   "session)")
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_llama4_shaped_moe_layer_time(recipe: str) -> None:
    row = next(r for r in REF["moe_layer"]["rows"] if r["model"] == "llama4_16e")
    simulated = _moe_layer_ms(_b200(), row["dim"], row["hidden"], mx=recipe == "mxfp8")
    assert simulated == pytest.approx(row[f"{recipe}_ms"], rel=0.10)
