"""The ``cluster:`` section of a scenario: the machines and the fabric between them.

Part of the config layer (``sim.scenario`` re-exports these names). Fields left out come from
a topology file (merged by :mod:`sim.config.load`) or from the GPU catalogue.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sim.config import bounds as B
from sim.config.base import StrictModel
from sim.config.zones import AzPlacement

GpuName = Literal["v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "h800",
                  "gb200", "h100-hbm2e-96gb", "b300", "gb300"]


class Cluster(StrictModel):
    """The machines and the fabric between them. Fields left out come from the topology file
    (when one is named) or from the GPU catalogue."""

    topology: str | None = None
    """A file in ``topologies/`` (by name) or a path; inline fields override it."""
    gpu: GpuName = "h100-sxm"
    """GPU model, a name from the GPU catalogue."""
    nodes: int = Field(default=1, gt=0, le=B.MAX_NODES)
    """Number of servers."""
    gpus_per_node: int = Field(default=8, gt=0, le=B.MAX_GPUS_PER_NODE)
    """GPUs in each server, joined by NVLink through NVSwitch."""
    nvlink_gbytes_per_s: float | None = Field(default=None, gt=0, le=B.GBYTES_PER_S_MAX)
    """NVLink bandwidth per GPU per direction; defaults to the GPU's datasheet figure."""
    pcie_gbytes_per_s: float | None = Field(default=None, gt=0, le=B.GBYTES_PER_S_MAX)
    """PCIe x16 bandwidth per direction; defaults to the GPU's PCIe generation."""
    nics_per_node: int = Field(default=8, ge=0, le=B.MAX_NICS_PER_NODE)
    """Network adapters per server, rail-aligned to GPUs."""
    nic_gbps: float = Field(default=400.0, gt=0, le=B.MAX_LINK_GBPS)
    """Line rate of each NIC, gigabits per second."""
    nodes_per_leaf: int = Field(default=16, gt=0, le=B.MAX_NODES_PER_LEAF)
    """Servers whose NICs share one leaf switch (per rail when rail-optimised)."""
    oversubscription: float = Field(default=1.0, ge=1.0, le=B.MAX_OVERSUBSCRIPTION)
    """Leaf downlink over uplink capacity (1 = full bisection)."""
    rail_optimized: bool = True
    """NIC k of every server in a leaf group connects to that group's rail-k leaf."""
    azs: int = Field(default=1, gt=0, le=B.MAX_ZONES)
    """Availability zones the servers are spread over (by ``az_placement``)."""
    az_placement: AzPlacement = "round_robin"
    """How the servers fill the zones: ``round_robin`` (node n in zone n % azs) or ``blocks``
    (each zone's servers consecutive, as a host list grouped by zone; :mod:`sim.config.zones`)."""
    az_link_gbps: float = Field(default=100.0, gt=0, le=B.MAX_LINK_GBPS)
    """Capacity between two zones, gigabits per second per direction."""
    az_latency_ms: float = Field(default=1.0, ge=0, le=B.MAX_LATENCY_MS)
    """One-way latency between two zones."""
    nic_latency_us: float | None = Field(default=None, ge=0, le=B.LATENCY_US_MAX)
    """NIC plus cable latency per traversal; defaults to the transport's figure."""
    switch_latency_us: float | None = Field(default=None, ge=0, le=B.LATENCY_US_MAX)
    """Per network switch hop; defaults to the transport's figure."""
    nic_transport: Literal["infiniband", "roce", "efa", "tcp"] = "infiniband"
    """What the NICs speak: InfiniBand verbs, RoCE v2, AWS EFA (SRD), or plain TCP sockets."""
    pcie_switches_per_node: int | None = Field(default=None, gt=0,
                                               le=B.MAX_PCIE_SWITCHES)
    """PCIe switches per server (GPUs and NICs spread evenly over them); default one per NIC."""
    regions: int = Field(default=1, gt=0, le=B.MAX_ZONES)
    """Cloud regions the zones are spread over, round robin by zone."""
    region_link_gbps: float = Field(default=100.0, gt=0, le=B.MAX_LINK_GBPS)
    """Capacity between two regions, gigabits per second per direction."""
    region_latency_ms: float = Field(default=30.0, ge=0, le=B.MAX_LATENCY_MS)
    """One-way latency between two regions."""
    cpu_cores: int | None = Field(default=None, gt=0, le=B.MAX_CPU_CORES)
    """CPU cores per server (both sockets); default from the host catalogue."""
    host_memory_gib: float | None = Field(default=None, gt=0, le=B.MAX_HOST_MEMORY_GIB)
    """CPU memory per server; default from the host catalogue."""
    host_memory_gbytes_per_s: float | None = Field(default=None, gt=0,
                                                     le=B.GBYTES_PER_S_MAX)
    """Achievable CPU memory bandwidth per server (STREAM-like); default from the host
    catalogue."""
    nvme_read_gbytes_per_s: float | None = Field(default=None, gt=0,
                                                   le=B.GBYTES_PER_S_MAX)
    """Local NVMe read bandwidth per server (all drives striped); default from the host
    catalogue."""
    nvme_write_gbytes_per_s: float | None = Field(default=None, gt=0,
                                                    le=B.GBYTES_PER_S_MAX)
    """Local NVMe write bandwidth per server; default from the host catalogue."""
    cpu_vendor: Literal["intel", "amd", "arm", "power", "zhaoxin", "mixed"] = "intel"
    """Host CPU vendor (architecture for Arm and POWER): NCCL indexes its LL bandwidth
    limit across nodes and its network overhead by it (tuning.cc). Intel where unknown."""
    routing: Literal["ecmp", "adaptive"] | None = None
    """How flows spread over the spine switches: ``ecmp`` (static per-flow hash) or
    ``adaptive`` (per-packet spreading, as InfiniBand adaptive routing and EFA's SRD do);
    default by ``nic_transport`` (:data:`sim.fabric.topology.routing.ROUTING_BY_TRANSPORT`)."""
    sharp: bool = False
    """The network switches do in-network reductions (InfiniBand SHARP) and NCCL's CollNet
    plugin is set up: CollNet Direct/Chain become available (with ``nccl.collnet_enable``)."""
    gpu_power_w: float | None = Field(default=None, gt=0, le=B.MAX_GPU_POWER_W)
    """The GPUs' power cap in watts (default: the part's TDP). A cap lowers the sustained SM
    clock and so the matrix (GEMM, attention) rates; memory-bound kernels barely change
    (:mod:`sim.hardware.power`)."""
    sm_clock: Literal["held", "balanced"] = "held"
    """The SM clock tensor-core kernels run at. ``held``: the clock a GEMM held back to back
    keeps at the power limit (the kernel tables' own regime: about 1,525 MHz on a 700 W
    Hopper part), on which the published multi-GPU runs are anchored. ``balanced``: the
    clock where the step's mix of GEMMs, attention and memory-bound kernels meets the
    limit, or ``gpu_power_w`` where set (700 W Hopper parts, dense models;
    :mod:`sim.frameworks.common.power_clock`):
    measured single-GPU H200 steps held 1,500-1,800 MHz, within 4% of it on the machine
    it was fitted on; the draw of a multi-GPU step's collectives is not in it."""

    @model_validator(mode="after")
    def _check_power(self) -> Cluster:
        if self.gpu_power_w is not None:
            from sim import catalog
            problem = catalog.gpu(self.gpu).power_cap_problem(self.gpu_power_w)
            if problem:
                raise ValueError(f"cluster.gpu_power_w: {problem}")
        return self
