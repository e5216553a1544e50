"""GB200's Grace hosts: a Grace CPU per two GPUs (GB200 NVL72 datasheet, 2024: 72 Neoverse V2
cores, up to 480 GB LPDDR5X at up to 512 GB/s, NVLink-C2C 900 GB/s bidirectional per
superchip), host copies over C2C, and every other topology's host left as it was."""

from __future__ import annotations

import pytest
from conftest import make_scenario
from helpers import MINIMAL_1B

from sim.api import fabric_spec
from sim.engine.core import Engine
from sim.engine.recorder import Recorder
from sim.fabric.collectives.nccl import C2C_EFFICIENCY, PCIE_EFFICIENCY
from sim.fabric.collectives.runner import transport_capacity
from sim.fabric.topology import LINK_KINDS, FabricSpec, build_fabric
from sim.hardware.host import (
    STREAM_FRACTION,
    X86_TRAINING_HOST_FACTOR,
    HostSpec,
    cpu_adam_s,
    cpu_pass_s,
)
from sim.program.ir import Op, Program, RankClass


def _scenario(gpu: str, gpus: int = 8, topology: str | None = None):
    cluster: dict[str, object] = {"gpu": gpu, "gpus_per_node": gpus, "nics_per_node": gpus}
    if topology:
        cluster["topology"] = topology
    return make_scenario(MINIMAL_1B, cluster=cluster)


def test_gb200_host_is_a_grace_per_two_gpus_from_the_datasheet() -> None:
    h = HostSpec.from_scenario(_scenario("gb200", 72, "gb200-nvl72"))
    # GB200 superchip: 1 Grace (72 cores, 480 GB LPDDR5X, 512 GB/s) + 2 GPUs; 900 GB/s C2C
    # bidirectional = 450 a direction.
    assert (h.cpu_cores, h.memory_gib, h.gpus_per_host, h.ranks_per_host) == (72, 480, 2, 2)
    assert h.memory_gbytes_per_s == pytest.approx(512 * STREAM_FRACTION)
    assert h.c2c_gbytes_per_s == 450
    # The rack's totals (datasheet: 36 Graces, 2,592 cores, 18.4 TB/s): 36 hosts of 72 GPUs.
    assert 72 // h.gpus_per_host * h.cpu_cores == 2592
    assert 72 // h.gpus_per_host * 512 == pytest.approx(18_432)


def test_grace_cpu_pass_shares_one_grace_not_the_rack() -> None:
    h = HostSpec.from_scenario(_scenario("gb200", 72, "gb200-nvl72"))
    # DeepSpeed-style work: 36 cores each (540 GB/s of threads) against half a Grace's
    # 384 GB/s: the Grace's memory paces it, 1 GB in 1 / 192 s.
    assert cpu_pass_s(h, 1e9, "deepspeed") == pytest.approx(1e9 / (512e9 * STREAM_FRACTION / 2))
    # One torch thread per rank (torchrun) is thread-bound as on x86: 15 GB/s.
    assert cpu_pass_s(h, 15e9, "torch") == pytest.approx(1.0)
    x86 = HostSpec.from_scenario(_scenario("b200", 72))
    assert cpu_adam_s(x86, 1e9, "deepspeed") > 10 * cpu_adam_s(h, 1e9, "deepspeed")


def test_x86_hosts_keep_the_whole_server_and_pcie() -> None:
    for gpu in ("h100-sxm", "b200", "a100-80gb"):
        s = _scenario(gpu)
        h = HostSpec.from_scenario(s)
        assert (h.gpus_per_host, h.c2c_gbytes_per_s, h.ranks_per_host) == (0, 0.0, 8)
        spec = fabric_spec(s)
        assert (spec.c2c_gbytes_per_s, spec.host_cpus) == (0.0, 0)
        fab = build_fabric(spec)
        assert not [n for n in fab.graph.nodes if n[0] == "cpu"]
        assert [LINK_KINDS[fab.kind[i]] for i in fab.route_to_host(3)] == ["pcie", "pcie"]


def _c2c_fabric(gpus: int = 4) -> FabricSpec:
    return FabricSpec(nodes=1, gpus_per_node=gpus, nvlink_gbytes_per_s=900,
                      pcie_gbytes_per_s=64, nics_per_node=gpus, nic_gbps=400,
                      c2c_gbytes_per_s=450, gpus_per_host=2)


def test_c2c_routes_go_through_their_grace_and_nics_keep_pcie() -> None:
    fab = build_fabric(_c2c_fabric())
    ends = [fab.endpoints[i] for i in fab.route_to_host(3)]
    assert ends == [(("gpu", 0, 3), ("cpu", 0, 1)), (("cpu", 0, 1), ("host", 0))]
    # GPUs 2 and 3 share Grace 1's port; GPU 0 uses Grace 0's.
    assert fab.route_to_host(2)[-1] == fab.route_to_host(3)[-1] != fab.route_to_host(0)[-1]
    eff = transport_capacity(fab, "blackwell") / fab.capacity
    assert {round(float(eff[i]), 6) for i in fab.route_to_host(3)} == {round(C2C_EFFICIENCY, 6)}
    # The NIC path is the PCIe tree, as before.
    assert all(eff[i] == pytest.approx(PCIE_EFFICIENCY) for i in fab.route(0, 0, rail=0)
               if "pcie" in (fab.endpoints[i][0][0], fab.endpoints[i][1][0]))


def _copy_program(gpus: int, nbytes: float, kind: str) -> Program:
    cls = RankClass(0, tuple(range(gpus)))
    p = Program([cls], gpus, 0, 0, 0)
    p.add(cls, Op(name=kind, kind="copy", stream="copy", phase="optimizer",
                  host_transfer=kind, nbytes=nbytes))  # type: ignore[arg-type]
    return p


@pytest.mark.parametrize("kind", ["d2h", "h2d"])
def test_c2c_copy_time_closed_form(kind: str) -> None:
    # Four GPUs copy 1 GB each; two share each Grace's 450 GB/s C2C port at the copy engines'
    # measured share (346 of 450 GB/s, nvbandwidth on GH200): 2 GB / (450 GB/s x eff).
    t = Engine(build_fabric(_c2c_fabric()), "blackwell", Recorder()).run_step(
        _copy_program(4, 1e9, kind))
    assert t == pytest.approx(2e9 / (450e9 * C2C_EFFICIENCY), rel=1e-3)
    # Alone on its Grace a GPU gets the whole port.
    t1 = Engine(build_fabric(_c2c_fabric(1)), "blackwell", Recorder()).run_step(
        _copy_program(1, 1e9, kind))
    assert t1 == pytest.approx(1e9 / (450e9 * C2C_EFFICIENCY), rel=1e-3)


def _host_bound_program(ops: int, cpu_s: float) -> Program:
    cls = RankClass(0, (0, 1))
    p = Program([cls], 2, 0, 0, 0)
    for i in range(ops):
        p.add(cls, Op(name=f"k{i}", kind="compute", stream="compute", phase="fwd",
                      duration=1e-7, cpu_s=cpu_s))
    return p


def test_grace_issues_ops_at_the_measured_cpu_ratio() -> None:
    # TE issue #2053: torch.nn.Linear forward, 37.08 us of CPU on GB200, 13.48 us on a DGX
    # H100's Xeon 8480C, same script and shape.
    grace = HostSpec.from_scenario(_scenario("gb200", 72, "gb200-nvl72"))
    assert grace.cpu_op_factor == pytest.approx(37.08 / 13.48)
    # The x86 DGX hosts of Hopper and Blackwell: the fitted in-job factor over the isolated
    # figures (docs/calibration.md, fifty-seventh session); the A100's keeps vTrain's.
    for gpu in ("h100-sxm", "b200"):
        x86 = HostSpec.from_scenario(_scenario(gpu))
        assert (x86.cpu, x86.cpu_op_factor) == ("x86", X86_TRAINING_HOST_FACTOR)
    assert HostSpec.from_scenario(_scenario("a100-80gb")).cpu_op_factor == 1.0
    assert grace.cpu == "grace"
    spec = FabricSpec(nodes=1, gpus_per_node=2, nvlink_gbytes_per_s=900, pcie_gbytes_per_s=64,
                      nics_per_node=0, nic_gbps=400)
    x86 = Engine(build_fabric(spec), "blackwell", Recorder()).run_step(
        _host_bound_program(100, 13.48e-6))
    eng = Engine(build_fabric(spec), "blackwell", Recorder())
    eng.host_cpu_factor = grace.cpu_op_factor
    arm = eng.run_step(_host_bound_program(100, 13.48e-6))
    # A host-bound step: 100 issues of 13.48 us on x86, of 37.08 us on Grace (+ the last
    # kernel's 0.1 us).
    assert x86 == pytest.approx(100 * 13.48e-6 + 1e-7, rel=1e-6)
    assert arm == pytest.approx(100 * 37.08e-6 + 1e-7, rel=1e-6)
