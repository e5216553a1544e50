"""Every collective and send names the NCCL element type it moves (``Op.dtype``), and its
bytes agree with that type where the element count is known.

The truth each check uses: the frameworks' own dtype rules (DDP's fp32 ``.grad`` buckets,
FSDP2's ``MixedPrecisionPolicy``, Megatron-Core's ``grad_reduce_in_fp32`` default, FairScale's
``fp32_reduce_scatter``, DeepSpeed's fp64 ZeRO-3 norm), the model's parameter count, and NCCL's
type sizes (nccl.h ``ncclDataType_t``). The type is a label only: ``run --json`` is pinned to
the last bit by tests/integration/test_golden.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from test_golden import SCENARIOS, SYNTHETIC, TINY

from sim.frameworks.common.base import JobContext
from sim.frameworks.registry import build_program
from sim.outputs.export.hta import nccl_kernel_name
from sim.program.ir import Op, Program
from sim.scenario import load_scenario

# Bytes per element of NCCL's types (nccl.h: ncclInt8/Uint8 1, Float16/Bfloat16 2,
# Float32/Int32 4, Float64/Int64 8, the fp8 types 1).
SIZE = {"i8": 1, "u8": 1, "f8e4m3": 1, "f8e5m2": 1, "f16": 2, "bf16": 2, "i32": 4, "u32": 4,
        "f32": 4, "i64": 8, "u64": 8, "f64": 8}


@contextmanager
def _in_scenarios() -> Iterator[None]:
    here = os.getcwd()
    os.chdir(SCENARIOS)
    try:
        yield
    finally:
        os.chdir(here)


def build(*assignments: str, base: str = TINY) -> tuple[JobContext, Program]:
    with _in_scenarios():
        sc = load_scenario(base, list(assignments))
    ctx = JobContext.from_scenario(sc, base)
    return ctx, build_program(ctx)


def comms(program: Program) -> list[Op]:
    """Collectives and the transfers of sends (Megatron's and DeepSpeed's pipeline transfers
    are rendezvous ops of kind ``recv`` on both ends)."""
    return [o for o in program.ops if o.kind in ("collective", "send")
            or (o.kind == "recv" and o.pairs)]


def _overrides(args: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    base = args[1]
    sets = tuple(args[i + 1] for i, a in enumerate(args) if a == "--set")
    return base, sets


RUN_CASES = [c for c in SYNTHETIC if c.args[0] == "run"]


@pytest.mark.parametrize("case", RUN_CASES, ids=[c.name for c in RUN_CASES])
def test_every_collective_of_every_framework_has_a_dtype(case) -> None:
    """The golden synthetic cases exercise every framework and option (bf16, fp16, fp8,
    fp32 parameters, ZeRO++, float8 all-gathers, TP/CP/PP)."""
    base, sets = _overrides(case.args)
    _, program = build(*sets, base=base)
    ops = comms(program)
    missing = [o.name for o in ops if o.dtype is None]
    assert not missing, f"{len(missing)} without a dtype, e.g. {missing[:3]}"
    assert all(o.dtype in SIZE for o in ops)
    # Whole elements: a label whose size did not divide the bytes would be wrong (a 2-byte
    # label on an fp32 buffer of odd element count, a 4-byte one on a 16-bit tensor).
    split = [o.name for o in ops if o.nbytes % SIZE[o.dtype or ""] != 0]
    assert not split, f"bytes not whole elements of the dtype: {split[:3]}"


def _per_mb(program: Program, collective: str, mb: int) -> list[Op]:
    return [o for o in program.ops if o.kind == "collective" and o.collective == collective
            and o.micro_batch == mb]


def test_ddp_reduces_fp32_gradients_of_every_parameter() -> None:
    """DDP all-reduces the fp32 ``.grad`` of every parameter once per step: 4 bytes x N."""
    ctx, program = build()
    ars = [o for o in program.ops if o.collective == "all_reduce"]
    assert ars and {o.dtype for o in ars} == {"f32"}
    assert sum(o.nbytes for o in ars) == 4 * ctx.model.total_params
    assert nccl_kernel_name(ars[0], "ring").startswith("ncclDevKernel_AllReduce_Sum_f32_")


@pytest.mark.parametrize("reduce_dtype,param_dtype", [("fp32", "bf16"), ("bf16", "fp32")])
def test_fsdp2_reduces_in_reduce_dtype_and_gathers_in_param_dtype(reduce_dtype: str,
                                                                   param_dtype: str) -> None:
    """FSDP2 reduce-scatters each unit's gradients in ``reduce_dtype`` and all-gathers its
    parameters in ``param_dtype`` (MixedPrecisionPolicy): summed over one micro-batch's
    reduce-scatters (or one forward's all-gathers), bytes / element size = every parameter."""
    ctx, program = build("framework.name=fsdp2", f"framework.reduce_dtype={reduce_dtype}",
                         f"framework.param_dtype={param_dtype}")
    n = ctx.model.total_params
    rs = _per_mb(program, "reduce_scatter", 0)
    assert {o.dtype for o in rs} == {"f32" if reduce_dtype == "fp32" else "bf16"}
    assert sum(o.nbytes for o in rs) == SIZE[rs[0].dtype or ""] * n
    ag = [o for o in _per_mb(program, "all_gather", 0) if "(fwd)" in o.name]
    assert {o.dtype for o in ag} == {"f32" if param_dtype == "fp32" else "bf16"}
    assert sum(o.nbytes for o in ag) == SIZE[ag[0].dtype or ""] * n


def test_fsdp2_float8_all_gathers_move_one_byte_per_parameter() -> None:
    """torchao's float8 all-gather casts a block's shards to E4M3 (1 byte per parameter),
    which NCCL moves as uint8; embedding and output stay bf16."""
    _, program = build("framework.name=fsdp2", "training.precision=fp8",
                       "framework.float8_all_gather=true")
    ag = _per_mb(program, "all_gather", 0)
    layers = [o for o in ag if o.name.split()[1].startswith("L")]
    assert layers and {o.dtype for o in layers} == {"u8"}
    assert {o.dtype for o in ag if o not in layers} == {"bf16"}


@pytest.mark.parametrize("fp32,want", [(None, "f32"), ("true", "f32"), ("false", "bf16")])
def test_megatron_gradient_reduces_follow_grad_reduce_in_fp32(fp32: str | None,
                                                              want: str) -> None:
    """Megatron-Core reduces gradients in fp32 by default for bf16 (``grad_reduce_in_fp32``
    None -> True, the bug this label fixes: it was traced bf16); parameter gathers stay
    bf16. Every gradient bucket's bytes are whole elements of its type."""
    sets = ["framework.name=megatron", "framework.distributed_optimizer=true",
            "parallelism.tp=2"]
    if fp32 is not None:
        sets.append(f"framework.grad_reduce_in_fp32={fp32}")
    _, program = build(*sets)
    grads = [o for o in program.ops if o.name.startswith("grad ")]
    assert grads and {o.dtype for o in grads} == {want}
    assert all(o.nbytes % SIZE[want] == 0 for o in grads)
    gathers = [o for o in program.ops if o.name.startswith("param all_gather")]
    assert gathers and {o.dtype for o in gathers} == {"bf16"}
    name = nccl_kernel_name(grads[0], "ring", dtype="bf16")   # bf16: the old fallback
    assert f"_Sum_{want}_" in name


@pytest.mark.parametrize("sets,want", [
    ((), "bf16"),
    (("framework.fp32_reduce_scatter=true",), "f32"),
    (("training.precision=fp16",), "f16")])
def test_fairscale_reduce_scatters_in_fp32_only_when_asked(sets: tuple[str, ...],
                                                           want: str) -> None:
    """FairScale reduce-scatters in the compute dtype unless ``fp32_reduce_scatter`` (which
    was traced in the training precision before); the gathers stay 16-bit."""
    _, program = build("framework.name=fairscale", *sets)
    rs = [o for o in program.ops if o.collective == "reduce_scatter"]
    assert rs and {o.dtype for o in rs} == {want}
    ag = [o for o in program.ops if o.collective == "all_gather"]
    assert {o.dtype for o in ag} == {"f16" if want == "f16" else "bf16"}


def test_deepspeed_zero3_types() -> None:
    """ZeRO-3 reduce-scatters and gathers the 16-bit model dtype and all-reduces its fp64
    gradient norm (one 8-byte element)."""
    _, program = build("framework.name=deepspeed")
    rs = [o for o in program.ops if o.collective == "reduce_scatter"]
    assert rs and {o.dtype for o in rs} == {"bf16"}
    norm = [o for o in program.ops if o.name == "all-reduce grad norm"]
    assert len(norm) == 1 and norm[0].dtype == "f64" and norm[0].nbytes == SIZE["f64"]
