"""torchao's float8 tensor-parallel styles as torchtitan applies them
(sim/frameworks/fsdp2/float8.py; torchao/float8/float8_tensor_parallel.py)."""

from __future__ import annotations

from conftest import make_scenario

from sim import catalog
from sim.frameworks.fsdp2.tp import titan_blocks
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import Style
from sim.workload.model import ModelSpec

M = ModelSpec.from_ref("llama3-8b")
CM = ComputeModel(catalog.gpu("h100-sxm"), "bf16")
TOKENS, TP = 2 * 8192, 8


def _tb(float8: bool, tp: int = TP):
    return titan_blocks(M, Style("bf16", compile=True, float8=float8), CM, 2, 8192, tp, 1,
                        "allgather")


def test_every_tp_linear_gemm_runs_at_fp8_rate() -> None:
    """Float8ColwiseParallel / Float8RowwiseParallel keep Float8Linear: all seven GEMM
    layouts of each of the layer's linears (fwd, dgrad, wgrad) are FP8 GEMMs."""
    tb = _tb(True)
    for key, n in (("attn_main", 4), ("mlp_main", 3)):
        seg = tb.seg[key]
        gemms = [k for k in seg.forward + seg.backward if k.klass == "gemm"]
        assert len(gemms) == 3 * n and all(k.fp8 for k in gemms)


def test_colwise_inputs_arrive_in_float8() -> None:
    """PrepareFloat8ModuleInput casts the norm output once, on the local tokens, before the
    all-gather: the colwise linears run no input cast, forward or backward, and the saved
    gathered input is 1 byte per element (tokens x hidden)."""
    tb = _tb(True)
    names = [k.name for k in tb.seg["mlp_main"].forward + tb.seg["mlp_main"].backward]
    for w in ("w1", "w3"):
        assert not {f"{w}.amax_in", f"{w}.cast_in", f"{w}.cast_in_bwd"} & set(names)
    assert "w2.cast_in" in names          # rowwise: local input cast as Float8Linear does
    assert tb.seg["mlp_main"].inputs[0].nbytes == TOKENS * M.hidden * 1
    norm = [k.name for k in tb.seg["mlp_norm"].forward]
    assert "fp8_cast" in norm
    cast = next(k for k in tb.seg["mlp_norm"].forward if k.name == "fp8_cast")
    assert cast.writes[0].nbytes == TOKENS // TP * M.hidden


def test_rowwise_gradient_cast_before_its_all_gather() -> None:
    """NoopFwToFloat8BwDynamic: wo/w2's output gradient is cast on the local tokens
    (tokens / tp) and arrives float8: no full-size gradient cast remains."""
    tb = _tb(True)
    names = {k.name: k for k in tb.seg["attn_main"].backward}
    assert "wo.cast_g" not in names and "wo.amax_g" not in names
    assert names["wo.cast_g_local"].writes[0].nbytes == TOKENS // TP * M.hidden


def test_float8_tp_is_faster_than_bf16_tp() -> None:
    """With the casts where torchao puts them, float8 speeds the layer up, forward and
    backward (before, three full-size input casts per attention made it slower than bf16).
    The attention block's backward is a near tie at TP 8: its projections are narrow (512
    and 128 output columns per rank), its flash backward stays bf16 and the FP8 dgrad/wgrad
    GEMMs run without fast accumulation (torchao's default); within 3% of bf16."""
    bf, f8 = _tb(False), _tb(True)
    for key in ("attn_main", "mlp_main"):
        assert f8.cost[key].fwd_s < bf.cost[key].fwd_s
    assert f8.cost["mlp_main"].bwd_s < bf.cost["mlp_main"].bwd_s
    assert f8.cost["attn_main"].bwd_s < 1.03 * bf.cost["attn_main"].bwd_s
    layer = ("attn_main", "mlp_main")
    assert sum(f8.cost[k].bwd_s for k in layer) < sum(bf.cost[k].bwd_s for k in layer)


def test_tp_all_gathers_carry_float8() -> None:
    """The layer all-gathers carry 1 byte per element under float8 TP, 2 under bf16; the
    head's (bf16 output layer) stays 2."""
    from sim.frameworks.fsdp2.float8 import tp_all_gather_bytes_per_element as per

    assert (per(True, "attn"), per(True, "mlp"), per(True, "head")) == (1, 1, 2)
    assert per(False, "mlp") == 2
    assert _tb(True).fp8_tp and not _tb(False).fp8_tp and not _tb(True, tp=1).fp8_tp


def test_program_tp_collectives_bytes() -> None:
    """In the built step: every layer all-gather (forward, SAC recompute, backward) carries
    tokens x hidden x 1 B under float8 (x 2 B under bf16); every reduce-scatter and the
    head's all-gather stay bf16."""
    from sim.api import simulate

    def ops(precision: str) -> list:
        sc = make_scenario({
            "name": "t", "model": "llama3-8b",
            "cluster": {"topology": "meta-grand-teton", "nodes": 2},
            "framework": {"name": "fsdp2", "compile": True},
            "parallelism": {"tp": 8},
            "training": {"seq_len": 8192, "micro_batch_size": 2, "global_batch_size": 4,
                         "precision": precision, "activation_checkpointing": "selective"}})
        return [o for o in simulate(sc).program.ops if o.name.startswith("tp ")]

    full = TOKENS * M.hidden
    for precision, per in (("fp8", 1), ("bf16", 2)):
        tp = ops(precision)
        layer_ag = [o for o in tp if o.collective == "all_gather" and " L" in o.name]
        assert layer_ag and all(o.nbytes == full * per for o in layer_ag)
        assert all(o.nbytes == full * 2 for o in tp if o.collective == "reduce_scatter")
        assert all(o.nbytes == full * 2 for o in tp
                   if o.collective == "all_gather" and "head" in o.name)
