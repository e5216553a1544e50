"""NeMo AutoModel's GPT-OSS attention module with FlexAttention and learned sinks
(sim/workload/automodel_attention.py), against closed forms: its parameters are the model's
(the catalogue's exact GPT-OSS counts), its FLOPs the causal triangle's or the window's band
(``window_pairs``), and what it saves for backward is what autograd keeps: q, k, v, the
kernel's output and log-sum-exp, and the sink scale (one fp32 per row).
"""

from __future__ import annotations

import pytest

from sim.hardware.attention_cost import window_pairs
from sim.workload.automodel_attention import eager_half_rope, flex_sink_attention_block
from sim.workload.kernels import Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.megatron_ops import STYLE
from sim.workload.model import ModelSpec

B, S = 2, 4096


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_parameters_flops_and_saved_tensors(name: str) -> None:
    m = ModelSpec.from_ref(name, S)
    t, qd, kvd, hd = B * S, m.q_dim, m.kv_dim, m.head_dim
    full = flex_sink_attention_block(m, B, S)
    band = flex_sink_attention_block(m, B, S, m.sliding_window)
    # q, k, v and o projections with biases, 64 sinks, the norm: the catalogue's count.
    for blk in (full, band):
        assert blk.params == m.attention_params + m.norm_params
    proj = 2.0 * t * m.hidden * (2 * qd + 2 * kvd)
    # Causal: 2 x S^2 x q_dim FLOPs a sequence forward (half of 4 S^2 d per head); the band:
    # 4 x q_dim per (query, key) pair it scores; backward 2.5 x the kernel and 2 x the GEMMs.
    assert full.flops_fwd == pytest.approx(proj + 2.0 * B * S * S * qd)
    assert band.flops_fwd == pytest.approx(proj + 4.0 * B * qd * window_pairs(S, 128))
    assert full.flops_bwd == pytest.approx(2 * proj + 2.5 * 2.0 * B * S * S * qd)
    rows = B * m.heads * S
    kernel_saved = {"q_bhsd": t * qd * 2, "k_bhsd": t * kvd * 2, "v_bhsd": t * kvd * 2,
                    "flex.out": t * qd * 2, "flex.lse": rows * 4, "sink.scale": rows * 4}
    saved = {x.name.removeprefix("attn."): x.nbytes for x in full.saved}
    assert {k: saved[k] for k in kernel_saved} == pytest.approx(kernel_saved)
    # The sink scaling multiplies the bf16 output by an fp32 scale: an fp32 product.
    mul = next(k for k in full.forward if k.name == "sink.mul")
    assert mul.writes[0].nbytes == pytest.approx(4.0 * t * qd)
    assert hd == 64


def test_eager_rope_moves_what_its_ops_touch() -> None:
    # n bf16 elements (2n bytes; a half is n bytes). Forward: two table casts (fp32 in, bf16
    # out), four products (a half and the table in, a half out: 2n + 2 table bytes each),
    # the difference and the sum (two halves in, one out: 3n each), the cat (4n).
    n, table = 1000.0, 10.0
    b = _Builder("a", STYLE)
    eager_half_rope(b, Tensor("a.q", 2 * n), n, table, "q")
    tables = 2 * (4 + 2) * table
    fwd = sum(k.nbytes for k in b.block.forward)
    assert fwd == pytest.approx(tables + 4 * (2 * n + 2 * table) + 2 * 3 * n + 4 * n)
