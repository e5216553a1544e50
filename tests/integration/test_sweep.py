"""Parameter sweeps (sim/apps/sweep/__init__.py): the grid, the backends, the cache, failures and
outputs.

Every sweep here is a tiny job (2 nodes x 2 H100, a 2-layer model: 5-25 ms per variant), so
the time goes to starting worker pools: loky ~1 s, a Dask LocalCluster ~2 s, Ray 7-20 s on
a 2-core machine.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from sim.api import simulate
from sim.apps import sweep
from sim.apps.sweep import (
    ROW_TAIL,
    cache_key,
    expand,
    flatten,
    parse_grid,
    run_sweep,
    sweep_command,
    sweep_figure,
    without_wall_clock,
    write_plot,
    write_rows,
)
from sim.scenario import ScenarioError, load_scenario

# Two nodes, so that the NIC speed matters; global batch 8 over dp = 4 ranks.
TINY = {
    "name": "tiny-sweep",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "ddp",
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8},
}
NICS = [25, 100, 400]
MBS = [1, 2]
GRID = [f"cluster.nic_gbps={','.join(map(str, NICS))}",
        f"training.micro_batch_size={','.join(map(str, MBS))}"]
KEYS = ["cluster.nic_gbps", "training.micro_batch_size"]


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sweep") / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


@pytest.fixture(scope="module")
def reference(scenario_file: str) -> list[dict[str, Any]]:
    """Each variant simulated in this process, in grid order: what every backend must give."""
    rows = []
    for nic in NICS:
        for mbs in MBS:
            sc = load_scenario(scenario_file, [f"cluster.nic_gbps={nic}",
                                               f"training.micro_batch_size={mbs}"])
            rows.append({"cluster.nic_gbps": nic, "training.micro_batch_size": mbs,
                         **flatten(simulate(sc, origin=scenario_file).summary), "error": None})
    return without_wall_clock(rows)


@pytest.fixture(scope="module")
def local_rows(scenario_file: str) -> list[dict[str, Any]]:
    return run_sweep(scenario_file, GRID, "local", workers=2, use_cache=False).rows


# --------------------------------------------------------------------------- the grid
def test_grid_is_the_cross_product_in_grid_order() -> None:
    axes = parse_grid(["a=1,2,3", "b=ring,tree", "c=true,false"])
    variants = expand(axes)
    assert len(variants) == 3 * 2 * 2
    # The first key varies slowest, the last fastest (itertools.product).
    assert [tuple(v.values.values()) for v in variants[:5]] == [
        (1, "ring", True), (1, "ring", False), (1, "tree", True), (1, "tree", False),
        (2, "ring", True)]
    assert [v.index for v in variants] == list(range(12))
    assert variants[-1].overrides == ("a=3", "b=tree", "c=false")
    # Values parse as --set parses them: YAML scalars, and flow collections kept whole.
    (axis,) = parse_grid(["model={layers: 2, hidden: 64},llama3-8b"])
    assert axis.values == ({"layers": 2, "hidden": 64}, "llama3-8b")


@pytest.mark.parametrize("spec, message", [
    (["cluster.nic_gbps"], "expected KEY=V1,V2"),
    (["cluster..nic=1"], "empty key path"),
    (["a=1,,2"], "empty value"),
    (["a=1", "a=2"], "given twice"),
    (["a=ring,tree,ring"], "value ring given twice"),
])
def test_grid_syntax_errors(spec: list[str], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_grid(spec)


@pytest.mark.parametrize("grid, message", [
    # A key that exists nowhere, a value of the wrong type: bad input before anything runs.
    (["training.bogus=1,2"], r"--grid training.bogus=1: .*training.bogus: unknown key"),
    (["cluster.nic_gbps=100,fast"], r"--grid cluster.nic_gbps=fast: .*cluster.nic_gbps"),
    # tp=3 fits no variant of the 4 GPUs (tp*pp*cp must divide them).
    (["framework.name=ddp,fsdp2", "parallelism.tp=1,3"], r"parallelism.tp=3: .*does not divide"),
    ([], "at least one --grid"),
])
def test_bad_grid_is_refused_before_running(scenario_file: str, grid: list[str],
                                            message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        run_sweep(scenario_file, grid, workers=1, use_cache=False)


def test_illegal_combinations_are_failed_rows(scenario_file: str) -> None:
    # ddp refuses tp > 1 when the scenario loads (fsdp2 takes it). Micro-batch 4 on dp = 4
    # replicas is 16 sequences, more than the global batch of 8, which only the framework
    # builder checks; with tp = 2 (dp = 2) it is exactly 8.
    result = run_sweep(scenario_file, ["framework.name=ddp,fsdp2", "parallelism.tp=1,2",
                                       "training.micro_batch_size=1,4"],
                       workers=2, use_cache=False)
    assert len(result.rows) == 8
    failed = {(r["framework.name"], r["parallelism.tp"], r["training.micro_batch_size"]):
              r["error"] for r in result.rows if r["error"]}
    assert set(failed) == {("ddp", 2, 1), ("ddp", 2, 4), ("ddp", 1, 4), ("fsdp2", 1, 4)}
    assert failed[("ddp", 2, 1)].startswith("ScenarioError: ") and "parallelism" in \
        failed[("ddp", 2, 1)]
    assert "not a multiple of micro_batch_size x dp = 4 x 4" in failed[("fsdp2", 1, 4)]
    assert result.failed == 4
    assert all(r["step_time_s"] > 0 for r in result.rows if not r["error"])


# --------------------------------------------------------------------------- rows
def test_rows_are_the_summaries_flattened_in_grid_order(local_rows: list[dict[str, Any]],
                                                        reference: list[dict[str, Any]]
                                                        ) -> None:
    assert without_wall_clock(local_rows) == reference
    assert [(r["cluster.nic_gbps"], r["training.micro_batch_size"]) for r in local_rows] == \
        [(n, m) for n in NICS for m in MBS]
    first = local_rows[0]
    assert list(first)[:2] == KEYS and tuple(list(first)[-3:]) == ROW_TAIL
    assert {"bytes.network", "cost.usd_per_step", "sim.wall_s", "step_time_s"} <= set(first)
    assert all(r["cached"] is False and r["wall_s"] > 0 for r in local_rows)
    # Physics, as a check that the grid reached the simulation: DDP all-reduces the same
    # gradient bytes whatever the NIC speed, and a faster NIC never makes the step slower.
    for m in MBS:
        same_mbs = [r for r in local_rows if r["training.micro_batch_size"] == m]
        # (to rounding: the byte counters integrate rate x time)
        assert [r["bytes.network"] for r in same_mbs] == \
            pytest.approx([same_mbs[0]["bytes.network"]] * len(same_mbs), rel=1e-12)
        times = [r["step_time_s"] for r in same_mbs]
        assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_ray_and_dask_give_the_same_rows(scenario_file: str,
                                         reference: list[dict[str, Any]]) -> None:
    import ray  # the [ray] extra; `make test` installs it

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        by_ray = run_sweep(scenario_file, GRID, "ray", use_cache=False)
    finally:
        ray.shutdown()
    by_dask = run_sweep(scenario_file, GRID, "dask", workers=2, use_cache=False)
    assert by_ray.backend == "ray" and by_dask.backend == "dask"
    assert without_wall_clock(by_ray.rows) == reference
    assert without_wall_clock(by_dask.rows) == reference


# --------------------------------------------------------------------------- the cache
def test_cache_key_is_the_resolved_scenario(scenario_file: str) -> None:
    base = load_scenario(scenario_file)
    # 400 Gb/s is the NIC default: the same resolved scenario, the same key.
    assert cache_key(load_scenario(scenario_file, ["cluster.nic_gbps=400"]), 1) == \
        cache_key(base, 1)
    assert cache_key(load_scenario(scenario_file, ["cluster.nic_gbps=100"]), 1) != \
        cache_key(base, 1)
    assert cache_key(base, 2) != cache_key(base, 1)


def test_second_run_is_served_from_the_cache(scenario_file: str, tmp_path: Path,
                                             reference: list[dict[str, Any]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    first = run_sweep(scenario_file, GRID, workers=2, cache_dir=tmp_path)
    assert (first.simulated, first.cached) == (6, 0)

    def no_backend(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a fully cached sweep must not start a backend")

    # Fast because nothing runs: no worker pool, only the 6 scenarios loaded and hashed.
    with monkeypatch.context() as m:
        m.setattr(sweep, "make_backend", no_backend)
        second = run_sweep(scenario_file, GRID, workers=2, cache_dir=tmp_path)
    assert (second.simulated, second.cached) == (0, 6)
    assert all(r["cached"] for r in second.rows)
    # Served rows are the simulated rows, wall_s included (it is the run's that filled it).
    assert [{**r, "cached": False} for r in second.rows] == first.rows
    assert without_wall_clock(second.rows) == reference
    # One more value for a key: only its variants run.
    third = run_sweep(scenario_file, [GRID[0] + ",200", GRID[1]], workers=2,
                      cache_dir=tmp_path)
    assert (third.simulated, third.cached) == (2, 6)


# --------------------------------------------------------------------------- failures
def _raise_at_100_gbps(values: dict[str, Any]) -> None:
    if values["cluster.nic_gbps"] == 100:
        raise RuntimeError("injected failure")


def _exit_at_100_gbps_mbs_2(values: dict[str, Any]) -> None:
    if values["cluster.nic_gbps"] == 100 and values["training.micro_batch_size"] == 2:
        os._exit(3)   # the worker process dies without a word, as in a segfault


def test_a_raising_variant_keeps_the_others(scenario_file: str,
                                            reference: list[dict[str, Any]]) -> None:
    result = run_sweep(scenario_file, GRID, workers=2, use_cache=False,
                       before_variant=_raise_at_100_gbps)
    assert result.failed == 2
    for row, ref in zip(without_wall_clock(result.rows), reference, strict=True):
        if row["cluster.nic_gbps"] == 100:
            assert row["error"] == "RuntimeError: injected failure"
            assert row["step_time_s"] is None
        else:
            assert row == ref


def test_a_killed_worker_keeps_the_others(scenario_file: str, tmp_path: Path,
                                          reference: list[dict[str, Any]]) -> None:
    result = run_sweep(scenario_file, GRID, workers=2, cache_dir=tmp_path,
                       before_variant=_exit_at_100_gbps_mbs_2)
    assert result.failed == 1
    for row, ref in zip(without_wall_clock(result.rows), reference, strict=True):
        if (row["cluster.nic_gbps"], row["training.micro_batch_size"]) == (100, 2):
            assert row["error"].startswith("WorkerDied: the worker process died (exit codes")
        else:
            assert row == ref
    # The failed variant is not cached: a re-run (without the hook) simulates it alone.
    again = run_sweep(scenario_file, GRID, workers=2, cache_dir=tmp_path)
    assert (again.simulated, again.cached, again.failed) == (1, 5, 0)
    assert without_wall_clock(again.rows) == reference


# --------------------------------------------------------------------------- outputs
def test_csv_and_parquet_hold_every_row_and_column(local_rows: list[dict[str, Any]],
                                                   tmp_path: Path) -> None:
    import pyarrow.parquet as pq  # the [parquet] extra; `make test` installs it

    columns = list(local_rows[0])
    write_rows(tmp_path / "rows.csv", local_rows, columns)
    write_rows(tmp_path / "rows.parquet", local_rows, columns)
    with open(tmp_path / "rows.csv", newline="") as fh:
        text_rows = list(csv.DictReader(fh))
    table = pq.read_table(tmp_path / "rows.parquet")
    assert table.column_names == columns and list(text_rows[0]) == columns
    for row, text, back in zip(local_rows, text_rows, table.to_pylist(), strict=True):
        # Floats survive CSV exactly (Python writes the shortest repr that reads back).
        assert float(text["step_time_s"]) == row["step_time_s"]
        assert int(text["cluster.nic_gbps"]) == row["cluster.nic_gbps"]
        assert text["error"] == ""
        assert json.loads(text["memory_by_rank_class"]) == row["memory_by_rank_class"]
        assert back["step_time_s"] == row["step_time_s"]
        assert back["bytes.network"] == row["bytes.network"]
        assert back["oom"] is row["oom"]
        assert back["error"] is None


def test_command_writes_the_file_json_and_cache(scenario_file: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out" / "sweep.csv"
    rc = sweep_command(scenario_file, GRID, workers=2, out=out, plot=tmp_path / "s.png",
                       as_json=True)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["rows"]) == 6
    with open(out, newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 6
    assert (tmp_path / "s.png").stat().st_size > 0
    assert any((out.parent / ".fabricsim-cache").rglob("*.json"))   # next to the output


@pytest.mark.parametrize("kwargs, message", [
    ({"out": Path("rows.xlsx")}, "expected a .csv or .parquet"),
    ({"plot": Path("p.png"), "grid": ["framework.name=ddp,fsdp2"]}, "no grid key with only"),
    ({"backend": "spark"}, "--backend spark: expected one of local, ray, dask"),
    ({"address": "tcp://x:1"}, "--address: only with --backend ray or dask"),
])
def test_command_bad_options(scenario_file: str, kwargs: dict[str, Any], message: str,
                             tmp_path: Path) -> None:
    args: dict[str, Any] = {"grid": GRID, "cache": tmp_path, **kwargs}
    with pytest.raises(ScenarioError, match=message):
        sweep_command(scenario_file, **args)


def test_plot_has_one_line_per_value_of_the_second_key(scenario_file: str,
                                                       tmp_path: Path) -> None:
    # The first numeric key is the x axis even when a word-valued key comes first.
    result = run_sweep(scenario_file, ["framework.name=ddp,fsdp2", *GRID], workers=2,
                       cache_dir=tmp_path)
    fig = sweep_figure(result.rows, result.keys, result.title)
    time_ax, cost_ax = fig.axes[:2]
    for ax in (time_ax, cost_ax):
        assert ax.get_xlabel() == "cluster.nic_gbps"
        # One line per (framework, micro-batch) combination, each through every NIC speed.
        assert len(ax.get_lines()) == 2 * len(MBS)
        assert all(list(line.get_xdata()) == NICS for line in ax.get_lines())
    assert time_ax.get_ylabel() == "step time (s)"
    assert cost_ax.get_ylabel() == "$ per million tokens"
    ddp_1 = [r["step_time_s"] for r in result.rows
             if r["framework.name"] == "ddp" and r["training.micro_batch_size"] == 1]
    assert list(time_ax.get_lines()[0].get_ydata()) == ddp_1
    assert [t.get_text() for t in cost_ax.get_legend().get_texts()] == \
        ["ddp, 1", "ddp, 2", "fsdp2, 1", "fsdp2, 2"]
    write_plot(tmp_path / "sweep.png", result.rows, result.keys)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
