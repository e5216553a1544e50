"""Megatron-Core's ``flex`` token dispatcher with the HybridEP backend
(``moe_flex_dispatcher_backend: hybridep``): NVIDIA's Hybrid-EP kernels, laid out on the
fabric.

``MoEFlexTokenDispatcher`` hands the expert-TP x EP group to ``_HybridEPManager``
(``megatron/core/transformer/moe/token_dispatcher.py``), whose dispatch and combine are
``HybridEPBuffer.dispatch_with_permute`` / ``combine_with_unpermute``
(``transformer/moe/fused_a2a.py``; deepseek-ai/DeepEP branch ``hybrid-ep``,
``deep_ep/hybrid_ep_buffer.py``, ``docs/Hybrid-EP_Implementation.md``). What differs from
DeepEP's normal kernels (:mod:`sim.frameworks.megatron.moe_flex`, whose closed forms and
per-peer layout this module reuses):

* **NVLink domains, not 8-GPU nodes.** Group rank ``r`` is local rank ``r % D`` of NVLink
  domain ``r // D``, ``D`` = ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``, which
  Megatron-Bridge's launcher sets to ``min(ep, 8)`` on H100 / B200 and to ``ep`` (at most 72)
  on GB200 NVL72 (``scripts/performance/perf_plugins.py`` ``_set_nvl_domain_size`` at
  74695a06d): on a GB200 rack an EP 32 group is one domain and every token goes over
  NVLink, once per destination rank. Across domains a token crosses the network **once per
  destination domain**, to the peer GPU of the same local rank, whose RDMA warp group hands
  it to the S2G warp groups that write it over NVLink to the ranks of that domain holding
  its experts ("Similar to DeepEP, Hybrid-EP first performs IB communication between peer
  GPUs, then each rank distributes the received inter-node data locally", section 8).
* **Records.** A token carries its 16-bit row and the fp32 probabilities of the experts it
  may reach there: the destination rank's local experts over NVLink, the whole domain's
  over RDMA (``prob_buffer`` / ``rdma_prob_buffer``, section 4.2); no ``SourceMeta`` nor
  top-k indices (the routing map stays in the handle). The combine sends rows only; the
  dispatch's backward (a combine) adds the probabilities' gradient; the combine's backward
  dispatches the gradient with the cached handle, without probabilities.
* **No FP8 dispatch.** ``init_hybrid_ep_buffer`` asserts ``not fp8_dispatch`` ("HybridEP
  dispatcher does not support fp8 dispatch now") and the dispatch passes
  ``fp8_dispatch = False``: FP8 runs send 16-bit tokens.
* **SMs.** ``moe_flex_dispatcher_num_sms`` (Megatron-Core passes it as both
  ``num_sms_dispatch_api`` and ``num_sms_combine_api``; Megatron-Bridge's performance
  scripts set 32, ``utils/overrides.py`` at 74695a06d), else Hybrid-EP's own default: 24 in
  one NVLink domain, 8 across domains (``csrc/hybrid_ep/config.cuh`` ``Configurer``; 32 / 8
  before 2026-03-31). Every block sends with TMA (:mod:`sim.fabric.collectives.hybridep_kernel`).
* **Buffers.** One buffer a process, allocated for the worst case (every token to one
  rank): ``max_tokens = tokens_per_rank x group size`` rows and probabilities, plus RDMA
  staging across domains, each RDMA buffer capped at 1 GB, shared by dispatch and combine
  (section 4.2-4.3; :func:`persistent_buffer_bytes`).

Before each dispatch ``metadata_preprocess`` all-gathers every rank's routing map over the
group (:attr:`HybridEPPlan.routing_map_bytes`, the op Megatron's other dispatchers use for
their token counts) and the dispatch sizes its output with a device-to-host synchronisation
unless the permuted count is known (``non_blocking``), as DeepEP's dispatch waits for its
counts: the combined 1F1B treats both alike. Not modelled: the metadata-scan kernel's time
(``num_sms_preprocessing_api``), the multi-domain copy into the RDMA buffer, and HybridEP
with token drop and padding (refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.moe_flex import (
    FlexLayout,
    FlexPlan,
    check_router_groups,
    checked_layouts,
    flex_op,
)
from sim.frameworks.megatron.moe_flex_skew import scenario_skew
from sim.program.ir import Op
from sim.program.mesh import Groups
from sim.scenario import MegatronOptions
from sim.workload.kernels import drop_kernels
from sim.workload.moe_ops import MoELayerOps

SMS_ONE_DOMAIN = 24
"""Hybrid-EP's dispatch / combine blocks in one NVLink domain when unset
(``csrc/hybrid_ep/config.cuh`` ``Configurer``: ``(num_of_nodes == 1) ? 24 : 8``)."""
SMS_DOMAINS = 8
"""... and across NVLink domains ("Inter-node case should use less SMs")."""
MAX_DOMAIN = 72
"""Largest NVLink domain Megatron-Bridge's launcher gives Hybrid-EP (GB200 / GB300 NVL72:
``assert ep_size <= 72``, ``perf_plugins.py`` ``_set_nvl_domain_size``)."""
MIN_BUFFER_TOKENS = 512
"""``Configurer``: ``max(max_num_of_tokens_per_rank, 512)`` ..."""
TOKEN_CHUNK = 64
"""... padded to the combine's chunk of 64 tokens (``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``)."""
RDMA_BUFFER_CAP = float(2**30)
""""Per RDMA buffer footprint is capped at <=1 GB" (``Hybrid-EP_Implementation.md`` 4.2)."""
PROB = 4
"""Hybrid-EP takes fp32 probabilities ("HybridEP only supports float32 probs")."""


def persistent_buffer_bytes(ranks: int, domain: int, tokens: float, hidden: int,
                            local_experts: int) -> float:
    """Hybrid-EP's buffer on each rank (``Hybrid-EP_Implementation.md`` 4.2, BF16, shared by
    dispatch and combine): ``max_tokens = tokens_per_rank x ranks`` rows of ``hidden x 2``
    bytes and of ``local_experts x domain`` fp32 probabilities; across ``ranks / domain``
    domains an RDMA row and probability buffer of ``tokens_per_rank x (domains - 1)``
    entries, each at most 1 GB. ``tokens_per_rank`` is the layer input's rows (at least 512,
    padded to 64).

    Examples
    --------
    >>> round(persistent_buffer_bytes(64, 64, 4096, 7168, 4) / 2**30, 2)   # doc: ~3.75 GB
    3.75
    >>> round(persistent_buffer_bytes(64, 8, 4096, 7168, 4) / 2**30, 2)    # 8 x 8: ~4 GB
    3.92
    """
    per_rank = math.ceil(max(tokens, MIN_BUFFER_TOKENS) / TOKEN_CHUNK) * TOKEN_CHUNK
    max_tokens = per_rank * ranks
    probs = local_experts * domain * PROB
    total = max_tokens * (hidden * 2.0 + probs)
    domains = ranks // domain
    if domains > 1:
        rows = per_rank * (domains - 1)
        total += min(rows * hidden * 2.0, RDMA_BUFFER_CAP) + min(rows * probs, RDMA_BUFFER_CAP)
    return float(total)


@dataclass(frozen=True)
class HybridEPLayout(FlexLayout):
    """The expert-TP x EP group as Hybrid-EP sees it: ``domain`` consecutive group ranks an
    NVLink domain (``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``)."""

    domain: int = 8

    def check(self) -> str | None:
        """Why Hybrid-EP cannot run on this group, or None: the group splits into NVLink
        domains of ``domain`` ranks (``hybrid_ep_buffer.py``: "The number of ranks ... should
        be divisible by the number of ranks per node"), each domain's ranks on one node of
        their own, at most 72 ranks a domain."""
        n = len(self.ranks)
        d = self.domain
        if d > MAX_DOMAIN:
            return (f"HybridEP's NVLink domain holds at most {MAX_DOMAIN} ranks (Megatron-Bridge "
                    f"perf_plugins: GB200 NVL72), not {d}")
        if n % d:
            return (f"HybridEP needs the {n}-rank expert-TP x EP group split into NVLink "
                    f"domains of {d} ranks (hybrid_ep_buffer.py)")
        nodes = [r // self.gpus_per_node for r in self.ranks]
        for b in range(0, n, d):
            block = set(nodes[b:b + d])
            if len(block) != 1 or any(x in block for x in nodes[:b]):
                return (f"HybridEP needs group ranks {b}..{b + d - 1} in one NVLink domain "
                        f"of their own ({d} GPUs of each domain in the expert-TP x EP group, "
                        "in rank order)")
        return None

    @property
    def internode(self) -> bool:
        return len(self.ranks) > self.domain

    def node_blocks(self) -> list[tuple[int, ...]]:
        """Group ranks per NVLink domain."""
        d = self.domain
        return [tuple(range(b, b + d)) for b in range(0, len(self.ranks), d)]


@dataclass(frozen=True)
class HybridEPPlan(FlexPlan):
    """The byte matrices of one MoE layer's four Hybrid-EP transfers (one micro-batch, one
    rank of ``tokens``); BF16 only (``fp8`` stays False)."""

    @property
    def local_experts(self) -> int:
        return self.layout.experts // self.layout.ep

    @property
    def domain(self) -> int:
        lay = self.layout
        return lay.domain if isinstance(lay, HybridEPLayout) else len(lay.node_blocks()[0])

    @property
    def routing_map_bytes(self) -> float:
        """Bytes of this rank's routing map (``[tokens, experts x expert-TP]`` bool) that
        Hybrid-EP's ``metadata_preprocess`` all-gathers over the group before each dispatch
        (``Hybrid-EP_Implementation.md`` section 5: "Allgather + metadata kernel + permute
        preprocessing"; an NCCL all-gather unless ``enable_custom_allgather``); the dispatch
        then waits for the scan on the host unless the permuted count is known."""
        return self.tokens * self.layout.experts * self.layout.etp

    def record_bytes(self, which: str, rdma: bool = False) -> float:
        """Bytes per token per destination of transfer ``which``: the 16-bit row, with the
        fp32 probabilities (or their gradient) of the destination rank's local experts over
        NVLink, of the destination domain's over RDMA, where the transfer carries them."""
        row = self.hidden * 2.0
        if which in ("dispatch_fwd", "dispatch_bwd"):
            experts = self.local_experts * (self.domain if rdma else 1)
            return row + experts * PROB
        return row

    def peer_bytes(self, which: str) -> tuple[tuple[float, ...], ...]:
        return _hybrid_peer_bytes(self, which)

    @property
    def persistent_bytes(self) -> float:
        return persistent_buffer_bytes(len(self.layout.ranks), self.domain, self.tokens,
                                       self.hidden, self.local_experts)

    def rdma_bytes(self, which: str = "dispatch_fwd") -> float:
        """Bytes group rank 0 puts on the network in transfer ``which`` (0 in one domain)."""
        if not self.layout.internode:
            return 0.0
        return sum(self.peer_bytes(which)[0][self.domain:])


@lru_cache(maxsize=256)
def _hybrid_peer_bytes(plan: HybridEPPlan, which: str) -> tuple[tuple[float, ...], ...]:
    """One matrix object per plan and transfer (the collective runner caches its flows by
    the matrix's identity): tokens times the NVLink record inside a domain, the RDMA record
    between domains."""
    m = plan.skew.matrix() if plan.skew is not None else plan.layout.tokens_matrix(plan.tokens)
    if which in ("combine_fwd", "dispatch_bwd"):
        m = tuple(zip(*m, strict=True))
    d = plan.domain
    nvl, rdma = plan.record_bytes(which), plan.record_bytes(which, rdma=True)
    return tuple(tuple(x * (nvl if i // d == j // d else rdma) for j, x in enumerate(row))
                 for i, row in enumerate(m))


def default_num_sms(domains: int) -> int:
    """Hybrid-EP's dispatch / combine SMs when ``moe_flex_dispatcher_num_sms`` is unset."""
    return SMS_ONE_DOMAIN if domains == 1 else SMS_DOMAINS


def hybridep_plan(ctx: JobContext, groups: Sequence[Groups], tokens: float) -> HybridEPPlan:
    """The Hybrid-EP layout of a Megatron job whose expert-TP x EP groups (every pipeline
    stage's) are ``groups``, ``tokens`` per rank entering each MoE layer; refuses what
    Megatron-Core and Hybrid-EP refuse, and what is not modelled."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, MegatronOptions)
    moe = ctx.model.moe
    assert moe is not None
    key = "framework.moe_flex_dispatcher_backend"
    par = s.parallelism
    ctx.require(par.ep * par.expert_tp > 1, key,
                "the flex dispatcher with HybridEP needs expert-TP x EP > 1")
    ctx.require(ctx.gpu.arch in ("hopper", "blackwell"), key,
                "HybridEP runs on H100, B200 and GB200 (Megatron-Core moe/README.md), not "
                f"{ctx.gpu.arch}")
    ctx.require(not opts.moe_deepep_fp8_dispatch, "framework.moe_deepep_fp8_dispatch",
                "HybridEP dispatcher does not support fp8 dispatch (Megatron-Core "
                "fused_a2a.init_hybrid_ep_buffer)")
    ctx.require(not opts.moe_pad_expert_input_to_capacity,
                "framework.moe_pad_expert_input_to_capacity",
                "token drop with padding is not modelled with the HybridEP backend")
    ctx.require(moe.capacity_factor is None, "model.capacity_factor",
                "token dropping is not modelled with the HybridEP backend (dropless only)")
    ng, m = check_router_groups(ctx)
    n = par.ep * par.expert_tp
    domain = min(n, s.cluster.gpus_per_node)
    rr = s.training.routing.distribution == "round_robin"
    checked_layouts(ctx, groups, lambda g: HybridEPLayout(
        g, s.cluster.gpus_per_node, moe.experts, moe.top_k, par.ep, par.expert_tp, ng, m,
        rr, domain=domain))
    sms = opts.moe_flex_dispatcher_num_sms or default_num_sms(n // domain)
    ctx.require(sms < ctx.gpu.sm_count, "framework.moe_flex_dispatcher_num_sms",
                f"HybridEP's blocks must fit the GPU's {ctx.gpu.sm_count} SMs")
    rel = HybridEPLayout(tuple(range(n)), domain, moe.experts, moe.top_k, par.ep,
                         par.expert_tp, ng, m, rr, domain=domain)
    skew = scenario_skew(ctx, int(tokens), domain, ng, m)
    return HybridEPPlan(rel, float(tokens), ctx.model.hidden, False, sms, skew)


def hybridep_op(coll: Callable[..., Op], plan: HybridEPPlan, which: str, label: str,
                groups: Groups, mb: int, layer: int) -> Op | None:
    """Hybrid-EP's transfer ``which`` (as :func:`~.moe_flex.flex_op`), run by its TMA kernel
    (``Op.fused_kernel``)."""
    op = flex_op(coll, plan, which, label, groups, mb, layer)
    if op is not None:
        op.fused_kernel = "hybridep"
    return op


FUSED_KERNELS = {
    "router": frozenset({"row_id_map.pass_1", "row_id_map.pass_2", "row_id_map.pass_3",
                         "permute", "permute.bwd", "permute.probs_bwd"}),
    "combine": frozenset({"unpermute", "unpermute.bwd"}),
    "experts": frozenset({"fp8_pad", "fp8_pad.bwd", "fp8_unpad", "fp8_unpad.bwd"}),
}
"""The ``alltoall`` dispatcher's permutation kernels Hybrid-EP does not run, and the FP8
padding copies its dispatch makes unnecessary (:func:`drop_fused_kernels`)."""


def drop_fused_kernels(ops: MoELayerOps) -> None:
    """Remove from one layer's blocks the permutations Hybrid-EP does inside its dispatch and
    combine. ``MoEFlexTokenDispatcher.dispatch_preprocess`` only reshapes (Megatron-Core
    23265d2d): no TE ``moe_permute_with_probs`` before the dispatch; ``HybridEPBuffer::
    dispatch_with_permute`` reads the layer's tokens with the routing map and its
    ``dispatch_postprocess`` permutes the received tokens into local-expert order, and
    ``combine_with_unpermute`` unpermutes them locally before its combine sums every copy
    back into the token's row (DeepEP hybrid-ep a0d27f1 ``csrc/hybrid_ep/hybrid_ep.cu``): no
    TE ``moe_unpermute`` after it. Those local permute / unpermute passes are the experts
    block's chunk sort and unsort (one copy of the permuted rows each way), which stay; the
    router's permutation with its row-id map and the combine's unpermutation go, with the
    saved tensors only they read. Their backward passes (the dispatch's is a combine, the
    combine's a dispatch) likewise.

    Under FP8 the dispatch also pads every local expert's rows to the quantization alignment
    (``pad_multiple = get_align_size_for_quantization``, passed to ``hybrid_ep_dispatch`` and
    ``hybrid_ep_combine`` since core_r0.16 b0cc2706, 26.02) and returns the padded counts, so
    the experts' ``Fp8Padding`` finds them aligned and returns its input (TE
    ``fp8_padding.py``; core_r0.18's ``skip_routed_expert_padding`` skips it outright), and
    the combine drops the padding: no pad or unpad copy; the GEMMs still run the aligned
    rows."""
    for name, drop in FUSED_KERNELS.items():
        drop_kernels(getattr(ops, name), drop)
