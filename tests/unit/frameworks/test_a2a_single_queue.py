"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the combined 1F1B schedule
(:func:`sim.frameworks.megatron.a2a_overlap.single_queue_emit`).

Independent truth: NVIDIA's "CUDA C/C++ Streams and Concurrency" (S. Rennich, 2011), "Stream
Scheduling": with one hardware queue an operation is dispatched only once the preceding calls
in its stream have completed and the preceding calls in the queue have been dispatched; its
depth-first example (stream 1: A1, A2; stream 2: B1, B2, issued in that order) overlaps only
A2 with B1 (NVIDIA/cuda-samples ``simpleHyperQ``: without Hyper-Q two streams' kernels meet
only at that boundary). And two bounds: one queue only adds waits, so the step is no shorter
than with separate queues, and the schedule still hides some all-to-all time, so it is no
longer than without the overlap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sim.frameworks.megatron.a2a_overlap import single_queue_emit
from sim.program.ir import HOST_WAIT_STREAM, Op

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))


def _op(name: str, stream: str, kernels: int = 1, deps: list[Op] | None = None) -> Op:
    return Op(name=name, kind="compute", stream=stream, phase="forward", duration=1e-3,
              kernels=kernels, deps=list(deps or []))


def _issue(ops: list[Op]) -> list[Op]:
    out: list[Op] = []
    put = single_queue_emit(out.append)
    for op in ops:
        put(op)
    return out


def test_depth_first_issue_overlaps_only_the_boundary_kernels() -> None:
    # Rennich's example: A1 A2 on one stream, then B1 B2 on another, one kernel each.
    a1, a2, b1, b2 = (_op("A1", "s1"), _op("A2", "s1"), _op("B1", "s2"), _op("B2", "s2"))
    _issue([a1, a2, b1, b2])
    # B1 is dispatched once A2 is, i.e. once A1 has completed: it overlaps A2, not A1.
    assert a1 in b1.deps and a2 not in b1.deps
    # B2 follows B1 in its stream (the engine's stream order) and A2 in the queue; A2 does not
    # hold it back beyond its dispatch (B1 completing already orders it after A1).
    assert a2 not in b2.deps


def test_an_op_behind_a_multi_kernel_op_waits_for_its_end() -> None:
    experts = _op("bwd experts", "compute", kernels=40)
    dispatch = _op("fwd dispatch", "moe_a2a")
    _issue([experts, dispatch])
    # Its last kernel launches about when it ends: the dispatch cannot run beside it.
    assert experts in dispatch.deps


def test_a_comm_op_issued_first_still_runs_beside_the_next_compute() -> None:
    # Megatron's pattern (the backward's combine before the forward's attention): the
    # single-kernel all-to-all is dispatched at once, the compute behind it may start too.
    before = _op("bwd experts", "compute", kernels=40)
    combine = _op("bwd combine", "moe_a2a", deps=[before])
    attn = _op("fwd attn", "compute", kernels=12)
    _issue([before, combine, attn])
    assert combine not in attn.deps
    assert attn.deps == [before]


def test_host_waits_take_no_queue_slot() -> None:
    experts = _op("bwd experts", "compute", kernels=40)
    wait = _op("token count wait", HOST_WAIT_STREAM, kernels=0)
    _issue([experts, wait])
    assert wait.deps == []


@pytest.mark.parametrize(("dispatcher", "wgrad"),
                         [("alltoall", False), ("flex", False), ("alltoall", True)])
def test_one_queue_keeps_the_step_between_the_overlapped_and_the_plain_schedule(
        dispatcher, wgrad) -> None:
    from test_megatron_moe_a2a_overlap import _exposed_a2a, _scn

    from sim.api import simulate
    par = {"tp": 1, "ep": 8}
    ov = {"moe_a2a_overlap": True, "delay_wgrad_compute": wgrad}
    runs = {k: simulate(_scn(par, moe_token_dispatcher_type=dispatcher, **kw))
            for k, kw in (("off", {}), ("many", ov),
                          ("one", {**ov, "cuda_device_max_connections": 1}))}
    step = {k: r.summary["step_time_s"] for k, r in runs.items()}
    exposed = {k: _exposed_a2a(r.recorder.ops) for k, r in runs.items()}
    assert step["many"] < step["one"] < step["off"]
    assert exposed["many"] < exposed["one"] < exposed["off"]
    # Only the combined schedule reads the option: the plain 1F1B step does not move.
    plain_one = simulate(_scn(par, moe_token_dispatcher_type=dispatcher,
                              cuda_device_max_connections=1))
    assert plain_one.summary["step_time_s"] == step["off"]
