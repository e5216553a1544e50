"""Fused attention on Blackwell priced from its units (sim/hardware/blackwell_attention.py) against
FlashAttention-4's published roofline and measured B200 figures
(sim/catalog/reference/blackwell_attention.yaml, sources there).

The per-SM rates and the roofline cycle counts come from the FA-4 paper; the measured figures
(Dao-AILab/flash-attention PR #2280) set nothing in the model and check it. Tolerances are
stated per test.
"""

from __future__ import annotations

import math

import pytest
import yaml

from sim import catalog
from sim.catalog import CATALOG_DIR
from sim.hardware import blackwell_attention as bw
from sim.hardware.compute import ComputeModel, exp_cost_flops
from sim.hardware.power import burst_spec, sustained_matrix_flops

# The references are kernel benchmarks, short bursts at the boost clock: the parts as they run
# them, not as a training step holds them at the power limit (sim/hardware/power.py).
B200 = burst_spec(catalog.gpu("b200"))
GB200 = burst_spec(catalog.gpu("gb200"))


@pytest.fixture(scope="module")
def ref() -> dict:
    with open(CATALOG_DIR / "reference" / "blackwell_attention.yaml") as fh:
        return yaml.safe_load(fh)


def _tflops(gpu, backend: str, batch: int, heads: int, seq: int, hd: int, pass_: str,
            causal: bool) -> float:
    cm = ComputeModel(gpu, attention_backend=backend)
    flops = 4.0 * batch * heads * seq * seq * hd * (0.5 if causal else 1.0)
    flops *= 2.5 if pass_ == "bwd" else 1.0
    return flops / cm.attention_time(batch, heads, seq, hd, pass_, causal=causal) / 1e12


def test_units_are_the_papers(ref: dict) -> None:
    u = ref["units_per_sm_per_clock"]
    assert {a: bw.MMA_FLOPS_PER_CLOCK_SM[a] for a in u["mma_bf16_flops"]} == u["mma_bf16_flops"]
    assert (bw.MUFU_EXP_PER_CLOCK_SM, bw.SMEM_BYTES_PER_CLOCK_SM) == (u["mufu_exp"],
                                                                      u["smem_bytes"])


def test_tile_cycles_reproduce_the_papers_roofline(ref: dict) -> None:
    # FA-4 sec. 3 at head_dim 128: forward co-bound by MMA and exponentials, backward bound by
    # shared memory (3,328 cycles against 2,560 of MMA).
    r = ref["roofline_cycles_hdim128_tile128"]
    f, b = bw.tile_cycles("fwd", 128), bw.tile_cycles("bwd", 128)
    assert (f.mma, f.exp) == (r["fwd"]["mma"], r["fwd"]["exp"])
    assert (b.mma, b.smem) == (r["bwd"]["mma"], r["bwd"]["smem"])
    assert f.smem < f.bound and b.bound == b.smem


def test_hopper_fit_exponential_cost_is_the_same_units_ratio() -> None:
    # The H200 fit prices one exponential as exp_cost_flops matmul FLOPs (989 / 3.9, FA-3
    # sec. 3); the per-SM units give Hopper's MMA/MUFU ratio 4096 / 16 = 256, within 1.5%.
    # On Blackwell the same ratio is 512: why scaling the Hopper form by matrix throughput alone
    # ran the exponentials twice as fast as the silicon.
    hopper = bw.MMA_FLOPS_PER_CLOCK_SM["hopper"] / bw.MUFU_EXP_PER_CLOCK_SM
    assert exp_cost_flops() == pytest.approx(hopper, rel=0.015)
    assert bw.MMA_FLOPS_PER_CLOCK_SM["blackwell"] / bw.MUFU_EXP_PER_CLOCK_SM == 2 * hopper


@pytest.mark.parametrize("causal,pass_", [
    (False, "fwd"), (False, "bwd"), (True, "fwd"), (True, "bwd")])
def test_fa4_against_its_measured_b200_figures(ref: dict, causal: bool, pass_: str) -> None:
    # PR #2280: batch 4, 16 heads, 8k, head_dim 128; backward with one SM per tile (the
    # model's; the 2-CTA kernel's +9% is not modelled). Measured 1,535 / 1,248 non-causal,
    # 1,418 / 1,118 causal; the model gives 1,546 / 1,215 and 1,446 / 1,159 (score tiles
    # alone: 1,647 / 1,267 and 1,634 / 1,257; the row fill, fitted on cuDNN's sliding-window
    # rows, closes the causal calls' gap from 12-15% to 2-4%). Nothing here was fitted.
    row = next(r for r in ref["fa4_b200_pr2280"] if r["causal"] == causal
               and r["pass"] == pass_ and r.get("cta", 1) == 1 and not r.get("deterministic"))
    got = _tflops(B200, "flash4", 4, 16, 8192, 128, pass_, causal)
    assert got == pytest.approx(row["tflops"], rel=0.05)


def _mla_tflops(causal: bool, pass_: str) -> float:
    # MLA's widths pass as their FLOP-weighted means (sim/workload/megatron_mla.py).
    cm = ComputeModel(B200, attention_backend="flash4")
    flops = 2.0 * 4 * 16 * 8192 * 8192 * (192 + 128) * (0.5 if causal else 1.0)
    flops *= 2.5 if pass_ == "bwd" else 1.0
    hd = 160 if pass_ == "fwd" else 166
    return flops / cm.attention_time(4, 16, 8192, hd, pass_, causal=causal) / 1e12


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pass_", ["fwd", pytest.param("bwd", marks=pytest.mark.xfail(
    strict=True, reason="MLA's 192/128 backward runs 18-25% faster in the model than FA-4 "
    "measured (PR #2270, 2-CTA), as against cuDNN 9.22 (test_cudnn_sdpa_reference.py): "
    "whatever binds it at these widths is not among the three units"))])
def test_fa4_at_mla_widths(ref: dict, causal: bool, pass_: str) -> None:
    # PR #2270: 1,556 / 1,494 TFLOP/s forward (model 1,565 / 1,480), 1,073 / 971 backward
    # (model 1,269 / 1,218). Nothing fitted.
    row = next(r for r in ref["fa4_b200_pr2270_hdim192_128"]
               if r["causal"] == causal and r["pass"] == pass_)
    assert _mla_tflops(causal, pass_) == pytest.approx(row["tflops"], rel=0.05)


def test_fa4_best_is_the_papers_headline(ref: dict) -> None:
    # "up to 1613 TFLOP/s (71% utilization)" on B200: the model's best over sequence lengths
    # (non-causal forward, head_dim 128) within 5%.
    best = max(_tflops(B200, "flash4", max(1, 32768 // s), 16, s, 128, "fwd", False)
               for s in (4096, 8192, 16384, 32768))
    assert best == pytest.approx(ref["headline_b200"]["fa4_best_tflops"], rel=0.05)


def test_forward_exponential_bound_below_head_dim_128() -> None:
    # Tensor-core cycles scale with head_dim, exponentials do not: at 64 the forward is bound
    # by MUFU (less FA-4's software share), so it runs below half its head-dim-128 throughput
    # per score ... but above the MUFU-only bound.
    t64 = bw.tile_cycles("fwd", 64, emulated_exp=bw.FA4_EMULATED_EXP_SHARE)
    assert t64.bound == t64.exp > t64.mma
    mufu_only = bw.tile_cycles("fwd", 64).bound
    assert t64.bound == pytest.approx(mufu_only * (1 - bw.FA4_EMULATED_EXP_SHARE))


@pytest.mark.parametrize("gpu", [B200, GB200])
def test_clock_and_rates_from_the_gpus_own_sms(gpu) -> None:
    # The clock follows from the dense peak over gpu.sm_count (read, not assumed), so a GPU
    # with more SMs at the same peak gets a lower clock and the same per-GPU unit rates.
    f = bw.sm_clock_hz(gpu)
    assert f == pytest.approx(gpu.peak_flops("bf16") / (8192 * gpu.sm_count))
    assert 1.5e9 < f < 2.2e9
    mufu = bw.MUFU_EXP_PER_CLOCK_SM * gpu.sm_count * f
    assert mufu == pytest.approx(gpu.peak_flops("bf16") / 512)


def test_gb200_follows_from_its_units() -> None:
    # Same die, more SMs at a higher sustained clock: every unit scales with SMs x clock, so a
    # long non-causal call runs faster by the ratio of the sustained matrix rates (the
    # catalogue's peak x matmul_efficiency: 1.078 = SMs x maximum clock of the real parts;
    # waves over the SMs aside: 64 groups x 128 row blocks keep both fully busy).
    b = _tflops(B200, "cudnn", 4, 16, 8192, 128, "bwd", False)
    g = _tflops(GB200, "cudnn", 4, 16, 8192, 128, "bwd", False)
    ratio = sustained_matrix_flops(GB200) / sustained_matrix_flops(B200)
    assert g / b == pytest.approx(ratio, rel=0.01)


def test_blackwell_no_longer_runs_exponentials_at_matrix_speed() -> None:
    # The old pricing scaled the whole Hopper form by matrix throughput, making B200
    # attention ~2x the H100's at every head dim. With the exponential on its own unit the
    # head-dim-64 forward gains much less over Hopper than the head-dim-128 one.
    h100 = burst_spec(catalog.gpu("h100-sxm"))   # published figures: bursts
    gain = {hd: _tflops(B200, "cudnn", 2, 2048 // hd, 8192, hd, "fwd", True)
            / _tflops(h100, "cudnn", 2, 2048 // hd, 8192, hd, "fwd", True) for hd in (64, 128)}
    assert gain[64] < 0.85 * gain[128]


def test_hopper_never_reaches_the_blackwell_pricing(monkeypatch) -> None:
    # Hopper keeps its fitted form bit for bit: the unit pricing is not consulted.
    def boom(*a, **k):
        raise AssertionError("blackwell pricing used on Hopper")
    monkeypatch.setattr(bw, "score_seconds", boom)
    for key in ("h100-sxm", "h200", "h800"):
        t = ComputeModel(catalog.gpu(key)).attention_time(1, 16, 16384, 128, "bwd")
        assert math.isfinite(t) and t > 0


@pytest.mark.parametrize("seq,pass_", [(2048, "fwd"), (8192, "fwd"), (16384, "fwd"),
                                       (1024, "bwd"), (2048, "bwd")])
def test_flash2_on_blackwell_runs_at_hoppers_per_sm_rate(ref: dict, seq: int, pass_: str) -> None:
    # FA-2's mma.sync kernels do not reach the tcgen05 tensor cores: measured B200 over
    # published H100 throughput is 1.06-1.20x (issue #1589; FA-3 paper figures), the ratio of
    # SMs x clock (1.14), not of matrix throughput (2.1). The model's ratio within 10% of each.
    b200 = next(r for r in ref["fa2_b200_issue1589_hdim64_noncausal"] if r["seqlen"] == seq)
    measured = b200[pass_] / ref["fa2_h100_hdim64_noncausal"][pass_][seq]
    h100 = burst_spec(catalog.gpu("h100-sxm"))   # published figures: bursts
    batch, heads = 16384 // seq, 32
    model = (_tflops(B200, "flash2", batch, heads, seq, 64, pass_, False)
             / _tflops(h100, "flash2", batch, heads, seq, 64, pass_, False))
    assert model == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize(("arch", "peak_tflops", "sms", "boost_ghz"), [
    ("ampere", 312.0, 108, 1.410),   # A100 SXM datasheet: 312 TF dense FP16/BF16, 1,410 MHz
    ("volta", 125.0, 80, 1.530),     # V100 SXM2 datasheet: 125 TF tensor, 1,530 MHz
])
def test_older_tensor_cores_from_their_datasheets(arch: str, peak_tflops: float, sms: int,
                                                  boost_ghz: float) -> None:
    # Peak / (SMs x boost clock): the per-SM, per-clock dense rate the row fill's clock uses.
    per_clock = peak_tflops * 1e12 / (sms * boost_ghz * 1e9)
    assert bw.MMA_FLOPS_PER_CLOCK_SM[arch] == pytest.approx(per_clock, rel=0.01)


@pytest.mark.parametrize("release,fwd,bwd", [
    ((9, 11, 0), 1.2, 1.1),     # NeMo 25.09's container: older than the measured 9.13
    ((9, 13, 1), 1.2, 1.1),     # 25.11's: FA-4 over cuDNN 9.13 (blog, PR #1945)
    ((9, 18, 0), 1.2, 1.1),     # 26.02's: unmeasured, priced as the newest measured before it
    ((9, 20, 0), 1.0, 1.0),     # 26.04's: from 9.19 at FA-4's rates (sglang PR #33655)
    (None, 1.0, 1.0),           # unnamed: the newest measured
])
def test_cudnn_release_sets_the_score_rate_not_the_fill(ref: dict, release, fwd: float,
                                                         bwd: float) -> None:
    # The gap is the published FA-4-over-cuDNN-9.13 ratio, applied to the score tiles; the
    # row fill (fitted on cuDNN 9.22's own windows) is the release's pipeline, not its rate.
    assert bw.CUDNN_913_GAP == pytest.approx(
        {"fwd": sum(ref["headline_b200"]["fa4_over_cudnn_913_fwd"]) / 2,   # the midpoint
         "bwd": ref["fa4_bwd_over_cudnn_pr1945"]})
    b200 = catalog.gpu("b200")
    args = (2, 16, 8192, 128)
    for pass_, gap in (("fwd", fwd), ("bwd", bwd)):
        new = ComputeModel(b200, attention_backend="cudnn")
        old = ComputeModel(b200, attention_backend="cudnn", cudnn_release=release)
        fill = bw.row_fill_seconds(b200, pass_, 8192, 2 * 16)
        t_new = new.attention_time(*args, pass_)
        t_old = old.attention_time(*args, pass_)
        assert (t_old - fill) / (t_new - fill) == pytest.approx(gap, rel=1e-12)


def test_cudnn_release_leaves_hopper_and_flash_attention_alone() -> None:
    for gpu, backend in (("h100-sxm", "cudnn"), ("b200", "flash4")):
        g = catalog.gpu(gpu)
        assert ComputeModel(g, attention_backend=backend, cudnn_release=(9, 11, 0)) \
            .attention_time(2, 16, 8192, 128, "bwd") == \
            ComputeModel(g, attention_backend=backend).attention_time(2, 16, 8192, 128, "bwd")


def test_cudnn_version_is_a_quoted_release() -> None:
    # Unquoted, YAML reads 9.20 as the number 9.2: refused with the fix in one line.
    from sim.scenario import ScenarioError, load_scenario

    with pytest.raises(ScenarioError, match=r"training\.cudnn_version: write 9\.2 as a quoted"):
        load_scenario("llama3.2-1b-1xh200", ["training.cudnn_version=9.20"])
    assert load_scenario("llama3.2-1b-1xh200", ['training.cudnn_version="9.20.0"']) \
        .training.cudnn_version == "9.20.0"
