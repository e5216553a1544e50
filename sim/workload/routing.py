"""Routing imbalance of a mixture-of-experts layer: how many tokens each expert receives.

Real routers do not spread tokens evenly. Inference traces of trained MoE models show a few
"hot" experts taking several times their share (Huang et al., "Towards MoE Deployment:
Mitigating Inefficiencies in Mixture-of-Expert (MoE) Inference", arXiv:2303.06182), and
Mixtral's routing analysis shows per-layer expert shares that stay visibly off the uniform
1/8 even with a load-balancing loss (Jiang et al., "Mixtral of Experts", arXiv:2401.04088,
section 5); DeepSeek-V3 plots per-expert load with and without its auxiliary-loss-free
balancing (arXiv:2412.19437, section 4.5). These distributions stand in for that:

* ``balanced``: every expert gets ``tokens x top_k / experts`` (the aux-loss ideal), each
  token's ``top_k`` distinct experts drawn uniformly;
* ``round_robin``: the same loads, but token ``t`` of each rank takes the ``top_k``
  consecutive experts from ``t x top_k`` (mod experts): NeMo AutoModel's ``FakeBalancedGate``
  (``nemo_automodel/components/moe/layers.py``: ``torch.arange(tokens * k).view(-1, k) %
  n_experts``), which every MoE row of its published benchmarks runs ("Fake balanced gate is
  enabled to simulate ideal expert routing", docs/performance-summary). A token's experts then
  sit on one or two neighbouring EP ranks, which is what a deduplicating dispatch (DeepEP)
  sends (:func:`round_robin_hit`);
* ``zipf``: the expert ranked ``r`` (1-based) gets a share proportional to ``r ** -s``; which
  expert holds which rank is a seeded random permutation (``numpy.random.Generator``), fixed
  for every layer of the step (a hot expert is a property of the checkpoint and the data,
  not of the micro-batch); ``s = 0`` is balanced;
* ``histogram``: measured per-expert shares, in expert order.

No expert can take more than one copy of each token (the top-k are distinct experts), so a
share above ``1 / top_k`` of the copies is capped at ``tokens`` and the excess spread over
the others in proportion to their shares (water-filling).

Expert-parallel layout (Megatron-Core ``MoELayer``: ``local_expert_indices_offset =
ep_rank x num_local_experts``): EP rank ``j`` holds experts ``j x E/ep .. (j+1) x E/ep - 1``.
Each source rank's tokens follow the same distribution (token origin is uniform over the EP
ranks), so rank ``i`` sends rank ``j`` its ``1 / ep`` of the copies bound for ``j``'s experts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np


def routing_shares(experts: int, distribution: str = "balanced", s: float = 1.0,
                   histogram: Sequence[float] | None = None, seed: int = 0
                   ) -> tuple[float, ...]:
    """Each expert's share of the routed token copies (sums to 1).

    Examples
    --------
    >>> routing_shares(4)
    (0.25, 0.25, 0.25, 0.25)
    >>> routing_shares(4, "zipf", s=0.0)
    (0.25, 0.25, 0.25, 0.25)
    >>> [round(11 * x, 9) for x in sorted(routing_shares(3, "zipf", s=1.0, seed=1))]
    [2.0, 3.0, 6.0]
    >>> routing_shares(2, "histogram", histogram=[3, 1])
    (0.75, 0.25)
    """
    if distribution in ("balanced", "round_robin"):
        return (1.0 / experts,) * experts
    if distribution == "zipf":
        if s < 0:
            raise ValueError(f"zipf exponent s must be >= 0, got {s}")
        ranked = np.arange(1, experts + 1, dtype=float) ** -float(s)
        order = np.random.Generator(np.random.PCG64(seed)).permutation(experts)
        w = ranked[order]           # expert e has rank order[e] + 1
    elif distribution == "histogram":
        if histogram is None or len(histogram) != experts:
            raise ValueError(f"histogram needs {experts} per-expert loads, got "
                             f"{0 if histogram is None else len(histogram)}")
        w = np.asarray(histogram, dtype=float)
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ValueError("histogram loads must be finite, non-negative, not all zero")
    else:
        raise ValueError(f"unknown routing distribution {distribution!r}")
    return tuple(float(x) for x in w / w.sum())


def round_robin_hit(experts: int, top_k: int, members: Sequence[int]) -> float:
    """Share of tokens whose ``round_robin`` experts (``top_k`` consecutive ones from ``t x
    top_k`` mod ``experts``) include at least one of ``members``. Token ``t``'s first expert
    runs over the multiples of ``g = gcd(top_k, experts)``, each once every ``experts / g``
    tokens: exact over whole periods (any micro-batch of a multiple of ``experts / g``
    tokens per rank).

    Examples
    --------
    >>> round_robin_hit(128, 8, range(16))          # Qwen3-30B, EP 8: one rank a token
    0.125
    >>> round_robin_hit(256, 8, range(4))           # DeepSeek-V3, EP 64: two ranks a token
    0.03125
    >>> round_robin_hit(8, 2, (0,))                 # Mixtral: as uniform routing, 2/8
    0.25
    """
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} must be between 1 and the {experts} experts")
    return _round_robin_hit(experts, top_k, frozenset(members))


@lru_cache(maxsize=4096)
def _round_robin_hit(experts: int, top_k: int, held: frozenset[int]) -> float:
    # Cached: the planner and each DeepEP op of a program ask for the same groups again.
    g = math.gcd(top_k, experts)
    starts = range(0, experts, g)
    hits = sum(any((s + j) % experts in held for j in range(top_k)) for s in starts)
    return hits / len(starts)


def _cap(shares: np.ndarray, cap: float) -> np.ndarray:
    """Water-fill: no share above ``cap``, the excess spread over the uncapped in proportion."""
    out = shares.copy()
    for _ in range(len(out)):
        over = out > cap + 1e-15
        if not over.any():
            break
        excess = float((out[over] - cap).sum())
        out[over] = cap
        free = out < cap - 1e-15
        out[free] += excess * out[free] / out[free].sum()
    return out


def expert_loads(tokens: int, top_k: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Token copies each expert receives: integers summing to ``tokens x top_k``, none above
    ``tokens`` (largest-remainder rounding of the capped shares; ties to the lower index).

    Examples
    --------
    >>> expert_loads(100, 2, routing_shares(4))
    (50, 50, 50, 50)
    >>> expert_loads(10, 2, (0.9, 0.05, 0.05))        # capped at one copy per token
    (10, 5, 5)
    >>> sum(expert_loads(1001, 8, routing_shares(256, "zipf", s=1.2, seed=3))) == 8008
    True
    """
    e = len(shares)
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must be between 1 and the {e} experts")
    total = int(tokens) * top_k
    ideal = _cap(np.asarray(shares, dtype=float), 1.0 / top_k) * total
    base = np.floor(ideal + 1e-9).astype(np.int64)
    base = np.minimum(base, int(tokens))
    left = total - int(base.sum())
    rem = ideal - base
    rem[base >= int(tokens)] = -1.0          # full experts take no more
    order = sorted(range(e), key=lambda i: (-rem[i], i))
    for i in order[:left]:
        base[i] += 1
    return tuple(int(x) for x in base)


def rank_loads(loads: Sequence[int], ep: int) -> tuple[int, ...]:
    """Token copies each EP rank's local experts receive (experts ``j x E/ep`` onwards on
    rank ``j``)."""
    local = len(loads) // ep
    return tuple(sum(loads[j * local:(j + 1) * local]) for j in range(ep))


def peer_tokens(loads: Sequence[int], ep: int, sources: int) -> tuple[tuple[float, ...], ...]:
    """The dispatch's tokens from EP rank ``i`` (row) to EP rank ``j`` (column) in one EP
    group, when ``sources`` ranks (``ep x`` expert-TP) feed the experts the ``loads`` count:
    each source sends ``1 / sources`` of the copies bound for each rank.

    Examples
    --------
    >>> peer_tokens((6, 2), 2, 2)
    ((3.0, 1.0), (3.0, 1.0))
    """
    per = [r / sources for r in rank_loads(loads, ep)]
    return tuple(tuple(float(x) for x in per) for _ in range(ep))


# ---------------------------------------------------------------------- token-level routing
CALIBRATION_TOKENS = 4096
"""Tokens the sampler calibrates its expert biases on (the first of the sample)."""
CALIBRATION_ROUNDS = 12
"""Fixed-point rounds of that calibration (common random numbers: deterministic)."""
_CHUNK = 8192
"""Tokens routed at a time (bounds the ``[tokens, experts]`` score array in memory)."""
_FLOOR = -1e4
"""Log-weight of an expert with no share: chosen only when a token finds too few others."""


def _top_k(scores: np.ndarray, k: int, groups: int, group_topk: int) -> np.ndarray:
    """Megatron-Core's router choice on ``[tokens, experts]`` scores: ``torch.topk``, or with
    ``groups`` > 1 ``moe_utils.group_limited_topk`` (each group scored by the sum of its best
    ``top_k // group_topk`` experts, the ``group_topk`` best groups kept, the top-k among
    their experts). Returns ``[tokens, k]`` expert indices."""
    if groups > 1:
        n, e = scores.shape
        size = e // groups
        # Softmax numerators (exp of the logits): the router's probabilities up to each
        # token's normaliser, which ranks the groups as Megatron's summed probs do.
        p = np.exp(scores - scores.max(axis=1, keepdims=True)).reshape(n, groups, size)
        best = max(1, k // group_topk)
        gscore = -np.sort(-p, axis=2)[:, :, :best].sum(axis=2)
        keep = np.argpartition(-gscore, group_topk - 1, axis=1)[:, :group_topk]
        mask = np.ones((n, groups), dtype=bool)
        mask[np.arange(n)[:, None], keep] = False
        scores = np.where(np.repeat(mask, size, axis=1), -np.inf, scores)
    return np.argpartition(-scores, k - 1, axis=1)[:, :k]


def routing_matrix(shares: Sequence[float], top_k: int, tokens: int, seed: int = 0,
                   groups: int = 1, group_topk: int = 1) -> np.ndarray:
    """Each token's ``top_k`` distinct experts (``[tokens, top_k]`` indices, each row
    sorted), drawn so that expert ``e`` takes about ``shares[e]`` of the copies.

    Per-token choices matter where the expert loads alone do not: DeepEP's dispatch sends a
    token once per destination node and once per destination rank
    (:mod:`sim.frameworks.megatron.moe_flex`), so which experts a token picks *together*
    sets the bytes. The router is a random-utility model: a token's logit for expert ``e``
    is ``b_e + g`` with ``g`` standard Gumbel noise (Gumbel-max: the top-``k`` of those is
    sampling ``k`` experts without replacement in proportion to ``exp(b_e)``; Kool et al.,
    "Stochastic Beams and Where to Find Them", ICML 2019), chosen by Megatron-Core's
    top-k or group-limited top-k (:func:`_top_k`). The biases ``b`` are calibrated (a
    fixed point on the first :data:`CALIBRATION_TOKENS` tokens' noise) so that each
    expert's inclusion rate meets ``k x`` its capped share (the water-filled shares of
    :func:`expert_loads`), as DeepSeek-V3's balancing bias steers the top-k selection
    (arXiv:2412.19437 section 2.1.2). Seeded (``numpy`` PCG64): the same arguments give the
    same matrix.

    Examples
    --------
    >>> m = routing_matrix(routing_shares(8), 2, 4000, seed=1)
    >>> m.shape, bool((m[:, 0] != m[:, 1]).all())
    ((4000, 2), True)
    >>> counts = np.bincount(m.ravel(), minlength=8)
    >>> int(counts.sum()), bool(abs(counts - 1000).max() < 100)
    (8000, True)
    >>> g = routing_matrix(routing_shares(8, "zipf", s=1.0), 4, 500, 2, groups=4, group_topk=2)
    >>> int(max(len(set(row // 2)) for row in g))          # at most 2 groups a token
    2
    """
    e = len(shares)
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must be between 1 and the {e} experts")
    if groups > 1 and (e % groups or top_k > group_topk * (e // groups)):
        raise ValueError(f"{e} experts in {groups} groups, {group_topk} a token, cannot "
                         f"give top-{top_k}")
    w = np.asarray(shares, dtype=float)
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ValueError("routing shares must be finite, non-negative, not all zero")
    target = _cap(w / w.sum(), 1.0 / top_k) * top_k
    bias = np.where(target > 0, np.log(np.maximum(target, 1e-300)), _FLOOR)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((int(seed), 14, 4))))
    out = np.empty((int(tokens), top_k), dtype=np.int32)
    for start in range(0, int(tokens), _CHUNK):
        n = min(_CHUNK, int(tokens) - start)
        noise = rng.gumbel(size=(n, e))
        if start == 0:
            cal = noise[:CALIBRATION_TOKENS]
            live = target > 0
            for _ in range(CALIBRATION_ROUNDS):
                got = np.bincount(_top_k(cal + bias, top_k, groups, group_topk).ravel(),
                                  minlength=e) / len(cal)
                # Half a logit step: inclusion saturates near 1, where a log step stalls,
                # and the experts compete for k slots, where a full step oscillates.
                lo = 0.5 / len(cal)
                t, g = np.clip(target, lo, 1 - lo), np.clip(got, lo, 1 - lo)
                step = 0.5 * (np.log(t / (1 - t)) - np.log(g / (1 - g)))
                bias = np.where(live, np.clip(bias + step, -60.0, 60.0), _FLOOR)
        out[start:start + n] = np.sort(_top_k(noise + bias, top_k, groups, group_topk), axis=1)
    return out
