"""Tied embeddings on torchtitan's tensor/context-parallel path (sim/frameworks/fsdp2/tp.py
``tied_grad_sum_tp_s``): the shared weight's two local gradients (output layer, lookup) are
summed by autograd before AccumulateGrad, as the ZeRO, DDP and plain-FSDP2 paths already
charge it (sim/frameworks/common/accounting.py ``tied_grad_sum_s``)."""

from __future__ import annotations

import pytest
from conftest import SMALL_MODEL, make_scenario

from sim import catalog
from sim.api import simulate
from sim.frameworks.common.accounting import tied_grad_sum_s
from sim.frameworks.fsdp2.tp import local_vocab, tied_grad_sum_tp_s
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import BF16
from sim.workload.model import ModelSpec

CM = ComputeModel(catalog.gpu("h100-sxm"), "bf16")


def test_closed_form_and_agreement_with_the_other_paths() -> None:
    m = ModelSpec.from_ref("llama3.2-1b")            # tied, vocabulary 128,256
    assert m.tied_embeddings
    # tp 1 (context parallelism alone): the whole table, the same as every other builder.
    assert tied_grad_sum_tp_s(CM, m, 1) == tied_grad_sum_s(CM, m, BF16)
    # tp 4: each rank sums its vocab/4 rows (DTensor Shard(0), first ranks one larger).
    assert local_vocab(m, 4) == 128256 // 4
    assert tied_grad_sum_tp_s(CM, m, 4) == CM.membound_time(3 * BF16 * 32064 * m.hidden)
    untied = ModelSpec.from_ref("llama3-8b")
    assert tied_grad_sum_tp_s(CM, untied, 4) == 0.0


def _embed_bwd(tied: bool, par: dict) -> float:
    model = {**SMALL_MODEL, "tied_embeddings": tied}
    s = make_scenario(model=model, framework={"name": "fsdp2"}, parallelism=par)
    r = simulate(s)
    return sum(x.op.duration for x in r.recorder.ops
               if x.cls == 0 and x.op.kind == "compute" and x.op.name.startswith("bwd embed"))


@pytest.mark.parametrize("par", [{"tp": 2}, {"cp": 2}], ids=["tp2", "cp2"])
def test_embedding_backward_pays_the_sum(par: dict) -> None:
    """The embedding's backward op grows by exactly the sum's time when the weight is tied
    (one micro-batch: the sum runs once per backward)."""
    tp = par.get("tp", 1)
    s = make_scenario(model={**SMALL_MODEL, "tied_embeddings": True})
    m = ModelSpec.from_ref(s.model)
    delta = _embed_bwd(True, par) - _embed_bwd(False, par)
    assert delta == pytest.approx(tied_grad_sum_tp_s(CM, m, tp), rel=1e-9)
    assert delta > 0
