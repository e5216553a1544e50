"""NCCL's cost model: latencies, protocol bandwidths, channel counts, algorithm choice.

Values from NCCL ``src/graph/tuning.cc`` (v2.30, ``ncclTopoTuneModel``,
``ncclTopoGetAlgoTime``), ``src/enqueue.cc`` (``calcCollChunking``), ``src/graph/topo.h`` and
``src/transport/nvls.cc``, cited per table. Our own code; the structure follows NCCL's:

* latency of a collective = a base latency of (algorithm, protocol) plus hardware latencies
  per step, NVLink steps inside a node and network steps between nodes (the tree's network
  latency when every node holds one rank), the CPU proxy's overhead on inter-node ring steps;
* bandwidth of a protocol = a share of the algorithm's bus bandwidth (LL moves 8 data bytes
  per 16-byte line, LL128 120 of 128, Simple all of it), capped per channel and, for LL, by
  ``llMaxBw`` (indexed by GPU generation in one node and by host CPU across nodes);
* NCCL's choice = the least ``latency + bytes / bandwidth`` (ncclTopoGetAlgoTime: integer
  log2 sizes, the tree's per-size correction, the ring's plateau factor; no pipeline fill).

The simulator uses this model twice: to choose what NCCL would run, and for the latency term
of what it runs. The bandwidth a collective gets is not taken from here: its flows share the
fabric (:mod:`sim.fabric.collectives.runner`).
"""
from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "pat", "collnet_direct", "collnet_chain")
PROTOCOLS = ("ll", "ll128", "simple")
# Algorithms NCCL runs with the Simple protocol only (tuning.cc ncclTopoTuneModel: NVLS and
# NVLS-tree skip LL/LL128, PAT runs Simple only, CollNet LL/LL128 bandwidth is set to 0).
SIMPLE_ONLY = ("nvls", "nvls_tree", "pat", "collnet_direct", "collnet_chain")

# tuning.cc ncclTunerConstantsDefaults.baseLatencies [algorithm][protocol], microseconds
# (LL, LL128, Simple).
BASE_LAT_US = {
    "tree": {"ll": 6.8, "ll128": 14.0, "simple": 8.4},
    "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
    "collnet_direct": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "collnet_chain": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "pat": {"ll": 8.0, "ll128": 8.0, "simple": 8.0},
}
# tuning.cc hwLatencies [NVLINK, PCI, NET][algorithm][protocol], microseconds per step.
HW_LAT_US = {
    "nvlink": {"tree": {"ll": 0.6, "ll128": 1.25, "simple": 4.0},
               "ring": {"ll": 0.6, "ll128": 1.9, "simple": 3.4},
               "collnet_direct": {"ll": 0.0, "ll128": 0.0, "simple": 3.7},
               "collnet_chain": {"ll": 0.0, "ll128": 0.0, "simple": 2.8},
               "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 25.0},
               "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 25.0},
               "pat": {"ll": 0.0, "ll128": 0.0, "simple": 4.0}},
    "pcie": {"tree": {"ll": 1.0, "ll128": 1.9, "simple": 4.0},
             "ring": {"ll": 1.0, "ll128": 2.5, "simple": 5.7},
             "collnet_direct": {"ll": 0.0, "ll128": 0.0, "simple": 3.7},
             "collnet_chain": {"ll": 0.0, "ll128": 0.0, "simple": 2.8},
             "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
             "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
             "pat": {"ll": 0.0, "ll128": 0.0, "simple": 4.0}},
    "network": {"tree": {"ll": 5.0, "ll128": 8.5, "simple": 14.0},
                "ring": {"ll": 2.7, "ll128": 4.0, "simple": 14.0},
                "collnet_direct": {"ll": 0.0, "ll128": 0.0, "simple": 31.0},
                "collnet_chain": {"ll": 0.0, "ll128": 0.0, "simple": 30.0},
                "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 18.0},
                "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 20.9},
                "pat": {"ll": 0.0, "ll128": 0.0, "simple": 14.0}},
}
# Backwards-compatible views of the ring row.
RING_BASE_LAT_US = BASE_LAT_US["ring"]
RING_HW_LAT_US = {link: HW_LAT_US[link]["ring"] for link in HW_LAT_US}
# tuning.cc getNetOverhead: the CPU proxy's cost of posting one network step, by host CPU:
# 1 us on x86 Intel, 2 us on x86 AMD, 1 us otherwise (Arm, POWER); x3 for Simple. Inter-node
# rings pay it on every step (intraLat = max(intraLat, netOverhead)).
NET_OVERHEAD_BY_CPU_US = {"intel": 1.0, "amd": 2.0}
NET_OVERHEAD_DEFAULT_US = 1.0
NET_OVERHEAD_SIMPLE_FACTOR = 3.0
DEFAULT_CPU_VENDOR = "intel"
"""Where a topology does not say: NCCL's tables then read the Intel (row 0) values."""
X86_VENDORS = ("intel", "amd", "zhaoxin", "mixed")
# Share of the bus bandwidth each protocol delivers on rings (tuning.cc: LL busBw*0.5, LL128
# *0.92); trees: busBw*0.92 capped per channel, then LL /3.8, LL128 7/9 in one node else
# 120/128 (also capped per channel).
PROTOCOL_BW_FACTOR = {"ll": 0.5, "ll128": 0.92, "simple": 1.0}
TREE_BW_FACTOR = {"ll": 1 / 3.8, "ll128_one_node": 7 / 9, "ll128": 120 / 128, "simple": 0.92}
TREE_ALLREDUCE_FACTOR = 0.92
PAT_BW_FACTOR = 0.75            # tuning.cc: if (a == NCCL_ALGO_PAT) busBw *= .75
COLLNET_DIRECT_SM90_FACTOR = 0.85  # tuning.cc: CollNet Direct all-reduce, minCompCap >= 90
# Compute-capability rows of NCCL's tables (NCCL_VOLTA/AMPERE/HOPPER/BLACKWELL_COMPCAP_IDX).
ARCH_ROW = {"volta": 0, "ampere": 1, "hopper": 2, "blackwell": 3}
ARCHS = ("volta", "ampere", "hopper", "blackwell")
# tuning.cc llMaxBws [index1][index2] (GB/s): index2 = nNodes-1 capped at 2 (1, 2, >2 nodes);
# index1 = the GPU generation's row for one node, but for more than one node the host CPU's:
# row 1 for AMD (or mixed hosts), row 0 otherwise ("LL: for single node, we look at GPU type;
# for multi-node, we look at CPU type").
LL_MAX_BWS_GBPS = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0),
                   (282.0, 90.0, 70.0))
# tuning.cc perChMaxRingLL128Bws, perChMaxTreeLL128Bws, perChMaxTreeBws, perChMaxNVLSTreeBws
# [compCap][index2], GB/s per channel.
LL128_PER_CHANNEL_GBPS = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
TREE_LL128_PER_CHANNEL_GBPS = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                               "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}
TREE_PER_CHANNEL_GBPS = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                         "hopper": (38.7, 41.4, 36.0), "blackwell": (70.0, 42.8, 24.0)}
NVLS_TREE_PER_CHANNEL_GBPS = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                              "hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
# tuning.cc treeCorrectionFactor[protocol][log2i(nBytes >> 6)]: NCCL's static correction of
# tree bandwidth for medium sizes (64 B to 256 MiB), applied in ncclTopoGetAlgoTime only.
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
# device.h: NCCL_MAX_NVLS_ARITY (NVLS all-gather/reduce-scatter need localRanks <= 32) and
# NCCL_MAX_DIRECT_ARITY (CollNet needs at most 8 local ranks, enqueue.cc).
MAX_NVLS_ARITY = 32
MAX_COLLNET_LOCAL_RANKS = 8
# tuning.cc nvlsEfficiency: the share of NVLink bandwidth NVLS (NVLink SHARP) delivers.
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
# nvls.cc: NVLS_NCHANNELS_SM90 16, NVLS_NCHANNELS_SM100 32 (24 in one NVLink domain);
# NCCL_NVLS_CHUNKSIZE default 128 KiB.
NVLS_CHANNELS = {"hopper": 16, "blackwell": 32}
NVLS_CHUNK_BYTES = 128 * 1024
# NCCL_STEPS: the slots of a channel's buffer (device.h); a Simple step is buffsize/8.
NCCL_STEPS = 8
# NCCL's per-link NVLink bandwidth used in its topology search (src/graph/topo.h,
# SM70/SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6, SM100_NVLINK_BW 40.1 GB/s) against the raw
# 25 GB/s per direction per NVLink2/3/4 link (50 for NVLink5): the share of NVLink a ring
# achieves. 18 x 20.6 = 371 GB/s, the ~370 GB/s nccl-tests reports for H100 in-node rings
# (nccl-tests issue 212).
NVLINK_EFFICIENCY = {"volta": 20.0 / 25.0, "ampere": 20.0 / 25.0, "hopper": 20.6 / 25.0,
                     "blackwell": 40.1 / 50.0}
# Share of NIC line rate a ring achieves between nodes, by transport. InfiniBand: 46-48 GB/s
# per 400 Gb/s NDR NIC (nccl-tests issue 290) and 24 of 25 GB/s per HDR NIC (nccl-tests issue
# 160), their mean. Calibration honesty: this IS fitted on those two published points, which
# the ``nccl`` suite also checks (ndr400-per-nic, hdr200-per-nic): they do not validate it.
# Its held-out check is dgx-a100-multinode (NCCL issue 812, 192 GB/s on 4 DGX A100, not in the
# fit). The wire alone cannot give it: an IB RDMA-write packet of 4096 B payload carries
# LRH 8 + BTH 12 + ICRC 4 + VCRC 2 = 26 B of headers (IBTA spec vol. 1, ch. 5 and 9) on the
# 400/200 Gb/s data rate NDR/HDR quote after 256b/257b encoding and FEC, a ceiling of
# 4096/4122 = 0.994; the rest (~5%) is NCCL's own (proxy, flags, step gaps), unmodelled here.
# RoCE v2 runs the same verbs over Ethernet (same share assumed); EFA (SRD
# through the aws-ofi-nccl plugin) and TCP sockets deliver less: assumed 0.85 and 0.6 of line
# rate, pending published nccl-tests figures.
NETWORK_EFFICIENCY_BY_TRANSPORT = {"infiniband": (47.0 / 50.0 + 24.0 / 25.0) / 2,
                                   "roce": (47.0 / 50.0 + 24.0 / 25.0) / 2,
                                   "efa": 0.85, "tcp": 0.6}
NETWORK_EFFICIENCY = NETWORK_EFFICIENCY_BY_TRANSPORT["infiniband"]
# Share of PCIe link rate a DMA copy achieves: 55.0 of 63.0 GB/s measured on the H200.
PCIE_EFFICIENCY = 55.0 / 63.0
# Share of NVLink-C2C's per-direction rate a copy-engine host<->GPU copy achieves: 346 GB/s
# host-to-device of 450 GB/s (900 bidirectional) measured by nvbandwidth on a GH200
# (NVIDIA/nvbandwidth issue #23, 2024-08; no GB200 figure found).
C2C_EFFICIENCY = 346.0 / 450.0


@dataclass(frozen=True)
class Estimate:
    """NCCL's predicted time of one collective for one (algorithm, protocol)."""

    algorithm: str
    protocol: str
    latency_s: float
    bus_bw_bytes_per_s: float
    bw_factor: float
    """Share of the algorithm's physical bandwidth the protocol delivers, caps included."""
    wire_factor: float = 1.0
    """Payload share of the bytes the protocol puts on the wire (LL: 8 data bytes per
    16-byte line, LL128: 120 of 128; NCCL's other factors treated alike)."""
    fill_s: float = -1.0
    """Pipeline fill of this call in execution (s), set by the runner for the message size
    it selected for; negative = not set."""

    def time(self, bytes_per_rank: float) -> float:
        return self.latency_s + bytes_per_rank / self.bus_bw_bytes_per_s


def log2i(n: int) -> int:
    """NCCL's integer log2 (utils.h log2i = bitops.h log2Down): floor(log2 n), -1 for n < 1.

    Examples
    --------
    >>> [log2i(n) for n in (0, 1, 2, 3, 4, 15, 16, 17)]
    [-1, 0, 1, 1, 2, 3, 4, 4]
    """
    return int(n).bit_length() - 1 if n >= 1 else -1


def ring_steps(op: str, n_ranks: int) -> int:
    """Pipeline steps of a ring collective (tuning.cc nsteps)."""
    if op == "all_reduce":
        return 2 * (n_ranks - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n_ranks - 1
    return n_ranks


def net_overhead_us(cpu_vendor: str, protocol: str) -> float:
    """tuning.cc getNetOverhead: the proxy's per-step cost by host CPU (x3 for Simple)."""
    base = NET_OVERHEAD_BY_CPU_US.get(cpu_vendor, NET_OVERHEAD_DEFAULT_US)
    return base * (NET_OVERHEAD_SIMPLE_FACTOR if protocol == "simple" else 1.0)


def ll_max_bw_gbps(arch: str, n_nodes: int, cpu_vendor: str = DEFAULT_CPU_VENDOR) -> float:
    """tuning.cc llMaxBw: by GPU generation in one node, by host CPU across nodes."""
    col = _column(n_nodes)
    if n_nodes <= 1:
        return LL_MAX_BWS_GBPS[ARCH_ROW[arch]][col]
    return LL_MAX_BWS_GBPS[1 if cpu_vendor in ("amd", "mixed") else 0][col]


def _plateau(arch: str) -> float:
    # ncclTopoGetAlgoTime: "Plateau effect of ring", x1.9 before sm80, x1.4 from sm80.
    return 1.9 if ARCH_ROW[arch] < ARCH_ROW["ampere"] else 1.4


def latency_s(algorithm: str, op: str, protocol: str, n_ranks: int, n_nodes: int,
              intra_link: str = "nvlink", cpu_vendor: str = DEFAULT_CPU_VENDOR,
              arch: str = "hopper", nbytes: float | None = None, channels: int = 0,
              latency_inter_us: float = 0.0) -> float:
    """Latency term of a collective as ncclTopoTuneModel builds it (and the ring plateau of
    ncclTopoGetAlgoTime when ``nbytes`` is given; ``None`` = a large message).

    ``latency_inter_us`` is the network plugin's latency (0 for InfiniBand verbs:
    net_ib/init.cc sets ``props->latency = 0``).
    """
    if n_ranks <= 1:
        return 0.0
    n_nodes = max(1, n_nodes)
    ppn = n_ranks // n_nodes          # NCCL's integer nRanks / nNodes
    base = BASE_LAT_US[algorithm][protocol]
    intra = HW_LAT_US[intra_link][algorithm][protocol]
    # "With ppn=1 latencies are fully exposed, use the Tree network latency."
    inter = HW_LAT_US["network"]["tree" if n_ranks == n_nodes else algorithm][protocol]
    inter += latency_inter_us * (2.0 if protocol == "simple" else 1.0)  # + flush on Simple
    if algorithm == "ring":
        steps = ring_steps(op, n_ranks)
        if op in ("broadcast", "reduce"):
            # Rings whose channels differ pay a chunk latency per step (Simple: the tree's).
            hw = HW_LAT_US[intra_link if n_nodes == 1 else "network"]
            lat = base + steps * hw["tree" if protocol == "simple" else "ring"][protocol]
        else:
            if n_nodes > 1:
                intra = max(intra, net_overhead_us(cpu_vendor, protocol))
            inter_steps = 0 if n_nodes == 1 else (
                2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1)
            lat = base + (steps - inter_steps) * intra + inter_steps * inter
            ch = max(1, channels)
            if (op == "all_reduce" and protocol == "simple" and n_nodes > 1
                    and (nbytes is None or nbytes / (ch * n_ranks) >= 64)):
                lat *= _plateau(arch)
    elif algorithm == "tree":
        lat = base + 2 * ((ppn - 1) * intra + log2i(n_nodes) * inter)
    elif algorithm == "collnet_direct":
        # 0.4 us arity serialisation per local rank (tuning.cc).
        lat = base + 2 * (min(1, ppn - 1) * intra + (ppn - 1) * 0.4) + inter
    elif algorithm == "collnet_chain":
        lat = base + 2 * (ppn - 1) * intra + inter
    elif algorithm == "nvls":
        lat = intra + (inter if n_nodes > 1 else 0.0)
    elif algorithm == "nvls_tree":
        lat = base + intra + 2 * log2i(n_nodes) * inter
    elif algorithm == "pat":
        # A log part over nodes plus a linear part of 2.8 us per rank (tuning.cc).
        lat = base + log2i(n_nodes) * (inter / 3.5) + n_ranks * 2.8
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return lat * 1e-6


def ring_latency_s(op: str, protocol: str, n_ranks: int, n_nodes: int,
                   cpu_vendor: str = DEFAULT_CPU_VENDOR) -> float:
    """Latency of a ring collective of a large message (ring-only callers)."""
    return latency_s("ring", op, protocol, n_ranks, n_nodes, cpu_vendor=cpu_vendor)


def _column(n_nodes: int) -> int:
    return 0 if n_nodes <= 1 else (1 if n_nodes == 2 else 2)


def protocols_of(algorithm: str) -> tuple[str, ...]:
    return ("simple",) if algorithm in SIMPLE_ONLY else PROTOCOLS


def protocol_bandwidth(algorithm: str, protocol: str, n_nodes: int, arch: str, bus_bw: float,
                       channels: int, cpu_vendor: str = DEFAULT_CPU_VENDOR) -> float:
    """NCCL's bus bandwidth (bytes/s) of ``algorithm`` with ``protocol``: the model
    refinements of ncclTopoTuneModel applied to the algorithm's full bus bandwidth."""
    col = _column(n_nodes)
    ch = max(1, channels)
    ll_max = ll_max_bw_gbps(arch, n_nodes, cpu_vendor) * 1e9
    if algorithm == "ring":
        if protocol == "ll":
            return min(ll_max, bus_bw * PROTOCOL_BW_FACTOR["ll"])
        if protocol == "ll128":
            return min(bus_bw * PROTOCOL_BW_FACTOR["ll128"],
                       ch * LL128_PER_CHANNEL_GBPS[arch] * 1e9)
        return bus_bw
    if algorithm == "tree":   # all-reduce (the only collective NCCL runs on trees)
        bw = min(bus_bw * TREE_ALLREDUCE_FACTOR, ch * TREE_PER_CHANNEL_GBPS[arch][col] * 1e9)
        if protocol == "ll":
            return min(bw * TREE_BW_FACTOR["ll"], ll_max)
        if protocol == "ll128":
            f = TREE_BW_FACTOR["ll128_one_node" if n_nodes == 1 else "ll128"]
            return min(bw * f, ch * TREE_LL128_PER_CHANNEL_GBPS[arch][col] * 1e9)
        return bw
    if algorithm == "pat":
        return bus_bw * PAT_BW_FACTOR
    if algorithm == "nvls_tree":
        cap = NVLS_TREE_PER_CHANNEL_GBPS[arch][col] * 1e9 * ch
        return min(bus_bw, cap) if cap > 0 else bus_bw
    if algorithm == "collnet_direct" and ARCH_ROW[arch] >= ARCH_ROW["hopper"]:
        return bus_bw * COLLNET_DIRECT_SM90_FACTOR
    return bus_bw


def estimates(algorithm: str, op: str, n_ranks: int, n_nodes: int, arch: str,
              bus_bw: float, channels: int, cpu_vendor: str = DEFAULT_CPU_VENDOR,
              nbytes: float | None = None, intra_link: str = "nvlink") -> list[Estimate]:
    """Predicted (latency, bus bandwidth) of each protocol NCCL offers for ``algorithm``.

    ``bus_bw`` (bytes/s) is the algorithm's bus bandwidth at full protocol efficiency, from
    the fabric (the simulator's counterpart of NCCL's nChannels x per-channel bandwidth).
    """
    out = []
    for p in protocols_of(algorithm):
        bw = protocol_bandwidth(algorithm, p, n_nodes, arch, bus_bw, channels, cpu_vendor)
        lat = latency_s(algorithm, op, p, n_ranks, n_nodes, intra_link, cpu_vendor, arch,
                        nbytes, channels)
        # The runner puts NCCL's protocol and algorithm factors on the wire as overhead
        # bytes (LL's flags, LL128's lines, the tree's and PAT's efficiency) and its caps
        # (LL maximum, per-channel limits) on the flows' rates.
        factor = protocol_bandwidth(algorithm, p, n_nodes, arch, 1.0, 1, cpu_vendor)
        out.append(Estimate(algorithm, p, lat, bw,
                            min(1.0, bw / bus_bw) if bus_bw > 0 else factor, factor))
    return out


def algo_time(est: Estimate, op: str, nbytes: float, volume: float, arch: str = "hopper",
              cpu_vendor: str = DEFAULT_CPU_VENDOR) -> float:
    """ncclTopoGetAlgoTime for one call (numPipeOps = 1): latency + bytes / bandwidth, the
    tree's bandwidth corrected per size (``treeCorrectionFactor``; also NVLS-tree on
    Blackwell with an x86 host). ``volume`` turns ``nbytes`` into bus bytes (NCCL's
    busBw -> algBw ratio). No pipeline fill: NCCL's choice does not include one."""
    bw = est.bus_bw_bytes_per_s
    log_size = log2i(int(nbytes) >> 6)
    correct = op == "all_reduce" and 0 <= log_size < len(TREE_CORRECTION["simple"]) and (
        (est.algorithm == "tree" and log_size < 23)
        or (est.algorithm == "nvls_tree" and ARCH_ROW[arch] >= ARCH_ROW["blackwell"]
            and cpu_vendor in X86_VENDORS))
    if correct:
        bw *= TREE_CORRECTION[est.protocol][log_size]
    return est.latency_s + nbytes * volume / bw


def chunk_bytes(algorithm: str, nbytes: float, channels: int, heads: int, n_nodes: int,
                buffsize: float, nvls_chunk: float = NVLS_CHUNK_BYTES) -> float:
    """The Simple chunk NCCL pipelines ``algorithm`` in (enqueue.cc calcCollChunking):
    one buffer step (NCCL_BUFFSIZE / NCCL_STEPS) for trees and CollNet, NVLink SHARP's
    ``NCCL_NVLS_CHUNKSIZE`` (128 KiB) cut to 64/32/16 KiB when few chunks would be in flight,
    NVLS-tree's (at most 64 KiB from 4 nodes on, nvls.cc ncclNvlsTuning) cut by size."""
    step = buffsize / NCCL_STEPS
    ops = max(1, channels) * max(1, heads)      # concurrentOps = nChannels x nHeads
    if algorithm == "nvls":
        chunk = min(step, nvls_chunk)
        for mult, size in ((64, 65536), (8, 32768), (2, 16384)):
            if nbytes < mult * ops * chunk and chunk > size:
                chunk = size
        return chunk
    if algorithm == "nvls_tree":
        chunk = min(nvls_chunk, 65536 if n_nodes >= 4 else nvls_chunk)
        for mult, size in ((32, 262144), (16, 131072), (4, 65536), (1, 32768)):
            if nbytes < mult * ops * chunk and chunk > size:
                chunk = size
        return chunk
    if algorithm == "collnet_chain":
        return min(256 * 1024, step)
    return step


def choose(candidates: list[Estimate], bytes_per_rank: float, protocol: str = "auto"
           ) -> Estimate:
    """The candidate of least predicted time (restricted to ``protocol`` unless auto)."""
    pool = [c for c in candidates if protocol == "auto" or c.protocol == protocol]
    if not pool:
        raise ValueError(f"protocol {protocol} is not available for this collective")
    return min(pool, key=lambda e: e.time(bytes_per_rank))


# Kept for the ring-only callers and tests of the previous version.
def choose_protocol(op: str, bytes_per_rank: float, n_ranks: int, n_nodes: int, arch: str,
                    link_bus_bw: float, channels: int, forced: str = "auto") -> Estimate:
    return choose(estimates("ring", op, n_ranks, n_nodes, arch, link_bus_bw, channels),
                  bytes_per_rank, forced)
