"""The ``moe-layer`` suites: one Megatron-Core MoE layer's forward and backward on eight H100s
(EP8), against NVIDIA's own timings of it (``sim/catalog/reference/megatron_moe_layer.yaml``:
Megatron-LM's ``moe_perf`` regression baselines, Mixtral-like and DeepSeek-like layers with
the ``alltoall``, DeepEP and HybridEP dispatchers, bf16 and blockwise FP8).

Each case becomes a one-layer scenario on one DGX H100 node with the test's settings (GELU
experts without bias, balanced routing, fused permutation and router, aux loss, TP1 EP8, one
sequence of 4,096 tokens a GPU); the simulated MoE layer's forward runs from its router's first
op to its combine's last, its backward from the combine's backward to the router's, on rank
class 0 (the ops named ``... moe L0 ...``; every EP rank runs the same under balanced routing).
What the test times between its CUDA events is the same stretch of the same stream.

The bf16 cases are the rows ``h100-sxm.gemm_rate_factor`` is fitted on
(``tools/fit_h100_gemm_rate.py``; docs/calibration.md): they run as ``moe-layer-fit``,
only when named. ``moe-layer`` reports the blockwise FP8 cases, which no constant was fitted on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sim.apps.validation.cases import scored_case
from sim.catalog import load_yaml
from sim.scenario import Scenario, scenario_from_dict

REFERENCE = (Path(__file__).resolve().parents[2] / "catalog" / "reference"
             / "megatron_moe_layer.yaml")
SUITE = "moe-layer"
# The test's own layer dimensions besides the proxies' (__main__.py): 8 attention heads (no
# attention is timed), a sequence of 4,096 tokens and one sequence a micro-batch per GPU.
HEADS = 8
SEQ_LEN = 4096
GPUS = 8
# The one-layer model needs an embedding the MoE layer never sees: any vocabulary will do.
VOCAB = 32000


def reference() -> dict[str, Any]:
    """The reference file: ``models`` (the two proxies) and ``cases``."""
    data = load_yaml(REFERENCE.read_text())
    assert isinstance(data, dict)
    return data


def scenario_of(case: Mapping[str, Any], models: Mapping[str, Mapping[str, Any]]) -> Scenario:
    """The one-layer DGX H100 scenario of one reference case.

    Examples
    --------
    >>> ref = reference()
    >>> sc = scenario_of(ref["cases"][0], ref["models"])
    >>> sc.parallelism.ep, sc.cluster.nodes, sc.model.layers, sc.model.mlp
    (8, 1, 1, 'gelu')
    """
    proxy = dict(models[case["model"]])
    framework: dict[str, Any] = {
        "name": "megatron",
        "moe_router_fusion": True, "moe_permute_fusion": True, "moe_aux_loss_coeff": 1.0,
        # TransformerConfig's default: the wgrad writes param.grad, no fp32 main_grad.
        "gradient_accumulation_fusion": False,
    }
    for key in ("moe_router_num_groups", "moe_router_group_topk"):
        if key in proxy:
            framework[key] = proxy.pop(key)
    if case["dispatcher"] == "alltoall":
        framework["moe_token_dispatcher_type"] = "alltoall"
    else:
        framework["moe_token_dispatcher_type"] = "flex"
        framework["moe_flex_dispatcher_backend"] = case["dispatcher"]
    if case["precision"] == "fp8":
        framework["fp8_recipe"] = "blockwise"
    model = {"name": case["model"], "layers": 1, "heads": HEADS, "vocab": VOCAB, "mlp": "gelu",
             "bias": False, "ffn_hidden": proxy["moe_ffn_hidden"], **proxy}
    return scenario_from_dict({
        "name": case["id"], "model": model,
        "cluster": {"topology": "dgx-h100", "nodes": 1},
        "framework": framework,
        "parallelism": {"tp": 1, "pp": 1, "ep": GPUS, "etp": 1},
        "training": {"seq_len": SEQ_LEN, "micro_batch_size": 1, "global_batch_size": GPUS,
                     "precision": case["precision"], "activation_checkpointing": "none"},
    }, origin=f"moe-layer {case['id']}")


def moe_layer_seconds(records: list[Any]) -> tuple[float, float]:
    """(forward, backward) seconds of layer 0's MoE ops on rank class 0 in step 0: from the
    first such op's start to the last one's end, per pass."""
    spans: dict[str, list[float]] = {"fwd": [], "bwd": []}
    for r in records:
        if r.cls != 0 or r.step != 0 or " moe L0 " not in r.op.name:
            continue
        spans[r.op.name.split(" ", 1)[0]] += [r.start, r.end]
    return (max(spans["fwd"]) - min(spans["fwd"]), max(spans["bwd"]) - min(spans["bwd"]))


def moe_layer_cases(half: str = "validate",
                    progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """One case per timed pass, ``{suite, id, metric, measured, simulated, error, source}``
    with metric ``forward_ms`` or ``backward_ms``: the FP8 cases (``half="validate"``) or the
    bf16 ones the H100's GEMM rate is fitted on (``half="fit"``)."""
    from sim.api import simulate

    ref = reference()
    todo = [c for c in ref["cases"] if (c["precision"] == "bf16") == (half == "fit")]
    suite = SUITE if half == "validate" else f"{SUITE}-fit"
    cases: list[dict[str, Any]] = []
    for done, c in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        result = simulate(scenario_of(c, ref["models"]), origin=f"moe-layer {c['id']}")
        fwd, bwd = moe_layer_seconds(result.recorder.ops)
        for metric, simulated in (("forward_ms", fwd * 1e3), ("backward_ms", bwd * 1e3)):
            cases.append(scored_case(
                suite, c["id"], metric, float(c[metric]), simulated,
                source="NVIDIA/Megatron-LM tests/functional_tests/test_cases/"
                       "common/moe_perf/baseline.json @ cf39a4dd"))
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
