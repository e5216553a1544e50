"""NCCL's cost model constants and protocol choice (v1: the ring algorithm).

Values from NCCL ``src/graph/tuning.cc`` (v2.30, ``ncclTopoTuneModel``), cited per table. Our
own code; the structure follows NCCL's:

* latency of a ring collective = base latency of (algorithm, protocol) + one hardware latency
  per step, NVLink steps inside a node and network steps between nodes;
* bandwidth of a protocol = a factor of the link bandwidth: LL moves 8 bytes of data per
  16-byte line (50%), LL128 120 of 128 bytes (NCCL uses 0.92 with its other overheads),
  Simple the full bandwidth;
* ``auto`` picks the protocol of least predicted time for the message size.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOLS = ("ll", "ll128", "simple")

# tuning.cc baseLat, Ring row, microseconds (LL, LL128, Simple).
RING_BASE_LAT_US = {"ll": 6.6, "ll128": 14.0, "simple": 8.4}
# tuning.cc hwLat, Ring column, microseconds per step, by link type (LL, LL128, Simple).
RING_HW_LAT_US = {
    "nvlink": {"ll": 0.6, "ll128": 1.9, "simple": 3.4},
    "pcie": {"ll": 1.0, "ll128": 2.5, "simple": 5.7},
    "network": {"ll": 2.7, "ll128": 4.0, "simple": 14.0},
}
# tuning.cc: network steps of Simple pay the CPU proxy overhead, 1 us (x3 for Simple) each.
NET_OVERHEAD_US = {"ll": 1.0, "ll128": 1.0, "simple": 3.0}
# Share of the link bandwidth each protocol delivers (tuning.cc: LL busBw*0.5, LL128 *0.92).
PROTOCOL_BW_FACTOR = {"ll": 0.5, "ll128": 0.92, "simple": 1.0}
# tuning.cc llMaxBws (GB/s of bus bandwidth) for [1 node, 2 nodes, >2 nodes], by GPU generation.
LL_MAX_BW_GBPS = {
    "volta": (39.0, 39.0, 20.4),
    "ampere": (87.7, 22.5, 19.0),
    "hopper": (141.0, 45.0, 35.0),
    "blackwell": (282.0, 90.0, 70.0),
}
# tuning.cc perChMaxRingLL128Bws per channel (GB/s), by generation.
LL128_PER_CHANNEL_GBPS = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
# NCCL's per-link NVLink bandwidth used in its topology search (src/graph/topo.h,
# SM80_NVLINK_BW 20.0 and SM90_NVLINK_BW 20.6 GB/s, SM100 40.1), against the raw 25 GB/s per
# direction per NVLink3/4 link (50 for NVLink5): the share of NVLink a ring achieves. 18 x 20.6
# = 371 GB/s, the ~370 GB/s nccl-tests reports for H100 in-node rings (nccl-tests issue 212).
NVLINK_EFFICIENCY = {"volta": 20.0 / 25.0, "ampere": 20.0 / 25.0, "hopper": 20.6 / 25.0,
                     "blackwell": 40.1 / 50.0}
# Share of NIC line rate a ring achieves between nodes: 46-48 GB/s per 400 Gb/s NDR NIC
# (nccl-tests issue 290), 24 of 25 GB/s per HDR NIC (nccl-tests issue 160); their mean.
NETWORK_EFFICIENCY = (47.0 / 50.0 + 24.0 / 25.0) / 2
# Share of PCIe link rate a DMA copy achieves: 55.0 of 63.0 GB/s measured on the H200.
PCIE_EFFICIENCY = 55.0 / 63.0


@dataclass(frozen=True)
class RingEstimate:
    """NCCL's predicted time of one ring collective for one protocol."""

    protocol: str
    latency_s: float
    bus_bw_bytes_per_s: float

    def time(self, bytes_per_rank: float) -> float:
        return self.latency_s + bytes_per_rank / self.bus_bw_bytes_per_s


def ring_steps(op: str, n_ranks: int) -> int:
    """Pipeline steps of a ring collective (tuning.cc nsteps)."""
    if op == "all_reduce":
        return 2 * (n_ranks - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n_ranks - 1
    return n_ranks


def ring_latency_s(op: str, protocol: str, n_ranks: int, n_nodes: int) -> float:
    """Latency term of a ring collective: base + intra-node steps + inter-node steps."""
    if n_ranks <= 1:
        return 0.0
    steps = ring_steps(op, n_ranks)
    inter = (2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1) if n_nodes > 1 else 0
    intra_lat = RING_HW_LAT_US["nvlink"][protocol]
    if n_nodes > 1:
        intra_lat = max(intra_lat, NET_OVERHEAD_US[protocol])
    inter_lat = RING_HW_LAT_US["network"][protocol]
    lat = RING_BASE_LAT_US[protocol] + (steps - inter) * intra_lat + inter * inter_lat
    if op == "all_reduce" and protocol == "simple" and n_nodes > 1:
        lat *= 1.4  # tuning.cc: ring Simple multi-node all-reduce latency x1.4 on sm80+
    return lat * 1e-6


def ring_estimates(op: str, n_ranks: int, n_nodes: int, arch: str, link_bus_bw: float,
                   channels: int) -> list[RingEstimate]:
    """Predicted (latency, bus bandwidth) of each protocol; ``link_bus_bw`` in bytes/s is the
    bandwidth of the ring's slowest hop with the protocol at full efficiency."""
    col = 0 if n_nodes == 1 else (1 if n_nodes == 2 else 2)
    out = []
    for p in PROTOCOLS:
        bw = link_bus_bw * PROTOCOL_BW_FACTOR[p]
        if p == "ll":
            bw = min(bw, LL_MAX_BW_GBPS[arch][col] * 1e9)
        elif p == "ll128":
            bw = min(bw, channels * LL128_PER_CHANNEL_GBPS[arch] * 1e9)
        out.append(RingEstimate(p, ring_latency_s(op, p, n_ranks, n_nodes), bw))
    return out


def choose_protocol(op: str, bytes_per_rank: float, n_ranks: int, n_nodes: int, arch: str,
                    link_bus_bw: float, channels: int, forced: str = "auto") -> RingEstimate:
    """The protocol NCCL would pick (least predicted time), unless ``forced``."""
    ests = ring_estimates(op, n_ranks, n_nodes, arch, link_bus_bw, channels)
    if forced != "auto":
        return next(e for e in ests if e.protocol == forced)
    return min(ests, key=lambda e: e.time(bytes_per_rank))
