"""Skewed routing with Megatron-Core's ``flex`` dispatcher (DeepEP's normal kernels).

With the ``alltoall`` dispatcher the bytes follow the expert loads alone: one copy per chosen
expert (:mod:`sim.frameworks.common.moe_pace`). DeepEP deduplicates: a token crosses the
network once per destination *node* and is forwarded over NVLink once per destination
*rank*, however many of its top-k experts sit there (``get_dispatch_layout``:
``is_token_in_rank``; ``internode.cu``: one RDMA send per node, ``SourceMeta``'s NVLink-peer
bits), so the bytes depend on which experts each token picks together. Under skew those
co-occurrences are no closed form: this module routes every token of one expert-TP x EP
group explicitly (:func:`sim.workload.routing.routing_matrix`, seeded, Megatron's top-k or
group-limited top-k on logits whose expert biases meet the scenario's shares) and counts,
per source rank,

* the tokens bound for each group rank (deduplicated per rank) and for each node
  (deduplicated per node): the per-peer token matrix of the fused transfers
  (:meth:`FlexSkew.matrix`; the same layout as :meth:`FlexLayout.tokens_matrix`: rail peers
  on other nodes get the RDMA leg, NVLink peers what the forwarder relays);
* the copies each expert receives: the expert GEMMs' rows on each EP rank; every rank of the
  stage runs the busiest EP rank's (:func:`flex_pace`), as the ``alltoall`` path does: the
  combine waits for the slowest rank.

Each source's tokens are its own rows of the matrix (token origin uniform over the group);
every micro-batch and layer routes alike (a hot expert belongs to the checkpoint and the
data, as :mod:`sim.workload.routing` says).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import Pace, busiest, priced_ranks, scenario_shares
from sim.hardware.compute import ComputeModel
from sim.workload.moe_ops import MoELayout
from sim.workload.routing import routing_matrix

Matrix = tuple[tuple[float, ...], ...]


def deepep_matrix(n: int, width: int, forward: Callable[[int, int], float],
                  rdma: Callable[[int, int], float]) -> tuple[tuple[float, ...], ...]:
    """DeepEP's dispatch as a sender-by-receiver matrix over ``n`` group ranks, ``width`` to a
    node: rank ``i`` sends ``forward(i, j)`` to rank ``j`` of its own node (NVLink forwarding)
    and ``rdma(i, node)`` to the same-rail rank of every other node (the RDMA leg); nothing to
    any other rank, nor to itself (a local copy)."""
    rows = []
    for i in range(n):
        bi, li = divmod(i, width)
        row = []
        for j in range(n):
            bj, lj = divmod(j, width)
            if i == j:
                v = 0.0
            elif bi == bj:
                v = forward(i, j)
            elif li == lj:
                v = rdma(i, bj)
            else:
                v = 0.0
            row.append(v)
        rows.append(tuple(row))
    return tuple(rows)


@dataclass(frozen=True)
class FlexSkew:
    """Counts of one routed micro-batch over one expert-TP x EP group of ``n`` ranks (group
    rank ``r`` holds EP rank ``r // etp``'s experts; ``width`` group ranks a node)."""

    rank_tokens: Matrix
    """``[source][group rank]``: tokens of the source bound for that rank (once each)."""
    node_tokens: Matrix
    """``[source][node]``: tokens of the source bound for that node (once each)."""
    expert_copies: tuple[int, ...]
    """Token copies each expert receives (sums to ``n x tokens x top_k``)."""
    width: int

    @property
    def n(self) -> int:
        return len(self.rank_tokens)

    def matrix(self) -> Matrix:
        """Tokens group rank ``i`` sends group rank ``j`` in one dispatch (row: sender):
        another node's same-rail rank its node's deduplicated tokens (the RDMA leg); a rank
        of its own node what it forwards there, the tokens of every same-rail source (its
        own included) bound for that rank; nothing to itself (a local copy)."""
        w = self.width
        return deepep_matrix(
            self.n, w,
            forward=lambda i, j: float(sum(self.rank_tokens[s][j]
                                           for s in range(i % w, self.n, w))),
            rdma=lambda i, node: float(self.node_tokens[i][node]))

    def received(self, rank: int | None = None) -> float:
        """Tokens group rank ``rank`` receives in one dispatch (once each); None: the
        busiest receiver's."""
        if rank is not None:
            return float(sum(row[rank] for row in self.rank_tokens))
        return float(max(sum(row[j] for row in self.rank_tokens) for j in range(self.n)))

    def rdma_tokens(self) -> float:
        """Tokens the whole group puts on the network in one dispatch: every source's tokens
        times the distinct *other* nodes they are bound for."""
        w = self.width
        return float(sum(c for s, row in enumerate(self.node_tokens)
                         for b, c in enumerate(row) if b != s // w))


@lru_cache(maxsize=16)
def flex_skew(shares: tuple[float, ...], top_k: int, tokens: int, seed: int, ep: int,
              etp: int, width: int, groups: int = 1, group_topk: int = 1) -> FlexSkew:
    """Route ``ep x etp`` sources of ``tokens`` tokens each (:func:`routing_matrix`) and
    count them per destination rank, node and expert (:class:`FlexSkew`)."""
    n = ep * etp
    e = len(shares)
    local = e // ep
    idx = routing_matrix(shares, top_k, n * tokens, seed, groups, group_topk)
    nodes = -(-n // width)
    # EP ranks of each node's group ranks (an EP rank's expert-TP ranks may span nodes).
    node_eps = [sorted({r // etp for r in range(b * width, min((b + 1) * width, n))})
                for b in range(nodes)]
    per_ep = np.zeros((n, ep), dtype=np.int64)
    per_node = np.zeros((n, nodes), dtype=np.int64)
    for s in range(n):
        rows = idx[s * tokens:(s + 1) * tokens] // local
        hit = np.zeros((len(rows), ep), dtype=bool)
        hit[np.arange(len(rows))[:, None], rows] = True
        per_ep[s] = hit.sum(axis=0)
        for b, eps in enumerate(node_eps):
            per_node[s, b] = int(hit[:, eps].any(axis=1).sum())
    rank_tokens = tuple(tuple(float(per_ep[s, r // etp]) for r in range(n)) for s in range(n))
    copies = np.bincount(idx.ravel(), minlength=e)
    return FlexSkew(rank_tokens=rank_tokens,
                    node_tokens=tuple(tuple(float(x) for x in row) for row in per_node),
                    expert_copies=tuple(int(x) for x in copies), width=width)


def scenario_skew(ctx: JobContext, tokens: int, width: int, groups: int, group_topk: int
                  ) -> FlexSkew | None:
    """The scenario's ``training.routing`` over one expert-TP x EP group with ``tokens`` per
    rank, or None when balanced (the closed forms of :class:`FlexLayout` then hold)."""
    routed = scenario_shares(ctx)
    if routed is None:
        return None
    shares, seed = routed
    moe = ctx.model.moe
    assert moe is not None
    if len(set(shares)) == 1:
        return None                         # zipf with s = 0: balanced
    par = ctx.scenario.parallelism
    return flex_skew(shares, moe.top_k, int(tokens), int(seed), par.ep, par.expert_tp, width,
                     groups, group_topk)


def flex_pace(ctx: JobContext, lay: MoELayout, tokens: int, cm: ComputeModel,
              skew: FlexSkew) -> Pace:
    """The busiest EP rank under ``skew``: its local experts' rows (every source's copies,
    the expert-TP ranks each computing their slice of the width), its layer ops and priced
    expert block; ``peer_tokens`` the copies from EP rank to EP rank (its sources summed)."""
    local = len(skew.expert_copies) // lay.ep
    loads = skew.expert_copies
    priced = priced_ranks(ctx, lay, tokens, cm, loads)
    j = busiest(priced)
    ops, cost = priced[j]
    per_rank = [float(sum(loads[j * local:(j + 1) * local])) for j in range(lay.ep)]
    total = sum(per_rank)
    # Sources send in proportion to the receivers' loads (token origin uniform).
    peers = tuple(tuple(x / lay.ep for x in per_rank) for _ in range(lay.ep)) if total else ()
    return Pace(loads=loads, rank=j, ops=ops, experts=cost, peer_tokens=peers)
