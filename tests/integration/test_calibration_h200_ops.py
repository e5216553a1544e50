"""PyTorch's elementwise loops in the model against the kernels a lent H200 ran.

``sim/catalog/calibration/h200-train-steps-ops.json`` holds two eager steps of Hugging Face
Llama under bf16 autocast (``1b-plain``: Llama 3.2 1B at 4 x 4096 tokens; ``8b4l-plain``:
four Llama 3 8B layers at 2 x 4096), profiled with every kernel by name. PyTorch names the
loop a kernel runs: ``vectorized_elementwise_kernel`` (contiguous operands of one dtype),
``unrolled_elementwise_kernel`` (contiguous, with dynamic casts), ``elementwise_kernel`` with
``gpu_kernel_impl_nocast`` (the non-vectorised loop: a broadcast or strided operand) or
``gpu_kernel_impl`` (the same, casting). The model says which loop each of its kernels runs
(:class:`sim.workload.kernels.Kernel` ``legacy_elements``, ``legacy_operands``,
``cast_elements``) and prices each family by its own rule
(:meth:`sim.hardware.compute.ComputeModel.legacy_loop_time`, ``cast_loop_time``).

One constant is fitted here: ``DYNAMIC_CAST_LATENCY_S``, from the 1B step's casting copies
(``test_dynamic_cast_latency_derivation``). Everything else checks: the 8B-layer step's
families (a step the fit never saw), the 1B step's families the fit did not use (the casting
legacy loop of RoPE's bf16 q times fp32 cos, the broadcast loops, the loss's softmax, SiLU).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from sim import catalog
from sim.hardware import memory_bound
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Kernel, Style
from sim.workload.layer_ops import model_blocks
from sim.workload.model import ModelSpec

OPS = json.loads((Path(catalog.__file__).parent / "calibration" / "h200-train-steps-ops.json")
                 .read_text())

# The two runs' models (their "config" blocks: Llama 3.2 1B; Llama 3 8B's layer x 4).
MODELS = {
    "1b-plain": (ModelSpec(name="llama3.2-1b", layers=16, hidden=2048, heads=32, kv_heads=8,
                           head_dim=64, ffn_hidden=8192, vocab=128256, tied_embeddings=True), 4),
    "8b4l-plain": (ModelSpec(name="llama3-8b-4l", layers=4, hidden=4096, heads=32, kv_heads=8,
                             head_dim=128, ffn_hidden=14336, vocab=128256,
                             tied_embeddings=False), 2),
}


def measured_family(name: str) -> str | None:
    """The loop family of a kernel PyTorch names (None: not an elementwise loop)."""
    if name.startswith("void at::native::unrolled_elementwise_kernel<at::native::direct_copy"):
        return "cast_copy"
    if name.startswith("void at::native::unrolled_elementwise_kernel"):
        return "cast_op"
    if name.startswith("void at::native::elementwise_kernel"):
        return "legacy" if "gpu_kernel_impl_nocast" in name else "legacy_cast"
    if "SoftMax" in name:
        return "softmax"
    if "vectorized_elementwise_kernel" in name and "silu" in name:
        return "silu"
    return None


def model_family(k: Kernel) -> str | None:
    """The same family for a model kernel (the rotate-half ``cat`` is PyTorch's
    ``CatArrayBatchedCopy``, not an elementwise loop)."""
    if k.klass != "elementwise" or k.name.endswith(".cat"):
        return None
    if k.legacy_elements:
        return "legacy_cast" if k.cast_elements else "legacy"
    if k.cast_elements:
        return "cast_copy" if len(k.reads) == 1 else "cast_op"
    if "softmax" in k.name:
        return "softmax"
    if "silu" in k.name:
        return "silu"
    return None


def families(run: str) -> tuple[dict[str, float], dict[str, float], float, float]:
    """Per family: measured and modelled seconds of one step; and for the casting copies the
    model's elements and vectorised-loop seconds (what the fit needs)."""
    m, batch = MODELS[run]
    measured: dict[str, float] = defaultdict(float)
    profile = next(r for r in OPS["runs"] if r["name"] == run)["profile"]
    for k in profile["top"]:
        fam = measured_family(k["name"])
        if fam:
            measured[fam] += k["us"] * 1e-6
    cm = ComputeModel(catalog.gpu("h200"))
    modelled: dict[str, float] = defaultdict(float)
    elements = streaming = 0.0
    per_block = {"embed": 1, "attn": m.layers, "mlp": m.layers, "head": 1}
    for blk in model_blocks(m, Style("autocast"), batch, 4096, kv_cache=False):
        for k in blk.forward + blk.backward:
            fam = model_family(k)
            if fam:
                modelled[fam] += kernel_time(cm, k) * per_block[blk.name]
            if fam == "cast_copy":
                elements += k.cast_elements * per_block[blk.name]
                streaming += cm.membound_time(k.nbytes) * per_block[blk.name]
    return measured, modelled, elements, streaming


def test_dynamic_cast_latency_derivation():
    """The fit: the 1B step's unrolled casting copies (bf16 gradients back to fp32, the
    logits' ``.float()``) take their vectorised-loop time plus each element's casts at
    ``DYNAMIC_CAST_LATENCY_S`` a resident thread (Little's law over 132 SMs x 2,048)."""
    measured, _, elements, streaming = families("1b-plain")
    threads = catalog.gpu("h200").sm_count * memory_bound.RESIDENT_THREADS_PER_SM
    fitted = (measured["cast_copy"] - streaming) / elements * threads
    assert fitted == pytest.approx(memory_bound.DYNAMIC_CAST_LATENCY_S, rel=0.02)


@pytest.mark.parametrize("run, family, tolerance", [
    # The step the fit never saw, family by family.
    ("8b4l-plain", "cast_copy", 0.10),
    ("8b4l-plain", "cast_op", 0.15),
    ("8b4l-plain", "legacy", 0.15),
    ("8b4l-plain", "legacy_cast", 0.15),
    ("8b4l-plain", "softmax", 0.10),
    ("8b4l-plain", "silu", 0.15),
    # The fitted step's other families.
    ("1b-plain", "cast_op", 0.15),
    ("1b-plain", "legacy", 0.15),
    ("1b-plain", "legacy_cast", 0.10),
    ("1b-plain", "softmax", 0.10),
    ("1b-plain", "silu", 0.15),
])
def test_loop_family_time(run, family, tolerance):
    measured, modelled, _, _ = families(run)
    assert modelled[family] == pytest.approx(measured[family], rel=tolerance)


def test_compiled_loss_kernels():
    """Whole-model compile: inductor's two looped reductions over the 1B step's 16,384 x
    128,256 logits (``triton_red_fused__log_softmax...``, h200-train-steps-profiled.json,
    ``1b-compile``: 3.18 ms forward, 3.59 backward) against the model's fused loss kernels,
    which save the bf16 logits and recompute the softmax (the eager loss: 16.2 ms)."""
    from sim.workload.block_pricing import _fuse, _needed_outside

    profiled = json.loads((Path(catalog.__file__).parent / "calibration"
                           / "h200-train-steps-profiled.json").read_text())
    run = next(r for r in profiled["runs"] if r["name"] == "1b-compile")
    measured = sum(k["us"] for k in run["profile"]["top"]
                   if k["name"].startswith("triton_red_fused__log_softmax")) * 1e-6
    m, batch = MODELS["1b-plain"]
    cm = ComputeModel(catalog.gpu("h200"))
    head = model_blocks(m, Style("autocast", compile=True, sdpa_mask=True), batch, 4096,
                        kv_cache=False)[3]
    modelled = sum(kernel_time(cm, k)
                   for ks in (head.forward, head.backward)
                   for k in _fuse(ks, _needed_outside(ks, head), head)
                   if "log_softmax" in k.name)
    assert modelled == pytest.approx(measured, rel=0.20)


def test_compiled_norm_backward_kernels():
    """Whole-model compile: each RMSNorm's backward is one fused kernel with the gradient sums
    around it (``triton_per_fused_..._add_..._pow_sum``, h200-train-steps-profiled.json,
    ``1b-compile``: 30 calls, 141 us on average), priced at the elementwise rate because its
    row reductions are over 2,048-wide rows (``inductor.STREAMING_ROW_ELEMENTS``)."""
    from sim.workload.block_pricing import _fuse, _needed_outside

    profiled = json.loads((Path(catalog.__file__).parent / "calibration"
                           / "h200-train-steps-profiled.json").read_text())
    run = next(r for r in profiled["runs"] if r["name"] == "1b-compile")
    norms = [k for k in run["profile"]["top"]
             if k["name"].startswith("triton_per_fused__to_copy_add_div_expand_mul_pow_sum")]
    measured = sum(k["us"] for k in norms) / sum(k["calls"] for k in norms) * 1e-6
    m, batch = MODELS["1b-plain"]
    cm = ComputeModel(catalog.gpu("h200"))
    _, attn, mlp, _ = model_blocks(m, Style("autocast", compile=True, sdpa_mask=True), batch,
                                   4096, kv_cache=False)
    modelled = [kernel_time(cm, k) for b in (attn, mlp)
                for k in _fuse(b.backward, _needed_outside(b.backward, b), b)
                if "norm.g_r_sum" in k.name]
    assert len(modelled) == 2
    assert sum(modelled) / 2 == pytest.approx(measured, rel=0.15)
