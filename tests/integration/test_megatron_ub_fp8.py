"""Transformer Engine's userbuffers under FP8 (``tp_comm_overlap`` with training.precision
fp8; sim/frameworks/megatron/overlap.py ``userbuffers_gather_bytes``): every all-gather buffer
is an FP8 ``uint8`` buffer (TE ``initialize_ub``: ``layers_all_gather_overlap``) filled with
the quantized local shard, so the ring-exchange and bulk all-gathers move one byte per
element; the reduce-scatters keep bf16. Checked op by op against the closed form (tokens x
hidden bytes) and on the wire (NVLink bytes fall by exactly the gathers' second byte)."""

from __future__ import annotations

import pytest
from helpers import megatron_scenario as scenario

from sim.api import simulate
from sim.frameworks.megatron.overlap import userbuffers_gather_bytes

SMALL = {"layers": 2, "hidden": 2048, "heads": 16, "ffn_hidden": 8192, "vocab": 1024,
         "mlp": "gelu", "tied_embeddings": False}
TP, SEQ = 4, 4096
TP4 = {"tp": TP, "pp": 1, "dp": 1, "sequence_parallel": True}


def _run(overlap: bool, precision: str):
    fw = {"name": "megatron", "tp_comm_overlap": overlap}
    return simulate(scenario(TP4, gbs=1, framework=fw, gpn=TP, nvlink=450, model=SMALL,
                             seq=SEQ, precision=precision))


def _tp_ops(r, kind: str):
    return [x.op for x in r.recorder.ops if x.cls == 0 and x.op.collective == kind
            and x.op.stream == "tp" and x.op.layer is not None]


def test_gather_bytes_rule() -> None:
    assert userbuffers_gather_bytes(4096.0, 2, True) == 2048.0
    assert userbuffers_gather_bytes(4096.0, 2, False) == 4096.0


def test_fp8_userbuffers_gathers_move_one_byte_per_element() -> None:
    full = SEQ * SMALL["hidden"]                # gathered [s, b, h] elements (b = 1)
    r = _run(True, "fp8")
    gathers, scatters = _tp_ops(r, "all_gather"), _tp_ops(r, "reduce_scatter")
    # per layer: fwd ring exchanges before QKV and fc1, bwd before proj/fc2 dgrad, and the
    # bulk input re-gathers of QKV and fc1's wgrad: 6 all-gathers, all FP8.
    assert len(gathers) == 6 * SMALL["layers"]
    assert all(g.nbytes == pytest.approx(full * 1) and g.dtype == "u8" for g in gathers)
    # pipelined (4 splits) and bulk reduce-scatters stay bf16: a layer's add up to 4 x 2 B.
    per_layer = sum(s.nbytes for s in scatters) / SMALL["layers"]
    assert per_layer == pytest.approx(4 * full * 2)


def test_fp8_userbuffers_halve_the_gathers_on_the_wire() -> None:
    """Against bf16 userbuffers with the same layout, NVLink carries exactly one byte per
    gathered element less: 6 gathers per layer x (tp-1)/tp of tokens x hidden received by
    each of the tp ranks, each byte on two NVLink links (GPU to NVSwitch, NVSwitch to GPU).
    Without userbuffers TE's NCCL gathers move FP8 too (``gather_along_first_dim`` with a
    quantizer; tests/integration/test_megatron_sp_fp8_gather.py): the same wire bytes."""
    bf, f8 = _run(True, "bf16"), _run(True, "fp8")
    full = SEQ * SMALL["hidden"]
    hops = 2
    received = [x.op.nbytes * (TP - 1) for x in bf.recorder.ops
                if x.cls == 0 and x.op.collective in ("all_gather", "reduce_scatter")]
    # The end of step's TP all-reduce of replicated gradients (norms, row-parallel biases;
    # sim/frameworks/megatron/tp_grads.py), a ring: 2 (tp - 1) / tp of it from each rank, in
    # NCCL's LL protocol at this size (114,688 B): 8-byte lines of 4 data and 4 flag bytes,
    # two wire bytes per byte.
    received += [2 * 2 * x.op.nbytes * (TP - 1) for x in bf.recorder.ops
                 if x.cls == 0 and x.op.collective == "all_reduce" and len(x.op.group) == TP]
    nv_bf, nv_f8 = bf.summary["bytes"]["nvlink"], f8.summary["bytes"]["nvlink"]
    assert nv_bf == pytest.approx(hops * sum(received), rel=1e-6)   # the wire's closed form
    saved = SMALL["layers"] * 6 * full * (TP - 1) / TP * TP * hops
    assert nv_bf - nv_f8 == pytest.approx(saved, rel=1e-6)
    nccl_f8 = _run(False, "fp8").summary["bytes"]["nvlink"]
    assert nccl_f8 == pytest.approx(nv_f8, rel=1e-6)
