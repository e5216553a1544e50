"""How fast a fused communication kernel that holds its own SMs (``Op.sm_ctas``: DeepEP's
normal dispatch and combine, ``Buffer.set_num_sms``) pushes bytes over NVLink.

An NCCL collective gets as many channels as its topology search finds to fill NVLink and
reaches NCCL's share of the links (:data:`~sim.fabric.collectives.nccl.NVLINK_EFFICIENCY`).
DeepEP's normal kernels (deepseek-ai/DeepEP ``csrc/kernels/legacy/intranode.cu``,
``internode.cu``; ``num_channels = num_sms / 2``, ``csrc/legacy/config.hpp``) copy with their
own SMs, two a channel: intranode the even SM of a pair is the sender whose warps
(``kNumThreads / kNumRanks`` a rank) store the channel's tokens into every peer's NVLink
buffer, the odd SM the receiver that copies them out of its own; internode the even SM is
the forwarder that stores the tokens arrived by RDMA into the node's NVLink buffers. So one
SM of each channel writes every byte a GPU sends over NVLink (warp-wide 16-byte stores,
``UNROLLED_WARP_COPY``), through ring buffers whose head and tail each side polls. Two
bounds follow, both on a GPU's NVLink sends in all:

* the SMs: :data:`SENDER_SM_NVLINK_GBPS` a sending SM, ``sm_ctas / 2`` of them
  (:func:`nvlink_send_rate`);
* the links: the share of raw NVLink these stores reach, :data:`NVLINK_STORE_EFFICIENCY`,
  below NCCL's (its per-token records, the queue polling), :func:`nvlink_share`.

Calibration (``docs/calibration.md``), on DeepEP's own V1 intranode benchmark
(``tests/legacy/test_intranode.py``: 8 ranks, 24 SMs, 4096 tokens, hidden 7168, top-8 of
256 experts; logical GB/s = received bytes, the rank's own eighth included, so 7/8 of it
crossed NVLink):

* H800 (8 NVLink 4 links, 200 GB/s raw a direction; ``docs/legacy.md`` table): 153 GB/s
  dispatch, 158 combine: 134 and 138 GB/s of NVLink, 0.67 and 0.69 of raw. Their mean is
  :data:`NVLINK_STORE_EFFICIENCY`. The same SMs moved more than twice that on H20, so the
  SMs did not bound H800: its links did.
* H20 (18 links, 450 GB/s raw; DeepEP issue 16, 2025-02-25, the test's day-one version):
  337 GB/s, 295 GB/s of NVLink from 12 sending SMs: 24.6 GB/s a sending SM, a lower bound
  (a maintainer answered "it may be essential to increase the number of SMs", i.e. the SMs
  bound it), taken as :data:`SENDER_SM_NVLINK_GBPS`.

Checked, not fitted, in ``tests/unit/engine/test_deepep_published_bandwidth.py``: DeepEP's
internode rows (EP 16 forwards over NVLink, EP 32 and 64 are bound by the network). A
GB200 single-host run at 24 SMs (DeepEP issue 394: 169 GB/s dispatch, 135 combine) is 2.3x
slower than this model: unexplained, marked there. DeepEP V2's ``ElasticBuffer`` kernels
(TMA copies, "saving up to 4x SM count", README.md) are a different kernel that
Megatron-Core's flex dispatcher does not run (``fused_a2a.py`` builds the legacy
``Buffer``).
"""

from __future__ import annotations

from sim.fabric.collectives import alltoall, nccl

SMS_PER_CHANNEL = 2
"""SMs of one DeepEP channel (a sender or forwarder SM and a receiver SM,
``csrc/legacy/config.hpp``: ``num_channels = num_sms / 2``)."""

SENDER_SM_NVLINK_GBPS = 337.35 * (7.0 / 8.0) / 12
"""NVLink bytes one sending SM of DeepEP's normal kernels writes a second, GB/s (24.6): H20,
8 ranks, 24 SMs (DeepEP issue 16; module docstring)."""

NVLINK_STORE_EFFICIENCY = (153.0 + 158.0) / 2 * (7.0 / 8.0) / 200.0
"""Share of raw NVLink bandwidth DeepEP's normal kernels reach (0.68): H800, 8 ranks, 24 SMs
(``docs/legacy.md``; module docstring). NCCL's: 0.82 (``nccl.NVLINK_EFFICIENCY``)."""


def nvlink_send_rate(sm_ctas: int) -> float:
    """The most NVLink bytes a second one GPU's SMs send in a fused kernel of ``sm_ctas``
    SMs (``sm_ctas / 2`` channels, one sending SM each); ``inf`` when ``sm_ctas`` is 0 (an
    NCCL kernel, whose channels the link model already fills).

    Examples
    --------
    >>> round(nvlink_send_rate(24) / 1e9, 1)     # DeepEP's test default: 12 channels
    295.2
    >>> round(nvlink_send_rate(20) / 1e9, 1)     # Megatron-Core's default
    246.0
    >>> nvlink_send_rate(0)
    inf
    """
    if sm_ctas <= 0:
        return float("inf")
    return (sm_ctas // SMS_PER_CHANNEL) * SENDER_SM_NVLINK_GBPS * 1e9


def nvlink_share(sm_ctas: int, arch: str) -> float:
    """The share of the NVLink capacity the flow network gives NCCL (raw times
    ``nccl.NVLINK_EFFICIENCY[arch]``) that a fused kernel of ``sm_ctas`` SMs reaches; for
    NCCL's own all-to-all (``sm_ctas`` 0) its measured share
    (:func:`sim.fabric.collectives.alltoall.nccl_nvlink_share`).

    Examples
    --------
    >>> round(nvlink_share(20, "hopper"), 3)
    0.826
    >>> nvlink_share(0, "hopper"), nvlink_share(0, "blackwell")
    (1.0, 0.843)
    """
    if sm_ctas <= 0:
        return alltoall.nccl_nvlink_share(arch)
    return min(1.0, NVLINK_STORE_EFFICIENCY / nccl.NVLINK_EFFICIENCY[arch])


def fixed_call_s(domains: int) -> float:
    """The fixed time of one call beyond its flows, over ``domains`` NVLink domains: none is
    priced for DeepEP's normal kernels (its published internode rows sit within 15% of the
    flows without one, ``tests/unit/engine/test_deepep_published_bandwidth.py``); NCCL's own
    all-to-all inside one domain is :func:`sim.fabric.collectives.alltoall.nvlink_call_s`,
    Hybrid-EP's :func:`sim.fabric.collectives.hybridep_kernel.fixed_call_s`.

    Examples
    --------
    >>> fixed_call_s(4)
    0.0
    """
    return 0.0
