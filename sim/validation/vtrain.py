"""The ``vtrain-single`` and ``vtrain-multi`` suites: measured Megatron iterations on A100.

``sim/catalog/reference/vtrain/`` holds vTrain's ground truth (Bang et al., "vTrain: A
Simulation Framework for Evaluating Cost-effective and Compute-optimal Large Language Model
Training", MICRO 2024; github VIA-Research/vTrain, MIT licence): 1,440 single-node and 109
multi-node iteration times of GPT models trained with Megatron-DeepSpeed.

What the rows do not say is taken from vTrain's repository (``config/validation``,
``src/config.py``, ``data/README.md``) and Megatron-DeepSpeed's defaults: A100 SXM on NVSwitch
(8 per node; their all-reduce tables reach 229 GB/s bus bandwidth on 8 GPUs), 800 Gb/s of
network per node (taken as 4 x 200 Gb/s HDR InfiniBand), fp16, Megatron's local (apex/PyTorch)
layers with the unfused attention
with dropout 0.1, full activation checkpointing, 1F1B, one non-overlapped gradient all-reduce
per step, tied embeddings, the GPT-2 vocabulary of 50,257 and learned positions; an
iteration includes the optimizer step. Each row becomes a scenario and runs through the same
:func:`sim.api.simulate` as ``fabricsim run``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sim.scenario import scenario_from_dict

DATA = Path(__file__).resolve().parents[1] / "catalog" / "reference" / "vtrain"


def rows(kind: str) -> list[dict[str, str]]:
    with open(DATA / f"ground_truth_{kind}.csv", encoding="utf-8-sig") as fh:
        return list(csv.DictReader(fh))


def scenario_for(row: dict[str, str]) -> dict[str, Any]:
    """The scenario mapping of one vTrain row."""
    gpus = int(row["# GPUs"])
    per_node = min(8, gpus)
    nodes = math.ceil(gpus / per_node)
    h = int(row["hidden size"])
    seq = int(row["sequence length"])
    return {
        "name": "vtrain",
        "model": {"layers": int(row["# layers"]), "hidden": h,
                  "heads": int(row["attention heads"]), "ffn_hidden": 4 * h, "vocab": 50257,
                  "mlp": "gelu", "tied_embeddings": True, "max_positions": seq},
        "cluster": {"topology": "dgx-a100", "nodes": nodes, "gpus_per_node": per_node,
                    "nics_per_node": 4, "nic_gbps": 200},
        "framework": {"name": "megatron", "implementation": "local",
                      "flash_attention": False, "dropout": 0.1},
        "parallelism": {"tp": int(row["tensor parallelism"]),
                        "pp": int(row["pipeline parallelism"]),
                        "dp": int(row["data parallelism"])},
        "training": {"seq_len": seq, "micro_batch_size": int(row["micro batch"]),
                     "global_batch_size": int(row["global batch"]), "precision": "fp16",
                     "activation_checkpointing": "full"},
    }


def vtrain_cases(kind: str, every: int = 1,
                 progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """One case per measured row (every ``every``-th); ``progress(done, total)`` after each."""
    from sim.api import simulate

    cases = []
    todo = [(i, row) for i, row in enumerate(rows(kind)) if i % every == 0]
    for done, (i, row) in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        measured = float(row["iteration time (ms)"]) / 1e3
        sc = scenario_for(row)
        simulated = simulate(scenario_from_dict(sc, origin=f"vtrain-{kind} row {i}")
                             ).summary["step_time_s"]
        p = sc["parallelism"]
        cases.append({
            "suite": f"vtrain-{kind}", "id": f"row{i}: {row['# GPUs']}gpu h{sc['model']['hidden']}"
            f" L{sc['model']['layers']} tp{p['tp']} pp{p['pp']} dp{p['dp']} "
            f"mb{sc['training']['micro_batch_size']} gb{sc['training']['global_batch_size']}",
            "metric": "step_time_s", "measured": measured, "simulated": simulated,
            "error": (simulated - measured) / measured,
        })
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
