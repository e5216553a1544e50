"""Sweeps that never lose work (issue 16, item 2; sim/apps/sweep/, sim/apps/executor.py):
a sweep killed after k of N variants (SIGINT, SIGKILL) and run again gives N rows, k of them
reused from the cache, none lost or duplicated, equal to an uninterrupted sweep's; a damaged
cache entry is recomputed, never served; two sweeps share one cache; a worker killed in a
variant costs one retry, and a variant that kills its worker twice is a failed row.

The killed sweeps run ``python -m sim.cli sweep`` as a subprocess in its own process group
(as a terminal's Ctrl-C reaches the sweep and its workers, and a lost machine takes them all),
on a job of about 0.3 s a variant (4 nodes x 8 H100, 32 layers) so that the test can stop it
between variants; the rest use the 2-layer job of tests/integration/test_sweep.py (5-25 ms).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import fabricsim_in_process

from sim.apps import sweep
from sim.apps.sweep import SweepCache, run_sweep, without_wall_clock

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "name": "tiny-resume",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": "ddp",
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8},
}
GRID = ["cluster.nic_gbps=25,100,400", "training.micro_batch_size=1,2"]
N_TINY = 6

# ~0.3 s a variant on this project's 2-core machine (measured: 0.30-0.33 s).
SLOW = {
    **TINY, "name": "slow-resume",
    "model": {**TINY["model"], "layers": 32},
    "cluster": {"gpu": "h100-sxm", "nodes": 4, "gpus_per_node": 8, "nics_per_node": 8},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 256},
}
SLOW_GRID = ["cluster.nic_gbps=50,100,200,400", "training.micro_batch_size=1,2"]
N_SLOW = 8


def _write(tmp: Path, name: str, doc: dict[str, Any]) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def slow_file(folder: Path) -> str:
    return _write(folder, "slow", SLOW)


@pytest.fixture(scope="module")
def tiny_file(folder: Path) -> str:
    return _write(folder, "tiny", TINY)


@pytest.fixture(scope="module")
def slow_reference(slow_file: str) -> list[dict[str, Any]]:
    """The sweep run once without interruption: what a resumed sweep must give."""
    rows = run_sweep(slow_file, SLOW_GRID, workers=2, use_cache=False).rows
    return without_wall_clock(rows)


def _default_sigint() -> None:
    # As a terminal starts a command: Ctrl-C not ignored. A child inherits an ignored SIGINT
    # (and Python then installs no KeyboardInterrupt), so whatever the test process's own
    # disposition is at this point of the suite, the sweep starts with the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(args: list[str], cwd: Path, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "sim.cli", *args], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_default_sigint, **kw)


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.json"))


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _grid_of(row: dict[str, Any]) -> tuple[str, str]:
    return str(row["cluster.nic_gbps"]), str(row["training.micro_batch_size"])


# --------------------------------------------------------------------------- kill and resume
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_killed_sweep_resumes_with_every_row_once(sig: signal.Signals, slow_file: str,
                                                    slow_reference: list[dict[str, Any]],
                                                    tmp_path: Path) -> None:
    # On a loaded machine this test may be starved while the sweep finishes every variant
    # before the kill lands; that tests no resume, so it tries again (a fresh sweep).
    for attempt in range(3):
        work = tmp_path / f"try{attempt}"
        work.mkdir()
        out, cache = work / "rows.csv", work / "cache"
        args = ["sweep", slow_file, "--grid", SLOW_GRID[0], "--grid", SLOW_GRID[1],
                "--workers", "1", "--out", str(out), "--cache", str(cache)]
        proc = _cli(args, work)
        deadline = time.monotonic() + 120
        while len(_entries(cache)) < 2:   # k >= 2 variants finished and cached
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the sweep did not get going"
            time.sleep(0.01)
        os.killpg(proc.pid, sig)   # the sweep and its worker, as Ctrl-C or a lost machine
        _, err = proc.communicate(timeout=60)
        k = len(_entries(cache))
        if k < N_SLOW:
            break
    assert 2 <= k < N_SLOW, f"killed too late to test a resume, three times (exit " \
        f"{proc.returncode}: {err.strip()[-300:]})"
    if sig == signal.SIGINT:
        # Interrupted: exit 130, one line saying how far it got; every finished row in --out.
        assert proc.returncode == 130, err
        assert f"interrupted: {k} of {N_SLOW} variants done" in err
        assert "Traceback" not in err
        assert len(_csv_rows(out)) == k
    else:
        assert proc.returncode == -signal.SIGKILL
        # The file holds whole rows only, at most one behind the cache (killed between
        # caching a result and rewriting the file).
        assert k - 1 <= len(_csv_rows(out)) <= k
    partial = _csv_rows(out)
    assert len({_grid_of(r) for r in partial}) == len(partial)   # none twice
    assert all(r["error"] == "" for r in partial)

    again = _cli([*args, "--json"], work)
    stdout, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    rows = json.loads(stdout)["rows"]
    assert sum(r["cached"] for r in rows) == k   # k reused, only the rest simulated
    assert without_wall_clock(rows) == slow_reference   # none lost, duplicated or changed
    written = _csv_rows(out)
    assert len(written) == N_SLOW and len({_grid_of(r) for r in written}) == N_SLOW
    assert len(_entries(cache)) == N_SLOW


def test_the_rerun_says_how_many_were_reused(tiny_file: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = run_sweep(tiny_file, GRID[:1], workers=1, cache_dir=cache)
    assert (first.simulated, first.cached) == (3, 0)
    # In-process through the command's entry point (tests/helpers.py): the killed and the
    # shared-cache sweeps here run the command as subprocesses.
    proc = fabricsim_in_process("sweep", tiny_file, "--grid", GRID[0], "--grid", GRID[1],
                                "--workers", "1", "--cache", str(cache), cwd=tmp_path)
    err = proc.stderr
    assert proc.returncode == 0, err
    # The first grid's 3 variants are the micro-batch 1 ones of the second (the scenario's).
    assert "6 variants: 3 simulated on local" in err and "3 reused from the cache" in err


# --------------------------------------------------------------------------- the cache
def test_a_damaged_cache_entry_is_recomputed_not_served(tiny_file: str,
                                                        tmp_path: Path) -> None:
    first = run_sweep(tiny_file, GRID, workers=1, cache_dir=tmp_path)
    entries = _entries(tmp_path)
    assert len(entries) == N_TINY
    # A file cut short (a crash before its data reached the disk) ...
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    # ... and one that still parses but whose step time changed (a flipped bit).
    entry = json.loads(entries[1].read_text())
    entry["summary"]["step_time_s"] *= 2
    entries[1].write_text(json.dumps(entry))
    # ... and an empty one.
    entries[2].write_bytes(b"")
    second = run_sweep(tiny_file, GRID, workers=1, cache_dir=tmp_path)
    assert (second.simulated, second.cached, second.corrupt) == (3, 3, 3)
    assert without_wall_clock(second.rows) == without_wall_clock(first.rows)
    # Rewritten whole: a third run serves all six.
    third = run_sweep(tiny_file, GRID, workers=1, cache_dir=tmp_path)
    assert (third.simulated, third.cached, third.corrupt) == (0, N_TINY, 0)


def test_cache_entries_are_checked_and_written_atomically(tmp_path: Path) -> None:
    cache = SweepCache(tmp_path)
    key = "ab" + "0" * 62
    assert cache.put(key, {"step_time_s": 1.5, "bytes": {"network": 3}}, 0.25)
    assert cache.get(key) == ({"step_time_s": 1.5, "bytes": {"network": 3}}, 0.25)
    assert [p.name for p in tmp_path.rglob("*")] == ["ab", f"{key}.json"]   # no temp left
    # An entry copied under another key (a misplaced file) is not served for it.
    other = "ab" + "1" * 62
    (tmp_path / "ab" / f"{other}.json").write_bytes((tmp_path / "ab" / f"{key}.json")
                                                    .read_bytes())
    assert cache.get(other) is None and cache.corrupt == 1
    assert not (tmp_path / "ab" / f"{other}.json").exists()


def test_a_cache_that_cannot_be_written_does_not_stop_the_sweep(
        tiny_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from sim.apps.sweep import cache as cache_module

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module.os, "replace", full)
    result = run_sweep(tiny_file, GRID[:1], workers=1, cache_dir=tmp_path)
    assert result.failed == 0 and len(result.rows) == 3
    assert result.cache_write_error == \
        "3 cache entries not written (OSError: [Errno 28] No space left on device)"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]   # no temp files left


def test_two_sweeps_share_one_cache(tiny_file: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["sweep", tiny_file, "--grid", GRID[0], "--grid", GRID[1], "--workers", "1",
            "--cache", str(cache), "--json"]
    procs = [_cli(args, tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    rows = [without_wall_clock(json.loads(o)["rows"]) for o, _ in outs]
    assert rows[0] == rows[1] and len(rows[0]) == N_TINY
    # Every entry whole and checked; no temporary file left behind.
    check = SweepCache(cache)
    assert len(_entries(cache)) == N_TINY
    assert all(check.get(p.stem) is not None for p in _entries(cache)) and check.corrupt == 0
    assert not [p for p in cache.rglob("*.tmp")]


# --------------------------------------------------------------------------- dead workers
def _kill_worker(log: Path, values: dict[str, Any]) -> None:
    """In the worker, before a variant: log the attempt, then SIGKILL the worker process
    (as the kernel's OOM killer does) for nic 25 every time and for nic 400, mbs 2 on its
    first attempt only (a node lost once)."""
    name = f"{values['cluster.nic_gbps']}-{values['training.micro_batch_size']}"
    with open(log / name, "a") as fh:
        fh.write("x")
        fh.flush()
    tries = (log / name).stat().st_size
    if values["cluster.nic_gbps"] == 25 or (name == "400-2" and tries == 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _check_deaths(result: sweep.SweepResult, log: Path, lost_unstarted: bool = False
                  ) -> None:
    by = {f"{r['cluster.nic_gbps']}-{r['training.micro_batch_size']}": r for r in result.rows}
    assert len(by) == N_TINY
    for name in ("25-1", "25-2"):   # killed its worker twice: retried once, then failed
        assert by[name]["error"].startswith("WorkerDied: the worker process died"), by[name]
        # Dask fails every task its dead worker held (KilledWorker), started or queued
        # there, and cannot say which: a queued one's try is lost unstarted, and where both
        # of its tries were queued behind the other's it never starts at all (no log).
        tries = (log / name).stat().st_size if (log / name).exists() else 0
        assert tries in ((0, 1, 2) if lost_unstarted else (2,))
    # Killed once, then simulated on the retry; the others untouched.
    assert (log / "400-2").stat().st_size == 2
    assert all(by[n]["error"] is None and by[n]["step_time_s"] > 0
               for n in ("100-1", "100-2", "400-1", "400-2"))
    assert result.failed == 2


def test_a_killed_local_worker_is_retried_once_then_recorded(tiny_file: str,
                                                             tmp_path: Path) -> None:
    # One worker: a worker death is pinned on the one variant it ran.
    result = run_sweep(tiny_file, GRID, workers=1, use_cache=False,
                       before_variant=functools.partial(_kill_worker, tmp_path))
    _check_deaths(result, tmp_path)


def test_a_killed_dask_worker_is_retried_once_then_recorded(tiny_file: str,
                                                            tmp_path: Path) -> None:
    pytest.importorskip("distributed", reason="the [dask] extra is not installed")
    result = run_sweep(tiny_file, GRID, "dask", workers=1, use_cache=False,
                       before_variant=functools.partial(_kill_worker, tmp_path))
    _check_deaths(result, tmp_path, lost_unstarted=True)


def test_a_killed_ray_worker_is_retried_once_then_recorded(tiny_file: str,
                                                           tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    # Ray's workers cannot import this test module: ship the hook by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[_kill_worker.__module__])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        result = run_sweep(tiny_file, GRID, "ray", workers=1, use_cache=False,
                           before_variant=functools.partial(_kill_worker, tmp_path))
    finally:
        ray.shutdown()
    _check_deaths(result, tmp_path)


def _kill_once(log: Path, values: dict[str, Any]) -> None:
    """In the worker: SIGKILL it on variant nic 100, mbs 1's first attempt only."""
    name = f"{values['cluster.nic_gbps']}-{values['training.micro_batch_size']}"
    with open(log / name, "a") as fh:
        fh.write("x")
    if name == "100-1" and (log / name).stat().st_size == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_dask_cluster_whose_worker_restart_fails_gets_new_workers(
        tiny_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The nanny's restart of a killed worker fails, as on a loaded machine (distributed logs
    # it and keeps no worker): without the cluster watch the sweep waited forever.
    pytest.importorskip("distributed", reason="the [dask] extra is not installed")
    import threading

    from distributed.nanny import Nanny

    from sim.apps import cluster_watch

    real = Nanny.instantiate

    async def first_start_only(self: Any) -> Any:
        if getattr(self, "_fabricsim_started", False):
            raise OSError("worker failed to start (the test's stand-in)")
        self._fabricsim_started = True
        return await real(self)

    monkeypatch.setattr(Nanny, "instantiate", first_start_only)
    monkeypatch.setattr(cluster_watch, "REVIVE_AFTER_S", 2.0)
    got: list[sweep.SweepResult] = []
    runner = threading.Thread(target=lambda: got.append(run_sweep(
        tiny_file, GRID, "dask", workers=1, use_cache=False,
        before_variant=functools.partial(_kill_once, tmp_path))), daemon=True)
    runner.start()
    runner.join(timeout=240)
    assert got, "the sweep did not finish: its cluster was left without a worker"
    rows = got[0].rows
    assert len(rows) == N_TINY and all(r["error"] is None for r in rows)
    assert (tmp_path / "100-1").stat().st_size == 2   # killed once, then simulated


# --------------------------------------------------------------------------- the planner
# tests/integration/test_plan.py's ODD job: 8 A100s, a 6-layer model; DDP's layouts only.
ODD = {
    "name": "odd-plan",
    "model": {"layers": 6, "hidden": 1536, "heads": 12, "kv_heads": 4, "ffn_hidden": 4096,
              "vocab": 32000, "name": "odd-6l"},
    "cluster": {"topology": "dgx-a100", "nodes": 1, "gpu": "a100-80gb"},
    "framework": {"name": "ddp"},
    "training": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 16},
}


def _plan(path: str, cache: Path, capsys: pytest.CaptureFixture[str], **kw: Any
          ) -> tuple[dict[str, Any], str]:
    from sim.apps import plan

    assert plan.plan_command(path, top=2, workers=1, frameworks=["ddp"], max_simulations=3,
                             as_json=True, cache=cache, **kw) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def _tops(data: dict[str, Any]) -> list[Any]:
    return [(t["scenario"], {k: v for k, v in t["summary"].items() if k != "sim"})
            for t in data["top"]]


def test_a_plan_run_again_reuses_its_simulations(folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(folder, "odd", ODD)
    first, err = _plan(path, tmp_path, capsys)
    assert "reused" not in err and _entries(tmp_path)   # the layouts' and the baseline's
    again, err = _plan(path, tmp_path, capsys)
    assert _tops(again) == _tops(first)
    assert first["simulated"] >= 1
    assert f"plan: {first['simulated']} simulations reused from the cache" in err


def test_a_plan_on_a_cluster_hook_reuses_its_simulations(folder: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from sim.apps import plan

    path = _write(folder, "odd", ODD)
    asked: list[int] = []

    def hook(base: Any, layouts: list[Any]) -> list[Any]:   # as backend_simulations does
        asked.append(len(layouts))
        return [plan.simulate_layout(base, x) for x in layouts]

    first, _ = _plan(path, tmp_path, capsys, backend="ray", simulate_many=hook)
    n = sum(asked)
    assert n >= 1
    again, err = _plan(path, tmp_path, capsys, backend="ray", simulate_many=hook)
    # Builds run on local processes beside the hook, so which layouts reach the budget can
    # differ between runs; those simulated before are not sent again.
    sent = sum(asked) - n
    reused = re.search(r"plan: (\d+) simulations reused from the cache", err)
    assert sent < n and reused is not None
    assert int(reused.group(1)) + sent == again["simulated"]
    before = dict((json.dumps(k, sort_keys=True), v) for k, v in _tops(first))
    for k, v in _tops(again):
        assert before.get(json.dumps(k, sort_keys=True), v) == v


def test_a_variant_estimated_past_an_hour_is_a_failed_row(tiny_file: str) -> None:
    # 2 layers x 2**26 / 4 = 2**24 micro-batches x 4 ops x 50 us = 6,711 s at the least
    # (sim/apps/budget.py); the other variant runs.
    result = run_sweep(tiny_file, [f"training.global_batch_size=8,{2**26}"], workers=1,
                       use_cache=False)
    ok, refused = result.rows
    assert ok["error"] is None and result.failed == 1 and result.simulated == 1
    assert refused["error"].startswith("ScenarioError: training.global_batch_size: at least "
                                       "134,217,728 ops to simulate (2 layers x 16,777,216 "
                                       "micro-batches), 1.9 h or more")


def test_an_output_that_cannot_be_written_is_one_line(tiny_file: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from sim.apps.sweep import command

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(command, "write_rows", full)
    out = tmp_path / "rows.csv"
    with pytest.raises(sweep.ScenarioError) as info:
        sweep.sweep_command(tiny_file, GRID[:1], workers=1, out=out, cache=tmp_path / "c",
                            as_json=True)
    assert str(info.value) == (
        f"--out {out}: cannot write it (No space left on device); the rows are in the cache "
        f"{tmp_path / 'c'}, run the same command again to write them")
    assert len(_entries(tmp_path / "c")) == 3
