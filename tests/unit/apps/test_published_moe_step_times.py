"""The ``published-moe`` rows whose source gives a step time rather than a throughput (the
Megatron Core MoE report's model zoo, yanring/Megatron-MoE-ModelZoo best_practice/qwen3/
readme.md; Megatron-LM PR 6429's performance table): the measured tokens/s per GPU is
GBS x seq / (step x GPUs), no FLOP formula, and the arithmetic printed in the source must agree
with the scenario it describes."""

from __future__ import annotations

import re

import pytest

from sim.apps.validation.published_moe import entries, scenario_of

# "2048 x 4096 / (19.7 x 256) = 1663 tokens/s/GPU" as the sources write the conversion.
_CONVERSION = re.compile(r"(\d+) x (\d+) / \(([\d.]+) x (\d+)\) = (\d+) tokens/s/GPU")
STEP_ROWS = [e for e in entries() if _CONVERSION.search(e["source"])]


def test_the_model_zoo_rows_are_found() -> None:
    # The five readme rows (Qwen3-235B-A22B on 256 H100; the Megatron-FSDP one since the
    # twenty-sixth session) and Megatron-LM PR 6429's arm C (its mean iteration time; the
    # fifty-third session), no more, no less.
    assert len(STEP_ROWS) == 6
    assert sum(e["id"].startswith("modelzoo-") for e in STEP_ROWS) == 5
    assert [e["id"] for e in STEP_ROWS if not e["id"].startswith("modelzoo-")] == [
        "mlm-pr6429-deepseek-v3-14l-64xh100-bf16-tp1pp4vp2ep16-alltoall-recompute"]


@pytest.mark.parametrize("entry", STEP_ROWS, ids=[e["id"] for e in STEP_ROWS])
def test_step_time_conversion_matches_the_scenario(entry) -> None:
    gbs, seq, step, gpus, tokens = _CONVERSION.search(entry["source"]).groups()
    sc = scenario_of(entry)
    assert int(gbs) == sc.training.global_batch_size
    assert int(seq) == sc.training.seq_len
    assert int(gpus) == sc.cluster.nodes * sc.cluster.gpus_per_node
    exact = int(gbs) * int(seq) / (float(step) * int(gpus))
    assert int(tokens) == round(exact)
    assert entry["measured"]["tokens_per_s_per_gpu"] == int(tokens)
