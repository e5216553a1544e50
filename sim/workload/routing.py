"""Routing imbalance of a mixture-of-experts layer: how many tokens each expert receives.

Real routers do not spread tokens evenly. Inference traces of trained MoE models show a few
"hot" experts taking several times their share (Huang et al., "Towards MoE Deployment:
Mitigating Inefficiencies in Mixture-of-Expert (MoE) Inference", arXiv:2303.06182), and
Mixtral's routing analysis shows per-layer expert shares that stay visibly off the uniform
1/8 even with a load-balancing loss (Jiang et al., "Mixtral of Experts", arXiv:2401.04088,
section 5); DeepSeek-V3 plots per-expert load with and without its auxiliary-loss-free
balancing (arXiv:2412.19437, section 4.5). Three distributions stand in for that:

* ``balanced``: every expert gets ``tokens x top_k / experts`` (the aux-loss ideal);
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

from collections.abc import Sequence

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
    if distribution == "balanced":
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
