"""MosaicML llm-foundry's published MPT throughputs against the simulation, with the attention
kernel they ran and with FlashAttention-2 in its place.

The rows (``sim/catalog/reference/published.yaml``, ids ``llm-foundry-*``) are llm-foundry's
benchmark tables: MPT 125M-70B under Composer's FSDP on 8-512 H100s and 8 A100s, 2k-64k
tokens. Their launcher sets ``attn_impl: triton``, FlashAttention's Triton kernel, which the
model prices from FlashAttention's CUDA kernel, at that kernel's published share of
FlashAttention-2's speed at the call's head dim and length (the FlashAttention-2 paper's bars;
:func:`sim.hardware.attention_cost.share_of_flash2`), times a factor fitted at head dim 128
on llm-foundry's own table (``TRITON_OVER_CUDA_AT_128``): eight of these rows are among the
31 it was fitted on (``sim.apps.validation.llm_foundry.half_of``), the others check it.
"""

from __future__ import annotations

import copy

import pytest

from sim.api import simulate
from sim.apps.validation.llm_foundry import MPT_SIZES, half_of
from sim.apps.validation.published import entries
from sim.scenario import scenario_from_dict

ROWS = [e for e in entries() if e["id"].startswith("llm-foundry-")]


def _errors(backend: str | None) -> dict[str, float]:
    """Relative throughput error per row, its scenario's attention kernel replaced by
    ``backend`` (None: as written)."""
    out = {}
    for e in ROWS:
        sc = copy.deepcopy(e["scenario"])
        if backend is not None:
            sc["training"]["attention_backend"] = backend
        s = simulate(scenario_from_dict({"name": e["id"], **sc})).summary
        out[e["id"]] = s["tokens_per_s_per_gpu"] / e["measured"]["tokens_per_s_per_gpu"] - 1
    return out


@pytest.fixture(scope="module")
def as_run() -> dict[str, float]:
    return _errors(None)


def test_the_rows_are_the_tables_of_both_gpus_at_every_length() -> None:
    assert len(ROWS) == 25
    assert all(e["scenario"]["training"]["attention_backend"] == "flash1_triton" for e in ROWS)
    # llm-foundry v0.3.0's MPT loss: flash-attn's fused cross-entropy (loss_fn default).
    assert all(e["scenario"]["framework"]["cross_entropy"] == "fused" for e in ROWS)
    seqs = {e["scenario"]["training"]["seq_len"] for e in ROWS}
    assert {2048, 65536} <= seqs
    assert {e["scenario"]["cluster"]["topology"] for e in ROWS} == {"dgx-h100", "dgx-a100"}


def test_with_the_kernel_they_ran_the_rows_are_within_the_published_bar(as_run) -> None:
    # Issue 11's bar for published runs: mean absolute error within 10%. Every row within 25%
    # (MPT-30B at 8k on 8 H100, +21%, the largest). The rows the factor was not fitted on
    # keep their own mean within 10%.
    errors = list(as_run.values())
    assert sum(abs(e) for e in errors) / len(errors) < 0.10
    assert max(abs(e) for e in errors) < 0.25
    fit = {e["id"] for e in ROWS if half_of(_table_row(e)) == "fit"}
    assert len(fit) == 8
    held = [v for k, v in as_run.items() if k not in fit]
    assert sum(abs(e) for e in held) / len(held) < 0.10


def _table_row(e: dict) -> dict[str, str]:
    """The fields of a published entry that :func:`half_of` reads."""
    sc = e["scenario"]
    hidden, heads = sc["model"]["hidden"], sc["model"]["heads"]
    size = {(d, h): name for name, (_, d, h) in MPT_SIZES.items()}[(hidden, heads)]
    gpu = "h100_80gb" if sc["cluster"]["topology"] == "dgx-h100" else "a100_80gb"
    return {"model": size, "seq_len": str(sc["training"]["seq_len"]),
            "gpus": str(8 * sc["cluster"]["nodes"]), "gpu": gpu}


def test_at_head_dim_64_the_long_rows_are_not_slow(as_run) -> None:
    # MPT-125M and -350M (head dim 64), no recomputation: at 64k tokens attention is most of
    # the step, so the kernel's speed decides the row. Priced at the head-dim-128 share (0.42
    # of FA2 instead of 0.57) the 64k rows came out 27-29% slow (their 2k rows 14%); at head
    # dim 64's own share they are within 8%.
    small = {k: v for k, v in as_run.items() if "-125m-" in k or "-350m-" in k}
    assert len(small) == 4
    for k in ("llm-foundry-mpt-125m-65536-8xa100", "llm-foundry-mpt-350m-65536-8xa100"):
        assert abs(small[k]) < 0.08
    assert all(abs(v) < 0.12 for v in small.values())


def test_priced_as_flash_attention_2_every_long_row_is_far_too_fast(as_run) -> None:
    # What the rows gave before the kernel could be named: FlashAttention-2 runs attention
    # about 2.4x faster than the Triton kernel, so from 32k tokens, where attention is most of
    # the step, every row comes out at least 30% too fast.
    fa2 = _errors("flash2")
    long_ids = [k for k in fa2 if "-32768-" in k or "-65536-" in k]
    assert long_ids and all(fa2[k] > 0.30 for k in long_ids)
    assert all(fa2[k] > as_run[k] for k in fa2)
