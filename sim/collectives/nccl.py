"""NCCL's cost model: latencies, protocol bandwidths, channel counts, algorithm choice.

Values from NCCL ``src/graph/tuning.cc`` (v2.30, ``ncclTopoTuneModel``), ``src/graph/topo.h``
and ``src/transport/nvls.cc``, cited per table. Our own code; the structure follows NCCL's:

* latency of a collective = a base latency of (algorithm, protocol) plus hardware latencies
  per step, NVLink steps inside a node and network steps between nodes;
* bandwidth of a protocol = a share of the algorithm's bus bandwidth (LL moves 8 data bytes
  per 16-byte line, LL128 120 of 128, Simple all of it), capped per channel;
* ``auto`` picks the (algorithm, protocol) of least predicted time for the message size.

The simulator uses this model twice: to choose what NCCL would run, and for the latency term
of what it runs. The bandwidth a collective gets is not taken from here: its flows share the
fabric (:mod:`sim.collectives.runner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree")
PROTOCOLS = ("ll", "ll128", "simple")

# tuning.cc baseLat [algorithm][protocol], microseconds (LL, LL128, Simple).
BASE_LAT_US = {
    "tree": {"ll": 6.8, "ll128": 14.0, "simple": 8.4},
    "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
    "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
    "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
}
# tuning.cc hwLat [link type][algorithm][protocol], microseconds per step.
HW_LAT_US = {
    "nvlink": {"tree": {"ll": 0.6, "ll128": 1.25, "simple": 4.0},
               "ring": {"ll": 0.6, "ll128": 1.9, "simple": 3.4},
               "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 25.0},
               "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 25.0}},
    "pcie": {"tree": {"ll": 1.0, "ll128": 1.9, "simple": 4.0},
             "ring": {"ll": 1.0, "ll128": 2.5, "simple": 5.7},
             "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 0.0},
             "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 0.0}},
    "network": {"tree": {"ll": 5.0, "ll128": 8.5, "simple": 14.0},
                "ring": {"ll": 2.7, "ll128": 4.0, "simple": 14.0},
                "nvls": {"ll": 0.0, "ll128": 0.0, "simple": 18.0},
                "nvls_tree": {"ll": 0.0, "ll128": 0.0, "simple": 20.9}},
}
# Backwards-compatible views of the ring row.
RING_BASE_LAT_US = BASE_LAT_US["ring"]
RING_HW_LAT_US = {link: HW_LAT_US[link]["ring"] for link in HW_LAT_US}
# tuning.cc: each network step also costs the CPU proxy 1 us (x3 for Simple).
NET_OVERHEAD_US = {"ll": 1.0, "ll128": 1.0, "simple": 3.0}
# Share of the bus bandwidth each protocol delivers on rings (tuning.cc: LL busBw*0.5, LL128
# *0.92); trees: Simple *0.92, LL /3.8, LL128 7/9 in one node else 120/128.
PROTOCOL_BW_FACTOR = {"ll": 0.5, "ll128": 0.92, "simple": 1.0}
TREE_BW_FACTOR = {"ll": 1 / 3.8, "ll128_one_node": 7 / 9, "ll128": 120 / 128, "simple": 0.92}
# tuning.cc llMaxBws (GB/s of bus bandwidth) for [1 node, 2 nodes, >2 nodes], by generation.
LL_MAX_BW_GBPS = {
    "volta": (39.0, 39.0, 20.4),
    "ampere": (87.7, 22.5, 19.0),
    "hopper": (141.0, 45.0, 35.0),
    "blackwell": (282.0, 90.0, 70.0),
}
# tuning.cc perChMaxRingLL128Bws, perChMaxTreeLL128Bws, perChMaxTreeBws per channel (GB/s).
LL128_PER_CHANNEL_GBPS = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
TREE_LL128_PER_CHANNEL_GBPS = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                               "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}
TREE_PER_CHANNEL_GBPS = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                         "hopper": (38.7, 41.4, 36.0), "blackwell": (70.0, 42.8, 24.0)}
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
# 160), their mean. RoCE v2 runs the same verbs over Ethernet (same share assumed); EFA (SRD
# through the aws-ofi-nccl plugin) and TCP sockets deliver less: assumed 0.85 and 0.6 of line
# rate, pending published nccl-tests figures.
NETWORK_EFFICIENCY_BY_TRANSPORT = {"infiniband": (47.0 / 50.0 + 24.0 / 25.0) / 2,
                                   "roce": (47.0 / 50.0 + 24.0 / 25.0) / 2,
                                   "efa": 0.85, "tcp": 0.6}
NETWORK_EFFICIENCY = NETWORK_EFFICIENCY_BY_TRANSPORT["infiniband"]
# Share of PCIe link rate a DMA copy achieves: 55.0 of 63.0 GB/s measured on the H200.
PCIE_EFFICIENCY = 55.0 / 63.0


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

    def time(self, bytes_per_rank: float) -> float:
        return self.latency_s + bytes_per_rank / self.bus_bw_bytes_per_s


def ring_steps(op: str, n_ranks: int) -> int:
    """Pipeline steps of a ring collective (tuning.cc nsteps)."""
    if op == "all_reduce":
        return 2 * (n_ranks - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n_ranks - 1
    return n_ranks


def latency_s(algorithm: str, op: str, protocol: str, n_ranks: int, n_nodes: int,
              intra_link: str = "nvlink") -> float:
    """Latency term of a collective (tuning.cc ncclTopoTuneModel)."""
    if n_ranks <= 1:
        return 0.0
    base = BASE_LAT_US[algorithm][protocol]
    intra = HW_LAT_US[intra_link][algorithm][protocol]
    inter = HW_LAT_US["network"][algorithm][protocol]
    ppn = max(1, n_ranks // max(1, n_nodes))
    if algorithm == "ring":
        steps = ring_steps(op, n_ranks)
        inter_steps = (2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1) \
            if n_nodes > 1 else 0
        if n_nodes > 1:
            intra = max(intra, NET_OVERHEAD_US[protocol])
        lat = base + (steps - inter_steps) * intra + inter_steps * inter
        if op == "all_reduce" and protocol == "simple" and n_nodes > 1:
            lat *= 1.4  # tuning.cc: ring Simple multi-node all-reduce latency x1.4 on sm80+
    elif algorithm == "tree":
        lat = base + 2 * ((ppn - 1) * intra + math.log2(max(n_nodes, 1)) * inter)
    elif algorithm == "nvls":
        lat = base + intra + (inter if n_nodes > 1 else 0.0)
    else:  # nvls_tree
        lat = base + intra + 2 * math.log2(max(n_nodes, 1)) * inter
    return lat * 1e-6


def ring_latency_s(op: str, protocol: str, n_ranks: int, n_nodes: int) -> float:
    """Latency of a ring collective (kept for callers of the ring-only model)."""
    return latency_s("ring", op, protocol, n_ranks, n_nodes)


def _column(n_nodes: int) -> int:
    return 0 if n_nodes == 1 else (1 if n_nodes == 2 else 2)


def estimates(algorithm: str, op: str, n_ranks: int, n_nodes: int, arch: str,
              bus_bw: float, channels: int) -> list[Estimate]:
    """Predicted (latency, bus bandwidth) of each protocol NCCL offers for ``algorithm``.

    ``bus_bw`` (bytes/s) is the algorithm's bus bandwidth at full protocol efficiency, from
    the fabric (the simulator's counterpart of NCCL's nChannels x per-channel bandwidth).
    """
    col = _column(n_nodes)
    out = []
    protocols = ("simple",) if algorithm in ("nvls", "nvls_tree") else PROTOCOLS
    for p in protocols:
        if algorithm == "tree":
            key = "ll128_one_node" if (p == "ll128" and n_nodes == 1) else p
            factor = TREE_BW_FACTOR[key]
            bw = bus_bw * factor
            if p == "simple":
                bw = min(bw, channels * TREE_PER_CHANNEL_GBPS[arch][col] * 1e9)
            elif p == "ll128":
                bw = min(bw, channels * TREE_LL128_PER_CHANNEL_GBPS[arch][col] * 1e9)
        else:
            factor = PROTOCOL_BW_FACTOR[p]
            bw = bus_bw * factor
            if p == "ll128":
                bw = min(bw, channels * LL128_PER_CHANNEL_GBPS[arch] * 1e9)
        if p == "ll":
            bw = min(bw, LL_MAX_BW_GBPS[arch][col] * 1e9)
        out.append(Estimate(algorithm, p, latency_s(algorithm, op, p, n_ranks, n_nodes),
                            bw, min(1.0, bw / bus_bw) if bus_bw > 0 else factor, factor))
    return out


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
