"""The host model: DGX defaults from the datasheets, and the CPU AdamW step."""

from __future__ import annotations

import pytest
from conftest import make_scenario
from helpers import MINIMAL_1B

from sim.hardware.host import (
    DEEPSPEED_ADAM_BYTES_PER_PARAM,
    STREAM_FRACTION,
    TORCH_ADAMW_BYTES_PER_PARAM,
    HostSpec,
    cpu_adam_s,
    cpu_pass_s,
)


def host(gpu: str = "h100-sxm", **cluster: object) -> HostSpec:
    return HostSpec.from_scenario(make_scenario(MINIMAL_1B, cluster={"gpu": gpu, **cluster}))


def test_dgx_h100_host_from_its_datasheet() -> None:
    h = host()
    # 2 sockets x 8 channels of DDR5-4800 (8 B per transfer) = 614.4 GB/s peak.
    assert h.memory_gbytes_per_s == pytest.approx(614.4 * STREAM_FRACTION)
    assert (h.cpu_cores, h.memory_gib) == (112, 2048)
    a = host("a100-80gb")   # 2x EPYC 7742: 16 channels of DDR4-3200
    assert a.memory_gbytes_per_s == pytest.approx(409.6 * STREAM_FRACTION)
    assert a.cpu_cores == 128


def test_cluster_fields_override_the_defaults() -> None:
    h = host(host_memory_gbytes_per_s=100.0, cpu_cores=64, nvme_read_gbytes_per_s=10.0)
    assert (h.memory_gbytes_per_s, h.cpu_cores, h.nvme_read_gbytes_per_s) == (100.0, 64, 10.0)


def test_cpu_adam_is_bound_by_the_rank_share_of_dram() -> None:
    h = host()
    # Eight ranks share the node's bandwidth; DeepSpeedCPUAdam's 14 threads could pull more.
    share = h.memory_gbytes_per_s / 8 * 1e9
    assert cpu_adam_s(h, 1e9, "deepspeed") == pytest.approx(
        1e9 * DEEPSPEED_ADAM_BYTES_PER_PARAM / share)
    # Time is linear in the partition.
    assert cpu_adam_s(h, 2e9, "deepspeed") == pytest.approx(2 * cpu_adam_s(h, 1e9, "deepspeed"))


def test_torch_cpu_adamw_is_several_times_slower_than_deepspeed_cpu_adam() -> None:
    # DeepSpeed's cpu_adam.py docstring claims 5x-7x over torch.optim.Adam(W); our model has
    # torch at one thread (torchrun's OMP_NUM_THREADS=1) and 84 vs 30 bytes per parameter.
    h = host()
    ratio = cpu_adam_s(h, 1e9, "torch") / cpu_adam_s(h, 1e9, "deepspeed")
    assert ratio > TORCH_ADAMW_BYTES_PER_PARAM / DEEPSPEED_ADAM_BYTES_PER_PARAM
    assert 4 < ratio < 15


def test_a_rank_alone_on_its_node_uses_every_core_for_torch_cpu_work() -> None:
    # torchrun sets OMP_NUM_THREADS=1 only with several processes per node: eight ranks each
    # get one thread (15 GB/s), a single rank gets all 112 cores, bounded by the DRAM's
    # 460.8 GB/s (DGX H100: 2 x 8 channels of DDR5-4800).
    eight = HostSpec(112, 2048, 460.8, 55.2, 32.0, 8)
    alone = HostSpec(112, 2048, 460.8, 55.2, 32.0, 1)
    assert cpu_pass_s(eight, 15e9, "torch") == pytest.approx(1.0)
    assert cpu_pass_s(alone, 460.8e9, "torch") == pytest.approx(1.0)
