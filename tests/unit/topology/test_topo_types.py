"""The fabric model: enums, JSON round trips, and malformed JSON."""
from __future__ import annotations

import json

import pytest

from topology.types import (ClusterTopology, HostTopology, LinkLayer, PciPath, PortState,
                            RankPlacement, TopologyError, from_dict, from_json, to_dict, to_json)


def test_pci_path_order():
    assert [p.distance for p in PciPath] == [0, 1, 2, 3, 4]
    assert PciPath.PIX.within(PciPath.PXB) and PciPath.PXB.within(PciPath.PXB)
    assert not PciPath.SYS.within(PciPath.NODE)


def test_link_layer_kinds():
    assert LinkLayer("Ethernet").link_kind.value == "roce"
    assert LinkLayer("InfiniBand").link_kind.value == "infiniband"


@pytest.mark.parametrize("name", ["dgx-a100", "dgx1-v100", "cpu-host", "dgx-a100-faulty"])
def test_json_round_trip(host, name):
    h = host(name)
    assert from_json(to_json(h)) == h
    cluster = ClusterTopology.single(h)
    text = to_json(cluster)
    assert json.loads(text)["type"] == "ClusterTopology"
    assert from_json(text) == cluster
    # plain dicts of builtins only: what MPI's lowercase methods carry
    assert json.loads(json.dumps(to_dict(cluster))) == to_dict(cluster)


def test_cluster_nodes_and_emulation(host):
    h = host("cpu-host")
    ranks = tuple(RankPlacement(r, h.hostname, r // 2, r % 2) for r in range(4))
    c = ClusterTopology((h,), ranks)
    assert c.nodes == ((0, 1), (2, 3)) and c.num_nodes == 2 and c.emulated
    single = ClusterTopology.single(h)
    assert single.nodes == ((0,),) and not single.emulated
    assert single.ranks[0].gpu is None and single.ranks[0].nic is None


def test_single_gpu_host_places_rank_on_gpu0_and_its_nic(host):
    c = ClusterTopology.single(host("dgx-a100"))
    assert (c.ranks[0].gpu, c.ranks[0].nic) == (0, "mlx5_0")


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["hosts"][0].pop("hostname"), "hosts[0].hostname"),
    (lambda d: d["hosts"][0].update(cpus="many"), "hosts[0].cpus"),
    (lambda d: d["hosts"][0]["nics"][0].update(state="SLEEPY"), "nics[0].state"),
    (lambda d: d["hosts"][0]["gpus"][0].update(colour="green"), "gpus[0]"),
    (lambda d: d["hosts"][0].update(gpus={}), "hosts[0].gpus"),
    (lambda d: d["hosts"][0]["nics"][0].update(rate_gbps=True), "rate_gbps"),
])
def test_malformed_json_names_the_field(host, mutate, where):
    d = to_dict(ClusterTopology.single(host("dgx-a100")))
    mutate(d)
    with pytest.raises(TopologyError) as err:
        from_dict(ClusterTopology, d)
    assert where in str(err.value)


def test_from_json_rejects_other_documents():
    with pytest.raises(TopologyError, match="not JSON"):
        from_json("{nope")
    with pytest.raises(TopologyError, match="expected a JSON object"):
        from_json("[1, 2]")
    with pytest.raises(TopologyError, match="type"):
        from_json('{"format": 1, "type": "Spaceship"}')
    with pytest.raises(TopologyError, match="format"):
        from_json('{"format": 99, "type": "HostTopology", "hostname": "x"}')
    assert from_json('{"format": 1, "type": "HostTopology", "hostname": "x"}') == HostTopology("x")


def test_host_lookups(host):
    h = host("dgx-a100")
    assert h.gpu(3).index == 3 and h.nic("mlx5_9").numa == 5
    assert h.link("GPU1", "GPU0").lanes == 12
    assert h.pair(0, "mlx5_0").path is PciPath.PXB
    with pytest.raises(KeyError):
        h.gpu(8)
    assert PortState("ACTIVE") is PortState.ACTIVE
