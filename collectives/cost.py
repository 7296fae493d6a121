"""The cost model's entry points: what the algorithms of :mod:`collectives.algorithms`
say they cost, by operation and name.

Each algorithm module holds its own alpha-beta formula (``formula``, written
in the primitives of :mod:`collectives.alphabeta`, where the model's
assumptions are stated), its shape rules (``shape_reason``) and its
candidate order; this module asks the registry.

:func:`estimate` is the entry point for callers that only know an operation,
a size and a group shape (the embedding planner); :func:`algorithm_cost`
prices one named algorithm for a full :class:`~collectives.types.Request`.
"""
from __future__ import annotations

import math
from dataclasses import replace

from collectives.algorithms import Algorithm, registry
from collectives.alphabeta import chain_segments
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["estimate", "algorithm_cost", "call_seconds", "shape_reason", "candidates", "costs",
           "chain_segments"]


def _find(op: CollectiveOp, algorithm: str) -> Algorithm | None:
    for algo in registry()[op]:
        if algo.name == algorithm:
            return algo
    return None


def candidates(op: CollectiveOp) -> tuple[str, ...]:
    """Names of the algorithms the model prices for ``op``, in tie-break order."""
    return tuple(algo.name for algo in registry()[CollectiveOp.parse(op)])


def shape_reason(op: CollectiveOp, algorithm: str, fabric: FabricModel,
                 group_size: int | None = None) -> str | None:
    """Why ``algorithm`` cannot run ``op`` on a group of ``fabric``'s shape (None if it can).
    ``group_size``: the group's real size, when its nodes hold different numbers of ranks
    (the fabric's shape is then nodes x the largest node)."""
    op = CollectiveOp.parse(op)
    algo = _find(op, algorithm)
    if algo is None:
        return f"no {algorithm!r} algorithm for {op.value}"
    return algo.shape_reason(op, fabric, group_size)


def algorithm_cost(op: CollectiveOp, algorithm: str, request: Request,
                   fabric: FabricModel) -> float:
    """Modelled seconds of ``algorithm`` for ``request`` (priced as ``op``) on
    ``fabric``, times its calibration factor. A group of one rank costs one local
    copy. ValueError naming the known algorithms when ``op`` has no ``algorithm``."""
    op = CollectiveOp.parse(op)
    algo = _find(op, algorithm)
    if algo is None:
        raise ValueError(f"algorithm: expected one of {list(candidates(op))} for {op.value}, "
                         f"got {algorithm!r}")
    if request.op is not op:
        request = replace(request, op=op)
    return algo.cost(request, fabric)


def call_seconds(op: CollectiveOp, algorithm: str, request: Request, fabric: FabricModel, *,
                 api: bool = True) -> float:
    """Modelled seconds of one call a user makes: :func:`algorithm_cost` plus, through
    neocomm's API (``api``), the fabric's per-call overhead, and over a TCP link between
    nodes that link's fixed cost of a call (:attr:`FabricModel.tcp_call_seconds`, paid by
    MPI's own calls too). The overheads are the same for every algorithm, so selection
    compares :func:`algorithm_cost` alone."""
    seconds = algorithm_cost(op, algorithm, request, fabric)
    if api:
        return seconds + call_overhead(request, fabric)
    return seconds + fabric.tcp_call_seconds


def call_overhead(request: Request, fabric: FabricModel) -> float:
    """The fabric's fixed cost of one API call of ``request`` beyond its algorithm
    (argument agreement, checks, selection), the operation's own where calibrated, plus a
    TCP link's fixed cost of a call where the group's nodes talk TCP; 0 on an
    uncalibrated fabric."""
    return (fabric.effective(request).call_overhead * fabric.overhead_factor(request.op)
            + fabric.tcp_call_seconds)


def costs(op: CollectiveOp, nbytes: int, fabric: FabricModel, *,
          itemsize: int = 4) -> dict[str, float]:
    """Modelled seconds of every algorithm that can run ``op`` on ``fabric``'s shape,
    in candidate order."""
    op = CollectiveOp.parse(op)
    if int(nbytes) < 0:
        raise ValueError(f"nbytes: expected bytes >= 0, got {nbytes}")
    request = Request(op, int(nbytes), itemsize, fabric.size)
    found = {algo.name: algo.cost(request, fabric) for algo in registry()[op]
             if algo.shape_reason(op, fabric) is None}
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

