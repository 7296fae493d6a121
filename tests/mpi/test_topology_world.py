"""World discovery over MPI on real and emulated node layouts, and the fabric CLI under mpirun."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from topology import (ProbeWarning, TopologyError, discover_host, discover_world, fixture,
                      to_json)

pytestmark = pytest.mark.layouts("all", why=(
    "discovery finds each real and emulated layout"))


def _nodes(world):
    return [world.node_of(r) for r in range(world.size)]


def _fixture_host(name):
    fx = fixture(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        return discover_host(fx.root, nvidia_smi_topo=fx.nvidia_smi_topo,
                             nvidia_smi_query=fx.nvidia_smi_query, live=False)


@pytest.mark.mpi(min_size=1)
def test_live_discovery_matches_the_runtime_grouping(world, all_ranks):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        cluster = discover_world(world.comm, _nodes(world))
    all_ranks(len(cluster.hosts) == 1 and cluster.size == world.size)
    all_ranks(cluster.nodes == tuple(world.ranks_of_node(n) for n in range(world.num_nodes)))
    me = cluster.ranks[world.rank]
    all_ranks(me.node == world.node and me.local_rank == world.local_rank)
    k = int(os.environ.get("NEOCOMM_RANKS_PER_NODE", "0") or 0)
    all_ranks(cluster.emulated == (k > 0 and world.num_nodes > 1))
    # every rank holds the same cluster
    texts = world.comm.allgather(to_json(cluster))
    all_ranks(len(set(texts)) == 1)
    # the host each rank is placed on is the one that rank sees itself, probed there
    from topology.sysfs import probe_cpus, probe_hostname

    seen = world.comm.allgather((probe_hostname("/"), probe_cpus("/")))
    all_ranks([p.host for p in cluster.ranks] == [h for h, _ in seen]
              and [p.rank for p in cluster.ranks] == list(range(world.size))
              and (cluster.hosts[0].hostname, cluster.hosts[0].cpus) == seen[0],
              f"{cluster.ranks} vs {seen}")


@pytest.mark.mpi(min_size=2)
def test_each_host_is_probed_once(world, all_ranks):
    calls = []

    def probe(**kw):
        calls.append(kw)
        return _fixture_host("cpu-host")

    cluster = discover_world(world.comm, _nodes(world), root=fixture("cpu-host").root, probe=probe)
    probes = world.comm.allreduce(len(calls))
    all_ranks(probes == 1 and cluster.hosts[0].hostname == "cpu-host-01")
    all_ranks(len(calls) == (1 if world.rank == 0 else 0))


@pytest.mark.mpi(min_size=2)
def test_two_hosts_gather_with_their_gpus_and_nics(world, all_ranks):
    # the first half of the ranks live on a DGX A100, the rest on a DGX-1
    half = (world.size + 1) // 2
    name = "dgx-a100" if world.rank < half else "dgx1-v100"
    mine = _fixture_host(name)
    cluster = discover_world(world.comm, _nodes(world), host=mine)
    names = [h.hostname for h in cluster.hosts]
    all_ranks(names == ["dgx-a100-01", "dgx1-v100-03"], str(names))
    placement = [(p.host, p.gpu, p.nic) for p in cluster.ranks]
    expect_a = [("dgx-a100-01", i, f"mlx5_{i}") for i in range(half)]
    all_ranks(placement[:half] == expect_a, str(placement))
    all_ranks(placement[half] == ("dgx1-v100-03", 0, "mlx5_0"), str(placement))
    all_ranks(cluster.host_of(world.rank) == mine)


@pytest.mark.mpi(min_size=2)
def test_a_failing_probe_fails_every_rank(world):
    def probe(**kw):
        if world.rank == 0:
            raise OSError("sysfs vanished")
        return _fixture_host("cpu-host")

    # rank 0 is the lowest rank of the (single) host, so its probe is the one used
    with pytest.raises(TopologyError, match=r"rank\(s\) \[0\].*OSError: sysfs vanished"):
        discover_world(world.comm, _nodes(world), root="/", probe=probe)


@pytest.mark.mpi(min_size=2)
def test_bad_node_list_fails_every_rank(world):
    nodes = _nodes(world)[:-1] if world.rank == world.size - 1 else _nodes(world)
    with pytest.raises(TopologyError, match=rf"rank\(s\) \[{world.size - 1}\].*node_of_rank"):
        discover_world(world.comm, nodes)


@pytest.mark.mpi(min_size=2)
def test_measurement_over_the_runtime(world, all_ranks):
    from neocomm.bandwidth import measure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        cluster = discover_world(world.comm, _nodes(world))
    gbs, notes = measure(world, cluster, nbytes=1 << 20, iters=2)
    all_ranks(world.comm.allgather(gbs) == [gbs] * world.size)
    # every pair of this job shares one host, so the physical path is shared memory
    all_ranks(set(gbs) == {"shm", "allreduce_bus"} and all(v > 0 for v in gbs.values()),
              str(gbs))
    wheres = {"different nodes"} if world.num_nodes > 1 else set()
    if world.local_size > 1:
        wheres.add("same node")
    all_ranks(wheres and all(w in notes["shm"] for w in wheres), str(notes))


@pytest.mark.mpi(min_size=2)
def test_fabric_validate_cli_under_mpirun(world, all_ranks, capsys):
    from neocomm.cli import main

    rc = main(["fabric", "validate", "cpu-host", "--measure", "--bytes", "1048576", "--iters",
               "2", "--json"])
    out = capsys.readouterr().out
    all_ranks(world.comm.allgather(rc) == [rc] * world.size)
    if world.rank == 0:
        report = json.loads(out)
        assert report["ranks"] == world.size and report["nodes"] == world.num_nodes
        measured = [c for c in report["checks"] if c["rule"] == "bandwidth"]
        assert [c["status"] for c in measured] in (["pass", "pass"], ["fail", "pass"],
                                                   ["pass", "fail"], ["fail", "fail"])
        assert all("GB/s" in c["found"] for c in measured)
        assert rc == (0 if report["passed"] else 1)
    else:
        assert out == ""
