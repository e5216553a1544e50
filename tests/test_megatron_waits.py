"""Megatron-Core's real waits and overlaps: blocking pipeline transfers (a send finishes only
once the receiver has posted its receive), per-bucket parameter gathers in the forward
pre-hooks, gradient buckets as ``distributed_data_parallel.py`` assigns them, the
sequence-parallel backward overlap of ``LinearWithGradAccumulationAndAsyncCommunication``
and Transformer Engine's context-parallel ring."""

from __future__ import annotations

import pytest

from sim.api import simulate
from sim.frameworks.megatron_pipeline import pipeline_steps, schedule
from tests.test_megatron import DEEP, scenario


def _fwd_spans(r, cls: int) -> dict[int, tuple[float, float]]:
    """(start, end) of each micro-batch's forward compute on one rank class."""
    spans: dict[int, tuple[float, float]] = {}
    for x in r.recorder.ops:
        if x.cls == cls and x.op.phase == "fwd" and x.op.kind == "compute" and x.end > x.start:
            a, b = spans.get(x.op.micro_batch, (x.start, x.end))
            spans[x.op.micro_batch] = (min(a, x.start), max(b, x.end))
    return spans


@pytest.mark.parametrize("kind,p,vp", [("1f1b", 4, 1), ("gpipe", 3, 1), ("1f1b", 4, 2),
                                       ("1f1b", 2, 3)])
def test_every_transfer_is_posted_on_both_sides_in_the_same_order(kind, p, vp) -> None:
    # NCCL matches a send with the peer's receive in issue order; the two stages' streams
    # must carry the same transfers in the same order, each waited for after it is posted.
    m = 2 * p
    per_stage = [pipeline_steps(kind, p, s, m, vp) for s in range(p)]
    sent: dict[int, list] = {s: [] for s in range(p)}
    got: dict[int, list] = {s: [] for s in range(p)}
    for s, steps in enumerate(per_stage):
        assert [st.unit for st in steps if st.what == "unit"] == \
            schedule(kind, p, s, m, vp)
        posted, waited = set(), set()
        for st in steps:
            for role, tr in st.transfers:
                (posted if st.what == "post" else waited).add((role, tr))
                if st.what == "post":
                    (sent if role == "send" else got)[s].append((tr[0], tr))
        assert posted == waited
    for s in range(p):
        for k in "FB":
            nxt = (s + 1) % p if k == "F" else (s - 1) % p
            out = [tr for kk, tr in sent[s] if kk == k and (tr[1] + (1 if k == "F" else -1))
                   % p == nxt]
            into = [tr for kk, tr in got[nxt] if kk == k and tr[1] % p == s]
            assert out == into


def test_slow_receiver_stalls_the_sender() -> None:
    # GPipe over 2 stages with a large vocabulary: the last stage's forward (output layer and
    # loss) is several times the first stage's. Stage 0's send of micro-batch i completes
    # only once stage 1 has posted its receive, after its forward of i - 1, so stage 0
    # cannot run ahead: its forward of i + 1 starts after stage 1 finished the forward of
    # i - 1, and its forwards stretch over the receiver's pace.
    model = dict(DEEP, layers=4, vocab=256_000)
    r = simulate(scenario({"tp": 1, "pp": 2, "dp": 1}, gbs=6, gpn=2, model=model,
                          framework={"name": "megatron", "pipeline_schedule": "gpipe"}))
    f0, f1 = _fwd_spans(r, 0), _fwd_spans(r, 1)
    own = sum(b - a for a, b in f0.values())
    slow = max(b - a for a, b in f1.values())
    assert slow > 2 * own / len(f0)            # the receiver really is the slower stage
    for i in range(1, 5):
        assert f0[i + 1][0] >= f1[i - 1][1] - 1e-9
    assert f0[5][1] - f0[0][0] > 1.5 * own
