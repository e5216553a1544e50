"""Routing imbalance in a mixture-of-experts layer: which EP rank sets the pace (Megatron-Core's
MoE layers and torchtitan's, :mod:`sim.frameworks.fsdp2.moe`, share this rule).

With skewed routing (``training.routing``, :mod:`sim.workload.routing`) the EP ranks hold
experts with different loads, so their grouped GEMMs and expert-TP exchanges take different
times, and the dispatch and combine all-to-alls send different bytes to each peer
(``input_splits``/``output_splits`` of ``MoEAlltoAllTokenDispatcher``). Every MoE layer's
combine all-to-all waits for the slowest rank's experts, so here every rank of a pipeline
stage runs the busiest EP rank's expert block (the stage stays one rank class), and the
all-to-alls carry the full per-peer byte matrix (``Op.peer_bytes``). FLOPs stay those of
balanced routing: the total work is the same, only its spread changes.

Limit of this one-class form: a collective has one size for all its groups, so with
expert-TP > 1 every expert-TP group gathers and scatters the busiest EP rank's tokens; the
step's pace is right, but the bytes those exchanges put on NVLink are overcounted by up to
the imbalance factor (:attr:`Pace.imbalance`). The all-to-alls' bytes are exact. Megatron's
and torchtitan's builders lift it with a class per (stage, expert load)
(:mod:`sim.frameworks.common.moe_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.moe_ops import STYLE, MoELayerOps, MoELayout, moe_layer_ops
from sim.workload.routing import expert_loads, peer_tokens, rank_loads, routing_shares


@dataclass(frozen=True)
class Pace:
    """The busiest EP rank under skewed routing."""

    loads: tuple[int, ...]
    """Token copies each routed expert receives from its EP x expert-TP ranks per layer and
    micro-batch."""
    rank: int
    """EP rank whose experts take longest (fwd + bwd)."""
    ops: MoELayerOps
    """Its MoE layer ops (expert rows, expert-TP bytes)."""
    experts: BlockCost
    """Its expert block, priced."""
    peer_tokens: tuple[tuple[float, ...], ...]
    """Dispatch tokens from EP rank i (row) to EP rank j (column) in one EP group."""

    @property
    def imbalance(self) -> float:
        """The busiest EP rank's token copies over the mean (1 = balanced)."""
        per = rank_loads(self.loads, len(self.peer_tokens))
        return max(per) * len(per) / sum(per) if sum(per) else 1.0


def scenario_shares(ctx: JobContext) -> tuple[tuple[float, ...], int] | None:
    """Each routed expert's share of the token copies under the scenario's
    ``training.routing``, and the routing seed; None when balanced (``round_robin`` too: its
    loads are the balanced ones, only which experts a token picks together differs, which
    :mod:`sim.frameworks.megatron.moe_flex` counts). A measured histogram must
    have one load per routed expert (one line naming the key otherwise)."""
    r = ctx.scenario.training.routing
    moe = ctx.model.moe
    assert moe is not None
    if r.distribution in ("balanced", "round_robin"):
        return None
    hist = r.histogram
    assert not isinstance(hist, str)        # the scenario's validator read the file
    if hist is not None:
        ctx.require(len(hist) == moe.experts, "training.routing.histogram",
                    f"{len(hist)} per-expert loads for the model's {moe.experts} "
                    "routed experts")
    seed = r.seed if r.seed is not None else ctx.scenario.seed
    return routing_shares(moe.experts, r.distribution, r.s, hist, seed), seed


def priced_ranks(ctx: JobContext, lay: MoELayout, tokens: int, cm: ComputeModel,
                 loads: Sequence[int], peers: Sequence[Sequence[float]] = ()
                 ) -> tuple[tuple[MoELayerOps, BlockCost], ...]:
    """Every EP rank's layer ops and priced expert block under per-expert ``loads`` (rank
    ``j`` holds the ``j``-th run of ``len(loads) / ep`` experts); ``peers``, when given, the
    copies from EP rank to EP rank (row: sender). Ranks with the same counts share one
    pricing, the first such rank's."""
    local = len(loads) // lay.ep
    priced: dict[tuple[int, ...], tuple[MoELayerOps, BlockCost]] = {}
    out = []
    for j in range(lay.ep):
        counts = tuple(loads[j * local:(j + 1) * local])
        if counts not in priced:
            ops = moe_layer_ops(ctx.model, lay, tokens, tokens_per_expert=counts,
                                send_tokens=peers[j] if peers else None,
                                recv_tokens=[row[j] for row in peers] if peers else None,
                                ep_rank=j)
            priced[counts] = (ops, price_block(ops.experts, STYLE, cm))
        out.append(priced[counts])
    return tuple(out)


def busiest(priced: Sequence[tuple[MoELayerOps, BlockCost]]) -> int:
    """The EP rank whose experts take longest (forward + backward; the first on a tie)."""
    return max(range(len(priced)),
               key=lambda j: priced[j][1].fwd_gpu_s + priced[j][1].bwd_gpu_s)


def routing_pace(ctx: JobContext, lay: MoELayout, tokens: int, cm: ComputeModel,
                 capacity: int | None = None) -> Pace | None:
    """The busiest EP rank's layer ops under the scenario's ``training.routing``, or None
    when every EP rank gets the same load (balanced routing, or a skew that evens out over
    each rank's experts): then the balanced program is exactly today's. ``capacity``: the
    copies each source keeps per expert when the router drops tokens (None: dropless)."""
    routed = scenario_shares(ctx)
    if routed is None:
        return None
    shares, _ = routed
    moe = ctx.model.moe
    assert moe is not None
    sources = lay.ep * lay.etp
    loads = expert_loads(tokens * sources, moe.top_k, shares)
    if capacity is not None:
        # Token dropping (Megatron's moe_expert_capacity_factor without padding): each source
        # keeps at most ``capacity`` copies per expert (apply_router_token_dropping).
        loads = tuple(min(x, capacity * sources) for x in loads)
    per_rank = rank_loads(loads, lay.ep)
    if len(set(per_rank)) == 1 and len(set(loads)) == 1:
        return None
    peers = peer_tokens(loads, lay.ep, sources)
    priced = priced_ranks(ctx, lay, tokens, cm, loads, peers)
    j = busiest(priced)
    ops, cost = priced[j]
    return Pace(loads=loads, rank=j, ops=ops, experts=cost, peer_tokens=peers)
