"""Routing distributions (sim/workload/routing.py) against closed forms: Zipf's shares
``r^-s / H(E, s)``, conservation of token copies, the top-k cap, determinism from the seed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.workload.routing import (
    expert_loads,
    peer_tokens,
    rank_loads,
    routing_shares,
)


@pytest.mark.parametrize("s", [0.5, 1.0, 1.5])
def test_zipf_shares_are_the_normalised_power_law(s) -> None:
    e = 16
    h = sum(r ** -s for r in range(1, e + 1))          # generalised harmonic number H(E, s)
    got = sorted(routing_shares(e, "zipf", s=s, seed=7), reverse=True)
    assert got == pytest.approx([r ** -s / h for r in range(1, e + 1)], rel=1e-12)


def test_zipf_zero_is_balanced_and_the_seed_only_permutes() -> None:
    assert routing_shares(8, "zipf", s=0.0, seed=3) == routing_shares(8)
    a = routing_shares(64, "zipf", s=1.0, seed=1)
    assert a == routing_shares(64, "zipf", s=1.0, seed=1)              # same seed, same
    others = [routing_shares(64, "zipf", s=1.0, seed=k) for k in range(2, 6)]
    assert any(o != a for o in others)                                  # another order
    assert all(sorted(o) == pytest.approx(sorted(a), rel=1e-12) for o in others)


@pytest.mark.parametrize("tokens,k,e,s", [(4096, 2, 8, 1.0), (1001, 8, 256, 1.2),
                                          (32768, 8, 128, 0.0), (7, 1, 4, 3.0)])
def test_loads_conserve_the_token_copies_and_respect_the_top_k_cap(tokens, k, e, s) -> None:
    loads = expert_loads(tokens, k, routing_shares(e, "zipf", s=s, seed=0))
    assert sum(loads) == tokens * k and len(loads) == e
    assert min(loads) >= 0 and max(loads) <= tokens    # top-k picks distinct experts
    if s == 0.0:
        assert set(loads) == {tokens * k // e}


def test_a_share_above_one_over_top_k_is_capped_and_the_rest_water_filled() -> None:
    # 8 experts, top-2, one expert asked for 80% of the copies: it can take each token once
    # (50%), the other 50% split over the seven others in proportion (1/7 each).
    shares = (0.8,) + (0.2 / 7,) * 7
    loads = expert_loads(7000, 2, shares)
    assert loads[0] == 7000 and loads[1:] == (1000,) * 7


def test_histogram_is_normalised_and_checked() -> None:
    assert routing_shares(4, "histogram", histogram=[2, 2, 4, 0]) == (0.25, 0.25, 0.5, 0.0)
    with pytest.raises(ValueError, match="4 per-expert loads"):
        routing_shares(4, "histogram", histogram=[1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        routing_shares(2, "histogram", histogram=[1, -1])


def test_peer_tokens_send_each_rank_its_experts_share() -> None:
    # 4 experts on ep=2 (experts 0,1 on rank 0): rank loads 30 and 10 copies from 2 sources.
    loads = (20, 10, 6, 4)
    assert rank_loads(loads, 2) == (30, 10)
    m = peer_tokens(loads, 2, 2)
    assert m == ((15.0, 5.0), (15.0, 5.0))
    # every source sends its tokens x top-k: 40 copies / 2 sources
    assert {sum(row) for row in m} == {20.0}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.data())
def test_round_robin_reaches_the_fewest_ranks_consecutive_experts_can(local: int, k: int,
                                                                       data) -> None:
    """AutoModel's / torchtitan's round-robin gate puts a token on k consecutive experts: with
    ``local`` experts a rank, such a run covers at least ceil(k / local) ranks and at most one
    more (it may start mid-rank), never more than there are ranks; the expected count is the
    sum over ranks of the share of tokens reaching each."""
    from sim.workload.routing import round_robin_hit
    ep = data.draw(st.integers(1, 16))
    experts = local * ep
    if k > experts:
        return
    reached = sum(round_robin_hit(experts, k, range(r * local, (r + 1) * local))
                  for r in range(ep))
    low = -(-k // local)
    assert low - 1e-9 <= reached <= min(ep, low + 1) + 1e-9
