"""Transformer Engine's context-parallel ring beside its attention calls
(sim/workload/te_attention.py) against the source's operations, counted.

Independent truth: ``AttnFuncWithCPAndKVP2P`` (``transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py`` @ d0067d0), causal, ``sbhd``, 16-bit attention:
forward ``torch.cat`` of keys and values into the first send buffer, a ``clone`` and cp - 1
merges of the log-sum-exp, cp output corrections after the loop (the first writes the output,
the others read and add into it); backward one copy of keys and values into the first send
buffer, then per step one copy (first step) or add (later steps) of the step's query, key and
value gradients into their accumulators.
"""

from __future__ import annotations

import pytest

from sim.frameworks.megatron.layer import CORE_BWD, CORE_FWD
from sim.workload.megatron_ops import MegatronLayout, attention_block
from sim.workload.model import ModelSpec

SEQ = 8192


def _ring(cp: int, model: str = "llama3-8b", tp: int = 1):
    m = ModelSpec.from_ref(model)
    main = attention_block(m, MegatronLayout(tp=tp, sequence_parallel=tp > 1, cp=cp), 1,
                           SEQ)[1]
    fwd = [k for k in main.forward if k.name.startswith("flash_fwd.cp_")]
    bwd = [k for k in main.backward if k.name.startswith("flash_bwd.cp_")]
    return m, fwd, bwd


def test_no_ring_without_context_parallelism() -> None:
    _, fwd, bwd = _ring(1)
    assert fwd == [] and bwd == []


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_forward_copies_and_merges_counted_from_the_source(cp: int) -> None:
    m, fwd, _ = _ring(cp)
    tokens = SEQ // cp
    out = tokens * m.q_dim * 2                      # the local output, bf16
    kv = 2 * tokens * m.kv_dim * 2                  # keys and values, bf16
    lse = m.heads * tokens * 4                      # fp32 log-sum-exp
    names = [k.name for k in fwd]
    assert names.count("flash_fwd.cp_kv_cat") == 1
    assert sum(n.startswith("flash_fwd.cp_lse_") for n in names) == cp   # clone + cp - 1
    corr = [k for k in fwd if "out_correction" in k.name]
    assert len(corr) == cp
    # Bytes: the cat reads and writes keys and values; the first correction reads the step's
    # output and the log-sum-exp and writes the output, each later one also reads the output.
    assert next(k for k in fwd if k.name.endswith("kv_cat")).nbytes == pytest.approx(2 * kv)
    assert sum(k.nbytes for k in corr) == pytest.approx(
        (2 * out + lse) + (cp - 1) * (3 * out + lse))


@pytest.mark.parametrize("cp", [2, 4])
def test_backward_accumulations_counted_from_the_source(cp: int) -> None:
    m, _, bwd = _ring(cp)
    tokens = SEQ // cp
    q, k = tokens * m.q_dim * 2, tokens * m.kv_dim * 2
    # Grouped-query keys are narrower than queries, so the last rank (whole query gradients,
    # half key/value ones) is the ring's slowest: q + kv/2 > q/2 + kv.
    assert q + k > q / 2 + 2 * k
    per_step = {"dq": q, "dk": k / 2, "dv": k / 2}
    assert bwd[0].name == "flash_bwd.cp_kv_copy" and bwd[0].nbytes == pytest.approx(4 * k)
    for name, size in per_step.items():
        ks = [x for x in bwd if x.name.startswith(f"flash_bwd.cp_{name}_")]
        assert len(ks) == cp
        # The first step copies (read, write), the others add (two reads, one write).
        assert sum(x.nbytes for x in ks) == pytest.approx(2 * size + (cp - 1) * 3 * size)


def test_ring_work_counts_as_core_attention() -> None:
    # They run inside TE's attention function: the ring's split of the block
    # (sim.frameworks.megatron.overlap.cp_ring) and selective recomputation of core_attn
    # find them by name.
    _, fwd, bwd = _ring(2)
    assert all(k.name.split(".")[0] in CORE_FWD for k in fwd)
    assert all(k.name.split(".")[0] in CORE_BWD for k in bwd)
