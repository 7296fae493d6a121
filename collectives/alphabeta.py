"""Alpha-beta primitives the algorithms' cost formulas are written in.

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

Each algorithm's own formula lives in its module under
:mod:`collectives.algorithms`; :mod:`collectives.cost` holds the entry points.
Times are seconds, sizes bytes. A link is the tuple
``(latency s, bandwidth B/s, chunk bytes)`` that :func:`link` returns.
"""
from __future__ import annotations

import math

from collectives.types import FabricModel

__all__ = ["inter_bandwidth", "link", "ring_link", "pair_step_is_inter", "stream", "copy",
           "log2ceil", "pow2_floor", "halving_steps", "fold", "chain_segments"]

LinkCost = tuple[float, float, int]


def inter_bandwidth(fabric: FabricModel, flows: int, spread: bool = True) -> float:
    """Bandwidth (bytes/s) of one of ``flows`` concurrent inter-node flows of a node.
    ``spread``: its chunks go round-robin over every NIC of the node."""
    flows = max(1, flows)
    if spread:
        return fabric.inter.bandwidth * fabric.nics_per_node / flows
    return fabric.inter_share(flows)


def link(fabric: FabricModel, inter: bool, flows: int = 1) -> LinkCost:
    """``(latency s, bandwidth B/s, chunk bytes)`` of an intra- or inter-node step
    (inter-node only when the fabric has more than one node) in which ``flows`` flows
    of a node run at once: inter-node flows share the node's NICs, intra-node flows
    the node's memory where the fabric says so (``node_bandwidth``)."""
    if inter and fabric.nodes > 1:
        return fabric.inter.latency, inter_bandwidth(fabric, flows), fabric.inter.chunk_bytes
    bandwidth = fabric.intra.bandwidth
    if fabric.node_bandwidth > 0:
        bandwidth = min(bandwidth, fabric.node_bandwidth / max(1, flows))
    return fabric.intra.latency, bandwidth, fabric.intra.chunk_bytes


def ring_link(fabric: FabricModel) -> LinkCost:
    """The slowest link of a node-ordered ring, every rank sending at once: one
    inter-node flow per node, ``ranks_per_node`` flows inside each."""
    within = link(fabric, False, fabric.ranks_per_node)
    if fabric.nodes == 1:
        return within
    across = link(fabric, True, 1)
    return max(within[0], across[0]), min(within[1], across[1]), across[2]


def pair_step_is_inter(fabric: FabricModel, distance: int) -> bool:
    """Whether a step where every rank talks to the rank ``distance`` away
    crosses nodes for at least one rank (the step waits for the slowest)."""
    if fabric.nodes == 1:
        return False
    distance %= fabric.size
    return distance != 0 and not (distance < fabric.ranks_per_node
                                  and fabric.ranks_per_node % (2 * distance) == 0)


def stream(nbytes: float, link: LinkCost, fabric: FabricModel, *,
           reduce: bool = False, overhead: bool = True, pipelined: bool = True) -> float:
    """Seconds to move ``nbytes`` over ``link`` (and reduce them on arrival).

    Pipelined: chunked, reduction of one chunk overlapping the wire time of
    the next. Not pipelined: one message, then the reduction. ``overhead``:
    each chunk pays ``step_overhead`` (steps issued from Python).
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


def copy(fabric: FabricModel, nbytes: float) -> float:
    """Seconds of a local copy of ``nbytes``."""
    return nbytes / fabric.copy_bandwidth


def log2ceil(n: int) -> int:
    """``ceil(log2 n)`` (0 for n <= 1)."""
    return max(0, (n - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two not above ``n`` (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def halving_steps(fab: FabricModel, nbytes: float, reduce: bool, pipelined: bool = True,
                  overhead: bool = True) -> float:
    """Recursive halving (reduce) or doubling (gather) of ``nbytes`` over the
    power-of-two core of the group: step ``d`` pairs ranks ``d`` apart and
    moves half of the previous step's bytes."""
    core = pow2_floor(fab.size)
    total, size, d = 0.0, nbytes, core // 2
    while d >= 1:
        size /= 2.0
        inter = pair_step_is_inter(fab, d)
        total += stream(size, link(fab, inter, fab.ranks_per_node), fab, reduce=reduce,
                        pipelined=pipelined, overhead=overhead)
        d //= 2
    return total


def fold(fab: FabricModel, nbytes: float, reduce: bool, pipelined: bool = True,
         overhead: bool = True) -> float:
    """The extra step of non-power-of-two groups (extra ranks fold into partners);
    0 for power-of-two groups."""
    if fab.size == pow2_floor(fab.size):
        return 0.0
    return stream(nbytes, link(fab, fab.nodes > 1, fab.ranks_per_node), fab, reduce=reduce,
                  pipelined=pipelined, overhead=overhead)


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
