"""Megatron-Core's optimizer precision, FP8 primary weights and CPU offload
(:mod:`sim.frameworks.megatron.optimizer_precision`), checked against the bytes per parameter
Megatron-Core's and Transformer Engine's source give (see that module's docstring)."""

from __future__ import annotations

import pytest
from conftest import make_scenario
from helpers import megatron_scenario, program

from sim.api import simulate
from sim.config.base import ScenarioError
from sim.frameworks import JobContext
from sim.frameworks.megatron.optimizer_precision import FUSED_CPU_ADAMW_BYTES, OFFLOAD_CHUNKS
from sim.frameworks.megatron.shape import MegatronShape, megatron_shape
from sim.hardware.host import HostSpec, cpu_pass_s
from sim.program.ir import Op
from sim.scenario import Scenario

SMALL = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 4096, "vocab": 1024,
         "mlp": "gelu", "tied_embeddings": False}
PA = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16",
      "exp_avg_sq_dtype": "bf16"}


def _scn(precision: str = "bf16", gpu: str = "h100-sxm", **fw: object) -> Scenario:
    s = megatron_scenario({"tp": 1, "pp": 1}, 8, framework={
        "name": "megatron", "distributed_optimizer": True, **fw}, model=SMALL, seq=1024,
        precision=precision)
    if gpu != "h100-sxm":
        s = make_scenario(s.model_dump(exclude_none=True), cluster__gpu=gpu)
    return s


def _shape(s: Scenario) -> MegatronShape:
    return megatron_shape(JobContext.from_scenario(s))


def _opt(s: Scenario) -> float:
    return _shape(s).initial_memory(0)["optimizer"]


def _ops(s: Scenario) -> list[Op]:
    return [o for ops in program(s).classes[0].streams.values() for o in ops]


def test_default_keeps_twelve_bytes_and_fp32_grad_copies_only_at_the_step() -> None:
    # distrib_optimizer.py: fp32 main shard + two fp32 moments = 12 B over dp = 8 ranks;
    # 16-bit grad buffers add the .float() copies (4 B) on the optimizer step alone.
    s = _scn()
    sh = _shape(s)
    n = sh.stage_params(0)
    assert _opt(s) == pytest.approx(12 * n / 8)
    step = next(o for o in _ops(s) if o.name == "optimizer step")
    assert step.transient == 0
    s16 = _scn(grad_reduce_in_fp32=False)
    assert _opt(s16) == pytest.approx(12 * n / 8)
    step = next(o for o in _ops(s16) if o.name == "optimizer step")
    assert step.transient == pytest.approx(4 * n / 8)


@pytest.mark.parametrize(("fw", "precision", "persistent", "step_copy"), [
    # TE master weights as 16-bit remainders beside bf16 params, bf16 moments: 2 + 2 + 2.
    (PA, "bf16", 6, 0),
    # store_param_remainders off: fp32 master in TE, bf16 moments: 4 + 2 + 2.
    ({**PA, "store_param_remainders": False}, "bf16", 8, 0),
    # fp8 moments: 2 + 1 + 1.
    ({**PA, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, "bf16", 4, 0),
    # FP8 current scaling with fp32 main params: Megatron keeps the fp32 master (4 + 2 + 2)
    # and, with bf16 grads, the fp32 grad copy at the step.
    ({**PA, "fp8_recipe": "tensorwise", "grad_reduce_in_fp32": False}, "fp8", 8, 4),
    # Delayed scaling is the exception: TE holds the master (remainders).
    ({**PA, "fp8_recipe": "delayed", "grad_reduce_in_fp32": False}, "fp8", 6, 0),
])
def test_precision_aware_bytes(fw: dict, precision: str, persistent: float,
                               step_copy: float) -> None:
    s = _scn(precision, **fw)
    n = _shape(s).stage_params(0)
    assert _opt(s) == pytest.approx(persistent * n / 8)
    step = next(o for o in _ops(s) if o.name == "optimizer step")
    assert step.transient == pytest.approx(step_copy * n / 8)


def test_bf16_moments_make_the_gpu_step_cheaper() -> None:
    # Fewer bytes through HBM (the step is memory-bound), and no separate cast or copy.
    def dur(s: Scenario) -> float:
        return next(o for o in _ops(s) if o.name == "optimizer step").duration
    assert dur(_scn(**PA)) < dur(_scn())


def test_cpu_offload_moves_the_state_to_the_host_and_its_bytes_over_pcie() -> None:
    fw = {**PA, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
    s = _scn(**fw)
    sh = _shape(s)
    local = sh.stage_params(0) / 8
    assert _opt(s) == 0
    ops = _ops(s)
    d2h = [o for o in ops if o.host_transfer == "d2h"]
    h2d = [o for o in ops if o.host_transfer == "h2d"]
    cpu = [o for o in ops if o.kind == "host" and "AdamW on CPU" in o.name]
    assert len(d2h) == len(h2d) == len(cpu) == 1
    # HybridDeviceOptimizer: fp32 grads down, fp32 params up (4 B each per parameter).
    assert sum(o.nbytes for o in d2h) == pytest.approx(4 * local)
    assert sum(o.nbytes for o in h2d) == pytest.approx(4 * local)
    host = HostSpec.from_scenario(s)
    assert sum(o.duration for o in cpu) == pytest.approx(
        cpu_pass_s(host, FUSED_CPU_ADAMW_BYTES * local, "torch"))
    # Half offloaded: the GPU keeps the fp32 share of the other half (12 B).
    half = _scn(**{**fw, "optimizer_offload_fraction": 0.5})
    assert _opt(half) == pytest.approx(12 * local / 2)


def test_overlapped_offload_pipelines_and_is_faster() -> None:
    fw = {**PA, "optimizer_cpu_offload": True}
    serial, overlap = _scn(**fw), _scn(**fw, overlap_cpu_optimizer_d2h_h2d=True)
    ops = _ops(overlap)
    assert len([o for o in ops if o.host_transfer == "d2h"]) == OFFLOAD_CHUNKS
    assert {o.stream for o in ops if o.host_transfer} == {"d2h", "h2d"}
    t_serial = simulate(serial).summary["step_time_s"]
    t_overlap = simulate(overlap).summary["step_time_s"]
    t_gpu = simulate(_scn(**PA)).summary["step_time_s"]
    assert t_gpu < t_overlap < t_serial


@pytest.mark.parametrize(("gpu", "buffer_bytes"), [("h100-sxm", 2.0), ("b200", 1.0)])
def test_fp8_weight_copies_per_architecture(gpu: str, buffer_bytes: float) -> None:
    # TE's cached FP8 weight (1 B) and, where non-TN FP8 GEMMs are unsupported (Hopper), its
    # transpose (1 B); Blackwell (compute capability 10.0) keeps no transpose.
    sh = _shape(_scn("fp8", gpu))
    lin = sh.stage_fp8_params(0)
    assert lin == pytest.approx(4 * sh.linear_params)
    mem = sh.initial_memory(0)
    assert mem["buffers"] == pytest.approx(buffer_bytes * lin)
    # FP8 primary weights: the parameter is the 1-byte FP8 tensor, no 16-bit copy.
    prim = _shape(_scn("fp8", gpu, fp8_param_gather=True)).initial_memory(0)
    assert mem["parameters"] - prim["parameters"] == pytest.approx(lin)
    assert prim["buffers"] == pytest.approx((buffer_bytes - 1.0) * lin)


def test_fp8_param_gather_gathers_linears_in_one_byte() -> None:
    sh = _shape(_scn("fp8", fp8_param_gather=True))
    n, lin = sh.stage_params(0), sh.stage_fp8_params(0)
    assert sh.gather_bytes(0, False) * n == pytest.approx(2 * (n - lin) + lin)
    assert _shape(_scn("fp8")).gather_bytes(0, False) == 2


@pytest.mark.parametrize(("fw", "precision", "key"), [
    ({"exp_avg_dtype": "bf16"}, "bf16", "framework.exp_avg_dtype"),
    ({"optimizer_cpu_offload": True}, "bf16", "framework.optimizer_cpu_offload"),
    ({"fp8_param_gather": True}, "bf16", "framework.fp8_param_gather"),
    ({**PA, "main_grads_dtype": "bf16", "grad_reduce_in_fp32": True}, "bf16",
     "framework.main_grads_dtype"),
])
def test_refused_as_megatron_refuses(fw: dict, precision: str, key: str) -> None:
    with pytest.raises(ScenarioError) as err:
        _shape(_scn(precision, **fw))
    assert key in str(err.value)
