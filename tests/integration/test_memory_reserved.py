"""Reserved memory: PyTorch's caching allocator, the CUDA context, NCCL and cuBLAS buffers.

Closed forms follow ``c10/cuda/CUDACachingAllocator.cpp`` (constants in
:mod:`sim.engine.allocator`);
the end-to-end check is the measured single-H200 step in
``sim/catalog/calibration/h200-train-step.json`` (``torch.cuda.max_memory_reserved``).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from sim import catalog
from sim.analysis.memory_overheads import (
    NCCL_CONNECTION_BYTES,
    NCCL_LL128_BUFFSIZE,
    NCCL_LL_BUFFSIZE,
    nccl_buffer_bytes,
)
from sim.analysis.metrics import memory_summary
from sim.api import simulate
from sim.engine.allocator import MIB, CachingAllocator, TensorLedger, allocation_size, round_size
from sim.scenario import Allocator, Claims, load_scenario

CALIB = Path(__file__).resolve().parents[2] / "sim/catalog/calibration/h200-train-step.json"
GIB = 2**30


def test_rounding_and_segment_sizes() -> None:
    # round_size: multiples of 512 B; get_allocation_size: 2 MiB small segments, 20 MiB for
    # 1-10 MiB requests, else rounded up to 2 MiB.
    assert [round_size(s) for s in (0, 1, 511, 512, 513, 4096)] == [512, 512, 512, 512, 1024,
                                                                     4096]
    assert allocation_size(1 * MIB) == 2 * MIB
    assert allocation_size(1 * MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(10 * MIB + 1) == 12 * MIB


def test_small_requests_share_a_2mib_segment() -> None:
    a = CachingAllocator()
    handles = [a.malloc(1000) for _ in range(100)]       # 100 x 1,024 B
    assert a.reserved == 2 * MIB
    assert a.allocated == 100 * 1024
    for h in handles:
        a.free(h)
    assert a.allocated == 0 and a.reserved == 2 * MIB   # cached, not returned


def test_freed_segment_is_reused_not_grown() -> None:
    a = CachingAllocator()
    for _ in range(10):
        h = a.malloc(100 * MIB)
        a.free(h)
    assert a.peak_reserved == 100 * MIB


def test_large_split_only_above_1mib_remainder() -> None:
    a = CachingAllocator()
    h = a.malloc(11 * MIB + 512)         # 12 MiB segment, remainder < 1 MiB: not split
    assert a.size_of(h) == 12 * MIB and a.allocated == 12 * MIB
    b = CachingAllocator()
    h = b.malloc(10 * MIB + 512)         # 12 MiB segment, remainder > 1 MiB: split
    assert b.size_of(h) == 10 * MIB + 512
    # The 2 MiB - 512 B remainder serves a 1 MiB + 512 B request whole: what would be left
    # (1 MiB - 1 KiB) is not above 1 MiB, so no split and no new segment.
    h2 = b.malloc(1 * MIB + 512)
    assert b.reserved == 12 * MIB and b.size_of(h2) == 2 * MIB - 512


def test_fragmentation_reserved_above_allocated() -> None:
    # Two 100 MiB blocks in two segments, one freed: a 150 MiB request fits in neither hole
    # (segments never merge), so a third segment is reserved: 350 MiB for 250 MiB live.
    a = CachingAllocator()
    x = a.malloc(100 * MIB)
    a.malloc(100 * MIB)
    a.free(x)
    a.malloc(150 * MIB)
    assert a.allocated == 250 * MIB
    assert a.reserved == 350 * MIB


def test_best_fit_and_merge() -> None:
    # A 60 MiB segment split into 20+20+20; freeing the outer two leaves holes that merge
    # with their neighbours only when adjacent.
    a = CachingAllocator()
    big = a.malloc(60 * MIB)
    a.free(big)
    p, q, r = (a.malloc(20 * MIB) for _ in range(3))
    assert a.reserved == 60 * MIB
    a.free(p)
    a.free(r)
    with pytest.raises(KeyError):
        a.free(p)
    a.malloc(30 * MIB)                   # no 30 MiB hole: new segment
    assert a.reserved == 90 * MIB
    a.free(q)                            # now the 60 MiB segment is one free block again
    a.malloc(60 * MIB)
    assert a.reserved == 90 * MIB


def test_release_cached_on_failed_cudamalloc() -> None:
    # At the edge of OOM PyTorch frees cached whole segments and retries.
    a = CachingAllocator(capacity=300 * MIB)
    x = a.malloc(200 * MIB)
    a.free(x)
    a.malloc(250 * MIB)                  # 200 cached + 250 > 300: release, retry, fits
    assert not a.oom and a.retries == 1 and a.reserved == 250 * MIB
    a.malloc(100 * MIB)                  # nothing to release: out of memory
    assert a.oom


@pytest.mark.parametrize("expandable", [False, True])
def test_random_stream_never_reserves_less_than_allocated(expandable: bool) -> None:
    rng = random.Random(7)
    a = CachingAllocator(expandable_segments=expandable)
    live: list[int] = []
    for _ in range(5000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([700, 0.3 * MIB, 3 * MIB, 25 * MIB, rng.random() * 200 * MIB])
            live.append(a.malloc(size, rng.choice(["compute", "comm"])))
        assert a.reserved >= a.allocated
    for h in live:
        a.free(h)
    assert a.allocated == 0
    # Everything merged back: one free block per segment.
    assert len(a._blocks) == len(a._segments)


def test_expandable_segments_grow_in_place() -> None:
    # The same fragmentation example: with expandable segments the 150 MiB request extends
    # the free tail instead of a new segment.
    a = CachingAllocator(expandable_segments=True)
    a.malloc(100 * MIB)
    y = a.malloc(100 * MIB)
    a.free(y)
    a.malloc(150 * MIB)
    assert a.reserved == 250 * MIB


def test_ledger_matches_frees_to_allocations() -> None:
    led = TensorLedger(CachingAllocator())
    led.alloc("activations", 300 * MIB, op=1, mb_layer=(0, 0))
    led.alloc("activations", 500 * MIB, op=2, mb_layer=(0, 1))
    led.free("activations", 300 * MIB, op=9, mb_layer=(0, 0))
    assert led.allocator.allocated == 500 * MIB
    led.free("activations", 200 * MIB, op=9, mb_layer=(0, 1))   # partial: block kept
    assert led.allocator.allocated == 500 * MIB
    led.free("activations", 300 * MIB, op=9, mb_layer=(0, 1))
    assert led.allocator.allocated == 0


def test_nccl_connection_buffers() -> None:
    # NCCL's default buffer sizes per protocol (src/include/device.h).
    assert NCCL_LL_BUFFSIZE == 524_288
    assert NCCL_LL128_BUFFSIZE == 4_915_200
    assert NCCL_CONNECTION_BYTES == 4 * MIB + 4_915_200 + 524_288


def test_single_gpu_reserved_against_measured_h200_step() -> None:
    # Measured with torch.cuda.max_memory_reserved / max_memory_allocated on one H200
    # (PyTorch 2.11, Llama 3.2 1B, seq 4096, batch 4; calibration file's meta). The issue's
    # target for peak memory is 15%; the reserved excess over allocated is the allocator's.
    run = json.loads(CALIB.read_text())["runs"][0]
    r = simulate(load_scenario("llama3.2-1b-1xh200"))
    s = r.summary
    assert s["peak_reserved_gib"] * GIB == pytest.approx(run["peak_reserved_bytes"], rel=0.05)
    assert s["peak_memory_gib"] <= s["peak_reserved_gib"]
    measured_ratio = run["peak_reserved_bytes"] / run["peak_allocated_bytes"]
    assert s["peak_reserved_gib"] / s["peak_memory_gib"] == pytest.approx(measured_ratio,
                                                                           abs=0.04)
    # One GPU: no NCCL communicator; nvidia-smi adds the CUDA context.
    assert s["memory_overheads_gib"]["nccl"] == 0
    assert s["peak_nvidia_smi_gib"] == pytest.approx(
        s["peak_reserved_gib"] + s["memory_overheads_gib"]["cuda_context"])
    assert nccl_buffer_bytes(r.program, r.program.classes[0], 1) == 0


def test_reserved_never_below_allocated_over_time() -> None:
    r = simulate(load_scenario("llama3.2-1b-1xh200"))
    tr = r.recorder.memory[0]
    allocated = {t: sum(c.values()) for t, c in tr.series}
    for t, reserved in tr.reserved_series:
        if t in allocated:
            assert reserved >= allocated[t] - 1.0


def test_oom_is_judged_on_reserved() -> None:
    # A GPU whose memory sits between the allocated and the reserved peak: only the reserved
    # judgement says out of memory.
    s = load_scenario("llama3.2-1b-1xh200")
    base = simulate(s).summary
    cap = (base["peak_memory_gib"] + base["peak_reserved_gib"]) / 2
    small = dataclasses.replace(catalog.gpu("h200"), usable_memory_gib=cap)
    r = simulate(s)
    mem = memory_summary(r.recorder, r.program, small)
    assert mem["peak_memory_gib"] < cap < mem["peak_nvidia_smi_gib"]
    assert mem["oom"] and mem["memory_by_rank_class"][0]["oom"]


@pytest.mark.parametrize("kind,key", [("reserved", "peak_reserved_gib"),
                                      ("allocated", "peak_memory_gib"),
                                      ("nvidia_smi", "peak_nvidia_smi_gib"),
                                      (None, "peak_reserved_gib")])
def test_memory_claim_compares_the_peak_it_names(kind: str | None, key: str) -> None:
    # The calibration step's measured reserved peak, 80,692,117,504 B = 75.15 GiB.
    fields: dict[str, object] = {"source": "h200-train-step.json", "peak_memory_gib": 75.15}
    if kind is not None:
        fields["peak_memory_kind"] = kind
    s = load_scenario("llama3.2-1b-1xh200")
    s = s.model_copy(update={"claims": Claims(**fields)})
    summary = simulate(s).summary
    (claim,) = summary["claims"]
    assert claim["simulated"] == summary[key]
    assert (kind or "reserved").replace("_", "-") in claim["reason"]


def test_expandable_segments_follow_the_launcher() -> None:
    # torchtitan's run_train.sh exports PYTORCH_ALLOC_CONF="expandable_segments:True", so an
    # fsdp2 run has it unless the scenario says otherwise; growing one segment in place
    # reserves no more than separate cudaMalloc segments, and never less than allocated.
    s = load_scenario("llama3-70b-fsdp2-64xh100")
    default = simulate(s).summary
    off = simulate(s.model_copy(update={"allocator": Allocator(expandable_segments=False)}))
    on = simulate(s.model_copy(update={"allocator": Allocator(expandable_segments=True)}))
    assert default["peak_reserved_gib"] == on.summary["peak_reserved_gib"]
    assert default["peak_memory_gib"] <= on.summary["peak_reserved_gib"]
    assert on.summary["peak_reserved_gib"] < off.summary["peak_reserved_gib"]
    assert on.summary["peak_memory_gib"] == off.summary["peak_memory_gib"]


def test_memory_plot_draws_the_reserved_line() -> None:
    from sim.outputs.plot import memory_figure

    r = simulate(load_scenario("llama3.2-1b-1xh200"))
    fig = memory_figure(r.recorder, "t")
    (ax,) = [a for a in fig.axes if a.get_lines()]
    lines = [ln for ln in ax.get_lines() if ln.get_label() == "reserved (caching allocator)"]
    assert len(lines) == 1
    top = max(lines[0].get_ydata())
    assert top * GIB == pytest.approx(r.recorder.memory[0].reserved_peak, rel=1e-9)
    assert top >= r.summary["peak_memory_gib"]


def test_allocator_retries_reported_at_the_edge_of_memory(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # A GPU just above the allocated peak plus what sits outside PyTorch, below the reserved
    # peak: the allocator frees its cache and retries (num_alloc_retries) and either fits
    # within it or runs out of memory, which the summary then reports.
    s = load_scenario("llama3.2-1b-1xh200")
    base = simulate(s).summary
    assert base["memory_by_rank_class"][0]["allocator_retries"] == 0
    over = base["memory_overheads_gib"]
    outside = over["cuda_context"] + over["nccl"]
    cap = base["peak_memory_gib"] + outside + 1.0
    assert cap < base["peak_nvidia_smi_gib"]
    small = dataclasses.replace(catalog.gpu("h200"), usable_memory_gib=cap)
    monkeypatch.setattr(catalog, "gpu", lambda key, power_w=None, lockstep_gpus=1: small)
    tight = simulate(s).summary
    row = tight["memory_by_rank_class"][0]
    assert row["allocator_retries"] > 0
    assert tight["peak_memory_gib"] == base["peak_memory_gib"]
    fits = tight["peak_reserved_gib"] <= cap - outside + 1e-9
    assert tight["oom"] == (not fits)


def test_nvls_buffers_inside_an_nvswitch_node() -> None:
    # nvls.cc ncclNvlsBufferSetup: 16 channels x 2 x 128 KiB x 8 steps = 32 MiB per head,
    # one head per local GPU: 256 MiB for 8 GPUs, on Hopper, not on Ampere (no multicast),
    # nor for a group of two GPUs (ncclNvlsInit needs more than two).
    from sim.program.ir import Op, Program, RankClass

    def comm_bytes(group: tuple[int, ...], arch: str) -> float:
        cls = RankClass(0, tuple(range(8)))
        prog = Program([cls], 8, 1.0, 1.0, 1.0)
        prog.add(cls, Op("ar", "collective", "comm", "comm", collective="all_reduce",
                         group=group, key="k"))
        return nccl_buffer_bytes(prog, cls, 8, arch)

    eight = tuple(range(8))
    assert comm_bytes(eight, "hopper") - comm_bytes(eight, "ampere") == 256 * MIB
    assert comm_bytes((0, 1), "hopper") == comm_bytes((0, 1), "ampere")


@pytest.mark.parametrize("name,update", [
    ("llama3.2-1b-ddp-8xh100", {}),
    ("llama3-8b-fsdp2-8xh100-mbs4", {}),
    ("llama3-8b-deepspeed-zero3-8xh100-mbs4", {}),
    ("llama3-8b-fairscale-8xh100-mbs4", {}),
    ("llama3-70b-fsdp2-tp8-32xh100", {}),
    ("llama3-70b-megatron-tp8pp4-64xh100", {"model": "llama3.2-1b"}),
])
def test_allocator_conserves_what_the_engine_reports(name: str, update: dict[str, object]
                                                     ) -> None:
    # Conservation: after the step, the bytes the allocator still holds for each category
    # are what the engine's allocations and frees add up to, and its blocks cover them.
    s = load_scenario(name)
    r = simulate(s.model_copy(update=update) if update else s)
    for cls, tr in r.recorder.memory.items():
        live = tr.ledger.live_bytes()
        for cat, held in tr.current.items():
            assert live.get(cat, 0.0) == pytest.approx(held, rel=1e-9, abs=4096), (cls, cat)
        alloc = tr.ledger.allocator
        assert alloc.allocated >= sum(live.values()) - 4096
        assert alloc.peak_reserved >= alloc.peak_allocated >= tr.peak - 4096
