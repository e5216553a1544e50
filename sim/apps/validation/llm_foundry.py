"""The ``llm-foundry`` suites: every 16-bit row of MosaicML llm-foundry's MPT benchmark tables
against the simulation (``sim/catalog/reference/llm_foundry_mpt.csv``).

The rows are ``scripts/train/benchmarking/README.md`` at b2a43a1 (2023-10-19; Apache-2.0):
MPT-125M to -70B under Composer's FSDP on 8-128 A100 40GB / 80GB and H100, 512 to 65,536
tokens; and its "Large Scale" H100 table at 5e85bd6 (2024-01-06: 128-512 H100, 2,048 tokens;
column ``readme_commit``). They are written as the launcher ran them (``submit_benchmarks.py``
at those commits: llm-foundry v0.3.0, then main of January 2024, each with its ``[gpu]``
extra): ``attn_impl: triton`` (flash-attn's Triton kernel on triton-pre-mlir:
``attention_backend: flash1_triton``) and MPT's default loss, flash-attn's fused
cross-entropy (``cross_entropy: fused``). MPT (``scripts/train/yamls/pretrain/mpt-*.yaml``
and ``configuration_mpt.py`` defaults): GELU MLP of 4x the width, biases, learned positions,
LayerNorm, the embedding tied to the output, GPT-NeoX's 50,368-token vocabulary. Composer's
mixed precision ``DEFAULT`` reduces gradients in fp32, ``PURE`` in bf16; ``SHARD_GRAD_OP``
keeps the gathered parameters through the backward (``reshard_after_forward: false``).

The Triton kernel's speed against the CUDA kernel it is priced as is fitted on some of these
rows (:data:`sim.hardware.attention_cost.TRITON_OVER_CUDA_AT_128`,
``tools/fit_triton_attention.py``): the head-dim-128 rows of 8k tokens and more on 8 A100
80GB, and on 8 H100 those of the models up to 3B (:func:`half_of`). ``llm-foundry``
reports every other row; ``llm-foundry-fit`` the fitted ones, only when named.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from sim.apps.validation.cases import scored_case
from sim.scenario import scenario_from_dict

DATA = Path(__file__).resolve().parents[2] / "catalog" / "reference" / "llm_foundry_mpt.csv"

# mpt-<size>.yaml at b2a43a1: (n_layers, d_model, n_heads); the yamls modified the head counts
# of 760m-3b "so that d_head == 128 to satisfy FlashAttention"; 125m and 350m keep 64.
MPT_SIZES: dict[str, tuple[int, int, int]] = {
    "125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12),
    "1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
    "30b": (48, 7168, 56), "70b": (80, 8192, 64),
}
GPUS = {"a100_40gb": "a100-40gb", "a100_80gb": "a100-80gb", "h100_80gb": "h100-sxm"}
# The rows the Triton kernel's factor is fitted on: long enough for attention to decide the
# step, at the head dim the factor applies to.
FIT_MIN_SEQ = 8192
FIT_H100_MODELS = ("760m", "1b", "3b")

Half = Literal["fit", "validate", "all"]


def rows() -> list[dict[str, str]]:
    """The table's rows as written in the data file.

    Examples
    --------
    >>> r = rows()[0]
    >>> r["model"], r["seq_len"], r["gpus"], r["gpu"], r["tokens_per_s_per_gpu"]
    ('70b', '2048', '64', 'h100_80gb', '1039')
    """
    with DATA.open(newline="") as f:
        return list(csv.DictReader(f))


def head_dim(row: dict[str, str]) -> int:
    """A row's attention head width (d_model / n_heads of its MPT yaml).

    Examples
    --------
    >>> head_dim({"model": "125m"}), head_dim({"model": "7b"})
    (64, 128)
    """
    _, d, h = MPT_SIZES[row["model"]]
    return d // h


def half_of(row: dict[str, str]) -> Literal["fit", "validate"]:
    """Whether a row is one the Triton kernel's factor is fitted on.

    Examples
    --------
    >>> r = {"model": "1b", "seq_len": "32768", "gpus": "8", "gpu": "h100_80gb"}
    >>> half_of(r), half_of({**r, "model": "7b"}), half_of({**r, "seq_len": "4096"})
    ('fit', 'validate', 'validate')
    """
    long_128 = int(row["seq_len"]) >= FIT_MIN_SEQ and head_dim(row) == 128 and row["gpus"] == "8"
    if long_128 and (row["gpu"] == "a100_80gb" or (
            row["gpu"] == "h100_80gb" and row["model"] in FIT_H100_MODELS)):
        return "fit"
    return "validate"


def scenario_dict(row: dict[str, str]) -> dict[str, Any]:
    """The scenario a row ran, as a scenario file would hold it.

    Examples
    --------
    >>> sc = scenario_dict(rows()[0])
    >>> sc["cluster"], sc["framework"]["cross_entropy"], sc["training"]["attention_backend"]
    ({'topology': 'dgx-h100', 'nodes': 8}, 'fused', 'flash1_triton')
    """
    layers, d, h = MPT_SIZES[row["model"]]
    seq, gpus = int(row["seq_len"]), int(row["gpus"])
    gpu = GPUS[row["gpu"]]
    topology = "dgx-h100" if gpu == "h100-sxm" else "dgx-a100"
    cluster: dict[str, Any] = {"topology": topology, "nodes": max(1, gpus // 8)}
    if topology == "dgx-a100":
        cluster["gpu"] = gpu
    framework: dict[str, Any] = {"name": "fsdp2", "cross_entropy": "fused",
                                 "reduce_dtype": "bf16" if row["mp_mode"] == "PURE" else "fp32"}
    if row["sharding_strategy"] == "SHARD_GRAD_OP":
        framework["reshard_after_forward"] = False
    return {
        "model": {"layers": layers, "hidden": d, "heads": h, "ffn_hidden": 4 * d,
                  "vocab": 50368, "mlp": "gelu", "tied_embeddings": True, "norm": "layernorm",
                  "position": "learned", "bias": True, "max_positions": seq},
        "cluster": cluster, "framework": framework,
        "training": {"seq_len": seq, "micro_batch_size": int(row["micro_batch_size"]),
                     "global_batch_size": int(row["global_batch_size"]), "precision": "bf16",
                     "activation_checkpointing":
                         "full" if row["activation_checkpointing"] == "True" else "none",
                     "attention_backend": "flash1_triton"},
    }


def row_id(row: dict[str, str]) -> str:
    """A row's name: ``mpt-<model>-<seq>-<gpus>x<gpu>-mbs<micro batch>``.

    Examples
    --------
    >>> row_id(rows()[0])
    'mpt-70b-2048-64xh100_80gb-mbs8'
    """
    return (f"mpt-{row['model']}-{row['seq_len']}-{row['gpus']}x{row['gpu']}"
            f"-mbs{row['micro_batch_size']}")


def row_case(row: dict[str, str], suite: str = "llm-foundry") -> dict[str, Any]:
    """One row simulated against its published tokens/s per GPU (a scored case)."""
    from sim.api import simulate

    rid = row_id(row)
    summary = simulate(scenario_from_dict({"name": rid, **scenario_dict(row)},
                                          origin=f"llm-foundry {rid}")).summary
    return scored_case(
        suite, rid, "tokens_per_s_per_gpu", float(row["tokens_per_s_per_gpu"]),
        float(summary["tokens_per_s_per_gpu"]),
        source=f"mosaicml/llm-foundry scripts/train/benchmarking/README.md "
               f"({row['readme_commit']})")


def llm_foundry_cases(half: Half = "validate", every: int = 1,
                      progress: Callable[[int, int], None] | None = None
                      ) -> list[dict[str, Any]]:
    """One throughput case per row of the half (every ``every``-th row; ``{suite, id,
    metric, measured, simulated, error, source}``); ``progress(done, total)`` after each."""
    suite = "llm-foundry" if half == "validate" else f"llm-foundry-{half}"
    todo = [r for r in rows() if half == "all" or half_of(r) == half][::every]
    cases = []
    for done, r in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        cases.append(row_case(r, suite))
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
