"""Host launches of a grouped GEMM (sim/workload/moe_ops.py, block_pricing.launches).

Independent truth: Transformer Engine's default grouped GEMM, ``multi_stream_cublas_gemm``
(``transformer_engine/common/gemm/cublaslt_gemm.cu``), loops ``for i < num_gemms`` calling
``nvte_cublas_gemm_v2`` once per expert, round-robin on 4 side streams; ``torch._grouped_mm``
(torchtitan) is a single kernel. Megatron-Core's ``TEGroupedMLP`` (``experts.py``) runs fc1
and fc2 each as one ``GroupedLinear``: forward one GEMM per expert for each, backward a dgrad
and a wgrad per expert for each.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import price_block
from sim.workload.kernels import Style
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

CM = ComputeModel(catalog.gpu("h100-sxm"))
ST = Style("bf16")


@pytest.mark.parametrize("ep,tokens", [(8, 1024), (32, 2048)])
def test_te_grouped_gemm_is_one_launch_per_expert(ep, tokens):
    # Qwen3-235B-A22B: 128 experts, so 16 local experts at EP 8 and 4 at EP 32.
    m = ModelSpec.from_ref("qwen3-235b-a22b")
    assert m.moe is not None
    local = m.moe.experts // ep
    te = price_block(moe_layer_ops(m, MoELayout(ep=ep, gemm_per_expert=True), tokens).experts,
                     ST, CM)
    one = price_block(moe_layer_ops(m, MoELayout(ep=ep), tokens).experts, ST, CM)
    # fc1 and fc2 forward: one cuBLASLt call per expert instead of one grouped kernel each.
    assert te.fwd_kernels == one.fwd_kernels           # the same Python-level ops
    assert (te.fwd_extra_launches, one.fwd_extra_launches) == (2 * (local - 1), 0)
    # Backward: dgrad and wgrad of fc1 and of fc2.
    assert (te.bwd_extra_launches, one.bwd_extra_launches) == (4 * (local - 1), 0)
    # The GPU time is the same grouped GEMM either way: only the host's issue changes.
    assert te.fwd_gpu_s == pytest.approx(one.fwd_gpu_s)
    assert te.bwd_gpu_s == pytest.approx(one.bwd_gpu_s)


def test_experts_without_rows_launch_nothing():
    m = ModelSpec.from_ref("qwen3-235b-a22b")
    lay = MoELayout(ep=8, gemm_per_expert=True)
    counts = (1024.0,) * 8 + (0.0,) * 8            # 16 local experts, half of them idle
    ops = moe_layer_ops(m, lay, 1024, tokens_per_expert=counts)
    g = [k for k in ops.experts.forward if k.klass == "gemm"]
    assert [k.launches for k in g] == [8, 8]
    single = replace(lay, gemm_per_expert=False)
    ops1 = moe_layer_ops(m, single, 1024, tokens_per_expert=counts)
    assert [k.launches for k in ops1.experts.forward if k.klass == "gemm"] == [1, 1]


def test_more_local_experts_cost_the_host_more():
    # The same rows over 16 experts (EP 8) take more host time to issue than over 4 (EP 32):
    # the CPU bound of a block grows with its launches, its GPU time does not.
    m = ModelSpec.from_ref("qwen3-235b-a22b")
    many = moe_layer_ops(m, MoELayout(ep=8, gemm_per_expert=True), 1024,
                         tokens_per_expert=(512.0,) * 16).experts
    few = moe_layer_ops(m, MoELayout(ep=32, gemm_per_expert=True), 1024,
                        tokens_per_expert=(2048.0,) * 4).experts
    cpu = (1e-3, 1e-3)     # 1 ms a launch: the block is bound by its issue
    assert price_block(many, ST, CM, cpu).fwd_s > price_block(few, ST, CM, cpu).fwd_s


def test_megatron_issues_a_gemm_per_expert():
    # Megatron's builder runs Megatron-Core's TEGroupedMLP (TE GroupedLinear).
    from sim.config.load import load_scenario
    from sim.frameworks import JobContext
    from sim.frameworks.megatron.moe_plan import moe_plan

    s = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100")
    ctx = JobContext.from_scenario(s, "s.yaml")
    plan = moe_plan(ctx, tp=4, pp=2, local_tokens=1024, cm=ctx.compute)
    g = [k for k in plan.ops.experts.forward if k.klass == "gemm"]
    local = ctx.model.moe.experts // 4                   # EP 4
    assert [k.launches for k in g] == [local, local]
    # The experts op the builder lays out carries them: kernels and host time.
    from sim.workload.block_pricing import CPP_LAUNCH_CPU_S, CUBLASLT_CALL_CPU_S
    c = plan.cost["experts"]
    assert c.fwd_extra_launches == 2 * (local - 1)
    # bf16: every extra launch is a cuBLASLt call (no per-expert quantization).
    assert c.fwd_extra_gemm_launches == c.fwd_extra_launches
    assert c.bwd_extra_gemm_launches == 4 * (local - 1)
    assert CPP_LAUNCH_CPU_S == pytest.approx(5e-6)     # compute.EAGER_BWD_OP_CPU_S
    # NVIDIA/raft PR 1736: an unmemoized cuBLASLt call, ~10 us wrapper entry to launch.
    assert CUBLASLT_CALL_CPU_S == pytest.approx(10e-6)


def test_each_experts_gemm_call_adds_to_the_per_expert_objects():
    # TE's GroupedLinear builds its per-expert split views, weight casts and saved tensors,
    # then calls cuBLASLt once per expert (cublaslt_gemm.cu: descriptors and heuristic query
    # every call). A GEMM call is host work of its own: the experts op's host time grows by
    # CUBLASLT_CALL_CPU_S per call however many objects there are (the old rule took the
    # larger of launches and objects, hiding every GEMM call behind the objects).
    from sim.frameworks.megatron.moe_host import set_host
    from sim.program.ir import Op
    from sim.workload.block_pricing import CUBLASLT_CALL_CPU_S
    from sim.workload.moe_host_ops import MoEHostConfig, moe_host_calls

    calls = moe_host_calls(MoEHostConfig(local_experts=16))
    assert calls["experts"].cpp_fwd > 2 * 15          # more objects than extra GEMM calls

    def host(gemms: int, phase: str) -> float:
        op = Op(name="experts", kind="compute", stream="compute", phase=phase, duration=1e-3,
                cpu_s=1e-4 + gemms * CUBLASLT_CALL_CPU_S)
        set_host(op, calls, "experts", phase, 34e-6, 0, gemms)
        return op.cpu_s

    for phase, gemms in (("fwd", 2 * 15), ("bwd", 4 * 15)):
        assert host(gemms, phase) - host(0, phase) == pytest.approx(gemms * CUBLASLT_CALL_CPU_S)


@pytest.mark.parametrize("coeff,expect", [(0.001, True), (0.0, False)])
def test_aux_loss_counts_are_all_reduced_over_tp(coeff, expect):
    # TopKRouter._apply_aux_loss -> get_tokens_per_expert_and_token_count (moe_utils.py):
    # routing_map.sum(dim=0), [experts] int64, all-reduced over tp_cp_group every forward.
    from sim.config.load import load_scenario
    from sim.frameworks import JobContext, build_program

    s = load_scenario("qwen3-30b-a3b-megatron-tp4pp2ep4-8xh100",
                      [f"framework.moe_aux_loss_coeff={coeff}"])
    ctx = JobContext.from_scenario(s, "s.yaml")
    prog = build_program(ctx)
    ops = [o for o in prog.classes[0].streams["compute"] if "aux-loss count" in o.name]
    assert bool(ops) == expect
    if expect:
        # One per MoE layer forward, as the dispatcher's own count all-gather.
        counts = [o for o in prog.classes[0].streams["compute"] if "token count" in o.name]
        assert len(ops) == len(counts) > 0
        assert all(o.collective == "all_reduce" and o.nbytes == 8 * 128 for o in ops)
        assert all(len(o.groups[0]) == 4 for o in ops)    # the TP group (tp = 4)


def test_accumulating_wgrad_pays_its_fp32_main_grad_traffic():
    # Megatron's wgrad adds into fp32 main_grad (beta = 1): the epilogue reads and writes 4
    # bytes an element. 16 local experts of 512 rows (Qwen3-235B, TP 4, EP 8): fc1's wgrad
    # moves 16 x 4096 x 3072 x 8 bytes of main_grad alone, more than its MACs take at the
    # fitted rate, so the roofline floor binds; its non-accumulating twin is faster.
    from dataclasses import replace as dc_replace

    from sim.workload.block_pricing import kernel_time

    m = ModelSpec.from_ref("qwen3-235b-a22b")
    ops = moe_layer_ops(m, MoELayout(ep=8, gemm_per_expert=True), 1024,
                        tokens_per_expert=(512.0,) * 16)
    w = next(k for k in ops.experts.backward if k.name == "fc1.wgrad")
    main_grad = 16 * 4096 * 3072 * 4
    assert any(t.nbytes == main_grad for t in w.reads)          # read ...
    assert any(t.nbytes == main_grad for t in w.writes)         # ... and written
    t = kernel_time(CM, w)
    assert t >= CM.membound_time(2 * main_grad)
    plain = dc_replace(w, reads=tuple(r for r in w.reads if r.nbytes != main_grad))
    assert kernel_time(CM, plain) < t
    # 4 experts of 4096 rows (EP 32): the MACs dominate, the floor does not bind.
    big = moe_layer_ops(m, MoELayout(ep=32, gemm_per_expert=True), 2048,
                        tokens_per_expert=(4096.0,) * 4)
    w32 = next(k for k in big.experts.backward if k.name == "fc1.wgrad")
    plain32 = dc_replace(w32, reads=tuple(r for r in w32.reads
                                          if r.nbytes != 4 * 4096 * 3072 * 4))
    assert kernel_time(CM, w32) == pytest.approx(kernel_time(CM, plain32))
