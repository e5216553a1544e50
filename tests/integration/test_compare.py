"""Tests of ``fabricsim compare`` (sim/apps/compare.py and the command in
sim/cli/commands.py): variants from ``--what-if`` values and from scenario files, the deltas
JSON, failed variants, bad input and the figure.
Every simulation is a small job on 2 nodes x 2 H100."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from sim.apps import compare as cmp
from sim.cli.commands import app

# A job whose step depends on the NICs: FSDP2 over 2 nodes, each rank gathering a 2-layer
# model's parameters from the other node every step.
TWO_NODES = {
    "name": "two-nodes",
    "model": {"layers": 2, "hidden": 2048, "heads": 16, "kv_heads": 4, "ffn_hidden": 5632,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "fsdp2",
    "training": {"seq_len": 1024, "micro_batch_size": 1},
}
# The same model with plain DDP: all-reduce instead of all-gather + reduce-scatter.
TWO_NODES_DDP = {**TWO_NODES, "name": "two-nodes-ddp", "framework": "ddp"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compare")
    (path / "fsdp2.yaml").write_text(yaml.safe_dump(TWO_NODES))
    (path / "ddp.yaml").write_text(yaml.safe_dump(TWO_NODES_DDP))
    return path


def invoke(folder: Path, *args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def nic_what_if(folder) -> dict:
    out = folder / "nic"
    result = invoke(folder, "compare", str(folder / "fsdp2.yaml"), "--what-if",
                    "cluster.nic_gbps=100,400", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_slower_nics_slow_the_step_and_move_the_same_bytes(nic_what_if):
    slow, fast = (v["summary"] for v in nic_what_if["variants"])
    assert [v["label"] for v in nic_what_if["variants"]] == ["cluster.nic_gbps=100",
                                                             "cluster.nic_gbps=400"]
    # The schedule and its collectives do not depend on the line rate: the same bytes on
    # every link class; only the time to move them changes.
    assert slow["bytes"]["network"] == pytest.approx(fast["bytes"]["network"], rel=1e-9)
    assert slow["bytes"]["nvlink"] == pytest.approx(fast["bytes"]["nvlink"], rel=1e-9)
    assert slow["bytes"]["network"] > 0
    assert slow["step_time_s"] > fast["step_time_s"]
    assert slow["exposed_comm_s"] > fast["exposed_comm_s"]
    # Same GPUs, same kernels: the difference is communication the step cannot hide, and
    # how much of it runs beside compute and slows it (sim/hardware/interference.py: up to the SM
    # share of NCCL's channels, 132/100 on Hopper, over the overlapped part).
    assert slow["compute_time_s"] == pytest.approx(fast["compute_time_s"], rel=0.08)


def test_json_shape_and_deltas(nic_what_if):
    r = nic_what_if
    assert set(r) == {"baseline", "variants", "deltas"}
    assert r["baseline"] == "cluster.nic_gbps=100"
    for v in r["variants"]:
        assert set(v) == {"label", "summary", "error"} and v["error"] is None
        assert {"step_time_s", "bytes", "cost"} <= set(v["summary"])
    assert [d["label"] for d in r["deltas"]] == ["cluster.nic_gbps=400"]
    d = r["deltas"][0]
    base, other = r["variants"][0]["summary"], r["variants"][1]["summary"]
    assert set(d) - {"label"} == {m.path for m in cmp.METRICS
                                  if cmp.metric_value(base, m.path) is not None}
    for path in ("step_time_s", "cost.usd_per_million_tokens", "bytes.network"):
        a, b = cmp.metric_value(other, path), cmp.metric_value(base, path)
        # exact, but for float rounding of sums taken in another order (within 1e-12)
        noise = 1e-12 * max(abs(a), abs(b))
        assert d[path]["abs"] == pytest.approx(a - b, abs=noise)
        assert d[path]["rel"] == pytest.approx((a - b) / b if b else 0.0, abs=1e-12)
    assert d["step_time_s"]["rel"] < 0                        # 400 Gb/s is faster
    # No training.tokens_total: no run cost, so no delta for it.
    assert "cost.run_usd" not in d


def test_out_writes_json_and_figure(folder, nic_what_if):
    out = folder / "nic"
    assert json.loads((out / "compare.json").read_text()) == nic_what_if
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figure_has_a_bar_per_variant_and_labelled_axes(nic_what_if):
    fig = cmp.compare_figure(nic_what_if)
    try:
        ax_time, ax_cost = fig.axes
        # compute, exposed comm, bubble, other: one stacked bar per variant in each segment.
        assert len(ax_time.containers) == len(cmp.SEGMENT_COLORS)
        assert all(len(c) == 2 for c in ax_time.containers)
        assert len(ax_cost.containers) == 1 and len(ax_cost.containers[0]) == 2
        assert ax_time.get_xlabel() == "time per step (s)"
        assert ax_cost.get_xlabel() == "$ per million tokens"
        assert [t.get_text() for t in ax_time.get_yticklabels()] == [
            "cluster.nic_gbps=100", "cluster.nic_gbps=400"]
        # Each variant's stack ends at its step time (nothing is clipped on this job).
        for i, v in enumerate(nic_what_if["variants"]):
            end = sum(c[i].get_width() for c in ax_time.containers)
            assert end == pytest.approx(max(v["summary"]["step_time_s"],
                                            v["summary"]["compute_time_s"]
                                            + v["summary"]["exposed_comm_s"]), rel=1e-9)
    finally:
        plt.close(fig)


def test_table_has_a_column_per_variant(nic_what_if):
    table = cmp.comparison_table(nic_what_if)
    assert len(table.columns) == 3            # metric + 2 variants
    console = Console(record=True, width=160)
    console.print(table)
    text = console.export_text()
    assert "cluster.nic_gbps" in text and "step time" in text and "$ / day" in text


def test_two_scenario_files(folder):
    a, b = str(folder / "fsdp2.yaml"), str(folder / "ddp.yaml")
    result = invoke(folder, "compare", a, b, "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert [v["label"] for v in r["variants"]] == [a, b] and r["baseline"] == a
    fsdp2, ddp = (v["summary"] for v in r["variants"])
    assert (fsdp2["framework"], ddp["framework"]) == ("fsdp2", "ddp")
    # DDP keeps a whole replica per GPU; FSDP2 shards it over 4 ranks.
    assert ddp["peak_memory_gib"] > fsdp2["peak_memory_gib"]
    d = r["deltas"][0]
    assert d["label"] == b
    assert d["peak_memory_gib"]["abs"] == ddp["peak_memory_gib"] - fsdp2["peak_memory_gib"]


def test_a_failing_variant_is_recorded_and_the_others_run(folder):
    # dp = 4: an HSDP shard group of 3 ranks does not divide it, which FSDP2's builder refuses.
    result = invoke(folder, "compare", str(folder / "fsdp2.yaml"), "--what-if",
                    "framework.hsdp_shard_size=3,2,4", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    failed, two, four = r["variants"]
    assert failed["summary"] is None
    assert "framework.hsdp_shard_size: 3 does not divide dp=4" in failed["error"]
    assert two["error"] is None and four["error"] is None
    # The baseline is the first variant that ran; a failed variant has no delta.
    assert r["baseline"] == "framework.hsdp_shard_size=2"
    assert [d["label"] for d in r["deltas"]] == ["framework.hsdp_shard_size=4"]
    fig = cmp.compare_figure(r)
    try:
        assert all(len(c) == 3 for c in fig.axes[0].containers)   # the failed row stays
        assert all(bar.get_width() == 0 for c in fig.axes[0].containers for bar in c[:1])
    finally:
        plt.close(fig)


@pytest.mark.parametrize("args, expected", [
    (["--what-if", "cluster.bogus=1,2"], "cluster.bogus: unknown key"),
    (["--what-if", "cluster.nic_gbps=fast,400"], "cluster.nic_gbps: "),
    (["--what-if", "cluster.nic_gbps"], "--what-if cluster.nic_gbps: expected KEY=V1,V2"),
    (["--what-if", "cluster.nic_gbps=100,"], "empty value"),
    (["--what-if", "pricing.instance=aws-p4d.24xlarge"],
     "pricing.instance: aws-p4d.24xlarge has a100-40gb GPUs but cluster.gpu is h100-sxm"),
    (["--what-if", "framework.hsdp_shard_size=3"],     # every variant failed
     "framework.hsdp_shard_size: 3 does not divide dp=4"),
    ([], "give --what-if KEY=V1,V2[,...] or two or more scenarios"),
])
def test_bad_input_exits_2_with_one_line(folder, args, expected):
    result = invoke(folder, "compare", str(folder / "fsdp2.yaml"), *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fabricsim: ") and expected in lines[0]


def test_what_if_takes_one_scenario(folder):
    result = invoke(folder, "compare", str(folder / "fsdp2.yaml"), str(folder / "ddp.yaml"),
                    "--what-if", "cluster.nic_gbps=100,400")
    assert result.exit_code == 2 and "exactly one scenario" in result.stderr


def test_missing_file_exits_2(folder):
    result = invoke(folder, "compare", str(folder / "fsdp2.yaml"), "no-such.yaml")
    assert result.exit_code == 2 and "no-such.yaml: no such file" in result.stderr
