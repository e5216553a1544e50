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

Fit and validate halves
-----------------------
A constant fitted on vTrain rows must not be validated on the same rows, so the rows are split
once, deterministically, into a FIT half and a VALIDATE half (:func:`half_of`; the rule is
restated in ``docs/calibration.md``). Rows are grouped into strata of one model on one GPU
count under one (tensor, pipeline) layout (GPU count, hidden size, layers, TP, PP): every
single-node stratum holds 10 rows (micro- and global-batch variants), the multi-node ones 1-7.
Inside a stratum the distinct configurations are ordered by the SHA-256 of their canonical
text and alternate between the halves, the first one's half set by the stratum's own hash.
So both halves span every model, GPU count and layout (single-node: 720 rows each), the split
does not depend on the CSV's row order, and two measurements of one configuration (the
multi-node file repeats one) always fall in the same half. The ``vtrain-*`` suites report the
VALIDATE half; ``vtrain-*-fit`` the FIT half, on which ``tools/fit_megatron_host.py`` fits.
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from sim.scenario import scenario_from_dict

DATA = Path(__file__).resolve().parents[2] / "catalog" / "reference" / "vtrain"
MEASURED = "iteration time (ms)"
# The columns that define a stratum: one model on one GPU count under one TP x PP layout.
STRATUM = ("# GPUs", "hidden size", "# layers", "tensor parallelism", "pipeline parallelism")
HALVES = ("fit", "validate", "all")
Half = Literal["fit", "validate", "all"]


def rows(kind: str) -> list[dict[str, str]]:
    with open(DATA / f"ground_truth_{kind}.csv", encoding="utf-8-sig") as fh:
        return list(csv.DictReader(fh))


def config_key(row: dict[str, str]) -> str:
    """The canonical text of a row's configuration: every column but the measurement, sorted
    by name, numbers normalised (``3.6`` and ``3.60`` read alike)."""
    return ";".join(f"{k}={float(v):g}" for k, v in sorted(row.items()) if k != MEASURED)


def _sha(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@lru_cache(maxsize=4)
def _split(kind: str) -> tuple[str, ...]:
    table = rows(kind)
    strata: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for r in table:
        strata[tuple(f"{float(r[c]):g}" for c in STRATUM)].add(config_key(r))
    half: dict[str, str] = {}
    for stratum, keys in strata.items():
        offset = _sha("|".join(stratum)) % 2
        for k, key in enumerate(sorted(keys, key=lambda x: (_sha(x), x))):
            half[key] = "fit" if (k + offset) % 2 == 0 else "validate"
    return tuple(half[config_key(r)] for r in table)


def half_of(kind: str, index: int) -> str:
    """``"fit"`` or ``"validate"``: the half of row ``index`` of ``ground_truth_{kind}.csv``.

    Examples
    --------
    >>> sum(half_of("single", i) == "fit" for i in range(len(rows("single"))))
    720
    """
    return _split(kind)[index]


def row_indices(kind: str, half: Half = "validate", every: int = 1) -> list[int]:
    """Indices of the rows of ``half`` (``"all"``: every row), then every ``every``-th of them
    (CI's subsample of a half)."""
    if half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, not {half!r}")
    chosen = [i for i, h in enumerate(_split(kind)) if half in ("all", h)]
    return chosen[::every]


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
                 progress: Callable[[int, int], None] | None = None,
                 half: Half = "validate") -> list[dict[str, Any]]:
    """One case per measured row of ``half`` (the VALIDATE half unless told; every
    ``every``-th of its rows); ``progress(done, total)`` after each."""
    from sim.api import simulate

    cases = []
    table = rows(kind)
    todo = [(i, table[i]) for i in row_indices(kind, half, every)]
    suite = f"vtrain-{kind}" + ("-fit" if half == "fit" else "")
    for done, (i, row) in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        measured = float(row[MEASURED]) / 1e3
        sc = scenario_for(row)
        simulated = simulate(scenario_from_dict(sc, origin=f"vtrain-{kind} row {i}")
                             ).summary["step_time_s"]
        p = sc["parallelism"]
        cases.append({
            "suite": suite, "id": f"row{i}: {row['# GPUs']}gpu h{sc['model']['hidden']}"
            f" L{sc['model']['layers']} tp{p['tp']} pp{p['pp']} dp{p['dp']} "
            f"mb{sc['training']['micro_batch_size']} gb{sc['training']['global_batch_size']}",
            "metric": "step_time_s", "measured": measured, "simulated": simulated,
            "error": (simulated - measured) / measured,
        })
    if progress is not None:
        progress(len(todo), len(todo))
    return cases
