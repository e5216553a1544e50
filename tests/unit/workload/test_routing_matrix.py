"""The token-level routing matrix (sim/workload/routing.py, ``routing_matrix``): every token
picks ``top_k`` distinct experts, the copies add up to ``tokens x top_k``, group-limited
routing never spans more than ``group_topk`` groups, the seed fixes the matrix, and the
calibrated biases make the expert loads meet the water-filled shares of ``expert_loads``
(to within sampling noise: a binomial count of ``n`` draws at rate ``p`` has standard
deviation ``sqrt(n p (1 - p))``; the bounds below are several of them)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.workload.routing import expert_loads, routing_matrix, routing_shares


@pytest.mark.parametrize("experts, k, s", [(8, 2, 1.0), (32, 4, 0.5), (64, 8, 1.5)])
def test_rows_are_distinct_experts_and_copies_conserve(experts, k, s) -> None:
    shares = routing_shares(experts, "zipf", s=s, seed=5)
    m = routing_matrix(shares, k, 3000, seed=5)
    assert m.shape == (3000, k)
    assert all(len(set(row)) == k for row in m.tolist())
    counts = np.bincount(m.ravel(), minlength=experts)
    assert counts.sum() == 3000 * k
    assert counts.max() <= 3000                    # one copy of a token per expert at most


def test_loads_meet_the_water_filled_shares() -> None:
    shares = routing_shares(32, "zipf", s=1.0, seed=2)
    n, k = 20000, 4
    got = np.bincount(routing_matrix(shares, k, n, seed=2).ravel(), minlength=32)
    want = np.array(expert_loads(n, k, shares), dtype=float)
    p = want / n
    sigma = np.sqrt(n * p * (1 - p)) + 1.0
    # Calibrated on 4,096 tokens, checked on 20,000: a few sigma of both samples.
    assert np.all(np.abs(got - want) <= 8 * sigma * np.sqrt(1 + n / 4096))
    # The hottest expert really is the hottest.
    assert int(np.argmax(got)) == int(np.argmax(want))


def test_balanced_shares_give_equal_loads_on_average() -> None:
    n, k, e = 16000, 2, 8
    got = np.bincount(routing_matrix(routing_shares(e), k, n, seed=0).ravel(), minlength=e)
    sigma = np.sqrt(n * (k / e) * (1 - k / e))
    assert np.all(np.abs(got - n * k / e) < 6 * sigma)


def test_group_limited_routing_bounds_the_groups_of_every_token() -> None:
    shares = routing_shares(32, "zipf", s=1.5, seed=9)
    m = routing_matrix(shares, 4, 5000, seed=9, groups=8, group_topk=2)
    groups_per_token = [len(set(row)) for row in (m // 4).tolist()]
    assert max(groups_per_token) <= 2
    free = routing_matrix(shares, 4, 5000, seed=9)
    assert max(len(set(row)) for row in (free // 4).tolist()) > 2


def test_the_seed_fixes_the_matrix() -> None:
    shares = routing_shares(16, "zipf", s=1.0, seed=1)
    a = routing_matrix(shares, 2, 10000, seed=1)
    assert np.array_equal(a, routing_matrix(shares, 2, 10000, seed=1))
    assert not np.array_equal(a, routing_matrix(shares, 2, 10000, seed=2))


def test_experts_without_a_share_get_no_token() -> None:
    m = routing_matrix((3, 1, 0, 0, 2, 0), 2, 2000, seed=4)
    assert set(np.unique(m)) == {0, 1, 4}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        routing_matrix(routing_shares(4), 5, 10)
    with pytest.raises(ValueError, match="groups"):
        routing_matrix(routing_shares(8), 4, 10, groups=4, group_topk=1)
