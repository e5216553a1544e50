"""FP8 attention (``framework.fp8_dot_product_attention``) priced at cuDNN's measured gain over
BF16 (sim/hardware/fp8_attention.py; the figures in sim/catalog/reference/cudnn_sdpa.yaml)."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.fp8_attention import fp8_attention_gain
from sim.hardware.power import burst_spec

GB200 = burst_spec(catalog.gpu("gb200"))


@pytest.mark.parametrize("fmt,pass_,seq,bf16_ms,fp8_ms", [
    # cuDNN 9.22 on a GB200, Llama 3.1's shape (64/8 heads, head dim 128), causal
    ("fp8", "fwd", 8192, 1.397, 1.074), ("fp8", "bwd", 8192, 4.127, 3.781),
    ("mxfp8", "bwd", 4096, 1.198, 1.305)])
def test_gain_is_the_measured_ratio_at_measured_lengths(fmt, pass_, seq, bf16_ms, fp8_ms) -> None:
    got = fp8_attention_gain("blackwell", fmt, pass_, "causal", 128, seq)
    assert got == pytest.approx(bf16_ms / fp8_ms, rel=1e-9)


def test_gain_interpolates_between_lengths_and_holds_at_the_ends() -> None:
    lo = fp8_attention_gain("blackwell", "fp8", "bwd", "full", 128, 4096)
    hi = fp8_attention_gain("blackwell", "fp8", "bwd", "full", 128, 8192)
    mid = fp8_attention_gain("blackwell", "fp8", "bwd", "full", 128, 5793)   # ~2^12.5
    assert min(lo, hi) < mid < max(lo, hi)
    assert fp8_attention_gain("blackwell", "fp8", "fwd", "full", 128, 512) == \
        fp8_attention_gain("blackwell", "fp8", "fwd", "full", 128, 2048)


def test_no_measured_kernel_means_the_16_bit_one() -> None:
    # Ampere has no FP8; cuDNN 9.19 refused FP8 with a sliding window on the H200.
    assert fp8_attention_gain("ampere", "fp8", "fwd", "causal", 128, 4096) == 1.0
    assert fp8_attention_gain("hopper", "fp8", "bwd", "window", 64, 4096) == 1.0


@pytest.mark.parametrize("seq,fp8_ms", [(2048, 0.536), (4096, 1.731), (8192, 6.176)])
def test_fp8_window_backward_runs_the_whole_triangle(seq: int, fp8_ms: float) -> None:
    # cuDNN 9.22's FP8 backward under a 128-key window grows 4x per doubling, as the whole
    # causal triangle does (its BF16 one 2x): priced as the causal call at the causal gain,
    # not from these rows, it lands within 12% of each (2 x 128 heads of 64, GB200).
    cm = ComputeModel(GB200, attention_backend="cudnn")
    t8 = cm.attention_time(2, 128, seq, 64, "bwd", window=128, fp8="fp8")
    assert t8 == pytest.approx(fp8_ms * 1e-3, rel=0.12)
    assert t8 > cm.attention_time(2, 128, seq, 64, "bwd", window=128)   # slower than BF16


# ------------------------------------------------------------- carried to Blackwell Ultra
GB300 = burst_spec(catalog.gpu("gb300"))


def test_blackwell_ultras_fp8_forward_gains_what_nvidia_measured_on_deepseek_v3() -> None:
    # NVIDIA technical blog "Making Softmax More Efficient with NVIDIA Blackwell Ultra"
    # (2026-02): doubling MUFU.EX2 gives "~35%" more FP8 forward-pass throughput for
    # DeepSeek-V3's attention on a GB300 than on a GB200. Nothing was fitted to it: the
    # carried gain comes from the units (FA-4's feeds and speeds). MLA's 192/128 heads are
    # priced at the FLOP-weighted width 160 (sim/workload/megatron_mla.py); 2 x 128 heads of
    # 4,096 tokens, causal.
    def fwd(gpu, fp8):
        return ComputeModel(gpu, attention_backend="cudnn").attention_time(
            2, 128, 4096, 160, "fwd", fp8=fp8)
    assert fwd(GB200, "fp8") / fwd(GB300, "fp8") == pytest.approx(1.35, rel=0.05)
    # BF16 is MMA-bound on both (the doubled MUFU does not show): only the parts' SMs x clock.
    assert fwd(GB200, None) / fwd(GB300, None) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("head_dim", [64, 128, 160, 192])
@pytest.mark.parametrize("seq", [2048, 8192])
def test_the_carried_gain_leaves_measured_blackwell_and_every_backward_alone(
        head_dim: int, seq: int) -> None:
    from sim.hardware.fp8_attention import fp8_attention_gain_on
    for fmt in ("fp8", "mxfp8"):
        measured = {p: fp8_attention_gain("blackwell", fmt, p, "causal", head_dim, seq)
                    for p in ("fwd", "bwd")}
        for part in ("b200", "gb200"):      # the measured part's MUFU: its own figure
            for p in ("fwd", "bwd"):
                assert fp8_attention_gain_on(catalog.gpu(part), fmt, p, "causal", head_dim,
                                             seq) == measured[p]
        for part in ("b300", "gb300"):
            # Backward: shared memory binds both parts, the exponentials never: unchanged.
            assert fp8_attention_gain_on(catalog.gpu(part), fmt, "bwd", "causal", head_dim,
                                         seq) == pytest.approx(measured["bwd"], rel=1e-12)
            # Forward: never less than measured, more wherever the exponentials bound it.
            assert fp8_attention_gain_on(catalog.gpu(part), fmt, "fwd", "causal", head_dim,
                                         seq) >= measured["fwd"]
