"""The fabric model built from discovered topologies (shipped fixtures)."""
from __future__ import annotations

import dataclasses
import warnings

from collectives import cost
from collectives.topofabric import CHUNK_BYTES, fabric_from_topology
from collectives.types import CollectiveOp
from topology import ClusterTopology, discover_host, fixture
from topology.world import place_ranks


def _host(name, hostname=None):
    fx = fixture(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = discover_host(fx.root, nvidia_smi_topo=fx.nvidia_smi_topo,
                          nvidia_smi_query=fx.nvidia_smi_query, live=False)
    return dataclasses.replace(h, hostname=hostname) if hostname else h


def _cluster(name, nodes=2, per_node=8):
    hosts = [_host(name, f"{name}-{i}") for i in range(nodes)]
    names = [h.hostname for h in hosts for _ in range(per_node)]
    node_of = [i for i in range(nodes) for _ in range(per_node)]
    return ClusterTopology(tuple(hosts), place_ranks(hosts, names, node_of))


def test_dgx_a100_device_fabric():
    fab = fabric_from_topology(_cluster("dgx-a100"), device=True)
    assert (fab.nodes, fab.ranks_per_node) == (2, 8)
    assert fab.intra.chunk_bytes == CHUNK_BYTES["nvlink"] and fab.intra.bandwidth > 100e9
    assert fab.inter.chunk_bytes in (CHUNK_BYTES["roce"], CHUNK_BYTES["infiniband"])
    assert fab.nics_per_node >= 1 and "nvlink" in fab.source
    assert fab.reduce_bandwidth > 1e11  # HBM, not host memory


def test_host_buffers_use_shared_memory_inside_a_node():
    fab = fabric_from_topology(_cluster("dgx-a100"), device=False)
    assert fab.intra.chunk_bytes == CHUNK_BYTES["shm"] and "shm within" in fab.source


def test_cpu_host_crosses_nodes_over_tcp():
    fab = fabric_from_topology(_cluster("cpu-host", nodes=2, per_node=2))
    assert fab.inter.latency > fab.intra.latency and "tcp" in fab.source
    assert fab.nics_per_node == 1


def test_emulated_nodes_use_shared_memory_between_nodes():
    h = _host("cpu-host", "box")
    cluster = ClusterTopology((h,), place_ranks([h], ["box"] * 4, [0, 0, 1, 1]))
    fab = fabric_from_topology(cluster)
    assert cluster.emulated and fab.inter == fab.intra


def test_more_nics_make_network_collectives_cheaper():
    fab = fabric_from_topology(_cluster("dgx-a100"), device=True)
    one = dataclasses.replace(fab, nics_per_node=1)
    for op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_REDUCE):
        assert cost.estimate(op, 256 << 20, fab) <= cost.estimate(op, 256 << 20, one)
