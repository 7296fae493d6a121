"""The alpha-beta cost model of every collective algorithm.

One message of ``m`` bytes over a link costs ``latency + m / bandwidth``
(Hockney's alpha-beta model); local work costs bytes over the copy or
reduction throughput of :class:`~collectives.types.FabricModel`; every
point-to-point step that neocomm's own algorithms issue from Python adds
``step_overhead`` (native library calls do not pay it). Pipelined algorithms
overlap the reduction of chunk k with the transfer of chunk k+1, so a stream
of ``m`` bytes in chunks of ``c`` costs about
``latency + (m / c) * step_overhead + max(m / bandwidth, m / reduce) + c / reduce``.

Ranks are assumed node-contiguous (group rank ``r`` is on node ``r // ranks_per_node``).
A node's NICs are shared by its concurrent inter-node flows; chunked traffic
is spread round-robin over the NICs, so one flow may use all of them.

:func:`estimate` is the entry point for callers that only know an operation,
a size and a group shape (the embedding planner); :func:`algorithm_cost`
prices one named algorithm for a full :class:`~collectives.types.Request`.
"""
from __future__ import annotations

import math
from typing import Callable

from collectives.types import (SYMMETRIC_RECV, SYMMETRIC_SEND, CollectiveOp, FabricModel,
                               Request)

__all__ = ["estimate", "algorithm_cost", "shape_reason", "candidates", "costs", "chain_segments"]

_Formula = Callable[[Request, FabricModel], float]

# ---------------------------------------------------------------- primitives


def _inter_bw(fabric: FabricModel, flows: int, spread: bool = True) -> float:
    """Bandwidth (bytes/s) of one of ``flows`` concurrent inter-node flows of a node."""
    flows = max(1, flows)
    if spread:  # chunks round-robin over every NIC of the node
        return fabric.inter.bandwidth * fabric.nics_per_node / flows
    return fabric.inter_share(flows)


def _link(fabric: FabricModel, inter: bool, flows: int = 1) -> tuple[float, float, int]:
    """``(latency s, bandwidth B/s, chunk bytes)`` of an intra- or inter-node step."""
    if inter and fabric.nodes > 1:
        return fabric.inter.latency, _inter_bw(fabric, flows), fabric.inter.chunk_bytes
    return fabric.intra.latency, fabric.intra.bandwidth, fabric.intra.chunk_bytes


def _pair_step_is_inter(fabric: FabricModel, distance: int) -> bool:
    """Whether a step where every rank talks to the rank ``distance`` away
    crosses nodes for at least one rank (the step waits for the slowest)."""
    if fabric.nodes == 1:
        return False
    distance %= fabric.size
    return distance != 0 and not (distance < fabric.ranks_per_node
                                  and fabric.ranks_per_node % (2 * distance) == 0)


def _stream(nbytes: float, link: tuple[float, float, int], fabric: FabricModel, *,
            reduce: bool = False, overhead: bool = True, pipelined: bool = True) -> float:
    """Seconds to move ``nbytes`` over ``link`` (and reduce them on arrival).

    Pipelined: chunked, reduction of one chunk overlapping the wire time of
    the next. Not pipelined: one message, then the reduction.
    """
    latency, bandwidth, chunk = link
    if nbytes <= 0:
        return 0.0
    wire = nbytes / bandwidth
    comp = nbytes / fabric.reduce_bandwidth if reduce else 0.0
    steps = max(1, math.ceil(nbytes / chunk)) if pipelined else 1
    soft = steps * fabric.step_overhead if overhead else 0.0
    if not pipelined or steps == 1:
        return latency + soft + wire + comp
    tail = min(nbytes, chunk) / fabric.reduce_bandwidth if reduce else 0.0
    return latency + soft + max(wire, comp) + tail


def _copy(fabric: FabricModel, nbytes: float) -> float:
    return nbytes / fabric.copy_bandwidth


def _log2ceil(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


# ---------------------------------------------------------------- all-to-all


def _a2a_pairwise(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    p, per_node = fab.size, fab.ranks_per_node
    block = req.max_block or req.nbytes / p
    intra = (per_node - 1) * _stream(block, _link(fab, False), fab, overhead=overhead,
                                     pipelined=False)
    inter = (p - per_node) * _stream(block, _link(fab, True, per_node), fab,
                                     overhead=overhead, pipelined=False)
    return intra + inter + _copy(fab, block)  # the block to self


def _a2a_native(req: Request, fab: FabricModel) -> float:
    return _a2a_pairwise(req, fab, overhead=False)


def _a2a_bruck(req: Request, fab: FabricModel) -> float:
    p, total = fab.size, 0.0
    half = req.nbytes / 2.0
    for k in range(_log2ceil(p)):
        # Rank r sends to r + 2^k: the last 2^k ranks of every node cross nodes.
        flows = min(fab.ranks_per_node, 1 << k)
        total += _stream(half, _link(fab, fab.nodes > 1, flows), fab, pipelined=False)
        total += _copy(fab, 2 * half)  # pack the blocks of this step, unpack them
    return total + _copy(fab, 2 * req.nbytes)  # initial and final rotation


def _a2a_hierarchical(req: Request, fab: FabricModel) -> float:
    p, per_node, nodes = fab.size, fab.ranks_per_node, fab.nodes
    block = req.max_block or req.nbytes / p
    intra = (per_node - 1) * _stream(nodes * block, _link(fab, False), fab, pipelined=False)
    inter = (nodes - 1) * _stream(per_node * block, _link(fab, True, per_node), fab,
                                  pipelined=False)
    return intra + inter + _copy(fab, 3 * req.nbytes)  # pack, regroup, unpack


# ---------------------------------------------------------------- reductions


def _ring_link(fab: FabricModel) -> tuple[float, float, int]:
    # A node-ordered ring has one inter-node flow per node.
    return _link(fab, fab.nodes > 1, 1)


def _rs_ring(req: Request, fab: FabricModel, pipelined: bool = True,
             overhead: bool = True) -> float:
    p = fab.size
    block = req.max_block or req.nbytes / p
    return (p - 1) * _stream(block, _ring_link(fab), fab, reduce=True, pipelined=pipelined,
                             overhead=overhead)


def _ag_ring(nbytes: float, fab: FabricModel, overhead: bool = True) -> float:
    p = fab.size
    return (p - 1) * _stream(nbytes / p, _ring_link(fab), fab, overhead=overhead)


def _halving_steps(fab: FabricModel, nbytes: float, reduce: bool, pipelined: bool = True,
                   overhead: bool = True) -> float:
    """Recursive halving (reduce) or doubling (gather) over the power-of-two core."""
    core = _pow2_floor(fab.size)
    total, size, d = 0.0, nbytes, core // 2
    while d >= 1:
        size /= 2.0
        inter = _pair_step_is_inter(fab, d)
        total += _stream(size, _link(fab, inter, fab.ranks_per_node), fab, reduce=reduce,
                         pipelined=pipelined, overhead=overhead)
        d //= 2
    return total


def _fold(fab: FabricModel, nbytes: float, reduce: bool, pipelined: bool = True,
          overhead: bool = True) -> float:
    """The extra step of non-power-of-two groups (extra ranks fold into partners)."""
    if fab.size == _pow2_floor(fab.size):
        return 0.0
    return _stream(nbytes, _link(fab, fab.nodes > 1, fab.ranks_per_node), fab, reduce=reduce,
                   pipelined=pipelined, overhead=overhead)


def _rs_rabenseifner(req: Request, fab: FabricModel) -> float:
    n = req.nbytes
    return (_fold(fab, n, True) + _halving_steps(fab, n, True)
            + _fold(fab, req.max_block or n / fab.size, False))


def _rs_native(req: Request, fab: FabricModel) -> float:
    return _rs_ring(req, fab, pipelined=False, overhead=False)


def _ar_ring(req: Request, fab: FabricModel) -> float:
    return _rs_ring(req, fab) + _ag_ring(req.nbytes, fab)


def _ar_rabenseifner(req: Request, fab: FabricModel, pipelined: bool = True,
                     overhead: bool = True) -> float:
    n = req.nbytes
    return (_fold(fab, n, True, pipelined, overhead) + _fold(fab, n, False, pipelined, overhead)
            + _halving_steps(fab, n, True, pipelined, overhead)
            + _halving_steps(fab, n, False, pipelined, overhead))


def _ar_native(req: Request, fab: FabricModel) -> float:
    ring = (_rs_ring(req, fab, pipelined=False, overhead=False)
            + _ag_ring(req.nbytes, fab, overhead=False))
    return min(ring, _ar_rabenseifner(req, fab, pipelined=False, overhead=False))


def _ar_hierarchical(req: Request, fab: FabricModel) -> float:
    per_node, nodes, n = fab.ranks_per_node, fab.nodes, req.nbytes
    local = fab.with_shape(per_node, 1)
    rail = FabricModel(ranks_per_node=1, nodes=nodes, intra=fab.intra,
                       inter=fab.inter.__class__(fab.inter.latency,
                                                 _inter_bw(fab, per_node),
                                                 fab.inter.chunk_bytes),
                       nics_per_node=1, copy_bandwidth=fab.copy_bandwidth,
                       reduce_bandwidth=fab.reduce_bandwidth, step_overhead=fab.step_overhead)
    shard = Request(CollectiveOp.ALL_REDUCE, int(n / per_node), req.itemsize, nodes)
    rail_ar = min(_ar_ring(shard, rail), _ar_rabenseifner(shard, rail))
    return (_rs_ring(Request(CollectiveOp.REDUCE_SCATTER, n, req.itemsize, per_node), local)
            + rail_ar + _ag_ring(n, local))


# ---------------------------------------------------------------- gathers, trees


def _ag_ring_cost(req: Request, fab: FabricModel) -> float:
    return _ag_ring(req.nbytes, fab)


def _ag_native(req: Request, fab: FabricModel) -> float:
    return _ag_ring(req.nbytes, fab, overhead=False)


def _ag_doubling(req: Request, fab: FabricModel) -> float:
    return _halving_steps(fab, req.nbytes, False)


def _tree_members(req: Request, fab: FabricModel) -> int:
    if req.op is CollectiveOp.ONE_TO_MANY:
        return 1 + (req.peers if req.peers else fab.size - 1)
    return fab.size


def _binomial(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    members = _tree_members(req, fab)
    link = _link(fab, fab.nodes > 1, 1)
    return _log2ceil(members) * _stream(req.nbytes, link, fab, pipelined=False,
                                        overhead=overhead)


def _chain(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    members = _tree_members(req, fab)
    if members < 2 or req.nbytes == 0:
        return 0.0
    latency, bandwidth, chunk = _link(fab, fab.nodes > 1, 1)
    alpha = latency + (fab.step_overhead if overhead else 0.0)
    segments = chain_segments(req.nbytes, members, alpha, bandwidth, chunk)
    return (members - 2 + segments) * (alpha + req.nbytes / segments / bandwidth)


def chain_segments(nbytes: int, members: int, alpha: float, bandwidth: float,
                   chunk_bytes: int) -> int:
    """Pipeline depth of a chain broadcast of ``nbytes`` through ``members`` ranks.

    The time ``(members - 2 + k) * (alpha + nbytes / k / bandwidth)`` is least
    at ``k = sqrt((members - 2) * nbytes / (bandwidth * alpha))``; segments are
    never smaller than one chunk of the link (``chunk_bytes``).
    """
    if nbytes <= 0:
        return 1
    most = max(1, math.ceil(nbytes / chunk_bytes))
    if members <= 2 or alpha <= 0:
        return most
    best = math.sqrt((members - 2) * nbytes / (bandwidth * alpha))
    return int(min(most, max(1, round(best))))


def _bcast_native(req: Request, fab: FabricModel) -> float:
    return min(_binomial(req, fab, overhead=False), _chain(req, fab, overhead=False))


def _one_to_many_direct(req: Request, fab: FabricModel) -> float:
    receivers = req.peers if req.peers else fab.size - 1
    latency, bandwidth, _ = _link(fab, fab.nodes > 1, 1)
    return receivers * (latency + fab.step_overhead + req.nbytes / bandwidth)


def _m2m_sparse(req: Request, fab: FabricModel) -> float:
    peers = req.peers if req.peers else fab.size - 1
    if peers == 0:
        return 0.0
    latency, bandwidth, _ = _link(fab, fab.nodes > 1, fab.ranks_per_node)
    return peers * (latency + fab.step_overhead) + req.nbytes / bandwidth


def _m2m_native(req: Request, fab: FabricModel) -> float:
    dense = Request(CollectiveOp.ALL_TO_ALL_V, req.nbytes, req.itemsize, fab.size,
                    max_block=req.max_block)
    return _a2a_native(dense, fab)


# ---------------------------------------------------------------- symmetric memory


def _sym_sync(fab: FabricModel) -> float:
    """One barrier of the group (dissemination: log2 p shared-memory hops)."""
    return _log2ceil(fab.size) * fab.intra.latency + fab.step_overhead


def _symmetric(req: Request, fab: FabricModel) -> float:
    """Direct loads from the peers' symmetric buffers: syncs plus local memory work.

    A copy out of a peer's buffer crosses cores as a shared-memory transfer
    does (intra-node bandwidth); a reduction streams the peers' inputs at the
    reduction throughput, with no transport copy before it. Infinite when
    the send side is not symmetric (the algorithm cannot run)."""
    if not req.symmetric & SYMMETRIC_SEND:
        return math.inf
    p, n, op = fab.size, req.nbytes, req.op
    peer_bw = fab.intra.bandwidth
    if op is CollectiveOp.REDUCE_SCATTER:
        block = req.max_block or n / p
        return 2 * _sym_sync(fab) + (p - 1) * block / fab.reduce_bandwidth
    if op is CollectiveOp.ALL_REDUCE:
        if req.symmetric & SYMMETRIC_RECV:  # two-shot
            seg = n / p
            return (3 * _sym_sync(fab) + (p - 1) * seg / fab.reduce_bandwidth
                    + (p - 1) * seg / peer_bw)
        return 2 * _sym_sync(fab) + (p - 1) * n / fab.reduce_bandwidth
    if op is CollectiveOp.BROADCAST:
        return 2 * _sym_sync(fab) + n / peer_bw
    block = req.max_block or n / p  # AlltoAll: n is the send buffer; AllGather: the output
    return 2 * _sym_sync(fab) + (p - 1) * block / peer_bw + _copy(fab, block)


# ---------------------------------------------------------------- tables

_A2A = {"native": _a2a_native, "pairwise": _a2a_pairwise, "bruck": _a2a_bruck,
        "hierarchical": _a2a_hierarchical, "symmetric": _symmetric}
_A2AV = {"native": _a2a_native, "pairwise": _a2a_pairwise, "hierarchical": _a2a_hierarchical}

#: op -> algorithm name -> formula. Candidate order is the tie-break order.
FORMULAS: dict[CollectiveOp, dict[str, _Formula]] = {
    CollectiveOp.ALL_TO_ALL: _A2A,
    CollectiveOp.ALL_TO_ALL_V: _A2AV,
    CollectiveOp.REDUCE_SCATTER: {"native": _rs_native, "ring": _rs_ring,
                                  "rabenseifner": _rs_rabenseifner, "symmetric": _symmetric},
    CollectiveOp.ALL_REDUCE: {"native": _ar_native, "ring": _ar_ring,
                              "rabenseifner": _ar_rabenseifner,
                              "hierarchical": _ar_hierarchical, "symmetric": _symmetric},
    CollectiveOp.ALL_GATHER: {"native": _ag_native, "ring": _ag_ring_cost,
                              "doubling": _ag_doubling, "symmetric": _symmetric},
    CollectiveOp.BROADCAST: {"native": _bcast_native, "binomial": _binomial, "chain": _chain,
                             "symmetric": _symmetric},
    CollectiveOp.ONE_TO_MANY: {"direct": _one_to_many_direct, "binomial": _binomial,
                               "chain": _chain},
    CollectiveOp.MANY_TO_MANY: {"sparse": _m2m_sparse, "native": _m2m_native},
}


def candidates(op: CollectiveOp) -> tuple[str, ...]:
    """Names of the algorithms the model prices for ``op``, in tie-break order."""
    return tuple(FORMULAS[CollectiveOp.parse(op)])


def shape_reason(op: CollectiveOp, algorithm: str, fabric: FabricModel,
                 group_size: int | None = None) -> str | None:
    """Why ``algorithm`` cannot run ``op`` on a group of ``fabric``'s shape (None if it can).
    ``group_size``: the group's real size, when its nodes hold different numbers of ranks
    (the fabric's shape is then nodes x the largest node)."""
    op = CollectiveOp.parse(op)
    if algorithm not in FORMULAS[op]:
        return f"no {algorithm!r} algorithm for {op.value}"
    if algorithm == "hierarchical":
        if fabric.nodes < 2:
            return "needs at least 2 nodes"
        if fabric.ranks_per_node < 2:
            return "needs at least 2 ranks per node"
    if algorithm == "symmetric" and fabric.nodes > 1:
        return "needs a group within one node (shared memory)"
    size = fabric.size if group_size is None else int(group_size)
    if algorithm == "doubling" and size & (size - 1):
        return f"needs a group whose size is a power of two, got {size} ranks"
    return None


def algorithm_cost(op: CollectiveOp, algorithm: str, request: Request,
                   fabric: FabricModel) -> float:
    """Modelled seconds of ``algorithm`` for ``request`` on ``fabric``, times its
    calibration factor. A group of one rank costs one local copy."""
    op = CollectiveOp.parse(op)
    try:
        formula = FORMULAS[op][algorithm]
    except KeyError:
        raise ValueError(f"algorithm: expected one of {list(FORMULAS[op])} for {op.value}, "
                         f"got {algorithm!r}") from None
    if fabric.size == 1:
        seconds = _copy(fabric, request.nbytes)
    else:
        seconds = formula(request, fabric)
    return seconds * fabric.factor(op, algorithm, request.nbytes)


def costs(op: CollectiveOp, nbytes: int, fabric: FabricModel, *,
          itemsize: int = 4) -> dict[str, float]:
    """Modelled seconds of every algorithm that can run ``op`` on ``fabric``'s shape."""
    op = CollectiveOp.parse(op)
    if int(nbytes) < 0:
        raise ValueError(f"nbytes: expected bytes >= 0, got {nbytes}")
    request = Request(op, int(nbytes), itemsize, fabric.size)
    found = {name: algorithm_cost(op, name, request, fabric) for name in FORMULAS[op]
             if shape_reason(op, name, fabric) is None}
    return {name: t for name, t in found.items() if t < math.inf}


def estimate(op: CollectiveOp, nbytes: int, fabric: FabricModel) -> float:
    """Seconds the cheapest algorithm takes for ``op`` of ``nbytes`` on ``fabric``.

    ``nbytes`` is nccl-tests' size (see :class:`~collectives.types.Request`):
    bytes one rank sends for AlltoAll(v) and ManyToMany, the input of
    ReduceScatter, the buffer of AllReduce and Broadcast, the output of
    AllGather, the payload per receiver of OneToMany (sent to every other
    rank). The group is ``fabric.nodes`` nodes of ``fabric.ranks_per_node``
    ranks.

    >>> from collectives.types import FabricModel
    >>> fab = FabricModel(ranks_per_node=8, nodes=2)
    >>> estimate(CollectiveOp.ALL_REDUCE, 1 << 20, fab) > 0
    True
    """
    return min(costs(op, nbytes, fabric).values())
