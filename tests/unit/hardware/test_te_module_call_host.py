"""The host cost of a Transformer Engine module call on x86 and on Grace
(:func:`sim.hardware.host.te_module_call_cpu_s`), recomputed from the published measurements,
and where the Megatron builder uses it.

Truths: TE issue #2053 (one script, bf16 Linear forward, hidden 2,048, 8,192 tokens): CPU per
call 99.66 us for ``te.Linear`` on GB200, 37.08 us for ``torch.nn.Linear`` on GB200, 13.48 us
on a DGX H100 (Xeon Platinum 8480C); PyTorch issue 187862: Python op dispatch on a GB200 at
70.7 / 65.5 and 126 / 111 ns of an H100 host's.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.build import MEGATRON_CPU_S_PER_OP
from sim.hardware.host import (
    GRACE_CPU_OP_FACTOR,
    GRACE_PYTHON_FACTOR,
    X86_TE_MODULE_CALL_CPU_S,
    HostSpec,
    te_module_call_cpu_s,
)


def test_the_x86_call_is_torch_linear_plus_tes_own_work_at_pythons_ratio() -> None:
    python_ratio = (70.7 / 65.5 + 126.0 / 111.0) / 2
    assert GRACE_PYTHON_FACTOR == pytest.approx(python_ratio)
    extra_on_grace = 99.66 - 37.08                      # TE's work beyond torch's, us
    assert X86_TE_MODULE_CALL_CPU_S * 1e6 == pytest.approx(13.48 + extra_on_grace / python_ratio)
    assert X86_TE_MODULE_CALL_CPU_S * 1e6 == pytest.approx(70.0, abs=0.1)
    # Between the two readings the decomposition allows: TE's extra work at Grace's Python
    # ratio (this) and at its launch-path ratio (what pricing the whole call x 2.75 implies).
    assert 13.48 + extra_on_grace / GRACE_CPU_OP_FACTOR < X86_TE_MODULE_CALL_CPU_S * 1e6 \
        < 13.48 + extra_on_grace


def test_on_grace_the_engine_scaled_call_is_the_measured_one() -> None:
    grace = HostSpec(72, 480, 384, 55.2, 32.0, 2, cpu_op_factor=GRACE_CPU_OP_FACTOR)
    x86 = HostSpec(112, 2048, 460, 55.2, 32.0, 8)
    assert te_module_call_cpu_s(grace) * grace.cpu_op_factor == pytest.approx(99.66e-6)
    assert te_module_call_cpu_s(x86) == X86_TE_MODULE_CALL_CPU_S


def _tp_cpu_s(implementation: str) -> set[float]:
    s = megatron_scenario({"tp": 2}, 8, framework={"name": "megatron",
                                                   "implementation": implementation})
    prog = build_program(JobContext.from_scenario(s, "s.yaml"))
    return {op.cpu_s for ops in prog.classes[0].streams.values() for op in ops
            if op.collective in ("all_reduce", "reduce_scatter", "all_gather")
            and op.key.startswith("tp/")}


def test_megatron_prices_a_te_call_at_the_hosts_cost_and_local_layers_at_vtrains() -> None:
    # The tensor-parallel collectives carry one module call each (the layer's issue cost).
    assert _tp_cpu_s("transformer_engine") == {X86_TE_MODULE_CALL_CPU_S}
    assert _tp_cpu_s("local") == {MEGATRON_CPU_S_PER_OP}
