"""SDPA handed an explicit mask (Hugging Face's code compiled whole): the measured table, the
slowdown read from it, and where the builders apply it.

``sim/catalog/calibration/h200-masked-attention.json`` (``tools/measure_masked_attention.py``,
PyTorch 2.11 on the lent H200) is what :mod:`sim.hardware.masked_attention` reads, so checks
against it are fit-quality checks; the independent check is the whole compiled step's cuDNN
kernels (``tests/integration/test_calibration_h200_steps.py``)."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.hardware.masked_attention import masked_slowdown
from sim.workload.kernels import Style
from sim.workload.layer_ops import attention_block
from sim.workload.model import ModelSpec

ROWS = catalog.calibration("h200-masked-attention.json")["rows"]


def _row(variant: str, head_dim: int, seq: int) -> dict:
    return next(r for r in ROWS if (r["variant"], r["head_dim"], r["seq"]) ==
                (variant, head_dim, seq))


def test_every_variant_ran_cudnn_s_kernels() -> None:
    # The mask changes the work cuDNN does, not the library: each variant ran cuDNN's fused
    # attention, so the slowdown is of the same kernel family (no math fallback).
    for r in ROWS:
        assert any("cudnn" in k for k in r["kernels"]), (r["variant"], r["seq"])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq", [2048, 4096, 8192, 16384])
def test_masked_calls_cost_the_rectangle_and_more(head_dim: int, seq: int) -> None:
    # Physics first: the full rectangle is about twice the causal triangle (1.5-2.1x from 2k:
    # a causal kernel pays its diagonal tiles whole), and a mask cannot be cheaper than the
    # rectangle it forces; the boolean and the additive mask cost the same (within 8%), so
    # the mask's bytes are not what costs.
    causal, full = _row("causal", head_dim, seq), _row("full", head_dim, seq)
    boolean, additive = _row("bool_mask", head_dim, seq), _row("float_mask", head_dim, seq)
    for p in ("fwd_s", "bwd_s"):
        assert 1.5 <= full[p] / causal[p] <= 2.2
        assert boolean[p] > full[p]
        assert additive[p] == pytest.approx(boolean[p], rel=0.08)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq", [1024, 2048, 4096, 8192, 16384])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_the_model_reproduces_the_masked_table(head_dim: int, seq: int, pass_: str) -> None:
    """Fit quality (the slowdown is read from these rows): the H200 fit's full-rectangle call
    times the slowdown, against the measured masked call."""
    cm = ComputeModel(catalog.gpu("h200"), "bf16", "cudnn")
    r = _row("bool_mask", head_dim, seq)
    t = cm.attention_time(r["batch"], r["heads"], seq, head_dim, pass_,  # type: ignore[arg-type]
                          masked=True)
    assert t == pytest.approx(r[f"{pass_}_s"], rel=0.25)


def test_slowdown_interpolates_and_holds_at_the_ends() -> None:
    lo, hi = masked_slowdown("fwd", 64, 1024), masked_slowdown("fwd", 64, 16384)
    assert masked_slowdown("fwd", 64, 512) == lo and masked_slowdown("fwd", 64, 65536) == hi
    mid = masked_slowdown("fwd", 64, 1448)     # between the 1k and 2k rows
    assert min(lo, masked_slowdown("fwd", 64, 2048)) <= mid <= max(
        lo, masked_slowdown("fwd", 64, 2048))
    assert masked_slowdown("bwd", 96, 4096) == masked_slowdown("bwd", 128, 4096)  # tie: wider


def _attention_kernels(style: Style) -> list:
    m = ModelSpec.from_ref("llama3.2-1b")
    b = attention_block(m, style, 1, 4096, kv_cache=False)
    return b.forward + b.backward


def test_only_a_traced_mask_changes_the_attention_call() -> None:
    plain = _attention_kernels(Style("autocast", compile=True))
    traced = _attention_kernels(Style("autocast", compile=True, sdpa_mask=True))
    assert not any(k.attn_masked for k in plain)
    assert [k.name for k in traced if k.attn_masked] == ["sdpa.fwd", "sdpa.bwd"]
    # repeat_kv for the grouped keys and values, again in the backward, and the gradient sum
    # back over the groups.
    extra = {k.name for k in traced} - {k.name for k in plain}
    assert extra == {"sdpa.repeat_k", "sdpa.repeat_v", "sdpa.repeat_k_bwd",
                     "sdpa.repeat_v_bwd", "sdpa.g_k_sum", "sdpa.g_v_sum"}


def test_ddp_compile_traces_the_mask_and_fsdp2_per_layer_compile_does_not() -> None:
    from conftest import make_scenario

    from sim.api import simulate

    def step_s(framework: dict) -> float:
        s = make_scenario(model="llama3.2-1b", cluster__gpu="h200", cluster__gpus_per_node=1,
                          cluster__nics_per_node=0, framework=framework,
                          training={"seq_len": 4096, "micro_batch_size": 1,
                                    "global_batch_size": 1, "torch_version": "2.11"})
        return simulate(s).summary["step_time_s"]

    eager = step_s({"name": "ddp"})
    whole = step_s({"name": "ddp", "compile": True})
    layers = step_s({"name": "fsdp2", "model_code": "huggingface", "compile": True})
    assert whole > layers
    assert layers < eager
