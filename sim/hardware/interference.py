"""How a running NCCL collective slows the compute kernels beside it, from what it occupies.

An NCCL kernel runs one CTA per channel, each resident on one SM for the kernel's whole life
(waiting for peers included), with a few hundred threads and its FIFO staging in shared
memory; a tensor-core GEMM CTA needs most of an SM's shared memory (a Hopper 128x256 tile
with its pipeline stages), so it cannot share an SM with an NCCL CTA: a GEMM beside a
collective runs on ``sm - ctas`` SMs. A memory-bound kernel saturates HBM with fewer SMs than
the GPU has, so it does not feel the missing SMs; it shares HBM with the collective's own
traffic instead. The slowdown of a compute op is then, over any interval where the
collectives of its GPU hold ``ctas`` SMs and move ``d`` bytes/s through HBM::

    matrix_share * sm / (sm - ctas) + (1 - matrix_share) * hbm / (hbm - d)

where ``matrix_share`` is the part of the op's time spent in tensor-core math (its FLOPs at
the GPU's sustained matrix rate, over its duration). The engine applies it piecewise: a
collective that starts or ends in the middle of an op changes the rate of the rest of it.

Channels (CTAs). NCCL's topology search on NVSwitch systems with one NIC per GPU finds
``nChannels`` rings and ``ncclTopoPostset`` doubles them up to ``MAXCHANNELS`` (32): NCCL's
init logs on DGX/HGX H100 read "32 coll channels" (``NCCL_DEBUG=INFO``), and DGX A100's 12
NVLinks give 24. A call does not always launch them all: ``topoGetAlgoInfo``
(``src/enqueue.cc``) drops channels while ``nBytes < nc * nThreads * threadThreshold``,
with 512 threads (``NCCL_SIMPLE_MAX_NTHREADS``) and a Simple-protocol threshold of 64 bytes
per thread (``NCCL_SIMPLE_THREAD_THRESHOLD``), i.e. 32 KiB per channel. Point-to-point
sends get ``p2pnChannelsPerPeer`` channels per peer: ``NCCL_NCHANNELS_PER_NET_PEER`` = 2 to
a network peer; to an NVLink peer ``ncclTopoGetNchannels`` (``src/graph/paths.cc``) gives 2
per NVLink of the path (36 on H100's 18), a power of two capped at the communicator's
channels (32 on H100, 24 on A100; the engine passes those for a send inside a node). Each
send then uses (``addP2pToPlan``, ``src/enqueue.cc``) that count halved while it times the
communicator's ranks exceeds its channels, at most one channel per ``minPartSize`` bytes
(``NCCL_P2P_NVL_CHUNKSIZE`` / 8 = 64 KiB in a node, ``NCCL_P2P_NET_CHUNKSIZE`` / 2 = 64 KiB
across nodes), doubled back while a part exceeds 32 chunks in a node. The communicator is
PyTorch's two-rank one of a plain send/recv (``ProcessGroupNCCL::pointToPoint``, key
"low:high", as Megatron's ``overlap_p2p_comm`` issues them); a batched send on a larger
group would run on fewer.

HBM traffic. Per byte a GPU receives, NCCL's Simple protocol writes it into the receive FIFO
(the peer's remote write), reads it back, and for a reduction also reads the local operand
and writes the result: 4 HBM bytes per wire byte for all-reduce and reduce-scatter, 3 for
all-gather and broadcast (FIFO write, read, output write), 2 for a send/recv; NVLS reads and
writes each byte once. The rate is the call's average: its bytes over the time NCCL's own
cost model predicts for it (``CollectiveRunner.select``), so a latency-bound small call
moves little.

The converse: communication slowed by compute (:func:`comm_rate_share`, applied by
:mod:`sim.engine.hbm_share`). NCCL's kernels move every byte with SM loads and stores through HBM
(and GPUDirect RDMA reads and writes HBM for network transfers), so a collective needs
``HBM_BYTES_PER_WIRE_BYTE`` HBM bytes per wire byte. A memory-bound kernel beside it
oversubscribes HBM: the memory system serves the outstanding requests of every SM issuing
them in turn, and an SM's rate is bounded by its own outstanding requests (Little's law), so
each issuing SM gets an equal share and NCCL's ``ctas`` CTAs get ``ctas / sm`` of HBM. The
same share binds the other way: over a memory-bound phase the compute kernel loses at most
that much (:func:`slowdown`). A GEMM's compulsory operand traffic (2(MK + KN + MN) bytes for
2MNK FLOPs: 9% of H100 HBM for an 8192-cube bf16 GEMM at its sustained rate) leaves more than
any NCCL demand, so a collective beside tensor-core math keeps its rate. Rashidi et al.
("Enabling Compute-Communication Overlap in Distributed Deep Learning Training Platforms",
ISCA 2021, arXiv 2007.00156) measure and model this contention: freeing the endpoint's
memory bandwidth and SMs for the collectives (their ACE engine) raises the effective network
bandwidth utilization beside DL compute by 1.44x on average, up to 2.67x; the Ascend
profiling guide reports communication bandwidth "about 1 to 2 times lower" beside
memory-intensive operators (hiascend.com, "Computing and Communication Bandwidth
Contention"). tests/unit/engine/test_hbm_share.py checks the model against that range, not fit to
it.

Checked, not fitted, against Lee et al., "Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114, 2025): 18.9% average slowdown
of overlapped kernels on A100/H100, up to 40% (tests/unit/hardware/test_interference.py). Not
modelled:
wave quantisation of a GEMM whose tile count just fits the whole GPU (Lee et al.'s worst
cases), and L2 contention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Channels NCCL builds per communicator, by GPU generation (NCCL_DEBUG=INFO "coll channels"
# on DGX/HGX systems: A100 24, H100 32; MAXCHANNELS = 32 caps Blackwell and Volta alike).
NCCL_CHANNELS = {"volta": 24, "ampere": 24, "hopper": 32, "blackwell": 32}
# topoGetAlgoInfo: Simple protocol, 512 threads x 64 bytes per thread per channel.
NCCL_BYTES_PER_CHANNEL = 512 * 64
# NCCL_NCHANNELS_PER_NET_PEER default: channels a send/recv to one network peer uses.
NCCL_P2P_CHANNELS = 2
# addP2pToPlan's smallest part per channel: NCCL_P2P_NVL_CHUNKSIZE (512 KiB) / 8 in a node,
# NCCL_P2P_NET_CHUNKSIZE (128 KiB) / 2 across nodes; a part grows to 32 NVLink chunks.
NCCL_P2P_MIN_PART = 64 << 10
NCCL_P2P_NVL_MAX_PART = 32 * (512 << 10)
# Ranks of the communicator a send/recv runs on: PyTorch's per-pair communicator.
P2P_COMM_RANKS = 2
# HBM bytes moved per byte received over the wire (Simple protocol, see module docstring).
HBM_BYTES_PER_WIRE_BYTE = {"all_reduce": 4.0, "reduce_scatter": 4.0, "all_gather": 3.0,
                           "broadcast": 3.0, "all_to_all": 2.0, "p2p": 2.0}


@dataclass(frozen=True)
class CommLoad:
    """What one running collective holds on each GPU of its group."""

    ctas: int
    """SMs its kernel occupies (one CTA per channel)."""
    hbm_bytes_per_s: float
    """HBM traffic it drives while moving data."""


def collective_ctas(arch: str, op: str, nbytes: float, channels: int | None = None,
                    algorithm: str = "ring") -> int:
    """CTAs (channels) NCCL launches for one call of ``nbytes``.

    Examples
    --------
    >>> collective_ctas("hopper", "all_reduce", 1 << 30)    # large: every channel
    32
    >>> collective_ctas("hopper", "all_reduce", 128 << 10)  # 128 KiB: 4 channels
    4
    >>> collective_ctas("hopper", "all_reduce", 1 << 30, 16, "nvls")
    16
    >>> collective_ctas("hopper", "p2p", 1 << 30)           # to a network peer
    2
    >>> collective_ctas("hopper", "p2p", 8 << 20, NCCL_CHANNELS["hopper"])  # NVLink peer
    16
    >>> collective_ctas("hopper", "p2p", 1 << 30, NCCL_CHANNELS["hopper"])
    32
    >>> collective_ctas("hopper", "p2p", 128 << 10, NCCL_CHANNELS["hopper"])
    2

    For a send, ``channels`` is NCCL's ``p2pnChannelsPerPeer`` (default: a network peer's).
    """
    if op == "p2p":
        return p2p_ctas(arch, nbytes, channels)
    full = channels or NCCL_CHANNELS.get(arch, 32)
    if algorithm == "nvls":
        return full
    return max(1, min(full, math.ceil(nbytes / NCCL_BYTES_PER_CHANNEL)))


def p2p_ctas(arch: str, nbytes: float, per_peer: int | None = None) -> int:
    """Channels one send/recv of ``nbytes`` runs on (``addP2pToPlan``, see module docstring);
    ``per_peer``: NCCL's ``p2pnChannelsPerPeer`` (None: a network peer's 2)."""
    nvlink = per_peer is not None
    most = per_peer or NCCL_P2P_CHANNELS
    comm_channels = NCCL_CHANNELS.get(arch, 32)
    least = most
    while least * P2P_COMM_RANKS > comm_channels and least > 1:
        least //= 2
    n = max(1, min(least, math.ceil(nbytes / NCCL_P2P_MIN_PART)))
    while nvlink and nbytes / n > NCCL_P2P_NVL_MAX_PART and n <= most // 2:
        n *= 2
    return n


def alltoall_ctas(arch: str, peers: list[tuple[float, bool]]) -> int:
    """CTAs NCCL's all-to-all launches: ``peers`` holds, for every other member, the bytes
    sent to it and whether it is an NVLink peer (same node).

    NCCL runs an all-to-all as grouped ``ncclSend``/``ncclRecv`` (PyTorch's
    ``all_to_all_single``), one round per peer; each peer's send runs on its own point-to-point
    channels (:func:`p2p_ctas`: 2 to a network peer, up to the communicator's channels to an
    NVLink peer) starting at a base that moves with the round (``ncclP2pChannelBaseForRound``,
    ``src/include/p2p.h``), so one kernel runs on the union of the rounds' channels: their sum,
    at most the communicator's point-to-point channels (``p2pnChannels``: 32 on H100, the
    ``NCCL_DEBUG=INFO`` line "32 p2p channels").

    >>> alltoall_ctas("hopper", [(4 << 20, False)] * 31)   # EP 32 over 4 nodes
    32
    >>> alltoall_ctas("hopper", [(128 << 10, True)] * 7)   # a small one in a node
    14
    """
    full = NCCL_CHANNELS.get(arch, 32)
    n = sum(p2p_ctas(arch, b, full if nvlink else None) for b, nvlink in peers if b > 0)
    return max(1, min(full, n))


def comm_load(arch: str, op: str, nbytes: float, wire_bytes: float, seconds: float,
              channels: int | None = None, algorithm: str = "ring") -> CommLoad:
    """The SMs and HBM bandwidth a collective holds on each GPU while it runs.

    ``wire_bytes``: bytes each GPU receives over the call (NCCL's bus bytes); ``seconds``:
    the call's duration as NCCL's cost model predicts it (latency included), so the HBM
    traffic is the call's average, not its links' peak. ``channels``: what NCCL's topology
    gives the communicator (default :data:`NCCL_CHANNELS`). NVLS reduces in the NVSwitch:
    each GPU's memory is read once and written once per message byte.
    """
    ctas = collective_ctas(arch, op, nbytes, channels, algorithm)
    if seconds <= 0:
        return CommLoad(ctas, 0.0)
    if algorithm == "nvls":
        hbm = 2.0 * nbytes / seconds
    else:
        hbm = HBM_BYTES_PER_WIRE_BYTE.get(op, 3.0) * wire_bytes / seconds
    return CommLoad(ctas, hbm)


def slowdown(sm_count: int, hbm_bytes_per_s: float, matrix_share: float, ctas: int,
             comm_hbm_bytes_per_s: float) -> float:
    """Factor by which a compute op's remaining work slows while collectives hold ``ctas``
    SMs and move ``comm_hbm_bytes_per_s`` through HBM (1.0 when nothing runs).

    Examples
    --------
    >>> slowdown(132, 4.8e12, 1.0, 32, 0.0)     # a GEMM beside a 32-channel collective
    1.32
    >>> round(slowdown(132, 4.8e12, 0.0, 32, 0.6e12), 3)   # an elementwise kernel: HBM only
    1.143
    """
    if ctas <= 0 and comm_hbm_bytes_per_s <= 0:
        return 1.0
    # NCCL never gets every SM: its channel count is far below any GPU's SM count, but keep
    # one SM for compute whatever the sum of concurrent collectives.
    free_sms = max(1, sm_count - ctas)
    # Oversubscribed HBM is shared per issuing SM: NCCL takes at most ctas/sm of it, the
    # same share comm_rate_share gives it (one rule for both directions).
    drawn = min(comm_hbm_bytes_per_s, hbm_bytes_per_s * max(1, ctas) / sm_count)
    free_hbm = hbm_bytes_per_s - drawn
    share = min(1.0, max(0.0, matrix_share))
    return share * sm_count / free_sms + (1.0 - share) * hbm_bytes_per_s / free_hbm


def comm_rate_share(sm_count: int, hbm_bytes_per_s: float, memory_share: float, ctas: int,
                    comm_hbm_bytes_per_s: float) -> float:
    """Share of their own rate the collectives of a GPU keep beside compute (1.0: unslowed).

    ``memory_share``: the part of the time the compute beside them runs memory-bound kernels
    (1 - matrix share, summed over concurrent ops, at most 1); ``ctas`` and
    ``comm_hbm_bytes_per_s``: what the collectives hold and need (:func:`comm_load`). Over a
    memory-bound phase they get ``ctas / sm`` of HBM; over tensor-core math all they need.

    Examples
    --------
    >>> comm_rate_share(132, 3.35e12, 0.0, 32, 1.5e12)     # beside a GEMM: unslowed
    1.0
    >>> round(comm_rate_share(132, 3.35e12, 1.0, 32, 1.5e12), 3)   # beside an elementwise op
    0.541
    >>> round(comm_rate_share(132, 3.35e12, 0.5, 32, 1.5e12), 3)   # half and half
    0.771
    """
    if comm_hbm_bytes_per_s <= 0 or memory_share <= 0:
        return 1.0
    m = min(1.0, memory_share)
    share = hbm_bytes_per_s * max(1, ctas) / sm_count
    return (1.0 - m) + m * min(1.0, share / comm_hbm_bytes_per_s)
