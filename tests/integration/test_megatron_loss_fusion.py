"""Megatron-Core's cross-entropy paths (``framework.cross_entropy_loss_fusion`` and
``cross_entropy_fusion_impl``; :mod:`sim.workload.megatron_loss`).

Independent truths, read from the sources each path runs:
``tensor_parallel/cross_entropy.py`` (unfused) and ``fusions/fused_cross_entropy.py`` (native)
save the fp32 softmax, ``tokens x vocab/tp x 4`` bytes; Transformer Engine's
``parallel_cross_entropy`` (TE 2.2-2.17, ``common/triton/cross_entropy.py``) saves the bf16
logits it overwrote with the gradient, ``tokens x vocab/tp x 2``, nothing fp32 of that size.
Bytes per logit moved by the passes over the ``N = tokens x vocab/tp`` logits, forward:
unfused ``.float()`` 2+4, max 4, subtract 4+4, exp 4+4, sum 4, divide 4+4 = 38; native (one
inductor kernel per compiled function) cast+max 2+4, subtract+exp+sum 4+4, divide 4+4 = 22; te
online softmax 2, cross-entropy kernel 2+2 = 6. Backward: unfused scales the saved fp32 softmax
in place (``mul_``, 4+4) and autograd casts it to bf16 (4+2), 14 (its one-hot update touches one
element per token); native reads the fp32 softmax and writes it back (the mutated input) and the
bf16 gradient, 4+4+2 = 10; te scales in place, 2+2 = 4. Megatron-LM's default is the unfused
loss (TransformerConfig ``cross_entropy_loss_fusion`` False).
"""

from __future__ import annotations

import pytest
import yaml
from helpers import megatron_scenario
from typer.testing import CliRunner

from sim.api import simulate
from sim.cli import app
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError, scenario_from_dict
from sim.workload.megatron_loss import loss_impl
from sim.workload.megatron_ops import MegatronLayout, head_block
from sim.workload.model import ModelSpec

# Llama-like, vocabulary a multiple of 128 x tp (no padding), so N is exact.
MODEL = {"layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 4096,
         "vocab": 32768}
SEQ, MB = 2048, 2
LOSS_FWD = {"unfused": ("logits_float", "row_max", "sub_max", "exp", "row_sum", "div_sum"),
            "native": ("ce_cast_max", "ce_sub_exp_sum", "ce_div"),
            "te": ("te_online_softmax", "te_cross_entropy")}
LOSS_BWD = {"unfused": ("softmax_minus_onehot", "scale_by_grad", "g_logits_half"),
            "native": ("ce_onehot_scatter", "ce_grad"), "te": ("te_element_mul",)}


def _m() -> ModelSpec:
    return ModelSpec.from_ref(megatron_scenario({"tp": 1}, 8, model=MODEL).model, SEQ)


def _head(impl: str, tp: int = 1, sp: bool = False):
    return head_block(_m(), MegatronLayout(tp=tp, sequence_parallel=sp, cross_entropy=impl),
                      MB, SEQ)


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (4, True)])
def test_saved_bytes_are_the_closed_forms(tp: int, sp: bool) -> None:
    n = MB * SEQ * MODEL["vocab"] // tp
    blocks = {impl: _head(impl, tp, sp) for impl in ("unfused", "native", "te")}
    big = {impl: [t for t in b.saved if t.nbytes >= n] for impl, b in blocks.items()}
    # unfused and native: one fp32 softmax of N logits; te: the bf16 logits only.
    assert [t.nbytes for t in big["unfused"]] == [4 * n]
    assert [t.nbytes for t in big["native"]] == [4 * n]
    assert [t.nbytes for t in big["te"]] == [2 * n]
    # Nothing else differs: the whole head saves exactly 2N bytes less with te.
    saved = {impl: sum(t.nbytes for t in b.saved) for impl, b in blocks.items()}
    assert saved["unfused"] == saved["native"] == saved["te"] + 2 * n


@pytest.mark.parametrize("impl", ["unfused", "native", "te"])
def test_kernel_bytes_per_logit(impl: str) -> None:
    n = MB * SEQ * MODEL["vocab"]
    b = _head(impl)
    fwd = [k for k in b.forward if k.name in LOSS_FWD[impl]]
    assert [k.name for k in fwd] == list(LOSS_FWD[impl])
    per_logit = {"unfused": 38, "native": 22, "te": 6}[impl]
    # te's online softmax also writes 3 fp32 statistics per token, read back by the second.
    stats = 2 * 3 * 4 * MB * SEQ if impl == "te" else 0
    assert sum(k.nbytes for k in fwd) == per_logit * n + stats
    bwd = [k for k in b.backward if k.name in LOSS_BWD[impl]]
    assert sum(k.nbytes for k in bwd) == {"unfused": 14, "native": 10, "te": 4}[impl] * n
    # The loss's gradient is what the output layer's dgrad and wgrad read.
    g = bwd[-1].writes[-1]
    assert g.nbytes == 2 * n
    readers = {k.name for k in b.backward if any(t is g for t in k.reads)}
    assert {"output.dgrad", "output.wgrad"} <= readers


def test_fused_paths_are_faster_and_te_holds_least() -> None:
    cost = {}
    for impl in ("unfused", "native", "te"):
        fw = {"name": "megatron", "cross_entropy_loss_fusion": impl != "unfused",
              "cross_entropy_fusion_impl": "te" if impl == "te" else "native"}
        ctx = JobContext.from_scenario(
            megatron_scenario({"tp": 1}, 16, model=MODEL, seq=SEQ, mbs=MB, framework=fw),
            "s.yaml")
        shape = megatron_shape(ctx)
        assert shape.lay.cross_entropy == impl
        cost[impl] = shape.cost["head"]
    assert cost["te"].fwd_s < cost["native"].fwd_s < cost["unfused"].fwd_s
    assert cost["te"].bwd_s < cost["native"].bwd_s < cost["unfused"].bwd_s
    assert cost["te"].saved_bytes < cost["native"].saved_bytes == cost["unfused"].saved_bytes


def test_default_is_megatrons_unfused_loss() -> None:
    assert MegatronLayout().cross_entropy == "unfused"
    assert loss_impl(False, "te") == "unfused"          # the impl only counts with the fusion
    s = megatron_scenario({"tp": 2}, 8, model=MODEL)
    assert megatron_shape(JobContext.from_scenario(s, "s.yaml")).lay.cross_entropy == "unfused"


def test_a_whole_step_fits_in_less_memory_with_te() -> None:
    # At micro-batch MB: at 1 this small model's step is paced by the x86 host's op issue
    # (sim.hardware.host.X86_TRAINING_HOST_FACTOR), which hides the loss kernels' difference.
    def run(fw: dict):
        return simulate(megatron_scenario({"tp": 2, "pp": 2}, 16, mbs=MB, model=MODEL, seq=SEQ,
                                          framework={"name": "megatron", **fw})).summary
    off = run({})
    te = run({"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"})
    native = run({"cross_entropy_loss_fusion": True})
    assert te["peak_memory_gib"] < off["peak_memory_gib"]
    assert te["step_time_s"] < native["step_time_s"] < off["step_time_s"]
    assert te["model_flops_per_step"] == off["model_flops_per_step"]


def test_mtp_heads_compute_the_same_loss() -> None:
    tiny = {"layers": 2, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
            "mtp_layers": 1}
    fw = {"name": "megatron", "cross_entropy_loss_fusion": True,
          "cross_entropy_fusion_impl": "te"}
    ctx = JobContext.from_scenario(megatron_scenario({"tp": 1}, 8, model=tiny, framework=fw),
                                   "s.yaml")
    head = megatron_shape(ctx).cost["head"].saved_bytes
    ops = [op for c in build_program(ctx).classes for st in c.streams.values() for op in st
           if "fwd mtp head+loss" in op.name or op.name.startswith("fwd head+loss")]
    assert ops and all(dict(op.alloc)["activations"] == head for op in ops)
    assert any("mtp" in op.name for op in ops)


def test_bad_impl_is_one_line_naming_the_key(tmp_path) -> None:
    s = megatron_scenario({"tp": 1}, 8, model=MODEL)
    raw = s.model_dump(mode="json", exclude_none=True)
    raw["framework"]["cross_entropy_fusion_impl"] = "triton"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["run", str(path)], catch_exceptions=False)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cross_entropy_fusion_impl" in lines[0]
    with pytest.raises(ScenarioError, match="cross_entropy_fusion_impl"):
        scenario_from_dict(raw, origin="bad.yaml")
