"""Megatron-Core's ``--offload-optimizer-states`` (core_dev_r0.16.0 ``OptimizerStateOffloader``).

Checked against what the source does, in closed form: at the step's start the distributed
optimizer's states (Adam's two moments and the fp32 master weights: 12 bytes a parameter of
the rank's shard here) go device-to-host and their GPU memory is released; they come back
host-to-device after the last backward (``finalize_model_grads``) and the optimizer step waits
for them. So the activation peak of the forward-backward no longer stands on them, the copies
move exactly those bytes, and the step slows by at most the two copies over the host link.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.scenario import ScenarioError

PAR = {"tp": 1, "pp": 4, "vp": 1}
FW = {"name": "megatron", "distributed_optimizer": True}
# Small weights, long sequences: the states go down while the first micro-batches run
# forward, and each stage's peak (its warm-up's last forward) falls after that.
SMALL = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 4096, "vocab": 1024}


def _scn(offload: bool, **fw):
    return megatron_scenario(PAR, gbs=64, mbs=8, gpn=4, model=SMALL, seq=8192,
                             framework=dict(FW, offload_optimizer_states=offload, **fw))


def _program(s):
    return build_program(JobContext.from_scenario(s, "s.yaml"))


def _ops(cls):
    return sorted((o for ops in cls.streams.values() for o in ops), key=lambda o: o.index)


def test_the_states_leave_at_the_start_and_return_before_the_step() -> None:
    p = _program(_scn(True))
    for cls in p.classes:
        opt = cls.initial_memory["optimizer"]
        assert opt > 0
        ops = _ops(cls)
        d2h, h2d = (next(o for o in ops if o.name == n) for n in
                    ("optimizer states offload D2H", "optimizer states reload H2D"))
        # Issued first (train_step's offload_states precedes the forward-backward), on its
        # own copy stream; frees exactly the shard's states when done.
        assert ops[0] is d2h and d2h.host_transfer == "d2h" and d2h.stream == "d2h"
        assert d2h.nbytes == opt and d2h.free == (("optimizer", opt),)
        assert h2d.host_transfer == "h2d" and h2d.alloc == (("optimizer", opt),)
        assert h2d.nbytes == opt
        # finalize_model_grads runs after the stage's last backward; the step waits for it.
        last_bwd = max((o for o in ops if o.phase == "bwd" and o.stream == "compute"),
                       key=lambda o: o.index)
        assert last_bwd in h2d.deps
        step = next(o for o in ops if o.name == "optimizer step")
        assert h2d in step.deps


def test_the_forward_backward_peak_drops_by_the_states() -> None:
    on, off = simulate(_scn(True)), simulate(_scn(False))
    for a, b in zip(on.summary["memory_by_rank_class"], off.summary["memory_by_rank_class"],
                    strict=True):
        assert a["breakdown_gib"]["optimizer"] == 0.0
        opt = b["breakdown_gib"]["optimizer"]
        assert opt > 0
        # The peak is in the forward-backward (activations at their most): what it holds
        # less is the states, no more.
        assert b["peak_gib"] - a["peak_gib"] == pytest.approx(opt, rel=1e-6)


def test_the_copies_cost_at_most_their_time_on_the_host_link() -> None:
    on, off = simulate(_scn(True)), simulate(_scn(False))
    slower = on.summary["step_time_s"] - off.summary["step_time_s"]
    assert slower >= 0.0
    opt_bytes = max(c.initial_memory["optimizer"] for c in _program(_scn(True)).classes)
    # H100 SXM on PCIe Gen5 x16 (the topology's host link): at least 25 GB/s each way.
    assert slower <= 2 * opt_bytes / 25e9


def test_megatron_refuses_it_without_the_distributed_optimizer() -> None:
    with pytest.raises(ScenarioError, match="offload_optimizer_states"):
        _program(_scn(True, distributed_optimizer=False))
