"""torchtitan refuses weight tying with pipeline parallelism: its model config's
``update_from_config`` raises ``NotImplementedError("Weight tying is not supported with
Pipeline Parallel.")`` for ``enable_weight_tying`` with ``pipeline_parallel_degree > 1``
(Qwen3 since torchtitan PR 1590, Llama 3 since PR 2580; now
torchtitan/models/common/decoder.py). fabricsim's fsdp2 builder refuses the same layout:
one line naming the file and the key, exit 2, nothing on stdout."""

from __future__ import annotations

import pytest
from helpers import fabricsim_in_process

SCENARIO = "llama3.2-1b-ddp-8xh100"     # Llama 3.2 1B ties its embedding (catalog, HF config)
FSDP2 = ["--set", "framework.name=fsdp2", "--set", "training.seq_len=512"]


# In-process through the command's entry point (tests/helpers.py): the exit status and the
# one line are main()'s, which tests/integration/test_cli.py runs as a true subprocess.
fabricsim = fabricsim_in_process


def test_tied_embedding_with_pp_exits_2_with_one_line() -> None:
    proc = fabricsim("run", SCENARIO, "--json", *FSDP2, "--set", "parallelism.pp=2")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "parallelism.pp" in lines[0] and SCENARIO in lines[0]
    assert "Weight tying is not supported with Pipeline Parallel" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("sets", [
    ["parallelism.pp=1"],                                   # tied, no pipeline
    ["parallelism.pp=2", "model=llama3-8b"],                # pipeline, untied (Llama 3 8B)
])
def test_either_alone_builds(sets: list[str]) -> None:
    args = [x for kv in sets for x in ("--set", kv)]
    proc = fabricsim("run", SCENARIO, "--json", *FSDP2, *args)
    assert proc.returncode == 0, proc.stderr
