"""torchtitan's MXFP8 grouped GEMMs for the routed experts (``quantize.grouped_mm.mx``:
``framework.grouped_mm_recipe: mxfp8``) in a whole step.

Independent truths: torchtitan's converter (``components/quantization/mx.py`` at 1a36996b:
token groups aligned to 32 rows, compute capability 10.0 asserted) and torchao's
``_MXFP8GroupedMM`` (v0.15.0: the three GEMMs block-scaled, the bf16 input kept for
backward); torchao's own timing of the function, forward and backward, bounds what it can
save: at most a 1 / 0.553 = 1.81x faster grouped GEMM on its benchmark's shapes
(``sim/catalog/reference/torchao_grouped_mm.yaml``), so a whole step gains less.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of
from sim.scenario import ScenarioError

ROW = "torchtitan-deepep-qwen3-30b-a3b-8xb200-bf16-ep8"      # Qwen3-30B-A3B, 8 B200, EP 8


def _entry(recipe: str, topology: str | None = None, backend: str | None = None) -> dict:
    e = copy.deepcopy({r["id"]: r for r in entries()}[ROW])
    e["scenario"]["framework"]["grouped_mm_recipe"] = recipe
    if backend is not None:
        e["scenario"]["framework"]["expert_parallel_comm_backend"] = backend
    if topology is not None:
        e["scenario"]["cluster"]["topology"] = topology
    return e


@cache
def _step(recipe: str, backend: str = "deepep") -> float:
    return float(simulate(scenario_of(_entry(recipe, backend=backend))).summary["step_time_s"])


@pytest.mark.parametrize("backend", ["deepep", "standard"])
def test_mxfp8_experts_shorten_the_step_by_less_than_the_grouped_gemm_alone(backend: str
                                                                             ) -> None:
    gain = _step("bf16", backend) / _step("mxfp8", backend)
    assert 1.0 < gain < 1.0 / 0.553


def test_the_expert_gemms_are_block_scaled_and_their_groups_aligned_to_32() -> None:
    from sim.frameworks.fsdp2.moe import MXFP8_GROUP_ALIGNMENT_SIZE, _aligned
    from sim.workload.model import ModelSpec
    from sim.workload.moe_ops import MoELayout, balanced_tokens_per_expert, moe_layer_ops

    m = ModelSpec.from_ref("qwen3-30b-a3b", 4096)
    assert m.moe is not None
    rows = _aligned(balanced_tokens_per_expert(4100, m.moe.top_k, m.moe.experts, 8),
                    MXFP8_GROUP_ALIGNMENT_SIZE)
    assert all(c % 32 == 0 for c in rows)
    ops = moe_layer_ops(m, MoELayout(ep=8, torch_grouped_mm=True, torchao_mx=True),
                        tokens=4100, tokens_per_expert=rows)
    gemms = [k for k in ops.experts.forward + ops.experts.backward if k.klass == "gemm"]
    assert len(gemms) == 6                            # fc1 and fc2: forward, dgrad, wgrad
    assert all(k.fp8 and k.fp8_block and k.grouped_impl == "torch" for k in gemms)
    # torchtitan's w1 and w3 are two torch._grouped_mm calls: fc1's input is cast twice.
    casts = [k.name for k in ops.experts.forward if k.name.startswith("fc1.cast_in")]
    assert len(casts) == 2
    # torchao keeps each GEMM's bf16 input for backward, not an FP8 copy: fc1's is the
    # sorted tokens, fc2's the activation.
    saved = {t.name.removeprefix("moe_experts."): t.nbytes for t in ops.experts.saved}
    assert saved["sorted"] == 2 * sum(rows) * m.hidden
    assert saved["act"] == 2 * sum(rows) * m.moe.ffn_hidden
    assert not any("_mx" in name for name in saved)


def test_refused_off_blackwell_with_one_line_naming_the_key() -> None:
    with pytest.raises(ScenarioError) as err:
        simulate(scenario_of(_entry("mxfp8", topology="dgx-h100")))
    msg = str(err.value)
    assert "framework.grouped_mm_recipe" in msg and "\n" not in msg


def test_refused_for_a_dense_model() -> None:
    e = _entry("mxfp8")
    e["scenario"]["model"] = "llama3-8b"
    e["scenario"]["parallelism"] = {}
    e["scenario"]["framework"].pop("expert_parallel_comm_backend")
    with pytest.raises(ScenarioError, match="framework.grouped_mm_recipe"):
        simulate(scenario_of(e))
