"""How Megatron cuts a sequence, refused where Megatron refuses it (found by fuzzing the CLI:
``training.seq_len: 1`` with tp 4 and sequence parallelism divided by zero in the GEMM
pricing). Megatron-LM ``validate_args`` asserts ``seq_length % (2 x cp) == 0`` with context
parallelism (each rank holds one chunk from each end, for the causal load balance), and
Megatron-Core's ``_split_along_first_dim`` (``tensor_parallel/mappings.py``) asserts that a
rank's ``[s / cp, b, h]`` activations split over tp under sequence parallelism."""

from __future__ import annotations

import pytest

from sim.api import simulate
from sim.scenario import ScenarioError, load_scenario

SP_TP4 = "qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100"   # tp 4, sequence parallelism


@pytest.mark.parametrize("seq", [1, 6, 4098])
def test_sequence_parallelism_needs_a_rank_s_tokens_to_split_over_tp(seq: int) -> None:
    s = load_scenario(SP_TP4, [f"training.seq_len={seq}"])
    with pytest.raises(ScenarioError, match=r"training\.seq_len: sequence parallelism splits "
                                            rf"each rank's {seq} tokens .* over tp=4"):
        simulate(s)


def test_without_sequence_parallelism_any_length_runs() -> None:
    s = load_scenario("llama3-70b-megatron-tp8pp4-64xh100",
                      ["training.seq_len=4098", "parallelism.sequence_parallel=false"])
    assert simulate(s).summary["step_time_s"] > 0


def test_context_parallelism_needs_two_chunks_a_rank() -> None:
    # 1,028 splits over cp = 2 (514 tokens a rank) but not into 2 x cp = 4 chunks.
    s = load_scenario(SP_TP4, ["parallelism.tp=1", "parallelism.sequence_parallel=false",
                               "parallelism.cp=2", "parallelism.ep=2", "parallelism.pp=2",
                               "training.seq_len=1026"])
    with pytest.raises(ScenarioError, match=r"parallelism\.cp: seq_len 1026 does not split "
                                            r"into 2 x cp = 4 chunks"):
        simulate(s)
