"""How fast HybridEP's fused dispatch and combine kernels (``Op.fused_kernel == "hybridep"``:
NVIDIA's Hybrid-EP in deepseek-ai/DeepEP's ``hybrid-ep`` branch, the ``hybridep`` backend
of Megatron-Core's flex dispatcher) push bytes over NVLink.

DeepEP's normal kernels copy with warp-wide stores, one sending SM of every two
(:mod:`sim.fabric.collectives.fused_kernel`). Hybrid-EP's are warp-specialised persistent
kernels, one block an SM (``docs/Hybrid-EP_Implementation.md`` section 8): in *every* block
a G2S warp group loads tokens into a shared-memory FIFO and an S2G warp group writes them
to the peers' NVLink buffers with TMA bulk copies (an RDMA warp group besides across
NVLink domains). So every SM sends, and a few SMs fill the links
(``docs/README_Hybrid-EP.md``: "significantly reducing SM resource usage"). Two bounds on a
GPU's NVLink sends, as for DeepEP:

* the SMs: :data:`SM_NVLINK_GBPS` a block, ``sm_ctas`` of them (:func:`nvlink_send_rate`);
* the links: :data:`NVLINK_STORE_EFFICIENCY` of raw NVLink (:func:`nvlink_share`).

Both from the branch's own table (``docs/README_Hybrid-EP.md`` "Performance Results",
4096 tokens a rank, hidden 7168, top-8, 8 local experts, uniform routing, BF16 dispatch,
kernel time only; its bandwidth is the bytes a rank receives, its own share included,
``tests/test_hybrid_ep.py`` ``nvl_recv_bytes``, so ``(n - 1) / n`` of them crossed NVLink):

* GB200, 8 ranks, 32 SMs (NVLink 5, 900 GB/s raw a direction): 764.03 GB/s dispatch,
  737.13 combine; 16 SMs moved nearly as much (750.15 / 684.27): the links bound it.
  Their 32-SM mean, in NVLink bytes over raw, is :data:`NVLINK_STORE_EFFICIENCY` (0.73).
* B200, 8 ranks, 16 SMs: 734.95 GB/s dispatch: at most 16 sending SMs moved
  ``734.95 x 7/8`` GB/s, so one moves at least 40.2 GB/s (:data:`SM_NVLINK_GBPS`, a lower
  bound: the links bound that run too).

Checked, not fitted, in ``tests/unit/engine/test_hybridep_published.py``: the GB200 rows
of 16 to 36 ranks in one NVLink domain (within 11%). No Hopper NVLink-bound figure is
published for Hybrid-EP: the same TMA store efficiency is taken there. Across NVLink domains
(H100 nodes) a call also pays :data:`INTERNODE_CALL_S`, fitted on the same README's H100 rows
(EP 16 to 64: without it the simulation was 5-37% fast there, by a near-constant 0.25-0.47
ms).
"""

from __future__ import annotations

from sim.fabric.collectives import nccl

NVLINK_STORE_EFFICIENCY = (764.03 + 737.13) / 2 * (7.0 / 8.0) / 900.0
"""Share of raw NVLink Hybrid-EP's TMA stores reach (0.73): GB200, 8 ranks, 32 SMs, BF16
dispatch and combine, kernel time (``docs/README_Hybrid-EP.md``; module docstring)."""

SM_NVLINK_GBPS = 734.95 * (7.0 / 8.0) / 16
"""NVLink bytes one Hybrid-EP block (one SM) writes a second, GB/s (40.2), a lower bound:
B200, 8 ranks, 16 SMs, BF16 dispatch, kernel time (module docstring)."""


def nvlink_send_rate(sm_ctas: int) -> float:
    """The most NVLink bytes a second one GPU's ``sm_ctas`` Hybrid-EP blocks send (every
    block sends); ``inf`` for 0.

    Examples
    --------
    >>> round(nvlink_send_rate(8) / 1e9, 1)     # the multi-domain default
    321.5
    >>> nvlink_send_rate(0)
    inf
    """
    if sm_ctas <= 0:
        return float("inf")
    return sm_ctas * SM_NVLINK_GBPS * 1e9


def nvlink_share(sm_ctas: int, arch: str) -> float:
    """The share of the NVLink capacity the flow network gives NCCL (raw times
    ``nccl.NVLINK_EFFICIENCY[arch]``) that Hybrid-EP's kernels reach; 1.0 for ``sm_ctas`` 0.

    Examples
    --------
    >>> round(nvlink_share(32, "blackwell"), 2)
    0.91
    """
    if sm_ctas <= 0:
        return 1.0
    return min(1.0, NVLINK_STORE_EFFICIENCY / nccl.NVLINK_EFFICIENCY[arch])


INTERNODE_CALL_S = 0.37e-3
"""Seconds a Hybrid-EP dispatch or combine across NVLink domains takes beyond the bytes its
flows move (**fitted**, ``tools/fit_hybridep_internode.py``): Hybrid-EP's own H100 benchmark
(``sim/catalog/reference/hybridep_benchmark.yaml``; EP 16, 32 and 64, 4,096 tokens a rank)
runs 0.25-0.47 ms longer than its flows at every EP size, a constant where a factor would
fall from 1.37 to 1.05; this is their mean. Where it goes is not published: the RDMA warp
group's chunked sends and their completion flags across the network, which one NVLink domain
does without, are the likely home. Measured at 4,096 tokens a rank only: whether it grows
with the tokens (per chunk) is not known. Checked on the 16-H100 Megatron-Bridge runs of
Qwen3-30B-A3B with Hybrid-EP (``published-moe``; docs/calibration.md)."""


def fixed_call_s(domains: int) -> float:
    """The fixed time of one Hybrid-EP call over ``domains`` NVLink domains:
    :data:`INTERNODE_CALL_S` across several, 0 in one (no RDMA leg).

    Examples
    --------
    >>> fixed_call_s(1), fixed_call_s(2) * 1e3
    (0.0, 0.37)
    """
    return INTERNODE_CALL_S if domains > 1 else 0.0
