"""Megatron-Core's layer-level activation CPU offloading (``framework.cpu_offloading_num_
layers``, sim/frameworks/megatron/layer_offload.py) against closed forms and the order
Transformer Engine's offload handler issues its copies in.

Independent truths: every micro-batch each of the first n layers' saved activations crosses
the host link twice (to the host after its forward, back before its backward); with them
away the activation peak falls by about n layers' worth (two may be in flight: the double
buffer); a layer's backward cannot start before its reload, and a reload does not start
before the backward of the layer above it has (the H2D stream waits for the compute stream).
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario, program

from sim.api import simulate
from sim.config.base import ScenarioError

N, MICRO_BATCHES, LAYERS = 20, 2, 32


def _scn(n: int = N, ac: str = "none", **par: int):
    fw = {"name": "megatron", "distributed_optimizer": True, "overlap_grad_reduce": True,
          "overlap_param_gather": True, "cpu_offloading_num_layers": n}
    return megatron_scenario({"tp": 1, **par}, gbs=8 * MICRO_BATCHES, framework=fw, ac=ac)


def _layer_bytes() -> float:
    ops = program(_scn(0)).ops
    first = next(o for o in ops if o.name == "fwd attn L0 mb0")
    return next(b for cat, b in first.alloc if cat == "activations")


def test_every_offloaded_layer_crosses_the_host_link_twice() -> None:
    ops = program(_scn()).ops
    d2h = [o for o in ops if o.name.startswith("cpu offload")]
    h2d = [o for o in ops if o.name.startswith("cpu reload")]
    assert len(d2h) == len(h2d) == N * MICRO_BATCHES
    x = _layer_bytes()
    assert sum(o.nbytes for o in d2h) == pytest.approx(N * MICRO_BATCHES * x)
    assert sum(o.nbytes for o in h2d) == pytest.approx(N * MICRO_BATCHES * x)
    assert {o.host_transfer for o in d2h} == {"d2h"} and {o.host_transfer for o in h2d} == {"h2d"}


def test_the_activation_peak_falls_by_the_offloaded_layers() -> None:
    gib = 2**30
    x = _layer_bytes() / gib
    full = simulate(_scn(0)).summary["peak_memory_breakdown_gib"]["activations"]
    off = simulate(_scn()).summary["peak_memory_breakdown_gib"]["activations"]
    assert full - N * x - 1e-6 <= off <= full - (N - 2) * x


def test_each_backward_waits_for_its_reload_issued_by_the_layer_above() -> None:
    ops = program(_scn()).ops
    reload5 = next(o for o in ops if o.name == "cpu reload L5 mb0")
    waiting = [o for o in ops if reload5 in o.deps]
    assert len(waiting) == 1 and waiting[0].layer == 5 and waiting[0].phase == "bwd"
    # It waits for the compute stream to finish layer 7's backward, i.e. to start layer 6's.
    assert any(d.layer == 7 and d.phase == "bwd" for d in reload5.deps)


@pytest.mark.parametrize("kw,key", [
    ({"n": LAYERS}, "framework.cpu_offloading_num_layers"),
    ({"ac": "full"}, "framework.cpu_offloading_num_layers"),
    ({"pp": 2}, "framework.cpu_offloading_num_layers"),
])
def test_refusals_name_the_key(kw: dict, key: str) -> None:
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        program(_scn(**kw))
