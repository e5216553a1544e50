"""NCCL's all-to-all as per-peer flows, with even or uneven sizes per peer.

NCCL has no all-to-all algorithm: ``alltoall_perf`` (nccl-tests ``src/alltoall.cu``) and
``torch.distributed.all_to_all_single`` issue one ``ncclSend`` and one ``ncclRecv`` per peer
inside ``ncclGroupStart``/``ncclGroupEnd``, so the op is ``n (n - 1)`` independent
point-to-point transfers that run at once, each on NCCL's p2p channels
(``ncclTopoGetNchannels``, :data:`~sim.fabric.collectives.algorithms.P2P_CHANNELS_PER_PEER`)
with the p2p buffer window (:mod:`sim.fabric.collectives.algorithms`). No tuning model picks
anything; the op ends when the last transfer ends, so the rank with most to send or receive
over its slowest link paces it (the even split's sends share links by max-min; uneven ones
are paced as one coflow, see :func:`peer_plan`).

Routes: a send to another node uses PXN (PCI x NVLink, NCCL 2.12 and later, on unless
``NCCL_PXN_DISABLE=1``). In ``src/graph/search.cc`` ``ncclTopoGetNetDev`` with no graph (p2p)
and ``NCCL_P2P_PXN_LEVEL=2`` (the default) looks up the NIC local to the GPU of *our* node with
the peer's device index, and, when that NIC's own GPU reaches us over NVLink with GPUDirect
RDMA, makes that GPU the proxy: the data crosses NVLink to it and leaves by its NIC. The
receiver posts on its own local NIC (``src/transport/net.cc`` ``recvSetup`` passes its own
rank as the peer). ``src/graph/paths.cc`` adds the same GPU -> GPU -> NET step
(``addInterStep``, "PXN = PCI + NVLink") to the topology paths. So on a rail-optimised fabric a
cross-node send stays on the destination's rail end to end: one NVLink hop to the local GPU of
that rail, that GPU's PCIe switch to its NIC, the rail's leaf, the peer's NIC. The plan builder
routes a send's edge (``rail=P2P_ROUTE``) this way, proxy GPU from
:func:`~sim.fabric.collectives.algorithms.nic_gpu`; with ``NcclSettings.pxn=False``
(``NCCL_PXN_DISABLE=1``) it leaves by the sender's own NIC and crosses rails through the
spines.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from sim.fabric.collectives.algorithms import (
    NCCL_STEPS,
    P2P_CHANNELS_PER_PEER,
    P2P_NET_CHUNK_BYTES,
    P2P_ROUTE,
    FlowPlan,
    PlanBuilder,
    nccl_channel_count,
)
from sim.fabric.collectives.nccl import NETWORK_EFFICIENCY
from sim.fabric.topology import CROSS_AZ, CROSS_REGION, NETWORK, NVLINK

# Peers one p2p work batch of a channel holds (src/include/device.h).
MAX_P2P_PER_BATCH = 8

# NCCL's all-to-all inside one NVLink domain against its ring rate and latency model: measured
# nccl-tests alltoall_perf sweeps approach their plateau far more slowly than NCCL's
# NVLINK_EFFICIENCY and its p2p latency (base + one NVLink hop, ~12 us) give, e.g. 268 GB/s
# busbw at 16 MB on 8 B300s against the ~460 those give (the sweeps: ``sim/catalog/reference/
# nccl.yaml``, ``*-alltoall-sweep``). Each call costs a fixed time more (the grouped
# send/recv kernel's launch, its per-peer work batches, the first chunk's round trip and the
# last's drain through the 8-slot p2p buffer) and, on NVLink 5, moves its bytes at a smaller
# share of the links than a ring does. Both **fitted** (``tools/fit_nvlink_alltoall.py``) on
# one sweep, the GB300 NVL72's 8 GPUs over two trays (oracle-quickstart/oci-gpu-quickstarts
# nvidia/GB300/README-GB300.md @ 61eba7f2, NCCL 2.28.7, 16 MB-1 GB: within 5.2%); validated
# on the others: 8 B300s (uccl-project/uccl b300_native_nccl_measurements.md, NCCL 2.29.7,
# 16-256 MB: 4.5-12.0% fast), the NVL72's 64 GPUs from 64 MB (-8.1 to +18.2%) and one tray's
# 4 (-4.2 to +14.2%); before them, 10-69% fast (tests/unit/fabric/
# test_nvlink_alltoall_sweeps.py). Hopper keeps its ring share: the maintainers' 370 GB/s
# 8-GPU plateau and a measured 4-GPU point (334.9 GB/s at 524 MB) hold it; with the call time
# 8 H100s are 4-16% faster than XLA's H100 table at 16-64 MiB (openxla/xla
# default_collective_perf_table.txtpb, 159 / 307 GB/s algbw, less XLA's own ~25 us a call).
# Not modelled: the NVL72's step below 1 MB a peer (64 GPUs: ~135 GB/s up to 32 MB).
P2P_NVLINK_CALL_S = 16.4e-6
P2P_NVLINK_SHARE = {"blackwell": 0.843}


# NCCL's all-to-all across the network against the ring's per-NIC rate (NETWORK_EFFICIENCY,
# 46-48 GB/s an NDR NIC): two measured two-node plateaus, each a 4 GB buffer (latency nil),
# both at about 0.89 of it. nccl-tests issue 355 (2025-10-31, NCCL 2.28.7): 16 H100 on 2
# nodes, one 400 Gb/s ConnectX-7 a GPU, busbw about 80 GB/s ("the CPU-proxy bandwidth can
# reach 80GB"); NVIDIA/nccl issue 1138 (2024-01-05, NCCL 2.18.6): 16 A100 on 2 nodes, four
# 200 Gb/s NICs a node, busbw 19.83 GB/s. On 2 nodes half of each rank's buffer crosses the
# network, so the ring's rate gives busbw = (15 / 16) x 2 x (NIC rate a GPU) x
# NETWORK_EFFICIENCY: 89.1 and 22.3 GB/s. Why less: each rank's network bytes are split over
# its peers' connections (NCCL_P2P_NET_CHUNKSIZE chunks, each posted by a CPU proxy, and with
# PXN the proxy of the rail's GPU posts its neighbours' sends too; issue 1138 traces the
# shortfall to that proxy's load). **Fitted** on these two points (the mean of their ratios);
# not on any training run. The maintainers' rule rows of ``nccl.yaml`` (46-48 GB/s a NIC
# times the node-count factor) now sit 12-15% above the simulation, as the measured 80 sits
# below the rule's 92-96.
P2P_NETWORK_SHARE = (80.0 / (15 / 16 * 2 * 50.0 * NETWORK_EFFICIENCY)
                     + 19.83 / (15 / 16 * 2 * 12.5 * NETWORK_EFFICIENCY)) / 2
_NETWORK_KINDS = (NETWORK, CROSS_AZ, CROSS_REGION)


def network_capacity(builder: PlanBuilder, share: float) -> np.ndarray:
    """The builder's link rates with the network's (NIC, switch and long-haul links) at
    ``share`` of NCCL's ring rate: what NCCL's own grouped sends reach there
    (:data:`P2P_NETWORK_SHARE`); fused kernels (DeepEP, Hybrid-EP) keep the ring's."""
    if share >= 1.0:
        return builder.capacity
    return np.where(np.isin(builder.fabric.kind, _NETWORK_KINDS), builder.capacity * share,
                    builder.capacity)


def nccl_nvlink_share(arch: str) -> float:
    """The share of NCCL's ring NVLink rate (``nccl.NVLINK_EFFICIENCY``) its all-to-all
    reaches (:data:`P2P_NVLINK_SHARE`; 1.0 where the ring's holds).

    Examples
    --------
    >>> nccl_nvlink_share("blackwell"), nccl_nvlink_share("hopper")
    (0.843, 1.0)
    """
    return P2P_NVLINK_SHARE.get(arch, 1.0)


def nvlink_call_s(builder: PlanBuilder, plan: FlowPlan) -> float:
    """:data:`P2P_NVLINK_CALL_S` when every flow of ``plan`` stays on NVLink (one NVLink
    domain), else 0: across nodes the network's own latency is NCCL's model's."""
    used = np.unique(plan.flat)
    return P2P_NVLINK_CALL_S if bool(np.all(builder.fabric.kind[used] == NVLINK)) else 0.0


PeerMatrix = tuple[tuple[float, ...], ...]


def even_matrix(n: int, nbytes: float) -> PeerMatrix:
    """nccl-tests' all-to-all of an ``nbytes`` buffer per rank: ``nbytes / n`` to each peer
    (``alltoall.cu``: ``count / nranks`` elements per peer), the diagonal kept local."""
    part = nbytes / n
    return tuple(tuple(0.0 if i == j else part for j in range(n)) for i in range(n))


def peer_plan(builder: PlanBuilder, groups: Sequence[tuple[int, ...]], matrix: PeerMatrix,
              coflow: bool = True, nvlink_send_rate: float = math.inf,
              nvlink_share: float = 1.0, network_share: float = 1.0) -> FlowPlan | None:
    """One flow per (source, destination) with bytes to move, in every group, each carrying
    ``matrix[i][j]`` bytes (the plan's message size is 1 byte: ``share`` is in bytes).

    Parameters
    ----------
    builder : the fabric's plan builder (its edges carry the PXN routes)
    groups : disjoint groups of one size ``n``; every group moves the same matrix
    matrix : ``n x n`` bytes, row = sender's position in the group, column = receiver's
    coflow : pace the sends as one coflow (below); False leaves each at its route's rate, for
        the even split, whose sends end at a few distinct times anyway
    nvlink_send_rate : the most bytes/s one rank sends to the peers of its own node in all,
        when a fused kernel's SMs copy them
        (:func:`~sim.fabric.collectives.fused_kernel.nvlink_send_rate`); ``inf``: the links
        alone bound them
    nvlink_share : the share of each NVLink link's capacity (NCCL's rate) the sends reach
        (:func:`~sim.fabric.collectives.fused_kernel.nvlink_share`)
    network_share : the same on network links (:data:`P2P_NETWORK_SHARE` for NCCL's own
        sends, 1 for a fused kernel's)

    Returns
    -------
    FlowPlan or None
        None when no off-diagonal entry is positive.
    """
    edges: list[tuple[int, int, float, int | None]] = []
    for group in groups:
        for i, src in enumerate(group):
            row = matrix[i]
            for j, dst in enumerate(group):
                b = row[j]
                if i != j and b > 0 and src != dst:
                    edges.append((src, dst, float(b), P2P_ROUTE))
    if not edges:
        return None
    ranks = {r for g in groups for r in g}
    nodes = len({builder.node_of[r] for r in ranks})
    # NCCL's cost model is not consulted (no algorithm choice); volume: bytes each rank puts
    # on the wire, on average, per message byte.
    volume = sum(e[2] for e in edges) / len(ranks)
    plan = builder._plan("p2p", edges, len(ranks), nodes, 1, 0.0, volume)
    chain = max((builder.long_haul(s, d) for s, d, _, _ in edges), default=0.0)
    n = max(len(g) for g in groups)
    per_peer = channels_per_peer(n, nodes, builder.nics, builder.g)
    # The time per message byte alone on the fabric is its most loaded link's bytes over
    # that link's rate (every flow of a link shares it): "bus bandwidth" = volume over that
    # time, so volume / bus_bw predicts the op alone (the nccl-tests column, the SMs' hold).
    load = np.bincount(plan.flat, weights=np.repeat(plan.share, plan.lengths),
                       minlength=len(builder.capacity))
    if network_share < 1.0 and not np.any(load[np.isin(builder.fabric.kind, _NETWORK_KINDS)]):
        network_share = 1.0   # NVLink only: the share is the network's, nothing to cap
    capacity = network_capacity(builder, network_share)
    if nvlink_share < 1.0:
        capacity = np.where(builder.fabric.kind == NVLINK, capacity * nvlink_share, capacity)
    per_byte = float((load / capacity).max())
    if nvlink_send_rate < math.inf:
        # The SMs that copy a rank's NVLink sends bound them as a port would: the op takes at
        # least the busiest sender's bytes to its own node over that rate.
        local: dict[int, float] = {}
        for s, d, b, _ in edges:
            if builder.node_of[s] == builder.node_of[d]:
                local[s] = local.get(s, 0.0) + b
        per_byte = max(per_byte, max(local.values(), default=0.0) / nvlink_send_rate)
    # Paced as one coflow: each send capped at its bytes over the op's time alone, so alone
    # on the fabric every send ends together at that bound, the time max-min sharing also
    # reaches when the busiest port (or sender's SMs) is the only bottleneck (the tests'
    # closed forms), with one completion instead of one per distinct size (thousands for an
    # uneven 64-rank op). A fused kernel's bounds are kept this way even without ``coflow``.
    # Under contention the caps keep each send to its share of the op: a send cannot take
    # what another op frees before the others end, which max-min would allow (slower by at
    # most that; the even split, ``coflow=False``, keeps max-min).
    if (coflow or nvlink_send_rate < math.inf or nvlink_share < 1.0
            or network_share < 1.0) and per_byte > 0:
        plan = replace(plan, bottleneck=np.minimum(plan.bottleneck, plan.share / per_byte))
    return replace(plan, bus_bw=volume / per_byte if per_byte > 0 else math.inf,
                   chain_latency_s=chain, flow_channels=float(per_peer),
                   window_bytes=float(NCCL_STEPS * P2P_NET_CHUNK_BYTES))


def channels_per_peer(n_ranks: int, n_nodes: int, nics: int, gpus_per_node: int) -> int:
    """NCCL channels each network peer's send runs on. Across nodes
    ``ncclTopoComputeP2pChannels`` (src/graph/paths.cc) halves ``p2pnChannelsPerPeer`` while
    ``perPeer x ceil(peers / NCCL_MAX_DEV_WORK_P2P_PER_BATCH)`` exceeds ``p2pnChannels`` (the
    ring channel count rounded up to a power of two), so that every peer fits in one round:
    2 per peer up to 64 ranks on 8-NIC nodes (16 channels), 1 beyond.

    Examples
    --------
    >>> [channels_per_peer(n, n // 8, 8, 8) for n in (16, 64, 128, 1024)]
    [2, 2, 1, 1]
    """
    per_peer = P2P_CHANNELS_PER_PEER
    if n_nodes <= 1:
        return per_peer
    ring = nccl_channel_count(n_nodes, max(1, nics), gpus_per_node)
    p2p_channels = 1 << max(0, ring - 1).bit_length()
    rounds = -(-n_ranks // MAX_P2P_PER_BATCH)
    while per_peer * rounds > p2p_channels and per_peer > 1:
        per_peer //= 2
    return per_peer


def paced_bytes(matrix: PeerMatrix) -> float:
    """The most bytes one rank sends or receives (the largest off-diagonal row or column
    sum): with every port equal, the op cannot end before that rank has moved them."""
    n = len(matrix)
    rows = [sum(matrix[i][j] for j in range(n) if j != i) for i in range(n)]
    cols = [sum(matrix[i][j] for i in range(n) if i != j) for j in range(n)]
    return max(rows + cols, default=0.0)


@functools.lru_cache(maxsize=1024)
def even_equivalent(matrix: PeerMatrix) -> float:
    """The message size of the even all-to-all (``nbytes / n`` to each peer) whose ranks each
    move as much as the busiest rank of ``matrix``: what its SMs and HBM traffic stand for.

    Examples
    --------
    >>> even_equivalent(even_matrix(4, 1024.0))
    1024.0
    >>> even_equivalent(((0.0, 3.0), (1.0, 0.0)))
    6.0
    """
    n = len(matrix)
    return paced_bytes(matrix) * n / (n - 1) if n > 1 else 0.0
