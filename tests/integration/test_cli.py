"""Tests of the installed ``fabricsim`` command (sim/cli/commands.py), run as a subprocess from a
temporary folder outside the repository, so shipped scenarios must resolve from anywhere."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

FABRICSIM = Path(sys.executable).parent / "fabricsim"
TINY = "llama3.2-1b-1xh200"
PEAK_H200_BF16 = 989.4e12   # H200 SXM datasheet: same compute as H100 SXM, 989.4 TFLOP/s bf16
# scenarios/llama3.2-1b-1xh200.yaml: 4 sequences x 4,096 tokens on one GPU.
TOKENS_PER_STEP = 4 * 4096
# Llama 3.2 1B: 6 x 1,235,814,400 + 6 x 16 x 4096 x 2048 = 8,220,192,768 FLOP per token.
FLOPS_PER_TOKEN = 6 * 1_235_814_400 + 6 * 16 * 4096 * 2048

SUMMARY_KEYS = {
    "scenario", "gpus", "step_time_s", "tokens_per_step", "tokens_per_s", "tokens_per_s_per_gpu",
    "model_flops_per_step", "mfu", "hfu", "model_tflops_per_gpu", "peak_memory_gib",
    "gpu_memory_gib", "oom", "compute_time_s", "comm_time_s", "exposed_comm_s",
    "overlap_fraction", "bubble_fraction", "bytes", "cost", "sim",
}
BYTES_KEYS = {"nvlink", "pcie", "network", "cross_az", "cross_region"}
COST_KEYS = {"usd_per_hour", "usd_per_step", "egress_usd_per_step", "usd_per_million_tokens",
             "run_hours", "run_usd"}
SIM_KEYS = {"wall_s", "events", "ranks_simulated"}

# A small multi-GPU job (2 nodes x 2 H100, FSDP2) so the trace has compute and comm streams.
TINY_FSDP2 = {
    "name": "tiny-fsdp2",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "fsdp2",
    "training": {"seq_len": 1024, "micro_batch_size": 1},
}


BAD_INPUT = [
    (["run", "no-such-scenario"], "no-such-scenario: no such file"),
    (["run", TINY, "--set", "training.bogus=1"], "training.bogus: unknown key"),
    (["run", TINY, "--set", "parallelism.tp=2"], "parallelism: tp*pp*cp = 2"),
    (["run", TINY, "--set", "training.seq_len=long"], "training.seq_len: "),
    (["run", TINY, "--set", "noequals"], "--set noequals: expected KEY=VALUE"),
    (["run", "broken.yaml"], "broken.yaml: line 3 not valid YAML"),
]

# Every command the tests look at, run side by side (each is mostly interpreter start-up).
# Other kinds of bad input (unknown model, framework, GPU) are covered in-process by
# tests/unit/config/test_scenario.py; run_hours with tokens_total by
# tests/unit/analysis/test_cost.py.
COMMANDS: dict[str, list[str]] = {
    "json": ["run", TINY, "--json"],
    "json-again": ["run", TINY, "--json"],
    "h100": ["run", TINY, "--json", "--set", "cluster.gpu=h100-sxm"],
    "table": ["run", TINY],
    "schema": ["schema"],
    "steps-0": ["run", TINY, "--steps", "0"],
    # parent folders of --out do not exist yet
    "out": ["run", "tiny-fsdp2.yaml", "--json", "--out", "results/tiny"],
    "out-window": ["run", "tiny-fsdp2.yaml", "--json", "--out", "zoomed", "--window",
                   "0.001:0.002"],
    "bad-window": ["run", "tiny-fsdp2.yaml", "--out", "never", "--window", "2:1"],
    "hta": ["run", "tiny-fsdp2.yaml", "--json", "--out", "hta-run", "--hta-all-ranks"],
    "hta-without-out": ["run", "tiny-fsdp2.yaml", "--hta"],
    **{f"bad-{i}": args for i, (args, _) in enumerate(BAD_INPUT)},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cwd")


@pytest.fixture(scope="module")
def results(workdir) -> dict[str, subprocess.CompletedProcess]:
    assert FABRICSIM.is_file(), f"{FABRICSIM} is not installed"
    (workdir / "broken.yaml").write_text("name: x\nmodel: [unclosed\n")
    (workdir / "tiny-fsdp2.yaml").write_text(yaml.safe_dump(TINY_FSDP2))
    env = {k: v for k, v in os.environ.items() if k != "FABRICSIM_DEBUG"}
    env["MPLBACKEND"] = "Agg"

    def one(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([str(FABRICSIM), *args], cwd=workdir, env=env, text=True,
                              capture_output=True, timeout=120)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(one, args) for name, args in COMMANDS.items()}
        return {name: f.result() for name, f in futures.items()}


def ok_json(results: dict, name: str) -> dict:
    proc = results[name]
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def summary(results) -> dict:
    return ok_json(results, "json")


def test_not_run_from_the_repository(workdir):
    repo = Path(__file__).resolve().parents[2]
    assert repo not in workdir.resolve().parents and workdir.resolve() != repo


def test_summary_has_every_contract_key(summary):
    assert SUMMARY_KEYS <= set(summary)
    # The contract only grows, so more keys are allowed; none of these may be missing.
    assert BYTES_KEYS <= set(summary["bytes"])
    assert COST_KEYS <= set(summary["cost"])
    assert SIM_KEYS <= set(summary["sim"])
    assert "claims" not in summary  # only with a claims block


def test_summary_values_are_consistent(summary):
    s = summary
    assert s["scenario"] == TINY and s["gpus"] == 1
    assert s["tokens_per_step"] == TOKENS_PER_STEP
    assert s["step_time_s"] > 0
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["step_time_s"], rel=1e-12)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_s"] / s["gpus"], rel=1e-12)
    assert s["model_flops_per_step"] == TOKENS_PER_STEP * FLOPS_PER_TOKEN
    assert s["mfu"] == pytest.approx(
        s["model_flops_per_step"] / (s["step_time_s"] * s["gpus"] * PEAK_H200_BF16), rel=1e-12)
    # No activation checkpointing: nothing recomputed, so HFU equals MFU.
    assert s["hfu"] == pytest.approx(s["mfu"], rel=1e-12)
    assert s["model_tflops_per_gpu"] == pytest.approx(
        s["model_flops_per_step"] / s["step_time_s"] / s["gpus"] / 1e12, rel=1e-12)
    # Physics: no GPU exceeds its dense peak.
    assert 0 < s["mfu"] < 1 and s["model_tflops_per_gpu"] < 989.4
    assert s["compute_time_s"] <= s["step_time_s"] * (1 + 1e-12)
    # gpus.yaml: 139.80 GiB usable on the H200 (CUDA's total_memory).
    assert s["gpu_memory_gib"] == 139.80
    assert s["oom"] is (s["peak_memory_gib"] > s["gpu_memory_gib"])
    # One GPU: no communication, no pipeline.
    assert s["comm_time_s"] == 0 and s["exposed_comm_s"] == 0 and s["bubble_fraction"] == 0
    assert all(v == 0 for v in s["bytes"].values())
    assert s["sim"]["events"] > 0 and s["sim"]["ranks_simulated"] == 1


def test_cost_of_the_one_gpu_run(summary):
    c, step = summary["cost"], summary["step_time_s"]
    # gpus.yaml: H200 reference price $5.408 per GPU-hour; one GPU; no egress.
    assert c["usd_per_hour"] == pytest.approx(5.408, rel=1e-12)
    assert c["usd_per_step"] == pytest.approx(5.408 * step / 3600, rel=1e-12)
    assert c["egress_usd_per_step"] == 0
    assert c["usd_per_million_tokens"] == pytest.approx(c["usd_per_step"] / TOKENS_PER_STEP * 1e6,
                                                        rel=1e-12)
    assert c["run_hours"] is None and c["run_usd"] is None   # no training.tokens_total


def test_two_runs_are_identical_but_for_wall_time(results, summary):
    a, b = dict(summary), dict(ok_json(results, "json-again"))
    a["sim"] = {k: v for k, v in a["sim"].items() if k != "wall_s"}
    b["sim"] = {k: v for k, v in b["sim"].items() if k != "wall_s"}
    assert a == b


def test_h100_override_is_slower(results, summary):
    # Same 989.4 TFLOP/s as the H200 but 3.35 instead of 4.8 TB/s of HBM: memory-bound kernels
    # take longer, so the step cannot be as fast.
    h100 = ok_json(results, "h100")
    assert h100["step_time_s"] > summary["step_time_s"]
    assert h100["gpu_memory_gib"] == 79.19   # gpus.yaml usable memory of the H100 SXM
    assert h100["model_flops_per_step"] == summary["model_flops_per_step"]


def test_table_output(results):
    proc = results["table"]
    assert proc.returncode == 0, proc.stderr
    assert TINY in proc.stdout and "step time" in proc.stdout


def test_schema_prints_json(results):
    schema = ok_json(results, "schema")
    assert schema["type"] == "object"
    assert {"model", "cluster", "framework", "parallelism", "training"} <= set(
        schema["properties"])


@pytest.mark.parametrize("i", range(len(BAD_INPUT)),
                         ids=[" ".join(args[1:]) for args, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line(results, i):
    proc = results[f"bad-{i}"]
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert BAD_INPUT[i][1] in lines[0]
    assert proc.stdout == ""


def test_bad_input_names_the_shipped_file(results):
    proc = results["bad-1"]   # --set training.bogus=1 on the shipped scenario
    assert proc.stderr.strip().endswith(f"{TINY}.yaml: training.bogus: unknown key")


def test_bad_option_value_is_one_line(results):
    proc = results["steps-0"]
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.fixture(scope="module")
def out_run(results, workdir) -> tuple[dict, Path]:
    return ok_json(results, "out"), workdir / "results" / "tiny"


def test_out_writes_every_file(out_run):
    _, out = out_run
    names = {"summary.json", "events.csv", "timeseries.csv", "trace.json", "timeline.png",
             "bytes.png", "memory.csv", "memory.png", "links.png"}
    assert names <= {p.name for p in out.iterdir()}
    for png in ("timeline.png", "bytes.png", "memory.png", "links.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # PNG signature
    # Nothing half-written is left beside the folder.
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]


def test_memory_csv_peaks_match_the_summary(out_run):
    printed, out = out_run
    with (out / "memory.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    peaks: dict[str, float] = defaultdict(float)
    for r in rows:
        peaks[r["rank_class"]] = max(peaks[r["rank_class"]], float(r["total_bytes"]))
    by_class = {str(c["rank_class"]): c["peak_gib"] for c in printed["memory_by_rank_class"]}
    assert by_class.keys() == peaks.keys()
    for cls, peak in peaks.items():
        # The CSV rows are the recorder's series; a transient's own peak sits inside an op,
        # so the summary's peak is at least the largest row.
        assert by_class[cls] * 2**30 >= peak * (1 - 1e-9)
    assert max(by_class.values()) == pytest.approx(printed["peak_memory_gib"])


def test_window_zooms_the_plots_and_a_reversed_window_is_bad_input(results, workdir):
    ok_json(results, "out-window")
    assert (workdir / "zoomed" / "timeline.png").is_file()
    bad = results["bad-window"]
    assert bad.returncode == 2 and "--window" in bad.stderr and "Traceback" not in bad.stderr
    assert not (workdir / "never").exists()


def test_hta_writes_one_trace_per_rank_with_its_rank(results, workdir):
    summary = ok_json(results, "hta")
    files = sorted((workdir / "hta-run" / "hta").glob("rank*.json"))
    assert len(files) == summary["gpus"]
    ranks = sorted(json.loads(f.read_text())["distributedInfo"]["rank"] for f in files)
    assert ranks == list(range(summary["gpus"]))
    bad = results["hta-without-out"]
    assert bad.returncode == 2 and "--out" in bad.stderr and bad.stdout == ""


def test_out_summary_matches_stdout(out_run):
    printed, out = out_run
    assert json.loads((out / "summary.json").read_text()) == printed
    assert printed["gpus"] == 4 and printed["comm_time_s"] > 0


def test_trace_is_valid_and_tracks_do_not_overlap(out_run):
    _, out = out_run
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert len(tracks) >= 2, "FSDP2 runs compute and communication streams"
    for key, spans in tracks.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            # One stream runs one op at a time. Tolerance 1e-6 us (1 ps): float64 rounding of
            # times of a few ms, far below any kernel.
            assert start >= end - 1e-6, f"overlap on track {key}"
    # Every op in events.csv is one X event in the trace.
    with (out / "events.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == sum(len(v) for v in tracks.values())
    for r in rows:
        assert float(r["ready_s"]) <= float(r["start_s"]) <= float(r["end_s"])


def test_timeseries_has_a_column_per_link_class(out_run):
    _, out = out_run
    with (out / "timeseries.csv").open() as fh:
        header = next(csv.reader(fh))
    assert header == ["time_s"] + [f"{k}_bytes_per_s" for k in ("nvlink", "pcie", "network",
                                                                 "cross_az", "cross_region")]
