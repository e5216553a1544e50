"""Tests of the shipped fabric presets (``topologies/*.yaml``): every file loads through the
scenario loader, carries its metadata and a comment on every number, and the figures that the
vendors document come out of the loader as the simulator will see them.

Each vendor check names the document it comes from; the same documents are listed under
``sources`` in the preset itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sim.scenario import TOPOLOGY_META_KEYS, Cluster, scenario_from_dict

TOPOLOGIES = Path(__file__).resolve().parents[3] / "topologies"
PRESETS = sorted(p.stem for p in TOPOLOGIES.glob("*.yaml"))


def raw(name: str) -> dict[str, Any]:
    """The preset file as written (metadata included)."""
    return yaml.safe_load((TOPOLOGIES / f"{name}.yaml").read_text())


def cluster(name: str, **inline: Any) -> Cluster:
    """The cluster the simulator sees for ``name``: two nodes, or the file's own node count when
    the preset fixes it (gb200-nvl72 is one rack = one node)."""
    nodes = raw(name).get("nodes", 2)
    data = {"model": "llama3-8b", "cluster": {"topology": name, "nodes": nodes, **inline},
            "framework": {"name": "fsdp2"}}
    return scenario_from_dict(data, origin=f"test_presets[{name}]").cluster


def node_gbps(c: Cluster) -> float:
    """Total NIC line rate of one node, Gb/s."""
    return c.nics_per_node * c.nic_gbps


# --------------------------------------------------------------------------- every preset
def test_the_required_presets_are_shipped():
    required = {"dgx-a100", "dgx-h100", "hgx-h200", "dgx-b200", "gb200-nvl72", "dgx-b300",
                "gb300-nvl72", "aws-p4d",
                "aws-p5", "gcp-a3-mega", "azure-ndv5", "coreweave-h100-ib", "ethernet-100g",
                "leaf-spine-oversubscribed"}
    assert required <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_through_the_scenario_loader(name):
    c = cluster(name)
    assert c.topology == name
    assert c.nodes == raw(name).get("nodes", 2)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_has_name_description_and_dated_sources(name):
    data = raw(name)
    assert data["name"] == name
    assert isinstance(data["description"], str) and data["description"].strip()
    sources = data["sources"]
    assert isinstance(sources, list) and sources
    assert all(isinstance(s, str) and s.strip() for s in sources)
    # Every source names its date: a year in parentheses or an ISO date somewhere in the line.
    assert all(any(str(year) in s for year in range(2012, 2031)) for s in sources), sources


@pytest.mark.parametrize("name", PRESETS)
def test_preset_holds_only_cluster_fields_and_metadata(name):
    keys = set(raw(name)) - set(TOPOLOGY_META_KEYS)
    assert keys <= set(Cluster.model_fields), keys - set(Cluster.model_fields)


@pytest.mark.parametrize("name", PRESETS)
def test_every_number_in_a_preset_says_where_it_comes_from(name):
    data = raw(name)
    numeric = {k for k, v in data.items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    lines = (TOPOLOGIES / f"{name}.yaml").read_text().splitlines()
    for key in numeric:
        line = next(ln for ln in lines if ln.startswith(f"{key}:"))
        comment = line.partition("#")[2].strip()
        assert comment, f"{name}.yaml: {key} has no comment saying where it comes from"


# --------------------------------------------------------------------------- vendor figures
def test_dgx_a100_figures():
    c = cluster("dgx-a100")
    # NVIDIA DGX A100 datasheet (2020): 8 single-port ConnectX-6 at 200 Gb/s HDR, one per GPU.
    assert (c.gpus_per_node, c.nics_per_node, c.nic_gbps) == (8, 8, 200.0)
    # A100 datasheet (2021): NVLink 600 GB/s per GPU both ways = 300 GB/s per direction.
    assert c.nvlink_gbytes_per_s == 300.0
    # DGX SuperPOD A100 RA (RA-09950-001, 2020): 20 DGX A100 per SU, rail-optimised, non-blocking.
    assert (c.nodes_per_leaf, c.rail_optimized, c.oversubscription) == (20, True, 1.0)
    assert c.nic_transport == "infiniband"


def test_dgx_h100_figures():
    c = cluster("dgx-h100")
    # NVIDIA DGX H100 datasheet (2023): 8 x single-port ConnectX-7 at 400 Gb/s = 3,200 Gb/s.
    assert (c.gpu, c.nics_per_node, c.nic_gbps) == ("h100-sxm", 8, 400.0)
    assert node_gbps(c) == 3200
    # DGX H100 datasheet (2023): NVLink 900 GB/s per GPU both ways = 450 per direction.
    assert c.nvlink_gbytes_per_s == 450.0
    # DGX SuperPOD H100 RA (RA-11333-001, 2023): 32 DGX H100 per scalable unit, rail-optimised.
    assert (c.nodes_per_leaf, c.rail_optimized) == (32, True)


def test_hgx_h200_figures():
    c = cluster("hgx-h200")
    # H200 datasheet (2024): H200 SXM, NVLink 900 GB/s per GPU (450 per direction).
    assert (c.gpu, c.nvlink_gbytes_per_s) == ("h200", 450.0)
    # NVIDIA HGX page / DGX BasePOD RA (2024): eight ConnectX-7 at 400 Gb/s per 8-GPU board.
    assert (c.nics_per_node, c.nic_gbps) == (8, 400.0)


def test_dgx_b200_figures():
    c = cluster("dgx-b200")
    # DGX B200 datasheet (2025): NVLink 5, 1.8 TB/s per GPU both ways = 900 GB/s per direction.
    assert (c.gpu, c.gpus_per_node, c.nvlink_gbytes_per_s) == ("b200", 8, 900.0)
    # DGX BasePOD RA (2024): 8 x single-port ConnectX-7 at up to 400 Gb/s.
    assert (c.nics_per_node, c.nic_gbps) == (8, 400.0)
    # DGX SuperPOD B200 RA: 128 nodes in 4 SUs = 32 per SU; leaf-spine cables = node-leaf cables.
    assert (c.nodes_per_leaf, c.oversubscription) == (32, 1.0)


def test_gb200_nvl72_is_one_72_gpu_node_with_a_nic_per_gpu():
    c = cluster("gb200-nvl72")
    # DGX SuperPOD GB200 RA (2025): 72 GPUs share one NVLink domain, 1.8 TB/s per GPU.
    assert (c.nodes, c.gpus_per_node, c.nvlink_gbytes_per_s) == (1, 72, 900.0)
    # Mission Control GB200 guide (2025): 4 OSFP InfiniBand ports per 4-GPU tray; Azure ND GB200
    # v6 (2025): 4 x 400 Gb/s per 4-GPU VM, 28.8 Tb/s per 72-GPU rack.
    assert (c.nics_per_node, c.nic_gbps) == (72, 400.0)
    assert node_gbps(c) == 28_800
    # More racks over the InfiniBand fabric: an inline node count overrides the file.
    assert cluster("gb200-nvl72", nodes=4).nodes == 4


def test_dgx_b300_figures():
    c = cluster("dgx-b300")
    # HGX B300 (2025): 8 Blackwell Ultra GPUs on NVLink 5 (900 GB/s per direction), one
    # 800 Gb/s ConnectX-8 per GPU.
    assert (c.gpu, c.gpus_per_node, c.nvlink_gbytes_per_s) == ("b300", 8, 900.0)
    assert (c.nics_per_node, c.nic_gbps) == (8, 800.0)
    # DGX SuperPOD B300 XDR RA (2026): 72 nodes and 8 leaves per SU, 576 node-leaf and 576
    # leaf-spine cables.
    assert (c.nodes_per_leaf, c.oversubscription, c.rail_optimized) == (72, 1.0, True)


def test_gb300_nvl72_is_one_72_gpu_node_with_an_800g_nic_per_gpu():
    c = cluster("gb300-nvl72")
    assert (c.gpu, c.nodes, c.gpus_per_node, c.nvlink_gbytes_per_s) == ("gb300", 1, 72, 900.0)
    # 72 ConnectX-8 at 800 Gb/s: twice the GB200 rack's scale-out line rate.
    assert (c.nics_per_node, c.nic_gbps) == (72, 800.0)
    assert node_gbps(c) == 2 * node_gbps(cluster("gb200-nvl72"))


def test_aws_p4d_has_400_gbps_of_efa_on_four_cards():
    c = cluster("aws-p4d")
    # AWS P4d deep dive (2020): 8 x A100 40 GB, 400 Gbps of EFA networking.
    assert (c.gpu, c.gpus_per_node) == ("a100-40gb", 8)
    assert node_gbps(c) == 400
    # EC2 User Guide interface table: p4d.24xlarge has 4 network cards (100 Gb/s each).
    assert (c.nics_per_node, c.nic_gbps) == (4, 100.0)
    assert c.nic_transport == "efa"


def test_aws_p5_has_3200_gbps_of_efa_on_32_cards():
    c = cluster("aws-p5")
    # AWS EC2 User Guide, p5-efa (2024): up to 32 network cards and 3,200 Gbps on P5.
    assert node_gbps(c) == 3200
    assert (c.nics_per_node, c.nic_gbps) == (32, 100.0)
    assert (c.gpu, c.nic_transport) == ("h100-sxm", "efa")


def test_gcp_a3_mega_follows_google_not_the_article():
    c = cluster("gcp-a3-mega")
    # Google Cloud GPU networking page (2025): A3 Mega, eight 200 Gbps GPU NICs with
    # GPUDirect-TCPXO, 1,600 Gbps for GPU traffic (1,800 with the host NIC).
    assert (c.nics_per_node, c.nic_gbps) == (8, 200.0)
    assert node_gbps(c) == 1600
    # distributed-training-finops-2026.txt (section 4) gives GCP 3,200 Gbps: not what Google
    # documents for any A3 H100 machine type.
    assert node_gbps(c) != 3200
    assert c.nic_transport == "tcp"


def test_azure_ndv5_has_one_400g_infiniband_link_per_gpu():
    c = cluster("azure-ndv5")
    # Microsoft Learn, ND H100 v5 (2024): one 400 Gb/s Quantum-2 CX7 InfiniBand link per GPU,
    # 3.2 Tb/s per VM.
    assert (c.gpus_per_node, c.nics_per_node, c.nic_gbps) == (8, 8, 400.0)
    assert node_gbps(c) == 3200
    assert c.nic_transport == "infiniband"


def test_coreweave_h100_is_rail_optimised_and_non_blocking():
    c = cluster("coreweave-h100-ib")
    # CoreWeave HPC Interconnect docs: non-blocking fat tree, no oversubscribed links,
    # rail-optimised InfiniBand.
    assert (c.oversubscription, c.rail_optimized, c.nic_transport) == (1.0, True, "infiniband")
    # HGX H100 design CoreWeave builds to: 8 x 400 Gb/s NDR.
    assert node_gbps(c) == 3200


def test_ethernet_100g_shares_one_100g_roce_nic():
    c = cluster("ethernet-100g")
    # The preset's definition: one 100 GbE NIC for all 8 GPUs, RoCE v2.
    assert (c.gpus_per_node, c.nics_per_node, c.nic_gbps) == (8, 1, 100.0)
    assert c.nic_transport == "roce"
    # Linley Newsletter (2017-07-31): Spectrum-2 Ethernet switch ASIC, 300 ns.
    assert c.switch_latency_us == pytest.approx(0.3)
    assert c.rail_optimized is False


def test_leaf_spine_is_two_to_one_and_can_be_changed_inline():
    c = cluster("leaf-spine-oversubscribed")
    # The preset's definition: 8 nodes per leaf, 2:1 oversubscription.
    assert (c.nodes_per_leaf, c.oversubscription) == (8, 2.0)
    # `--set cluster.oversubscription=...` lands in the inline cluster mapping, which wins.
    assert cluster("leaf-spine-oversubscribed", oversubscription=4).oversubscription == 4.0
