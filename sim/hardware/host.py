"""The servers' CPUs, host memory and local NVMe: what offloading frameworks lean on.

ZeRO-Offload/Infinity and FSDP2's ``CPUOffloadPolicy`` keep optimizer states (and sometimes
parameters) in host memory or on NVMe and run the optimizer step on the CPU. The transfers
themselves run as flows on the fabric's PCIe and NVMe links (:mod:`sim.engine.core`); this module
gives the host figures those links and the CPU step need.

Defaults follow the NVIDIA DGX server that carries each GPU generation (the datasheets name
the CPUs, the memory and the drives); a scenario's ``cluster`` fields override them. Grace
superchips (GB200, GH200) are hosted differently: one Grace CPU with its own LPDDR5X per two
GPUs (per GPU on GH200), reached over NVLink-C2C instead of PCIe; :class:`HostSpec` then
describes one Grace and the GPUs it hosts (``gpus_per_host``), and the fabric gives each Grace
its C2C link (``c2c_gbytes_per_s``).

The CPU optimizer step is memory-bound: AdamW does about a dozen flops per parameter, far
below what AVX-512 cores deliver, while it streams every optimizer tensor through DRAM. Its
time is the bytes it moves over the bandwidth the rank gets: the node's achievable bandwidth
shared by the ranks stepping at once, or what the rank's threads can pull, whichever is lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sim.scenario import Scenario

# Achievable over theoretical DRAM bandwidth: STREAM triad on two-socket servers reaches
# 70-80% of the channels' peak (e.g. ~330 of 410 GB/s on 2x EPYC 7742, ~470 of 614 GB/s on
# 2x Xeon 8480; vendors' published STREAM results); we take 0.75.
STREAM_FRACTION = 0.75

# --- Grace hosts (GB200 superchip) -----------------------------------------------------------
# NVIDIA GB200 NVL72 datasheet (2024), GB200 Grace Blackwell Superchip column: one Grace CPU
# and two Blackwell GPUs; 72 Arm Neoverse V2 cores, up to 480 GB LPDDR5X at up to 512 GB/s;
# NVLink-C2C 900 GB/s bidirectional (the rack: 36 Graces, 2,592 cores, 17 TB at 18.4 TB/s).
GB200_GPUS_PER_GRACE = 2
GRACE_CORES = 72
GRACE_MEMORY_GB = 480.0
GRACE_LPDDR5X_GBYTES_PER_S = 512.0
# The Grace's C2C port per direction: 900 GB/s bidirectional / 2, shared by its two GPUs (the
# datasheet gives one C2C figure per superchip). STREAM_FRACTION applies to the LPDDR5X as to
# DDR: NVIDIA's Grace performance tuning guide ("Basic System Health Checks", STREAM) expects
# TRIAD of 410 GB/s and up on a 512 GB/s superchip, 0.80 of peak, near the 0.75 used here.
NVLINK_C2C_GBYTES_PER_S = 450.0
# CPU seconds a Grace spends per framework op against the x86 hosts the frameworks' issue
# costs come from (compute.EAGER_*, megatron.build.MEGATRON_CPU_S_PER_OP): the same script
# timed torch.nn.Linear's forward (bf16, hidden 2048, 8,192 tokens) at 37.08 us of CPU on
# GB200 against 13.48 us on a DGX H100 (Xeon Platinum 8480C) (NVIDIA/TransformerEngine issue
# #2053, 2025-08; GH200 33.17 us). One op, one measurement: PyTorch's dispatch, cuBLAS's
# launch path and the Python interpreter on Neoverse V2 against Sapphire Rapids.
X86_TORCH_LINEAR_CALL_CPU_S = 13.48e-6
GRACE_TORCH_LINEAR_CALL_CPU_S = 37.08e-6
GRACE_CPU_OP_FACTOR = GRACE_TORCH_LINEAR_CALL_CPU_S / X86_TORCH_LINEAR_CALL_CPU_S
# Python-level work runs nearly as fast on Grace as on those x86 hosts: PyTorch issue 187862
# (zou3519, 2026-06-22) times op dispatch from Python (``OpOverload.__call__``) on a GB200 at
# 70.7 ns a direct call against 65.5 on an H100 host, and its overhead at 126 against 111 ns.
GRACE_PYTHON_FACTOR = (70.7 / 65.5 + 126.0 / 111.0) / 2
# One Transformer Engine module call (a ``te.Linear`` forward, bf16), the unit Megatron-Core's
# TE layers are priced in, by TE release. TE cut its modules' CPU work from v2.11 (PRs #2377
# and #2400, 2025-11; a maintainer on TE issue #2126, 2026-01-03: "CPU overhead should have
# been greatly reduced as of today ... TELinear is nearly the same with vanilla torch linear").
# Before the cut: 99.66 us of CPU on GB200 (TE issue #2053, 2025-08, the same script as
# GRACE_CPU_OP_FACTOR's). After it: 59.19 us on GB200 (TE PR 3523's CPU-time table, 2026-09,
# main before that PR's change; later cuts, #2439 in v2.13, #2559 in v2.14, #2957 in v2.16,
# have no measurement of their own, so every release from v2.11 is priced at it).
TE_CPU_OVERHEAD_CUT_RELEASE = (2, 11, 0)
GRACE_TE_MODULE_CALL_CPU_S_BEFORE_CUT = 99.66e-6
GRACE_TE_MODULE_CALL_CPU_S = 59.19e-6
# On an x86 host a call is torch.nn.Linear's 13.48 us (its dispatch and GEMM launch) plus TE's
# own work beyond it (the Grace call less torch's 37.08 us there: the module's Python, its FP8
# and device checks, the autograd Function), which is Python and so takes Grace's Python
# ratio, not its launch path's: 70.0 us before the cut, 33.4 after.
X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT = X86_TORCH_LINEAR_CALL_CPU_S + (
    GRACE_TE_MODULE_CALL_CPU_S_BEFORE_CUT - GRACE_TORCH_LINEAR_CALL_CPU_S) / GRACE_PYTHON_FACTOR
X86_TE_MODULE_CALL_CPU_S = X86_TORCH_LINEAR_CALL_CPU_S + (
    GRACE_TE_MODULE_CALL_CPU_S - GRACE_TORCH_LINEAR_CALL_CPU_S) / GRACE_PYTHON_FACTOR

# An x86 DGX host's seconds per framework op inside a training job, over the isolated single-
# process figures its issue costs come from (X86_TORCH_LINEAR_CALL_CPU_S, the TE module call
# derived from it, compute.EAGER_*): FITTED, not measured (docs/calibration.md, fifty-seventh
# and fifty-eighth sessions). Chosen from 1.0 / 1.25 / 1.5 / 1.75 on the x86 rows of the
# published MoE suite's NVIDIA performance tables (nemo-*, mbridge-*, card-*) less the host-
# bound regime's three rows, reported apart (37 rows, MAPE 10.5 / 8.9 / 8.4 / 8.9%), and
# checked on its other x86 rows, never consulted to choose it (Megatron-LM's recipes, the model
# zoo, the MoE report, AutoModel, torchtitan, DGX Cloud: 38 rows, 13.0 / 12.1 / 12.4 / 13.5%)
# and on Megatron-LM's one-layer FP8 timings (moe-layer: 6.9 / 5.6 / 5.5 / 6.3%). What it
# stands for, none of it measured here: TE issue #2053's 13.48 us was one process timing one
# module in a loop on an otherwise idle DGX H100 (its Xeon at its single-core turbo, the loop's
# code and data hot in cache), where a training node runs eight ranks' Python threads beside
# NCCL's proxy threads, each rank walking a whole model's modules; the lent H200's KVM Xeon
# enqueued a looped F.linear at 25-43 us an expert forward and 67-88 us backward
# (sim/catalog/calibration/h200-grouped-linear-host.json) against the 10 and 5 us per op the
# eager path is priced at. Grace keeps its measured ratio (GRACE_CPU_OP_FACTOR): its figures
# were measured by the same script, and the rows on it were not part of the choice; the A100
# and V100 hosts keep 1.0 (MEGATRON_CPU_S_PER_OP was fitted in-job on vTrain's A100s).
X86_TRAINING_HOST_FACTOR = 1.5

# One core's sustained DRAM bandwidth. Little's law: ~48 outstanding L2 misses of 64 B over a
# ~110 ns DRAM latency bound a Golden Cove / Zen 2 core near 28 GB/s; single-thread STREAM
# measures 10-20 GB/s on these servers. We take 15 GB/s.
CORE_GBYTES_PER_S = 15.0

# Bytes of DRAM traffic per parameter of one AdamW step.
# DeepSpeedCPUAdam (csrc/adam/cpu_adam_impl.cpp, Step_AVX): reads the fp32 parameter,
# gradient, exp_avg and exp_avg_sq (16 B), writes the parameter and both moments (12 B).
# The fused 16-bit copy (ds_adam_step_plus_copy) is not used by ZeRO: stage_1_and_2.py
# _optimizer_step has it commented out and stage3.py calls optimizer.step() without it; the
# frameworks move the updated partition back themselves.
DEEPSPEED_ADAM_BYTES_PER_PARAM = 28.0
# torch.optim.AdamW on CPU tensors runs _single_tensor_adamw (foreach is CUDA-only): one
# vectorised ATen kernel per line, each a full pass: param.mul_ (r4 w4), exp_avg.lerp_
# (r8 w4), exp_avg_sq.mul_ (r4 w4) and .addcmul_ (r12 w4), denom = sqrt (r4 w4), / bias
# correction (r4 w4), .add_(eps) (r4 w4), param.addcdiv_ (r12 w4): 52 B read, 32 B written.
TORCH_ADAMW_BYTES_PER_PARAM = 84.0

# Threads one rank's optimizer uses. torchrun sets OMP_NUM_THREADS=1 for each process when it
# starts several per node (torch/distributed/run.py: only when nproc_per_node > 1 and the
# variable is unset), so torch's CPU AdamW runs on one core; a single process per node keeps
# torch's default, one intra-op thread per core. DeepSpeedCPUAdam parallelises with OpenMP
# over the cores the rank is bound to (the node's cores divided by its ranks, deepspeed
# --bind_cores_to_rank).
TORCH_THREADS_PER_RANK = 1


@dataclass(frozen=True)
class HostSpec:
    """One server's CPU side.

    Examples
    --------
    >>> h = HostSpec(cpu_cores=112, memory_gib=2048, memory_gbytes_per_s=460.8,
    ...              nvme_read_gbytes_per_s=55.2, nvme_write_gbytes_per_s=32.0,
    ...              gpus_per_node=8)
    >>> round(h.memory_gbytes_per_s / h.gpus_per_node, 1)
    57.6
    """

    cpu_cores: int
    memory_gib: float
    memory_gbytes_per_s: float
    """Achievable (STREAM-like) DRAM bandwidth of the whole server."""
    nvme_read_gbytes_per_s: float
    nvme_write_gbytes_per_s: float
    gpus_per_node: int
    gpus_per_host: int = 0
    """GPUs sharing one host's cores and memory (the fields above); 0: the whole server."""
    c2c_gbytes_per_s: float = 0.0
    """NVLink-C2C bandwidth per direction between one host CPU and its GPUs; 0: the host is
    reached over PCIe (the fabric's PCIe tree)."""
    cpu_op_factor: float = 1.0
    """The host CPU's seconds per framework op in a training job relative to the isolated x86
    figures the frameworks' issue costs were set on (:data:`X86_TRAINING_HOST_FACTOR` on the
    Hopper and Blackwell DGX hosts, 1.0 on the older ones, :data:`GRACE_CPU_OP_FACTOR` on
    Grace)."""
    cpu: Literal["x86", "grace"] = "x86"
    """The host CPU's kind: which measured unit costs apply (:func:`te_module_call_cpu_s`)."""

    @property
    def ranks_per_host(self) -> int:
        """GPU ranks sharing one host's memory bandwidth and cores."""
        return self.gpus_per_host or self.gpus_per_node

    @classmethod
    def from_scenario(cls, s: Scenario) -> HostSpec:
        """The host of ``s``'s servers: the DGX of its GPU generation, cluster fields over it."""
        c = s.cluster
        d = DGX_HOSTS[_generation(c.gpu)]
        return cls(
            cpu_cores=c.cpu_cores or d.cpu_cores,
            memory_gib=c.host_memory_gib or d.memory_gib,
            memory_gbytes_per_s=c.host_memory_gbytes_per_s or d.memory_gbytes_per_s,
            nvme_read_gbytes_per_s=c.nvme_read_gbytes_per_s or d.nvme_read_gbytes_per_s,
            nvme_write_gbytes_per_s=c.nvme_write_gbytes_per_s or d.nvme_write_gbytes_per_s,
            gpus_per_node=c.gpus_per_node,
            gpus_per_host=min(d.gpus_per_host, c.gpus_per_node) if d.gpus_per_host else 0,
            c2c_gbytes_per_s=d.c2c_gbytes_per_s,
            cpu_op_factor=d.cpu_op_factor,
            cpu=d.cpu,
        )


@dataclass(frozen=True)
class _Dgx:
    cpu_cores: int
    memory_gib: float
    memory_gbytes_per_s: float
    nvme_read_gbytes_per_s: float
    nvme_write_gbytes_per_s: float
    source: str
    gpus_per_host: int = 0
    c2c_gbytes_per_s: float = 0.0
    cpu_op_factor: float = 1.0
    cpu: Literal["x86", "grace"] = "x86"


def _dgx(cores: int, mem_gib: float, channels: int, mt_s: int, drives: int,
         drive_read: float, drive_write: float, source: str,
         cpu_op_factor: float = 1.0) -> _Dgx:
    # DDR: 8 bytes per transfer per channel.
    peak = channels * mt_s * 8 / 1000
    return _Dgx(cores, mem_gib, peak * STREAM_FRACTION, drives * drive_read,
                drives * drive_write, source, cpu_op_factor=cpu_op_factor)


DGX_HOSTS: dict[str, _Dgx] = {
    "volta": _dgx(48, 1536, 12, 2666, 8, 3.5, 2.0,
                  "DGX-2 datasheet (2019): 2x Xeon Platinum 8168 (24 cores), 1.5 TB DDR4-2666 "
                  "(6 channels per socket), 30 TB NVMe (8x 3.84 TB, PCIe Gen3 U.2: ~3.5 GB/s "
                  "read, ~2 GB/s write each)"),
    "ampere": _dgx(128, 1024, 16, 3200, 4, 6.9, 4.0,
                   "DGX A100 datasheet (2020): 2x AMD EPYC 7742 (64 cores), 1 TB DDR4-3200 "
                   "(8 channels per socket), 15 TB NVMe (4x 3.84 TB Gen4 U.2; Samsung PM1733 / "
                   "KIOXIA CM6 datasheets ~6.9 GB/s sequential read, ~4 GB/s write)"),
    "hopper": _dgx(112, 2048, 16, 4800, 8, 6.9, 4.0,
                   "DGX H100/H200 datasheet (2023/2024): 2x Xeon Platinum 8480C (56 cores), "
                   "2 TB DDR5-4800 (8 channels per socket), 8x 3.84 TB NVMe U.2 Gen4",
                   X86_TRAINING_HOST_FACTOR),
    "blackwell": _dgx(112, 2048, 16, 5600, 8, 6.9, 4.0,
                      "DGX B200 datasheet (2024): 2x Xeon Platinum 8570 (56 cores), 2 TB "
                      "DDR5-5600 (8 channels per socket), 8x 3.84 TB NVMe U.2",
                      X86_TRAINING_HOST_FACTOR),
    "grace-blackwell": _Dgx(
        GRACE_CORES, GRACE_MEMORY_GB, GRACE_LPDDR5X_GBYTES_PER_S * STREAM_FRACTION,
        8 * 6.9, 8 * 4.0,
        "GB200 NVL72 datasheet (2024): 36 Grace CPUs (72 Arm Neoverse V2 cores each) with 72 "
        "Blackwell GPUs, a GB200 superchip = 1 Grace + 2 GPUs, up to 480 GB LPDDR5X at up to "
        "512 GB/s per Grace, NVLink-C2C 900 GB/s bidirectional; NVMe figures kept from the x86 "
        "DGX entries (no per-rack figure used)",
        gpus_per_host=GB200_GPUS_PER_GRACE, c2c_gbytes_per_s=NVLINK_C2C_GBYTES_PER_S,
        cpu_op_factor=GRACE_CPU_OP_FACTOR, cpu="grace"),
}


def host_cpu_op_factor(gpu: str) -> float:
    """``cpu_op_factor`` of the DGX host that carries ``gpu`` (a catalogue key), as
    :meth:`HostSpec.from_scenario` gives it.

    Examples
    --------
    >>> host_cpu_op_factor("a100-80gb"), host_cpu_op_factor("h100-sxm")
    (1.0, 1.5)
    >>> round(host_cpu_op_factor("gb200"), 2)
    2.75
    """
    return DGX_HOSTS[_generation(gpu)].cpu_op_factor


def _generation(gpu: str) -> str:
    if gpu.startswith("gb"):
        return "grace-blackwell"
    if gpu.startswith("v100"):
        return "volta"
    if gpu.startswith("a100"):
        return "ampere"
    if gpu.startswith("b"):
        return "blackwell"
    return "hopper"


def te_module_call_cpu_s(host: HostSpec,
                         te_release: tuple[int, int, int] | None = None) -> float:
    """Host seconds of one Transformer Engine module call as an op's ``cpu_s`` (before the
    engine multiplies it by the host's ``cpu_op_factor``), for TE release ``te_release``
    (None: the newest). From :data:`TE_CPU_OVERHEAD_CUT_RELEASE` on,
    :data:`X86_TE_MODULE_CALL_CPU_S` on the x86 DGX hosts and
    :data:`GRACE_TE_MODULE_CALL_CPU_S` (measured) on Grace; before it the ``_BEFORE_CUT``
    pair.

    Examples
    --------
    >>> x86 = HostSpec(112, 2048, 460, 55.2, 32.0, 8)
    >>> [round(te_module_call_cpu_s(x86, release) * 1e6, 1) for release in ((2, 9, 0), None)]
    [70.0, 33.4]
    >>> grace = HostSpec(72, 480, 384, 55.2, 32.0, 2, cpu_op_factor=GRACE_CPU_OP_FACTOR,
    ...                  cpu="grace")
    >>> round(te_module_call_cpu_s(grace, (2, 7, 0)) * grace.cpu_op_factor * 1e6, 2)
    99.66
    >>> round(te_module_call_cpu_s(grace) * grace.cpu_op_factor * 1e6, 2)
    59.19
    """
    before = te_release is not None and te_release < TE_CPU_OVERHEAD_CUT_RELEASE
    if host.cpu == "x86":
        return X86_TE_MODULE_CALL_CPU_S_BEFORE_CUT if before else X86_TE_MODULE_CALL_CPU_S
    grace = GRACE_TE_MODULE_CALL_CPU_S_BEFORE_CUT if before else GRACE_TE_MODULE_CALL_CPU_S
    return grace / host.cpu_op_factor


AdamImplementation = Literal["deepspeed", "torch"]


def cpu_adam_s(host: HostSpec, params_per_rank: float,
               implementation: AdamImplementation) -> float:
    """Seconds of one rank's AdamW step on the CPU while every rank of the node steps at once.

    Parameters
    ----------
    host : HostSpec
        The server.
    params_per_rank : float
        Parameters of the rank's (sharded) optimizer partition.
    implementation : {"deepspeed", "torch"}
        ``deepspeed``: DeepSpeedCPUAdam (fused AVX kernel, OpenMP over the rank's cores);
        ``torch``: ``torch.optim.AdamW`` on CPU tensors (one kernel
        per line of the update, one thread under torchrun).

    Examples
    --------
    >>> h = HostSpec(112, 2048, 460.8, 55.2, 32.0, 8)
    >>> round(cpu_adam_s(h, 1e9, "deepspeed"), 3)   # 28 GB over 57.6 GB/s
    0.486
    >>> round(cpu_adam_s(h, 1e9, "torch") / cpu_adam_s(h, 1e9, "deepspeed"), 1)
    11.5
    """
    per_param = (DEEPSPEED_ADAM_BYTES_PER_PARAM if implementation == "deepspeed"
                 else TORCH_ADAMW_BYTES_PER_PARAM)
    return cpu_pass_s(host, params_per_rank * per_param, implementation)


def cpu_pass_s(host: HostSpec, nbytes: float, implementation: AdamImplementation) -> float:
    """Seconds for one rank's CPU work to stream ``nbytes`` through DRAM while every rank of
    the host does the same: the host's bandwidth shared by its ranks, or what the rank's
    threads pull (``deepspeed``: its share of the cores; ``torch``: one thread, or every core
    when the rank is alone on its host), whichever is lower. The host is the server (x86
    DGX) or one Grace CPU (GB200: two GPUs each).

    Examples
    --------
    >>> h = HostSpec(112, 2048, 460.8, 55.2, 32.0, 8)
    >>> round(cpu_pass_s(h, 15e9, "torch"), 3)       # one thread at 15 GB/s
    1.0
    """
    ranks = max(1, host.ranks_per_host)
    share = host.memory_gbytes_per_s / ranks
    threads = (max(1, host.cpu_cores // ranks) if implementation == "deepspeed" or ranks == 1
               else TORCH_THREADS_PER_RANK)
    return nbytes / (min(share, threads * CORE_GBYTES_PER_S) * 1e9)
