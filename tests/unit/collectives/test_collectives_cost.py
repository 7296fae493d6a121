"""The alpha-beta cost model: ordering of algorithms on synthetic fabrics."""
from __future__ import annotations

import math

import pytest

from collectives import cost
from collectives.types import CollectiveOp, FabricModel, LinkCost, Request

KiB, MiB = 1 << 10, 1 << 20

# A ZionEX-like node: 8 GPUs on NVLink (about 150 GB/s per GPU one way, 1 us),
# RoCE NICs of 200 Gb/s (25 GB/s, 3 us) between nodes.
NVLINK = LinkCost(latency=1e-6, bandwidth=150e9, chunk_bytes=512 * KiB)
ROCE = LinkCost(latency=3e-6, bandwidth=25e9, chunk_bytes=128 * KiB)


def zionex(nodes=2, nics=8, per_node=8, **kw):
    return FabricModel(ranks_per_node=per_node, nodes=nodes, intra=NVLINK, inter=ROCE,
                       nics_per_node=nics, reduce_bandwidth=1e12, copy_bandwidth=1e12,
                       step_overhead=2e-6, **kw)


def test_estimate_is_the_cheapest_algorithm():
    fab = zionex()
    for op in CollectiveOp:
        for n in (KiB, MiB, 64 * MiB):
            costs = cost.costs(op, n, fab)
            assert costs, op
            assert cost.estimate(op, n, fab) == min(costs.values())
            assert all(v > 0 and math.isfinite(v) for v in costs.values())


def test_estimate_grows_with_size():
    fab = zionex()
    for op in CollectiveOp:
        sizes = [KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
        values = [cost.estimate(op, n, fab) for n in sizes]
        assert values == sorted(values), op


def test_one_nic_per_gpu_beats_one_nic_per_node():
    for op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER):
        wide = cost.estimate(op, 64 * MiB, zionex(nics=8))
        narrow = cost.estimate(op, 64 * MiB, zionex(nics=1))
        assert wide < narrow, op


def test_hierarchical_alltoall_wins_for_small_blocks_across_nodes():
    fab = zionex(nodes=8, nics=8)
    small = cost.costs(CollectiveOp.ALL_TO_ALL, 64 * KiB, fab)
    assert small["hierarchical"] < small["pairwise"]
    large = cost.costs(CollectiveOp.ALL_TO_ALL, 256 * MiB, fab)
    assert large["pairwise"] < large["hierarchical"]


def test_bruck_wins_for_tiny_messages_on_many_ranks():
    fab = FabricModel(ranks_per_node=64, nodes=1)
    tiny = cost.costs(CollectiveOp.ALL_TO_ALL, 64 * 8, fab)
    assert tiny["bruck"] < tiny["pairwise"]
    big = cost.costs(CollectiveOp.ALL_TO_ALL, 64 * MiB, fab)
    assert big["pairwise"] < big["bruck"]


def test_rabenseifner_beats_ring_for_small_vectors():
    fab = FabricModel(ranks_per_node=16, nodes=1)
    small = cost.costs(CollectiveOp.ALL_REDUCE, 4 * KiB, fab)
    assert small["rabenseifner"] < small["ring"]


def test_hierarchical_allreduce_beats_flat_ring_with_one_nic_per_node():
    fab = zionex(nodes=4, nics=1)
    costs = cost.costs(CollectiveOp.ALL_REDUCE, 256 * MiB, fab)
    assert costs["hierarchical"] < costs["ring"]


def test_pipelined_ring_beats_unpipelined_native_when_reduction_is_slow():
    # Shared-memory host: reduction throughput comparable to the link.
    fab = FabricModel(ranks_per_node=2, nodes=1, reduce_bandwidth=4e9)
    costs = cost.costs(CollectiveOp.ALL_REDUCE, 64 * MiB, fab)
    assert costs["ring"] < costs["native"]


def test_chain_beats_binomial_for_large_broadcasts():
    fab = zionex(nodes=4)
    costs = cost.costs(CollectiveOp.BROADCAST, 256 * MiB, fab)
    assert costs["chain"] < costs["binomial"]
    tiny = cost.costs(CollectiveOp.BROADCAST, 64, fab)
    assert tiny["binomial"] < tiny["chain"]


def test_shape_rules():
    one_node = FabricModel(ranks_per_node=4, nodes=1)
    assert cost.shape_reason(CollectiveOp.ALL_TO_ALL, "hierarchical", one_node)
    assert cost.shape_reason(CollectiveOp.ALL_GATHER, "doubling",
                             FabricModel(ranks_per_node=3))
    assert cost.shape_reason(CollectiveOp.ALL_TO_ALL, "hierarchical", zionex()) is None
    assert "hierarchical" not in cost.costs(CollectiveOp.ALL_REDUCE, MiB, one_node)


def test_calibration_factors_scale_an_algorithm():
    fab = FabricModel(ranks_per_node=2)
    req = Request(CollectiveOp.ALL_REDUCE, MiB, 4, 2)
    base = cost.algorithm_cost(CollectiveOp.ALL_REDUCE, "native", req, fab)
    slow = FabricModel(ranks_per_node=2, algorithm_factors={"all_reduce/native": 3.0})
    assert cost.algorithm_cost(CollectiveOp.ALL_REDUCE, "native", req, slow) == \
        pytest.approx(3 * base)


def test_chain_segments():
    assert cost.chain_segments(0, 8, 1e-6, 1e9, 4096) == 1
    assert cost.chain_segments(MiB, 2, 1e-6, 1e9, 4096) == MiB // 4096
    k = cost.chain_segments(64 * MiB, 16, 10e-6, 10e9, 4096)
    assert 1 < k <= 64 * MiB // 4096


def test_bad_input():
    fab = FabricModel()
    with pytest.raises(ValueError, match="nbytes"):
        cost.estimate(CollectiveOp.ALL_REDUCE, -1, fab)
    with pytest.raises(ValueError, match="op"):
        cost.estimate("no_such_op", 10, fab)
    with pytest.raises(ValueError, match="algorithm"):
        cost.algorithm_cost(CollectiveOp.ALL_REDUCE, "nope",
                            Request(CollectiveOp.ALL_REDUCE, 8), fab)
    with pytest.raises(ValueError, match="ranks_per_node"):
        FabricModel(ranks_per_node=0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkCost(latency=1e-6, bandwidth=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        LinkCost(latency=1e-6, bandwidth=1e9, chunk_bytes=0)


def test_op_parse():
    assert CollectiveOp.parse("allreduce") is CollectiveOp.ALL_REDUCE
    assert CollectiveOp.parse("ALL_TO_ALL_V") is CollectiveOp.ALL_TO_ALL_V
    assert CollectiveOp.parse("many-to-many") is CollectiveOp.MANY_TO_MANY


def test_symmetric_memory_is_priced_only_when_the_buffers_are_symmetric():
    fab = FabricModel(ranks_per_node=4, nodes=1)
    op = CollectiveOp.ALL_REDUCE
    plain = Request(op, 16 << 20, 4, 4)
    two_shot = Request(op, 16 << 20, 4, 4, symmetric=3)
    one_shot = Request(op, 16 << 20, 4, 4, symmetric=1)
    assert math.isinf(cost.algorithm_cost(op, "symmetric", plain, fab))
    # loads from shared memory beat every message-passing algorithm on one node
    others = [cost.algorithm_cost(op, a, plain, fab) for a in ("native", "ring", "rabenseifner")]
    assert cost.algorithm_cost(op, "symmetric", two_shot, fab) < min(others)
    # two-shot reads each input once; one-shot reads every input on every rank
    assert (cost.algorithm_cost(op, "symmetric", two_shot, fab)
            < cost.algorithm_cost(op, "symmetric", one_shot, fab))
    # the planner's estimate never assumes symmetric buffers
    assert "symmetric" not in cost.costs(op, 16 << 20, fab)
    assert cost.shape_reason(op, "symmetric", FabricModel(ranks_per_node=2, nodes=2))
    assert cost.shape_reason(op, "symmetric", fab) is None


def test_symmetric_copies_cost_what_the_transport_does_plus_synchronisation():
    fab = FabricModel(ranks_per_node=4, nodes=1)
    op = CollectiveOp.ALL_TO_ALL
    req = Request(op, 16 << 20, 4, 4, max_block=4 << 20, symmetric=1)
    # reading a peer's buffer crosses cores like the shared-memory transport: no
    # gain for pure copies by default (calibration may still show one)
    assert (cost.algorithm_cost(op, "symmetric", req, fab)
            > cost.algorithm_cost(op, "native", req, fab))
    cheap = FabricModel(ranks_per_node=4, nodes=1,
                        algorithm_factors={"all_to_all/symmetric": 0.5})
    assert (cost.algorithm_cost(op, "symmetric", req, cheap)
            < cost.algorithm_cost(op, "native", req, cheap))

