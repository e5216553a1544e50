"""Megatron-Core's ``flex`` token dispatcher with the DeepEP backend: the fused dispatch and
combine of DeepEP's normal (high-throughput) kernels, laid out on the fabric.

``MoEFlexTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``) runs one
communication group over expert-TP x EP (``tp_ep_group``; the routing map is replicated over
expert-TP, so a token goes to every expert-TP rank of a chosen expert, ``router_topk = tp x
topk``) and hands it to ``_DeepepManager``: ``fused_dispatch`` / ``fused_combine``
(``fused_a2a.py``) call DeepEP's ``Buffer.dispatch`` / ``Buffer.combine``. Unlike the
``alltoall`` dispatcher there is no permutation before the send, no separate all-to-all of
the probs (they travel with the tokens as ``topk_weights``) and no expert-TP all-gather.

What goes on the wire (deepseek-ai/DeepEP, ``docs/legacy.md`` "Normal kernels with NVLink and
RDMA forwarding"; ``csrc/kernels/legacy/internode.cu``):

* a token is sent **once per destination rank**, not once per chosen expert
  (``get_dispatch_layout``: ``is_token_in_rank``); the receiving rank permutes it to its local
  experts (``get_permuted_hidden_states_by_experts``);
* **inside one node** (at most 8 ranks, ``intranode.cu``) each rank sends over NVLink to each
  rank holding one of the token's experts;
* **across nodes** (``internode.cu``: group rank r is NVLink rank ``r % 8`` of RDMA rank
  ``r // 8``; ``SourceMeta`` carries 8 NVLink-peer bits): a token crosses the network **once
  per destination node**, to the GPU with the same local index (same rail, no PXN hop), which
  forwards it over NVLink to the ranks of that node that hold its experts. The two legs run as
  one pipelined kernel (RDMA senders, forwarders and NVLink receivers on their own SMs), so
  here they are one all-to-all whose per-peer matrix (``Op.peer_bytes``) holds both legs'
  flows at once: rail peers on other nodes get the deduplicated RDMA bytes, NVLink peers the
  forwarded bytes. The combine runs the same flows backwards, each forwarder summing its
  node's expert outputs before the RDMA leg (``internode::combine``), the source summing the
  nodes' partial sums;
* per token and destination: the hidden row, ``SourceMeta`` (two ints), ``topk_idx`` (int32)
  and ``topk_weights`` (fp32) for the token's ``router_topk`` entries
  (``get_num_bytes_per_token``, 16-byte aligned); in FP8 (DeepEP's ``x`` as a tuple of an
  e4m3 tensor and ``[tokens, hidden // 128]`` fp32 scales) 1 byte per element plus 4 bytes
  per 128. The combine returns the 16-bit row (and, for the dispatch's backward, the probs'
  gradient).

The expected bytes under balanced routing are closed forms (:func:`miss_probability`): a
token picks ``top_k`` distinct experts uniformly; with group-limited routing
(``moe_router_num_groups`` / ``moe_router_group_topk``, DeepSeek-V3's node-limited routing:
8 groups, 4 of them per token, arXiv:2412.19437 section 2.1.2) it first picks
``group_topk`` of the equal expert groups, then ``top_k`` experts among theirs. Experts are
laid out contiguously over the EP ranks (expert ``e`` on EP rank ``e // (experts / ep)``).
Under skewed routing (``training.routing``) the same per-peer layout is counted from an
explicit, seeded routing of every token (:mod:`sim.frameworks.megatron.moe_flex_skew`).

The fused kernels hold ``moe_flex_dispatcher_num_sms`` SMs (Megatron-Core sets DeepEP's
``Buffer.set_num_sms`` to 20 when unset, ``_DeepepManager.__init__``) for their whole run:
the engine's interference model (:mod:`sim.hardware.interference`) takes them from any
compute beside the dispatch (``Op.sm_ctas``), and they copy the data themselves: their count
and DeepEP's share of NVLink bound each GPU's NVLink sends
(:mod:`sim.fabric.collectives.fused_kernel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.moe_flex_skew import FlexSkew, deepep_matrix, scenario_skew
from sim.frameworks.megatron.moe_memory import CATEGORY
from sim.program.ir import Op
from sim.program.mesh import Groups
from sim.scenario import MegatronOptions
from sim.workload.kernels import drop_kernels
from sim.workload.moe_ops import MoELayerOps
from sim.workload.routing import round_robin_hit

DEEPEP_NUM_SMS = 20
"""SMs of DeepEP's normal kernels when ``moe_flex_dispatcher_num_sms`` is unset: Megatron-Core's
``_DeepepManager`` passes 20 to ``Buffer.set_num_sms`` ("DeepEP's historical mcore default";
DeepEP's own ``Buffer.num_sms`` default is 20 too, ``deep_ep/buffers/legacy.py``)."""
NVL_PEERS = 8
"""GPUs per NVLink domain DeepEP's normal kernels address (``LEGACY_NUM_MAX_NVL_PEERS``:
``SourceMeta`` holds one bit per NVLink peer)."""
FP8_BLOCK = 128
"""Elements per FP8 scale: DeepEP takes FP8 tokens as (e4m3 ``[tokens, hidden]``, fp32
``[tokens, hidden // 128]``), DeepSeek-V3's 1x128 activation tiles (arXiv:2412.19437 3.3.2)."""
SOURCE_META = 8
"""``internode::SourceMeta``: the source RDMA rank and the NVLink-peer bits, two ints."""
ALIGN = 16
"""``get_num_bytes_per_token`` rounds each token's record up to an ``int4``."""
# Buffer.get_dispatch_config / get_combine_config (deep_ep/buffers/legacy.py): per group size,
# (NVLink receive tokens a channel, RDMA receive tokens a channel); fused_a2a.get_buffer
# allocates the larger of the two configs' buffers. Other group sizes are refused there
# ("Unsupported number of EP ranks").
DEEPEP_CONFIGS = {2: ((256, 128), (256, 128)), 4: ((256, 128), (256, 128)),
                  8: ((256, 128), (256, 128)), 16: ((288, 128), (288, 128)),
                  24: ((288, 128), (288, 128)), 32: ((288, 128), (288, 128)),
                  48: ((288, 128), (288, 128)), 64: ((288, 128), (288, 128)),
                  96: ((480, 128), (480, 128)), 128: ((560, 128), (560, 128)),
                  144: ((720, 128), (720, 128)), 160: ((720, 128), (720, 128))}
MAX_TOPK = MAX_SCALES = 128
"""``Config``'s buffer hints reserve room for 128 top-k entries and 128 scales a token."""
TOPK_IDX = 8
"""``topk_idx_t``: 64-bit by default (``EP_NUM_TOPK_IDX_BITS``)."""


def persistent_buffer_bytes(ranks: int, hidden: int, num_sms: int) -> float:
    """DeepEP's ``Buffer`` (NVLink plus RDMA bytes) for a group of ``ranks`` as Megatron-Core
    allocates it once per process (``fused_a2a.get_buffer``: hidden bytes ``hidden x 2``, the
    larger of the dispatch and combine configs' ``get_nvl_buffer_size_hint`` /
    ``get_rdma_buffer_size_hint``, ``csrc/legacy/config.hpp``; ``num_sms / 2`` channels).

    Examples
    --------
    >>> round(persistent_buffer_bytes(64, 7168, 20) / 2**20)     # DeepSeek-V3, EP 64
    681
    """
    hb = hidden * 2
    channels = num_sms // 2
    rdma_ranks = max(ranks // NVL_PEERS, 1)
    nvl_ranks = min(ranks, NVL_PEERS)
    per_token = hb + SOURCE_META + MAX_TOPK * (TOPK_IDX + 4) + MAX_SCALES * 4
    nvl = rdma = 0
    for nvl_tokens, rdma_tokens in DEEPEP_CONFIGS[ranks]:
        n = channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_tokens * per_token)
        nvl = max(nvl, -(-n // 128) * 128)
        if ranks > NVL_PEERS:
            r = channels * rdma_ranks * ((NVL_PEERS * 2 + 2) * 2 * 4
                                         + rdma_tokens * 2 * (per_token + 16))
            rdma = max(rdma, -(-r // 128) * 128)
    return float(nvl + rdma)


def dispatch_elem_bytes(fp8: bool) -> float:
    """Wire bytes per hidden element of a dispatched token: 2 (bf16), or 1 plus one fp32 scale
    per 128 elements with FP8 dispatch.

    Examples
    --------
    >>> dispatch_elem_bytes(False), dispatch_elem_bytes(True)
    (2.0, 1.03125)
    """
    return 1.0 + 4.0 / FP8_BLOCK if fp8 else 2.0


def token_bytes(hidden: int, topk: int, elem: float, weights: bool = True,
                meta: bool = True) -> float:
    """One token's record to one destination: the row (``hidden x elem`` bytes), and with
    ``meta`` the ``SourceMeta``, ``topk`` int32 indices and (``weights``) fp32 weights, rounded
    up to 16 bytes (``get_num_bytes_per_token``); without ``meta`` (a combine's record) the
    row and, with ``weights``, the weights' gradient.

    Examples
    --------
    >>> token_bytes(7168, 8, 2.0)                  # V3, bf16: 14336 + 8 + 32 + 32, to 16
    14416.0
    >>> token_bytes(7168, 8, dispatch_elem_bytes(True))   # FP8: 7168 + 224 + 72, to 16
    7472.0
    >>> token_bytes(7168, 8, 2.0, weights=False, meta=False)
    14336.0
    """
    extra = (SOURCE_META + 4 * topk if meta else 0) + (4 * topk if weights else 0)
    raw = hidden * elem + extra
    return float(math.ceil(raw / ALIGN) * ALIGN)


@lru_cache(maxsize=4096)
def miss_probability(experts: int, top_k: int, members: tuple[int, ...], groups: int = 1,
                     group_topk: int = 1) -> float:
    """Probability that a token's ``top_k`` experts include none of ``members`` (expert
    indices), under balanced routing: with ``groups`` > 1 it first picks ``group_topk`` of the
    ``groups`` equal contiguous expert groups uniformly, then ``top_k`` distinct experts
    uniformly among theirs; else ``top_k`` of all experts.

    Exact (hypergeometric): over the groups ``members`` touch, the number ``i`` of them
    chosen and the members ``a`` they hold, ``P(miss) = sum C(G - c, M - i) / C(G, M) x
    C(M s - a, k) / C(M s, k)`` (``s`` experts a group, ``c`` groups touched).

    Examples
    --------
    >>> round(miss_probability(256, 8, tuple(range(32))), 4)     # one node of 8, no limit
    0.3382
    >>> round(miss_probability(256, 8, tuple(range(32)), 8, 4), 4)  # node-limited (V3)
    0.5464
    >>> miss_probability(8, 2, (0,))                 # Mixtral: 1 - 2/8
    0.75
    >>> round(miss_probability(256, 8, tuple(range(160)), 8, 4), 5)  # 5 of 8 groups touched
    0.00795
    """
    if groups <= 1:
        groups, group_topk = 1, 1
    size = experts // groups
    pool = group_topk * size
    per_group: dict[int, int] = {}
    for e in members:
        per_group[e // size] = per_group.get(e // size, 0) + 1
    touched = len(per_group)
    # ways[i][a]: subsets of the touched groups with i groups holding a members in all.
    ways: list[dict[int, int]] = [{0: 1}]
    for count in per_group.values():
        nxt: list[dict[int, int]] = [dict(w) for w in ways] + [{}]
        for i, row in enumerate(ways):
            for a, w in row.items():
                nxt[i + 1][a + count] = nxt[i + 1].get(a + count, 0) + w
        ways = nxt
    total = math.comb(groups, group_topk)
    denom = math.comb(pool, top_k)
    p = 0.0
    for i, row in enumerate(ways):
        if i > group_topk:   # a token's groups hold at most group_topk touched ones
            break
        pick = math.comb(groups - touched, group_topk - i)
        if pick == 0:
            continue
        for a, w in row.items():
            p += w * pick / total * math.comb(pool - a, top_k) / denom
    return p


@dataclass(frozen=True)
class FlexLayout:
    """The expert-TP x EP group as DeepEP sees it, and the routing that fills it.

    ``ranks``: the group's global ranks in group order (expert-TP fastest, as
    ``tp_ep_group``); ``gpus_per_node``: the cluster's. Group rank ``r`` holds the experts of
    EP rank ``r // etp``."""

    ranks: tuple[int, ...]
    gpus_per_node: int
    experts: int
    top_k: int
    ep: int
    etp: int
    groups: int = 1
    group_topk: int = 1
    round_robin: bool = False
    """``training.routing`` ``round_robin`` (AutoModel's fake balanced gate): each token's
    experts are ``top_k`` consecutive ones, not a uniform draw (group limits do not apply)."""

    def check(self) -> str | None:
        """Why DeepEP's normal kernels cannot run on this group, or None. Intranode: all
        ranks on one node, at most 8 (``intranode.cu``); internode: 8 ranks per node, group
        ranks ``8n .. 8n+7`` on node ``n`` (``internode.cu``: NVLink rank ``r % 8``)."""
        nodes = [r // self.gpus_per_node for r in self.ranks]
        n = len(self.ranks)
        if n not in DEEPEP_CONFIGS:
            return (f"DeepEP's normal kernels have no config for a {n}-rank expert-TP x EP "
                    f"group (Buffer.get_dispatch_config: {sorted(DEEPEP_CONFIGS)})")
        if n <= NVL_PEERS and len(set(nodes)) == 1:
            return None
        if n % NVL_PEERS:
            return (f"the flex dispatcher's DeepEP kernels need the {n}-rank expert-TP x EP "
                    f"group inside one node of at most {NVL_PEERS} GPUs, or {NVL_PEERS} GPUs "
                    "of each of several nodes")
        for b in range(0, n, NVL_PEERS):
            block = set(nodes[b:b + NVL_PEERS])
            if len(block) != 1 or any(x in block for x in nodes[:b]):
                return (f"DeepEP's internode kernels need group ranks {b}..{b + NVL_PEERS - 1} "
                        f"on one node of their own ({NVL_PEERS} GPUs of each node in the "
                        "expert-TP x EP group, in rank order)")
        return None

    def _experts_of(self, members: Sequence[int]) -> tuple[int, ...]:
        local = self.experts // self.ep
        slots = sorted({m // self.etp for m in members})
        return tuple(e for s in slots for e in range(s * local, (s + 1) * local))

    def hit(self, members: Sequence[int]) -> float:
        """Probability that a token goes to at least one of the group ranks ``members``."""
        if self.round_robin:
            return round_robin_hit(self.experts, self.top_k, self._experts_of(members))
        return 1.0 - miss_probability(self.experts, self.top_k, self._experts_of(members),
                                      self.groups, self.group_topk)

    @property
    def internode(self) -> bool:
        return len({r // self.gpus_per_node for r in self.ranks}) > 1

    def node_blocks(self) -> list[tuple[int, ...]]:
        """Group ranks per node (one block when intranode)."""
        n = NVL_PEERS if self.internode else len(self.ranks)
        return [tuple(range(b, b + n)) for b in range(0, len(self.ranks), n)]

    def expected_nodes(self) -> float:
        """Expected distinct destination nodes of one token."""
        return sum(self.hit(b) for b in self.node_blocks())

    def tokens_matrix(self, tokens: float) -> tuple[tuple[float, ...], ...]:
        """Expected tokens each group rank sends to each other (row: sender) in one dispatch
        of ``tokens`` tokens per rank: rail peers on other nodes the tokens that node needs
        (once per node), NVLink peers in the node what the forwarder relays (the tokens of
        every node's same-rail rank, its own included, routed to that peer); the diagonal is
        a local copy."""
        blocks = self.node_blocks()
        nodes = len(blocks)
        node_hit = [self.hit(b) for b in blocks]
        rank_hit = [self.hit((r,)) for r in range(len(self.ranks))]
        return deepep_matrix(len(self.ranks), len(blocks[0]),
                             forward=lambda i, j: nodes * tokens * rank_hit[j],
                             rdma=lambda i, node: tokens * node_hit[node])


@dataclass(frozen=True)
class FlexPlan:
    """The byte matrices of one MoE layer's four fused transfers (one micro-batch, one rank
    of ``tokens``) and the SMs they hold.

    Keys as :class:`~sim.workload.moe_ops.MoELayerOps`'s all-to-alls: ``dispatch_fwd`` and
    ``combine_bwd`` (the output gradient dispatched again with the cached handle,
    ``FusedCombine.backward``: no indices nor weights) carry dispatch records, FP8 with
    ``fp8``; ``combine_fwd`` and ``dispatch_bwd`` (the tokens'
    gradient combined, with the probs' gradient, ``FusedDispatch.backward``) the 16-bit
    combine records along the transposed matrix."""

    layout: FlexLayout
    tokens: float
    hidden: int
    fp8: bool = False
    num_sms: int = DEEPEP_NUM_SMS
    skew: FlexSkew | None = None
    """Skewed routing: the routed tokens' counts (:mod:`~sim.frameworks.megatron.moe_flex_skew`)
    replace the balanced closed forms; None: balanced."""
    receiver: int | None = None
    """Skewed routing: the group rank whose received tokens size the per-micro-batch
    buffers (a rank class's own, :mod:`~sim.frameworks.megatron.moe_rank_memory`); None:
    the busiest receiver's."""

    @property
    def topk(self) -> int:
        """``router_topk`` of the DeepEP manager: top-k x expert-TP."""
        return self.layout.top_k * self.layout.etp

    def record_bytes(self, which: str) -> float:
        """Bytes per token per destination of transfer ``which``."""
        if which == "dispatch_fwd":
            return token_bytes(self.hidden, self.topk, dispatch_elem_bytes(self.fp8))
        if which == "combine_bwd":
            # FusedCombine.backward dispatches the gradient with the cached handle: no
            # indices nor weights, the row and SourceMeta only.
            return token_bytes(self.hidden, 0, dispatch_elem_bytes(self.fp8), weights=False)
        return token_bytes(self.hidden, self.topk, 2.0, weights=which == "dispatch_bwd",
                           meta=False)

    def peer_bytes(self, which: str) -> tuple[tuple[float, ...], ...]:
        """Transfer ``which``'s byte matrix over the group (row: sender)."""
        return _peer_bytes(self, which)

    def nbytes(self, which: str) -> float:
        """The op's size: the busiest sender's row."""
        return max(sum(row) for row in self.peer_bytes(which))

    @property
    def persistent_bytes(self) -> float:
        """DeepEP's ``Buffer`` on each rank (:func:`persistent_buffer_bytes`)."""
        return persistent_buffer_bytes(len(self.layout.ranks), self.hidden, self.num_sms)

    def rdma_bytes(self, which: str = "dispatch_fwd") -> float:
        """Bytes group rank 0 puts on the network in transfer ``which`` (0 intranode)."""
        if not self.layout.internode:
            return 0.0
        return sum(self.peer_bytes(which)[0][NVL_PEERS:])


CHUNK_SORT_KERNELS = frozenset({"sort_chunks", "sort_chunks.map", "sort_chunks.probs",
                                "sort_chunks.bwd", "unsort_chunks", "unsort_chunks.map",
                                "unsort_chunks.bwd"})
"""The ``alltoall`` dispatcher's chunk sort and unsort, which DeepEP's path never runs
(:func:`drop_chunk_sorts`)."""


def drop_chunk_sorts(ops: MoELayerOps) -> None:
    """Remove the ``alltoall`` dispatcher's chunk sort and unsort from one layer's experts
    block: with DeepEP, ``MoEFlexTokenDispatcher.dispatch_postprocess`` permutes the received
    tokens straight into local-expert order (``_DeepepManager.
    get_permuted_hidden_states_by_experts``: one TE ``moe_permute`` with its row-id map) and
    ``combine_preprocess`` unpermutes them once (``get_restored_hidden_states_by_experts``)
    before DeepEP's combine (Megatron-Core core_v0.14.0 ``token_dispatcher.py``,
    ``MoEFlexTokenDispatcher`` and ``_DeepepManager``). Those two copies are what the layer's
    ``router`` permutation and ``combine`` unpermutation already price (the same rows under
    balanced routing: a token's copies to its local experts); the source-rank to
    local-expert ``sort_chunks_by_idxs`` pair of the ``alltoall`` dispatcher has no
    counterpart, so it goes, with the saved maps only it reads.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.workload.model import ModelSpec
    >>> from sim.workload.moe_ops import MoELayout, moe_layer_ops
    >>> ops = moe_layer_ops(ModelSpec.from_ref("qwen3-30b-a3b"), MoELayout(ep=8), 4096.0)
    >>> any(k.name in CHUNK_SORT_KERNELS for k in ops.experts.forward)
    True
    >>> drop_chunk_sorts(ops)
    >>> any(k.name in CHUNK_SORT_KERNELS for k in ops.experts.forward + ops.experts.backward)
    False
    """
    drop_kernels(ops.experts, CHUNK_SORT_KERNELS)


@lru_cache(maxsize=256)
def _matrix(layout: FlexLayout, tokens: float) -> tuple[tuple[float, ...], ...]:
    return layout.tokens_matrix(tokens)


@lru_cache(maxsize=256)
def _peer_bytes(plan: FlexPlan, which: str) -> tuple[tuple[float, ...], ...]:
    """One matrix object per plan and transfer: the collective runner caches its flows by the
    matrix's identity."""
    m = plan.skew.matrix() if plan.skew is not None else _matrix(plan.layout, plan.tokens)
    if which in ("combine_fwd", "dispatch_bwd"):
        m = tuple(zip(*m, strict=True))
    per = plan.record_bytes(which)
    return tuple(tuple(x * per for x in row) for row in m)


def check_router_groups(ctx: JobContext) -> tuple[int, int]:
    """Group-limited routing's (groups, groups per token), (1, 1) without it, refused as
    Megatron-Core's ``TransformerConfig.__post_init__`` refuses it (groups needed with
    ``moe_router_group_topk``, experts divisible by them, at most all of them picked) and
    where a token could not find ``top_k`` experts in its groups."""
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    moe = ctx.model.moe
    assert moe is not None
    g, m = opts.moe_router_num_groups, opts.moe_router_group_topk
    if m is None:
        return 1, 1
    key = "framework.moe_router_group_topk"
    ctx.require(g is not None, key, "group-limited routing needs moe_router_num_groups "
                "(Megatron-Core TransformerConfig)")
    assert g is not None
    ctx.require(moe.experts % g == 0, "framework.moe_router_num_groups",
                f"{moe.experts} experts do not split into {g} equal groups")
    ctx.require(m <= g, key, f"moe_router_group_topk ({m}) above moe_router_num_groups ({g})")
    ctx.require(moe.top_k <= m * (moe.experts // g), key,
                f"{m} groups of {moe.experts // g} experts hold fewer than top-k "
                f"({moe.top_k}) experts")
    return g, m


L = TypeVar("L", bound=FlexLayout)


def checked_layouts(ctx: JobContext, groups: Sequence[Groups],
                    make: Callable[[tuple[int, ...]], L]) -> L:
    """The layout ``make`` gives every expert-TP x EP group of every pipeline stage, each
    refused (``parallelism.ep``) where its kernels cannot run it; the first one."""
    first: L | None = None
    for stage in groups:
        for g in stage:
            lay = make(tuple(g))
            why = lay.check()
            ctx.require(why is None, "parallelism.ep", why or "")
            first = first or lay
    assert first is not None
    return first


def flex_plan(ctx: JobContext, groups: Sequence[Groups], tokens: float) -> FlexPlan:
    """The DeepEP layout of a Megatron job whose expert-TP x EP groups (every pipeline
    stage's) are ``groups``, ``tokens`` per rank entering each MoE layer; refuses what
    Megatron-Core and DeepEP refuse."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, MegatronOptions)
    moe = ctx.model.moe
    assert moe is not None
    key = "framework.moe_token_dispatcher_type"
    par = s.parallelism
    ctx.require(par.ep * par.expert_tp > 1, key,
                "the flex dispatcher with DeepEP needs expert-TP x EP > 1 (Megatron-Core "
                "MoEFlexTokenDispatcher)")
    ctx.require(not opts.moe_pad_expert_input_to_capacity,
                "framework.moe_pad_expert_input_to_capacity",
                "the flex dispatcher with DeepEP does not pad to capacity (Megatron-Core "
                "TransformerConfig)")
    ctx.require(ctx.gpu.arch in ("ampere", "hopper", "blackwell"), key,
                "DeepEP runs on Ampere, Hopper and Blackwell GPUs (Megatron-Bridge "
                f"validate_deepep), not {ctx.gpu.arch}")
    ctx.require(s.training.routing.distribution in ("balanced", "round_robin")
                or moe.capacity_factor is None,
                "model.capacity_factor", "token dropping under skewed routing is not "
                "modelled with the flex dispatcher (dropless only)")
    ctx.require(moe.capacity_factor is None or moe.capacity_factor >= 1.0,
                "model.capacity_factor", "token dropping below the balanced share is not "
                "modelled with the flex dispatcher")
    sms = opts.moe_flex_dispatcher_num_sms or DEEPEP_NUM_SMS
    ctx.require(sms % 2 == 0 and sms < ctx.gpu.sm_count,
                "framework.moe_flex_dispatcher_num_sms",
                f"DeepEP takes an even SM count below the GPU's {ctx.gpu.sm_count} "
                "(Buffer.set_num_sms)")
    ctx.require(not opts.moe_deepep_fp8_dispatch or s.training.precision == "fp8",
                "framework.moe_deepep_fp8_dispatch",
                "FP8 dispatch feeds FP8 expert GEMMs: it needs training.precision fp8")
    ng, m = check_router_groups(ctx)
    return deepep_plan(ctx, groups, tokens, par.expert_tp, (ng, m),
                       opts.moe_deepep_fp8_dispatch, sms)


def deepep_plan(ctx: JobContext, groups: Sequence[Groups], tokens: float, etp: int = 1,
                router_groups: tuple[int, int] = (1, 1), fp8: bool = False,
                num_sms: int = DEEPEP_NUM_SMS) -> FlexPlan:
    """DeepEP's normal kernels over the expert-TP x EP ``groups`` (every pipeline stage's),
    ``tokens`` per rank entering each MoE layer, whichever framework calls them (Megatron-
    Core's flex dispatcher, NeMo AutoModel's copy of it): each group refused where the
    kernels cannot run it; the scenario's ``training.routing`` fills the layout."""
    s = ctx.scenario
    moe = ctx.model.moe
    assert moe is not None
    ep = s.parallelism.ep
    ng, m = router_groups
    rr = s.training.routing.distribution == "round_robin"
    first = checked_layouts(ctx, groups, lambda g: FlexLayout(
        g, s.cluster.gpus_per_node, moe.experts, moe.top_k, ep, etp, ng, m, rr))
    # Every group has the same shape (check): one layout, on relative ranks.
    rel = FlexLayout(tuple(range(len(first.ranks))), NVL_PEERS if first.internode
                     else len(first.ranks), moe.experts, moe.top_k, ep, etp, ng, m, rr)
    skew = scenario_skew(ctx, int(tokens), len(rel.node_blocks()[0]), ng, m)
    return FlexPlan(rel, float(tokens), ctx.model.hidden, fp8, num_sms, skew)


def flex_op(coll: Callable[..., Op], plan: FlexPlan, which: str, label: str, groups: Groups,
            mb: int, layer: int) -> Op | None:
    """DeepEP's fused transfer ``which`` over the expert-TP x EP ``groups`` (None for the
    probs' all-to-alls of the alltoall path: the probs travel with the tokens), made by the
    builder's collective factory ``coll``."""
    if "probs" in which:
        return None
    fp8 = plan.fp8 and which in ("dispatch_fwd", "combine_bwd")
    op = coll(f"{label} {which.replace('_', ' ')}", "all_to_all", groups, plan.nbytes(which),
              "f8e4m3" if fp8 else "bf16", "ep", mb, layer)
    op.peer_bytes = plan.peer_bytes(which)
    op.sm_ctas = plan.num_sms
    return op


def attach_flex(plan: FlexPlan, ops: list[Op], backward: bool, label: str) -> None:
    """DeepEP's per-micro-batch buffers of one layer on its ops (the ``moe_dispatch`` memory
    category, as :mod:`sim.frameworks.megatron.moe_memory` does for ``alltoall``).

    The dispatch reads the layer's input in place and returns ``recv_x`` (the tokens this
    rank receives, once each, with their indices and weights), which the permutation reads
    (freed after the experts); the experts' output, restored to one row per received token
    (``get_restored_hidden_states_by_experts``), is the combine's input (freed when it
    ends); the combined ``[tokens, hidden]`` output is the unpermutation's. Backward: the
    same for the output gradient (dispatched again) and the input gradient (combined with
    the probs' gradient). DeepEP's persistent NVLink and RDMA buffers (``Buffer``, sized by
    its config hints once per process) are the stage's ``buffers`` from the start
    (:attr:`FlexPlan.persistent_bytes`)."""

    def add(op: Op | None, field: str, nbytes: float) -> None:
        if op is not None and nbytes > 0:
            setattr(op, field, (*getattr(op, field), (CATEGORY, nbytes)))

    def find(name: str) -> Op | None:
        return next((o for o in ops if o.name == label + name), None)

    lay = plan.layout
    # Under skew the busiest receiver's tokens (memory is the worst rank's), or the class's.
    recv = (plan.skew.received(plan.receiver) if plan.skew is not None
            else len(lay.ranks) * plan.tokens * lay.hit((0,)))
    disp = plan.record_bytes("combine_bwd" if backward else "dispatch_fwd")
    rows = recv * plan.hidden * 2.0
    out = plan.tokens * plan.hidden * 2.0 + (plan.tokens * plan.topk * 4.0 if backward else 0)
    first, experts, second = (find(" combine") if backward else find(" router"),
                              find(" experts"),
                              find(" dispatch bwd") if backward else find(" combine fwd"))
    last = find(" router") if backward else find(" combine")
    if None in (first, experts, second, last):
        return
    add(first, "alloc", recv * disp)
    add(experts, "free", recv * disp)
    add(experts, "alloc", rows + out)
    add(second, "free", rows)
    add(last, "free", out)
