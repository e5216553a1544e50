"""The checkpoint storage endpoint on the fabric graph (sim.fabric.topology.storage)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.fabric.topology import CROSS_AZ, CROSS_REGION, NETWORK, Fabric, FabricSpec, build_graph
from sim.fabric.topology.storage import attach_storage, local_storage


def spec(**kw: object) -> FabricSpec:
    base = dict(nodes=4, gpus_per_node=8, nvlink_gbytes_per_s=450, pcie_gbytes_per_s=64,
                nics_per_node=8, nic_gbps=400, nodes_per_leaf=2)
    base.update(kw)
    return FabricSpec(**base)  # type: ignore[arg-type]


def built(sp: FabricSpec, kind: str = "pfs", rate: float = 100.0, zone: int = 0):
    g = build_graph(sp)
    target = attach_storage(g, sp, kind, rate, zone)
    fab = Fabric(g, sp)
    return fab, target.bind(fab)


def test_existing_links_keep_their_index_and_capacity() -> None:
    sp = spec(azs=2)
    plain = Fabric(build_graph(sp), sp)
    fab, _ = built(sp, zone=3)
    m = plain.n_links
    assert fab.n_links > m
    assert fab.endpoints[:m] == plain.endpoints
    assert np.array_equal(fab.capacity[:m], plain.capacity)


def test_home_zone_route_ends_on_the_rate_limited_endpoint() -> None:
    sp = spec()
    fab, t = built(sp, rate=123.0)
    for rank in (0, 13, 31):
        route = t.route(rank, from_gpu=True)
        assert fab.endpoints[route[0]][0] == ("gpu", *divmod(rank, 8))
        assert fab.endpoints[route[-1]][1] == ("storage", 0)
        assert fab.capacity[route[-1]] == pytest.approx(123e9)
        assert not np.isin(fab.kind[list(route)], [CROSS_AZ, CROSS_REGION]).any()
        # Host memory, then the rank's own rail NIC.
        nodes = [fab.endpoints[i][1] for i in t.route(rank, from_gpu=False)]
        assert ("nic", rank // 8, sp.rail_of(rank % 8)) in nodes


def test_another_zone_crosses_one_zone_link_and_another_region_one_region_link() -> None:
    # Zones 0 and 1 hold the job, in regions 0 and 1; storage in zone 2, region 0.
    sp = spec(azs=2, regions=2)
    fab, t = built(sp, zone=2)
    kinds0 = fab.kind[list(t.route(0, from_gpu=False))]     # node 0: zone 0, region 0
    kinds1 = fab.kind[list(t.route(8, from_gpu=False))]     # node 1: zone 1, region 1
    assert (kinds0 == CROSS_AZ).sum() == 1 and (kinds0 == CROSS_REGION).sum() == 0
    assert (kinds1 == CROSS_REGION).sum() == 1 and (kinds1 == CROSS_AZ).sum() == 0
    one_zone = spec()
    fab1, t1 = built(one_zone, zone=1)
    k = fab1.kind[list(t1.route(5, from_gpu=False))]
    assert (k == CROSS_AZ).sum() == 1
    assert fab1.capacity[list(t1.route(5, False))][k == CROSS_AZ][0] == pytest.approx(
        one_zone.az_link_gbps * 1e9 / 8)


def test_object_store_caps_each_gpu_at_its_servers_rate_share() -> None:
    sp = spec()
    fab, t = built(sp, "object_store", 4.0)
    assert t.flow_cap == pytest.approx(4e9 / 8)
    assert fab.capacity[t.route(0, False)[-1]] == pytest.approx(4 * 4e9)   # 4 servers
    assert fab.kind[t.route(0, False)[-1]] == NETWORK


def test_local_nvme_rate_and_no_nic_cluster() -> None:
    sp = spec(nvme_read_gbytes_per_s=50, nvme_write_gbytes_per_s=30)
    g = build_graph(sp)
    t = local_storage(g, sp, 12.0)
    fab = Fabric(g, sp)
    t.bind(fab)
    assert [fab.capacity[i] for i in t.route(9, from_gpu=False)] == [pytest.approx(12e9)]
    with pytest.raises(ValueError, match="no NICs"):
        one = spec(nodes=1, nics_per_node=0)
        attach_storage(build_graph(one), one, "pfs", 1.0)
    with pytest.raises(ValueError, match="needs NVMe"):
        local_storage(build_graph(spec()), spec(), None)
