"""The host cost of a Transformer Engine module call on x86 and on Grace, by TE release
(:func:`sim.hardware.host.te_module_call_cpu_s`), recomputed from the published measurements,
and where the Megatron builder uses it.

Truths: TE issue #2053 (2025-08, one script, bf16 Linear forward, hidden 2,048, 8,192 tokens):
CPU per call 99.66 us for ``te.Linear`` on GB200, 37.08 us for ``torch.nn.Linear`` on GB200,
13.48 us on a DGX H100 (Xeon Platinum 8480C); TE PR 3523's table (2026-09): ``te.Linear``'s
bf16 forward 59.19 us on GB200; PyTorch issue 187862: Python op dispatch on a GB200 at
70.7 / 65.5 and 126 / 111 ns of an H100 host's; TE's CPU-overhead cuts (#2377, #2400) first
released in v2.11.
"""

from __future__ import annotations

import pytest
from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.build import MEGATRON_CPU_S_PER_OP
from sim.hardware.host import (
    GRACE_CPU_OP_FACTOR,
    GRACE_PYTHON_FACTOR,
    X86_TE_MODULE_CALL_CPU_S,
    X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT,
    HostSpec,
    te_module_call_cpu_s,
)

PYTHON_RATIO = (70.7 / 65.5 + 126.0 / 111.0) / 2
GRACE = HostSpec(72, 480, 384, 55.2, 32.0, 2, cpu_op_factor=GRACE_CPU_OP_FACTOR, cpu="grace")
X86 = HostSpec(112, 2048, 460, 55.2, 32.0, 8)


@pytest.mark.parametrize("grace_te_us,x86_us,x86_const", [
    (99.66, 70.0, X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT),
    (59.19, 33.4, X86_TE_MODULE_CALL_CPU_S)])
def test_the_x86_call_is_torch_linear_plus_tes_own_work_at_pythons_ratio(
        grace_te_us: float, x86_us: float, x86_const: float) -> None:
    assert GRACE_PYTHON_FACTOR == pytest.approx(PYTHON_RATIO)
    extra_on_grace = grace_te_us - 37.08                # TE's work beyond torch's, us
    assert x86_const * 1e6 == pytest.approx(13.48 + extra_on_grace / PYTHON_RATIO)
    assert x86_const * 1e6 == pytest.approx(x86_us, abs=0.1)
    # Between the two readings the decomposition allows: TE's extra work at Grace's Python
    # ratio (this) and at its launch-path ratio.
    assert 13.48 + extra_on_grace / GRACE_CPU_OP_FACTOR < x86_const * 1e6 \
        < 13.48 + extra_on_grace


@pytest.mark.parametrize("release,grace_us,x86_const", [
    ((2, 7, 0), 99.66, X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT),
    ((2, 10, 0), 99.66, X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT),
    ((2, 11, 0), 59.19, X86_TE_MODULE_CALL_CPU_S),
    (None, 59.19, X86_TE_MODULE_CALL_CPU_S)])
def test_on_grace_the_engine_scaled_call_is_the_measured_one_of_its_release(
        release: tuple[int, int, int] | None, grace_us: float, x86_const: float) -> None:
    assert te_module_call_cpu_s(GRACE, release) * GRACE.cpu_op_factor == \
        pytest.approx(grace_us * 1e-6)
    assert te_module_call_cpu_s(X86, release) == x86_const


def _tp_cpu_s(implementation: str, training: dict | None = None) -> set[float]:
    s = megatron_scenario({"tp": 2}, 8, framework={"name": "megatron",
                                                   "implementation": implementation})
    if training:
        s = s.model_copy(update={"training": s.training.model_copy(update=training)})
    prog = build_program(JobContext.from_scenario(s, "s.yaml"))
    return {op.cpu_s for ops in prog.classes[0].streams.values() for op in ops
            if op.collective in ("all_reduce", "reduce_scatter", "all_gather")
            and op.key.startswith("tp/")}


def test_megatron_prices_a_te_call_by_release_and_local_layers_at_vtrains() -> None:
    # The tensor-parallel collectives carry one module call each (the layer's issue cost).
    assert _tp_cpu_s("transformer_engine") == {X86_TE_MODULE_CALL_CPU_S}
    assert _tp_cpu_s("transformer_engine", {"transformer_engine_version": "2.9"}) == \
        {X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT}
    assert _tp_cpu_s("local") == {MEGATRON_CPU_S_PER_OP}
    assert _tp_cpu_s("local", {"transformer_engine_version": "2.9"}) == {MEGATRON_CPU_S_PER_OP}


def test_an_older_release_slows_a_host_bound_te_step() -> None:
    # A tiny layer on one node is bound by its host, whose time is nearly all TE module calls
    # (the rest, plain torch ops and launches, does not change with the release): the step
    # slows by nearly the calls' ratio, 70.0 / 33.4 us, and not beyond it.
    def step(release: str | None) -> float:
        s = megatron_scenario({"tp": 2}, 8, model={
            "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn_hidden": 1536,
            "vocab": 32000}, seq=512)
        s = s.model_copy(update={"training": s.training.model_copy(
            update={"transformer_engine_version": release})})
        return simulate(s).summary["step_time_s"]
    old, new = step("2.9"), step(None)
    ratio = X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT / X86_TE_MODULE_CALL_CPU_S
    assert 0.9 * ratio * new < old < ratio * new


def test_reference_rows_of_software_before_the_cut_name_their_release() -> None:
    # The NeMo containers of 2024-2025 and the Megatron-MoE-ModelZoo's H100 image ran TE
    # releases before 2.11 (the reference files' headers give each pin): their rows must say
    # so, or their TE calls would be priced at the newest release's cost.
    from sim.apps.validation import published, published_moe
    prefixes = ("nemo-24.", "nemo-25.", "modelzoo-", "dgxc-25.", "mcore-readme-")
    rows = [e for e in published.entries() + published_moe.entries()
            if e["id"].startswith(prefixes)
            and e["scenario"].get("framework", {}).get("name") == "megatron"]
    assert len(rows) >= 60
    unnamed = [e["id"] for e in rows
               if e["scenario"].get("training", {}).get("transformer_engine_version") is None]
    assert unnamed == []
    for e in rows:
        release = e["scenario"]["training"]["transformer_engine_version"]
        assert tuple(int(x) for x in release.split(".")) < (2, 11)
