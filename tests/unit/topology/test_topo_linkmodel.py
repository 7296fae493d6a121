"""Link parameters per link class for the cost models."""
from __future__ import annotations

import dataclasses

import pytest

from topology import ClusterTopology, inter_node_kind, intra_node_kind, link_model
from topology.linkmodel import (LATENCY, SHM_BANDWIDTH, TCP_DEFAULT_GBPS, nvlink_generation,
                                nvlink_lane_bandwidth, nvlink_max_lanes, pcie_bandwidth)
from topology.types import LinkKind, PortState
from topology.world import place_ranks


@pytest.mark.parametrize("name, gen, lanes, lane_bw", [
    ("NVIDIA A100-SXM4-80GB", 3, 12, 25e9), ("NVIDIA H100 80GB HBM3", 4, 18, 25e9),
    ("Tesla V100-SXM2-32GB", 2, 6, 25e9), ("Tesla P100-SXM2-16GB", 1, 4, 20e9),
    ("NVIDIA B200", 5, 18, 50e9), ("NVIDIA GeForce RTX 3090", None, None, 25e9)])
def test_generations(name, gen, lanes, lane_bw):
    assert nvlink_generation(name) == gen and nvlink_max_lanes(name) == lanes
    assert nvlink_lane_bandwidth(name) == lane_bw


def test_pcie_by_generation():
    assert pcie_bandwidth("Tesla V100-SXM2-32GB") == 15.75e9
    assert pcie_bandwidth("NVIDIA A100-SXM4-80GB") == 31.5e9
    assert pcie_bandwidth("NVIDIA H100 80GB HBM3") == 63e9


def test_dgx_a100_model(host):
    model = link_model(host("dgx-a100"))
    assert model[LinkKind.NVLINK] == (12 * 25e9, LATENCY[LinkKind.NVLINK])
    bw, lat = model[LinkKind.INFINIBAND]
    assert bw == 200e9 / 8 and lat == 5e-6
    assert model[LinkKind.ROCE].bandwidth == 100e9 / 8  # the storage NICs
    assert model[LinkKind.PCIE].bandwidth == 31.5e9
    assert model[LinkKind.SHM] == (SHM_BANDWIDTH, LATENCY[LinkKind.SHM])
    assert model[LinkKind.TCP].bandwidth == 1e9 / 8  # the 1 GbE management port


def test_cube_mesh_bottleneck_is_a_single_link(host):
    model = link_model(host("dgx1-v100"))
    assert model[LinkKind.NVLINK].bandwidth == 25e9  # an NV1 pair
    assert model[LinkKind.INFINIBAND].bandwidth == 100e9 / 8


def test_cpu_host_model(host):
    model = link_model(host("cpu-host"))
    assert set(model) == {LinkKind.SHM, LinkKind.TCP}
    assert model[LinkKind.TCP].bandwidth == 25e9 / 8  # eno1 is up at 25 Gb/s
    silent = dataclasses.replace(host("cpu-host"), interfaces=())
    assert link_model(silent)[LinkKind.TCP].bandwidth == TCP_DEFAULT_GBPS * 1e9 / 8


def test_faulty_host_uses_the_ports_that_are_up(host):
    h = host("dgx-a100-faulty")
    assert link_model(h)[LinkKind.INFINIBAND].bandwidth == 25e9
    down = dataclasses.replace(h, nics=tuple(dataclasses.replace(n, state=PortState.DOWN)
                                             for n in h.nics))
    assert LinkKind.INFINIBAND not in link_model(down)


def test_link_classes_between_and_within_nodes(host):
    a100, cpu = host("dgx-a100"), host("cpu-host")
    assert inter_node_kind(ClusterTopology.single(a100)) is LinkKind.INFINIBAND
    assert intra_node_kind(ClusterTopology.single(a100)) is LinkKind.NVLINK
    assert intra_node_kind(ClusterTopology.single(a100), device=False) is LinkKind.SHM
    assert inter_node_kind(ClusterTopology.single(cpu)) is LinkKind.TCP
    assert intra_node_kind(ClusterTopology.single(cpu)) is LinkKind.SHM
    mixed = ClusterTopology((a100, cpu))
    assert inter_node_kind(mixed) is LinkKind.TCP and intra_node_kind(mixed) is LinkKind.SHM


def test_rank_placement(host):
    a100, dgx1 = host("dgx-a100"), host("dgx1-v100")
    names = [a100.hostname] * 2 + [dgx1.hostname] * 3
    ranks = place_ranks([a100, dgx1], names, [0, 0, 1, 1, 2])
    assert [(p.gpu, p.nic) for p in ranks] == [(0, "mlx5_0"), (1, "mlx5_1"), (0, "mlx5_0"),
                                               (1, "mlx5_0"), (2, "mlx5_1")]
    assert [(p.node, p.local_rank) for p in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    cluster = ClusterTopology((a100, dgx1), ranks)
    assert cluster.nodes == ((0, 1), (2, 3), (4,))
    assert cluster.emulated  # the DGX-1 carries nodes 1 and 2
    real = ClusterTopology((a100, dgx1), place_ranks([a100, dgx1], names, [0, 0, 1, 1, 1]))
    assert not real.emulated and real.num_nodes == 2
