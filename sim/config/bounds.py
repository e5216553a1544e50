"""Physical upper bounds on a scenario's sizes, counts, rates, latencies and prices.

A value beyond its bound is bad input, refused by the schema with one line naming the key and
the bound (exit status 2), before it reaches numpy (which cannot take integers beyond 64 bits)
or a simulation that would never end. Each bound leaves an order of magnitude or more above
the largest real system it cites, so that what-if studies of future hardware stay possible;
what it excludes is the absurd (10**30 GPUs, an infinite bandwidth). Floats have these bounds
too, which also refuses ``.inf`` (``.nan`` fails every comparison, so every bounded field
refuses it).

Part of the config layer; used by :mod:`sim.config.cluster`, :mod:`sim.config.training` and
:mod:`sim.config.scenario`.
"""

from __future__ import annotations

import math
from typing import Any

# -- machines
MAX_GPUS = 2**22
"""GPUs in one job (4,194,304). The largest announced training clusters are 100-200 thousand
GPUs (xAI Colossus, 2024-2025: 100k then 200k H100/H200); twenty times that."""
MAX_NODES = MAX_GPUS
"""Servers (each has at least one GPU)."""
MAX_GPUS_PER_NODE = 1024
"""GPUs in one NVLink domain: 72 in GB200 NVL72 (NVIDIA GB200 NVL72 datasheet), 576 in the
announced Rubin Ultra NVL576 (NVIDIA GTC 2025 keynote)."""
MAX_NICS_PER_NODE = 1024
"""Network adapters per server: 8 in DGX H100/B200, one per GPU in an NVL72 rack (72)."""
MAX_PCIE_SWITCHES = 1024
"""PCIe switches per server: 4 in DGX H100 (DGX H100 user guide), at most one per device."""
MAX_NODES_PER_LEAF = 16384
"""Servers per leaf switch (per rail): a leaf's radix bounds it; 64 ports on Quantum-2
(NDR), 144 on Quantum-X800, 512 x 100G on Spectrum-4 (NVIDIA switch datasheets)."""
MAX_OVERSUBSCRIPTION = 1024.0
"""Leaf downlink over uplink capacity: 1-4 in practice (the shipped leaf-spine example: 2)."""
MAX_ZONES = 1024
"""Availability zones or regions a job spans: AWS has 3-6 zones a region and ~35 regions."""
MAX_CPU_CORES = 65536
"""CPU cores per server: 2 x 192 (AMD EPYC 9965), 768 threads."""
MAX_HOST_MEMORY_GIB = 2.0**20
"""CPU memory per server, GiB (1 PiB): large servers hold 6-32 TiB."""
MAX_GPU_POWER_W = 100_000.0
"""A GPU's power cap: 700 W for H100 SXM, 1,200 W for GB200 (NVIDIA datasheets)."""
MAX_GPU_SMS = 4096
"""Streaming multiprocessors of one GPU: 132 on H100 SXM, 148 on B200 (NVIDIA datasheets)."""

# -- rates and latencies
GBYTES_PER_S_MAX = 1e6
"""A per-GPU or per-server bandwidth in GB/s (NVLink, PCIe, host memory, NVMe): NVLink 5 is
900 GB/s per direction per GPU (NVIDIA Blackwell datasheet), PCIe 6 x16 about 121 GB/s,
a 12-channel DDR5-6400 socket 614 GB/s; a thousand times the fastest and more. (The suffix
_MAX, not a leading MAX_: names ending _GBYTES_PER_S or _LATENCY_US are calibrated constants
docs/calibration.md lists; this is a schema bound.)"""
MAX_LINK_GBPS = 1e7
"""A NIC's or a data-centre link's rate in Gb/s (10 Pb/s): NICs reach 800 Gb/s
(ConnectX-8), inter-zone capacity is sold in multiples of 100 Gb/s."""
MAX_LATENCY_MS = 1e5
"""A one-way latency in milliseconds (100 s): across the globe ~150 ms (half the speed of
light in fibre over 20,000 km), a geostationary satellite hop ~270 ms."""
LATENCY_US_MAX = 1e8
"""A NIC's or a switch's latency in microseconds (the same 100 s): 0.1-10 us in practice."""

MAX_DURATION_S = 1e9
"""A span of simulated time in seconds (about 32 years), such as when a job of a multi-job
file starts: a training run lasts months; nanoseconds since the start still fit in 64 bits."""
MAX_TRANSFER_BYTES = 1e18
"""Bytes of one background transfer (an exabyte): a GPU's whole memory is under 2**38."""

# -- the training step
MAX_SEQ_LEN = 2**27
"""Tokens per sequence (134 million): the longest published training contexts are 1-10
million tokens (Llama 4 Scout: 10M; Meta AI blog, April 2025)."""
MAX_BATCH = 2**26
"""Sequences in a micro-batch or a global batch: Llama 3 405B trained at 16M tokens a step,
2,048 sequences of 8,192 (Llama 3 paper, arXiv:2407.21783, section 3.4)."""
MAX_TOKENS_TOTAL = 1e18
"""Tokens of a whole run: Llama 3 trained on 15.6 trillion (1.6e13); 60,000 times that."""
MAX_PARALLEL = MAX_GPUS
"""A parallel degree (tp, pp, dp, cp, ep, etp): at most the GPUs of a job."""
MAX_VIRTUAL_STAGES = 4096
"""Virtual pipeline chunks per stage: at most the layers a stage holds (Megatron-LM
``--num-layers-per-virtual-pipeline-stage`` >= 1)."""
MAX_NCCL_BUFFSIZE = 2**34
"""NCCL_BUFFSIZE in bytes (16 GiB, more than an H100's memory divided over its channels):
NCCL's default is 4 MiB (``DEFAULT_BUFFSIZE``, src/init.cc)."""
MAX_SEED = 2**63 - 1
"""Seeds are 64-bit signed integers as numpy's ``SeedSequence`` and C code take them."""

# -- the model
MAX_LAYERS = 100_000
"""Transformer blocks: 126 in Llama 3 405B, 61 in DeepSeek-V3."""
MAX_WIDTH = 2**24
"""A hidden, FFN, head or low-rank width: 16,384 hidden / 53,248 FFN in Llama 3 405B."""
MAX_HEADS = 2**20
"""Attention heads: 128 in Llama 3 405B and DeepSeek-V3."""
MAX_VOCAB = 2**26
"""Vocabulary size: 128,256 in Llama 3, 262,144 in Gemma 3."""
MAX_EXPERTS = 2**20
"""Routed experts per layer: 256 in DeepSeek-V3, 384 in Kimi K2."""
MAX_CAPACITY_FACTOR = 1e6
"""An expert's capacity as a multiple of its balanced share: 1-2 in practice (GShard,
Switch Transformer)."""
MAX_ACTIVATION_CLAMP = 1e6
"""Ceiling of a gated activation's clamp (GPT-OSS: 7; bf16 overflows near 3.4e38)."""
MAX_ROPE_SCALING = 1e6
"""Ceiling of a rotary scaling factor (GPT-OSS's YaRN: 32, DeepSeek-V3's: 40)."""

# -- framework options (buckets, thresholds, partitions)
MAX_ELEMENTS = 2**40
"""A bucket, prefetch or persistence threshold in elements: 2^40 (1.1e12) is above every
model's parameter count (DeepSeek-V3: 6.7e11), so any larger value means "all of them"."""
MAX_BUCKET_MB = 2.0**20
"""A gradient bucket in MB: 1 TB, above any model's gradients on one GPU."""

# -- prices
MAX_USD_PER_GPU_HOUR = 1e6
"""An on-demand GPU-hour: 2-12 USD on the clouds' price lists (2025)."""
MAX_USD_PER_GB = 1e6
"""A GB of transfer: 0.01-0.12 USD on the clouds' price lists (2025)."""


# -- every number of a scenario document
MAX_INT_BITS = 63
"""No integer in a scenario may need more than 64 bits (signed): numpy, which sizes and
indexes everything downstream, cannot hold one (``OverflowError: Python int too large to
convert to C long``)."""


def unrepresentable(data: Any, path: str = "") -> str | None:
    """The first number in a scenario document (a mapping read from YAML, ``--set`` applied)
    that no field can use: an integer beyond 64 bits or a float that is not finite (.nan,
    .inf), as one line naming its key; None when there is none.

    A backstop under the per-field bounds, for sections whose fields have none (a
    framework's options).

    Examples
    --------
    >>> unrepresentable({"framework": {"bucket_mb": 10**30}})
    'framework.bucket_mb: 1000000000000000000000000000000 does not fit in 64 bits'
    >>> unrepresentable({"cluster": {"nic_gbps": float("nan")}})
    'cluster.nic_gbps: nan is not a finite number'
    >>> unrepresentable({"model": "llama3-8b", "x": [1, 2.5]}) is None
    True
    """
    if isinstance(data, dict):
        for k, v in data.items():
            found = unrepresentable(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found = unrepresentable(v, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(data, bool):
        return None
    elif isinstance(data, int) and abs(data) >= 2**MAX_INT_BITS:
        return f"{path}: {data} does not fit in 64 bits"
    elif isinstance(data, float) and not math.isfinite(data):
        return f"{path}: {data} is not a finite number"
    return None
