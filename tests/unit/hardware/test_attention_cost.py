"""Attention kernels per framework and GPU generation (sim/hardware/attention_cost.py) against the
published FlashAttention-2/3 and cuDNN figures and PyTorch's SDPA dispatch history.

Figures: FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608) fig. 5, forward on an
H100 SXM5 (Dao-AILab/flash-attention assets/flash3_fp16_fwd.png); the FlashAttention-2
README's forward + backward figures on H100 and A100 (assets/flash2_h100_fwd_bwd_benchmark.png,
assets/flash2_a100_fwd_bwd_benchmark.png; Dao 2023, arXiv 2307.08691, fig. 4). Benchmark
shape of both: 16k tokens per call (batch 16,384 / seq), hidden 2048 (2048 / head_dim heads).
Only fig. 5(d) at 16k and fig. 6 at 16k enter the model (the anchors); every other point
checks it.
"""

from __future__ import annotations

import math

import pytest
from conftest import make_scenario

from sim import catalog
from sim.api import simulate
from sim.frameworks.common.base import JobContext
from sim.hardware.attention_cost import (
    ANCHOR,
    TRITON_OVER_CUDA_AT_128,
    matmul_share,
    sdpa_backend,
    share_of_flash2,
)
from sim.hardware.compute import ComputeModel
from sim.hardware.flash_curves import (
    FLASH1_CAUSAL_FWD_BWD,
    FLASH2_CAUSAL_FWD_BWD,
    SEQS,
    flash2_causal_speedup,
)
from sim.hardware.power import burst_spec
from sim.scenario import ScenarioError
from sim.workload.layer_ops import Kernel, kernel_time

# The published kernel figures are bursts: the part at its burst clock, not a busy node's
# held rate (h100-sxm.saturated_rate_factor).
H100 = burst_spec(catalog.gpu("h100-sxm"))
A100 = catalog.gpu("a100-80gb")


def _tflops(cm: ComputeModel, seq: int, hd: int, pass_: str, causal: bool = True) -> float:
    """Achieved TFLOP/s as the FlashAttention papers count them, at their benchmark shape."""
    heads, batch = 2048 // hd, max(1, 16384 // seq)
    fwd = 4.0 * batch * heads * seq * seq * hd * (0.5 if causal else 1.0)
    tf = cm.attention_time(batch, heads, seq, hd, "fwd", causal=causal)
    tb = cm.attention_time(batch, heads, seq, hd, "bwd", causal=causal)
    if pass_ == "fwd":
        return fwd / tf / 1e12
    if pass_ == "bwd":
        return 2.5 * fwd / tb / 1e12
    return 3.5 * fwd / (tf + tb) / 1e12


def test_the_h200_calibration_ran_cudnn_not_flash_attention_2() -> None:
    # PyTorch 2.11 SDPA, causal, head_dim 128, 16 heads x 16k tokens: 612 TFLOP/s forward.
    # FA2 peaks at 335 on the same SMs (fig. 5d); cuDNN 9.1 reached 539 there, FA3 616.
    row = next(r for r in catalog.calibration("h200-kernels.json")["attn"]
               if r["seq"] == 16384 and r["heads"] == 16)
    assert row["fwd_tflops"] > 1.5 * 335
    assert 0.9 * 539 < row["fwd_tflops"] < 1.1 * 616


@pytest.mark.parametrize("backend,hd,causal,seq,published,tol", [
    # fig. 5(d), causal, head dim 128 (16k is the anchor; shorter sequences check the form)
    ("flash2", 128, True, 4096, 319, 0.06), ("flash2", 128, True, 8192, 333, 0.06),
    ("flash3", 128, True, 4096, 579, 0.06), ("flash3", 128, True, 8192, 602, 0.06),
    # fig. 5(b), causal, head dim 64: the exponential's share grows, the tensor-core one not
    ("flash2", 64, True, 8192, 295, 0.10), ("flash2", 64, True, 16384, 299, 0.10),
    ("flash3", 64, True, 8192, 460, 0.10), ("flash3", 64, True, 16384, 473, 0.10),
    # fig. 5(c), no mask, head dim 128 (the form has no extra causal masking cost: +-12%)
    ("flash2", 128, False, 16384, 370, 0.12), ("flash3", 128, False, 16384, 648, 0.12),
])
def test_h100_forward_against_the_flashattention3_paper(backend, hd, causal, seq, published,
                                                        tol) -> None:
    cm = ComputeModel(H100, attention_backend=backend)
    assert _tflops(cm, seq, hd, "fwd", causal) == pytest.approx(published, rel=tol)


@pytest.mark.parametrize("hd,causal,seq,published", [
    # FlashAttention-2 README, H100 80GB SXM5, forward + backward (a different benchmark run
    # from the FA3 paper's anchors): (d) causal hd 128, (c) causal hd 64, (b) no mask hd 128
    (128, True, 4096, 294), (128, True, 8192, 308), (128, True, 16384, 328),
    (64, True, 16384, 284), (128, False, 16384, 338),
])
def test_h100_flash2_forward_backward_against_the_flashattention2_readme(hd, causal, seq,
                                                                          published) -> None:
    cm = ComputeModel(H100, attention_backend="flash2")
    assert _tflops(cm, seq, hd, "fwd_bwd", causal) == pytest.approx(published, rel=0.10)


@pytest.mark.parametrize("hd,causal,seq,published", [
    # FlashAttention-2 README / paper fig. 4, A100 80GB SXM4, forward + backward: nothing of
    # it enters the model (share 1: the form scaled by the A100's dense peak)
    (128, True, 4096, 173), (128, True, 8192, 182), (128, True, 16384, 189),
    (128, False, 16384, 203), (64, True, 16384, 171),
])
def test_a100_flash2_against_the_flashattention2_paper(hd, causal, seq, published) -> None:
    cm = ComputeModel(A100, attention_backend="flash2")
    assert _tflops(cm, seq, hd, "fwd_bwd", causal) == pytest.approx(published, rel=0.12)


def test_pytorch_sdpa_on_h100_ran_flash_attention_2_speed() -> None:
    # pytorch/pytorch issue #142132 (tritonbench, PyTorch 2.6 nightly, H100, no mask): SDPA's
    # default 329 TFLOP/s at (batch 1, 24 heads, 4,608 tokens, head dim 128) against 631
    # for cuDNN -- a third measurement, neither paper's.
    fl = 4.0 * 24 * 4608**2 * 128
    for backend, published in (("flash2", 329), ("cudnn", 631)):
        cm = ComputeModel(H100, attention_backend=backend)
        t = cm.attention_time(1, 24, 4608, 128, "fwd", causal=False)
        assert fl / t / 1e12 == pytest.approx(published, rel=0.12)


def test_on_hopper_flash2_is_slowest_and_flash3_matches_the_measured_cudnn() -> None:
    # fig. 5(d) and fig. 6 at 8k: FA2 at 55-62% of FA3, cuDNN within ~15% of FA3.
    rates = {b: {p: _tflops(ComputeModel(H100, attention_backend=b), 8192, 128, p)
                 for p in ("fwd", "bwd")} for b in ("flash2", "flash3", "cudnn")}
    for p in ("fwd", "bwd"):
        assert 0.50 < rates["flash2"][p] / rates["flash3"][p] < 0.65
        assert rates["cudnn"][p] == pytest.approx(rates["flash3"][p], rel=0.15)
    # Only the tensor-core term differs: FA2 runs its matmuls at about half FA3's speed.
    assert matmul_share("flash2", "hopper", "fwd") == pytest.approx(0.46, abs=0.03)
    assert matmul_share("flash3", "hopper", "fwd") == pytest.approx(1.05, abs=0.05)


@pytest.mark.parametrize("backend", ["flash2", "flash3"])
@pytest.mark.parametrize("seq", [32768, 65536, 131072, 1 << 20])
def test_long_sequences_stay_on_the_published_plateau(backend, seq) -> None:
    # Past 8k the published causal curves are flat (fig. 5d: FA2 333 -> 335 from 8k to 16k,
    # FA3 602 -> 616): one sequence per call, 16 heads. What still rises is the row tiles'
    # fill, whose share halves with each doubling: the rate stays within 4% above 16k's
    # (FA3's own 8k -> 16k step is +2.3%).
    cm = ComputeModel(H100, attention_backend=backend)
    a = ANCHOR

    def rate(s: int) -> float:
        return 2.0 * a["heads"] * s * s * a["head_dim"] / cm.attention_time(
            1, a["heads"], s, a["head_dim"], "fwd")

    assert 0.99 <= rate(seq) / rate(16384) <= 1.04
    # Causal tile skipping: half the unmasked work plus the diagonal tiles (64 of seq).
    full = cm.attention_time(1, 8, seq, 128, "fwd", causal=False)
    assert cm.attention_time(1, 8, seq, 128, "fwd") / full == pytest.approx(
        0.5 * (1 + 64 / seq), rel=0.01)


@pytest.mark.parametrize("backend", ["flash2", "flash3"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_chunks_add_up_to_the_whole_causal_attention(backend, cp) -> None:
    # Megatron's load-balanced chunks (2 x cp, head-tail): each rank attends seq/cp queries
    # to the whole sequence over half of it; the ranks together do the causal triangle,
    # priced by the same kernel as the unsplit attention. (cuDNN adds the H200's measured
    # residual of the chunk's own query length, a shape correction, so it is left out here.)
    # Backward runs the ring's cp calls one after another, each paying its own row fill and
    # the diagonal step its causal edge: within 2% of the whole at these lengths.
    seq = 131072
    cm = ComputeModel(H100, attention_backend=backend)
    for p, rel in (("fwd", 0.01), ("bwd", 0.02)):
        whole = kernel_time(cm, Kernel("a", "attention", attn=(1, 8, seq, 128, p)))
        chunk = kernel_time(cm, Kernel("a", "attention", attn=(1, 8, seq // cp, 128, p),
                                       attn_kv_seq=seq))
        assert cp * chunk == pytest.approx(whole, rel=rel)
        if p == "bwd":
            assert cp * chunk >= whole


@pytest.mark.parametrize("arch,version,expected", [
    ("hopper", "2.4", "flash2"),      # cuDNN needed TORCH_CUDNN_SDPA_ENABLED (PR #128539)
    ("hopper", "2.5.0", "cudnn"),     # PR #125343
    ("hopper", "2.5.1", "flash2"),    # PR #138522 cherry-picked: cuDNN opt-in
    ("hopper", "2.8", "flash2"),      # issue #142132 (2.6): SDPA 329 vs cuDNN 631 TFLOP/s
    ("hopper", "2.9", "cudnn"),       # PR #162073, "for 2.9"
    ("hopper", "2.10", "flash2"),     # PR #171627 / #171895: bundled cuDNN below the gate
    ("hopper", "2.11", "cudnn"),      # the calibration H200's 612 TFLOP/s
    ("blackwell", "2.5.0", "flash2"), ("blackwell", "2.9", "cudnn"),
    ("ampere", "2.11", "flash2"), ("volta", "2.11", "mem_efficient"),
    # PyTorch 2.2 brought FlashAttention-2 to SDPA (release notes); 2.0 and 2.1 ran the first
    ("ampere", "2.1", "flash1"), ("hopper", "2.0", "flash1"), ("hopper", "2.2", "flash2"),
])
def test_sdpa_default_backend_follows_pytorch_releases(arch, version, expected) -> None:
    assert sdpa_backend(arch, version) == expected


def _scenario(framework: dict, gpu: str = "h100-sxm", **training):
    framework = dict(framework)
    parallelism = framework.pop("_parallelism", {})
    return make_scenario({"model": "llama3-8b"},
                         cluster={"gpu": gpu, "nodes": 1, "gpus_per_node": 8},
                         framework=framework, parallelism=parallelism,
                         training={"seq_len": 4096, **training})


@pytest.mark.parametrize("framework,gpu,training,expected", [
    ({"name": "megatron"}, "h100-sxm", {}, "cudnn"),
    ({"name": "megatron"}, "b200", {}, "cudnn"),
    ({"name": "megatron"}, "a100-80gb", {}, "flash2"),
    ({"name": "megatron", "implementation": "local"}, "h100-sxm", {}, "flash2"),
    ({"name": "megatron", "flash_attention": False}, "h100-sxm", {}, "unfused"),
    ({"name": "deepspeed", "zero_stage": 1, "pipeline": {"flash_attention": True},
      "_parallelism": {"tp": 2}}, "h100-sxm", {}, "flash2"),
    ({"name": "fsdp2"}, "h100-sxm", {}, "flash2"),
    ({"name": "fsdp2"}, "h100-sxm", {"torch_version": "2.11"}, "cudnn"),
    ({"name": "fsdp2"}, "a100-80gb", {"torch_version": "2.11"}, "flash2"),
    ({"name": "ddp"}, "h200", {}, "flash2"),
    ({"name": "fairscale"}, "h100-sxm", {}, "flash2"),
    ({"name": "deepspeed"}, "h100-sxm", {"torch_version": "2.9"}, "cudnn"),
    ({"name": "fsdp2"}, "h100-sxm", {"attention_backend": "flash3"}, "flash3"),
    ({"name": "megatron"}, "h100-sxm", {"attention_backend": "sdpa"}, "flash2"),
])
def test_auto_resolves_as_each_framework_does(framework, gpu, training, expected) -> None:
    ctx = JobContext.from_scenario(_scenario(framework, gpu, **training))
    assert ctx.compute.attention_backend == expected


def test_a_kernel_the_gpu_cannot_run_is_refused_naming_the_key() -> None:
    with pytest.raises(ScenarioError, match="training.attention_backend: flash3"):
        JobContext.from_scenario(_scenario({"name": "fsdp2"}, "a100-80gb",
                                           attention_backend="flash3"))
    with pytest.raises(ScenarioError, match="torch_version"):
        _scenario({"name": "fsdp2"}, torch_version=2.10)


def _step(framework: dict, gpu: str, **training) -> dict:
    return simulate(_scenario(framework, gpu, **training)).summary


def test_torchtitan_on_h100_slows_down_megatron_te_and_a100_do_not() -> None:
    # "Before" is the single measured-cuDNN curve, i.e. attention_backend: cudnn.
    fsdp = _step({"name": "fsdp2"}, "h100-sxm")
    assert fsdp["attention_backend"] == "flash2"
    assert fsdp["step_time_s"] > 1.02 * _step({"name": "fsdp2"}, "h100-sxm",
                                             attention_backend="cudnn")["step_time_s"]
    mega = {"name": "megatron", "_parallelism": {"tp": 8}}
    assert _step(mega, "h100-sxm")["step_time_s"] == _step(
        mega, "h100-sxm", attention_backend="cudnn")["step_time_s"]
    # On the A100 FA2 runs the form at share 1, moved only by its published causal curve
    # over length (sim/hardware/flash_curves.py): within 1% of the step.
    assert _step({"name": "fsdp2"}, "a100-80gb")["step_time_s"] == pytest.approx(_step(
        {"name": "fsdp2"}, "a100-80gb", attention_backend="cudnn")["step_time_s"], rel=0.01)


# FlashAttention's first CUDA kernel and FlashAttention-2: the bars of the FlashAttention-2
# paper's fig. 4(c)/(d) (A100) and its H100 figure, causal, forward + backward, at 512 to 16k
# tokens and head dims 64 and 128 (assets/flash2_{a100,h100}_fwd_bwd_benchmark.png; the table
# is sim/hardware/flash_curves.py). The model runs each kernel's causal call at its bar.
@pytest.mark.parametrize("gpu,arch", [(A100, "ampere"), (H100, "hopper")])
@pytest.mark.parametrize("hd", [64, 128])
def test_the_flash_kernels_run_at_the_flashattention2_papers_bars(gpu, arch, hd) -> None:
    for backend, table in (("flash2", FLASH2_CAUSAL_FWD_BWD), ("flash1", FLASH1_CAUSAL_FWD_BWD)):
        cm = ComputeModel(gpu, attention_backend=backend)
        for seq, published in zip(SEQS, table[(arch, hd)], strict=True):
            assert _tflops(cm, seq, hd, "fwd_bwd") == pytest.approx(published, rel=0.03)


def test_between_the_bars_the_curve_is_monotone_and_beyond_them_it_holds() -> None:
    # Lengths between the published ones interpolate (log2); past 16k the curve holds.
    cm = ComputeModel(H100, attention_backend="flash2")
    rates = [_tflops(cm, s, 128, "fwd_bwd") for s in (2048, 3000, 4096, 6000, 8192)]
    assert rates == sorted(rates)
    assert flash2_causal_speedup("hopper", 128, 65536) == flash2_causal_speedup(
        "hopper", 128, 16384)
    # Non-causal calls keep the form (the panels' short bars are unreadable).
    assert ComputeModel(H100, attention_backend="flash2").attention_time(
        2, 16, 8192, 128, "fwd", causal=False) == ComputeModel(
        H100, attention_backend="flash2").attention_time(
        2, 16, 8192, 128, "fwd", causal=False, published_curve=False)


def test_the_first_flash_kernel_keeps_more_of_flash2s_speed_at_head_dim_64() -> None:
    # FA2's gain over FA1 came mostly at the wide head: 0.55-0.57 of its speed at 64 on both
    # parts, 0.42-0.44 at 128; head dims between run between (log2), outside take the edge.
    for arch in ("ampere", "hopper"):
        at = {hd: share_of_flash2("flash1", arch, hd) for hd in (32, 64, 80, 96, 128, 256)}
        assert 0.54 < at[64] < 0.58 and 0.41 < at[128] < 0.45
        assert at[32] == at[64] and at[256] == at[128]
        assert at[64] > at[80] > at[96] > at[128]


def test_the_sm80_kernels_keep_their_share_of_flash_attention_2_from_a100_to_h100() -> None:
    # The rule that carries a kernel without a figure of its own to another GPU, checked on
    # the CUDA kernel that has both: its A100 share of FA2 predicts its H100 figure within 6%.
    kernel, fa2 = (t[("ampere", 128)][-1] for t in (FLASH1_CAUSAL_FWD_BWD, FLASH2_CAUSAL_FWD_BWD))
    assert kernel / fa2 * 328 == pytest.approx(137, rel=0.06)
    assert share_of_flash2("flash1", "blackwell") == share_of_flash2("flash1", "hopper")


def test_the_triton_kernel_llm_foundry_runs_is_priced_from_the_cuda_kernel() -> None:
    # The papers' "FlashAttention Triton" bars are triton.ops.flash_attention (OpenAI's
    # tutorial kernel), not flash_attn_triton.py; the latter documents itself against the CUDA
    # kernel, whose share it takes at head dim 64 and, at 128, times the factor fitted on
    # llm-foundry's table (TRITON_OVER_CUDA_AT_128; log2 between).
    for arch in ("ampere", "hopper"):
        assert share_of_flash2("flash1_triton", arch, 64) == share_of_flash2("flash1", arch, 64)
        f = TRITON_OVER_CUDA_AT_128[arch]
        for hd, power in ((96, math.log2(96 / 64)), (128, 1.0)):
            assert share_of_flash2("flash1_triton", arch, hd) == pytest.approx(
                share_of_flash2("flash1", arch, hd) * f ** power)


@pytest.mark.parametrize("backend", ["flash1", "flash1_triton"])
@pytest.mark.parametrize("gpu", [A100, H100])
def test_earlier_flash_kernels_run_flash2s_call_at_their_share(backend, gpu) -> None:
    # The same shape curve as FlashAttention-2 (causal tiles, waves, head dim), slower by the
    # share of the call's head dim and length in both passes, at short and long sequences
    # and in context-parallel steps.
    old, fa2 = (ComputeModel(gpu, attention_backend=b) for b in (backend, "flash2"))
    for args in ((2, 32, 2048, 128), (1, 32, 65536, 128), (4, 16, 8192, 64)):
        share = share_of_flash2(backend, gpu.arch, args[3], args[2])
        assert share is not None and 0.4 < share < 0.6
        for pass_ in ("fwd", "bwd"):
            assert old.attention_time(*args, pass_) == pytest.approx(
                fa2.attention_time(*args, pass_) / share)
    # A context-parallel step's calls are 8k and 4k rows: their shares within 3% of 8k's.
    share = share_of_flash2(backend, gpu.arch, 128, 8192)
    assert old.cp_attention_time(1, 32, 8192, 128, "bwd", 32768) == pytest.approx(
        fa2.cp_attention_time(1, 32, 8192, 128, "bwd", 32768) / share, rel=0.03)


def test_a_kernel_volta_cannot_run_is_refused_naming_the_key() -> None:
    for backend in ("flash1", "flash1_triton"):
        with pytest.raises(ScenarioError, match=f"training.attention_backend: {backend}"):
            JobContext.from_scenario(_scenario({"name": "fsdp2"}, "v100-32gb",
                                               attention_backend=backend))


def test_a_sliding_window_call_takes_the_curve_at_its_rows_length() -> None:
    # A query's row under a window is the window long: FA2's windowed call runs at the
    # published curve's speed for that length, the first kernel at that length's share.
    fa2 = ComputeModel(H100, attention_backend="flash2")
    base = fa2.attention_time(1, 32, 32768, 128, "fwd", window=2048, published_curve=False)
    assert fa2.attention_time(1, 32, 32768, 128, "fwd", window=2048) == pytest.approx(
        base / flash2_causal_speedup("hopper", 128, 2048))
    old = ComputeModel(H100, attention_backend="flash1")
    assert old.attention_time(1, 32, 32768, 128, "fwd", window=2048) == pytest.approx(
        fa2.attention_time(1, 32, 32768, 128, "fwd", window=2048)
        / share_of_flash2("flash1", "hopper", 128, 2048))
