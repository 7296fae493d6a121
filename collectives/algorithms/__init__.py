"""Algorithms as plug-ins: one module each, found through :func:`registry`.

An algorithm is an :class:`Algorithm` with

- ``supports(request, fabric) -> reason or None``: None when it can run the
  request on a group of the fabric's shape, else why not (shown to users
  when nothing can run);
- ``cost(request, fabric) -> seconds``: its alpha-beta cost
  (:mod:`collectives.cost`);
- ``run(call)``: a generator that moves the data of one :class:`Call` with
  the backend's non-blocking send/recv and local array compute, yielding
  the handles it waits for (:mod:`collectives.progress`).

Adding an algorithm is adding a module here, listing it in ``_MODULES`` and
giving it a formula in :mod:`collectives.cost`.
"""
from __future__ import annotations

import importlib
from typing import Sequence

import numpy as np

from collectives import cost
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Algorithm", "Call", "registry", "lookup", "names", "displs", "UFUNCS"]

_MODULES = ("native", "pairwise", "bruck", "hier_alltoall", "ring", "rabenseifner",
            "hier_allreduce", "doubling", "binomial", "chain", "direct", "sparse", "symmetric")

#: ReduceOp value -> ufunc name (looked up on the array module of the buffers).
UFUNCS = {"sum": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}


class Algorithm:
    """Base of the algorithm plug-ins; subclasses set ``name``, ``ops`` and ``run``."""

    name: str = ""
    ops: frozenset = frozenset()

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        """None when this algorithm can run ``request``, else the reason it cannot."""
        if request.op not in self.ops:
            return f"does not implement {request.op.value}"
        return cost.shape_reason(request.op, self.name, fabric, request.group_size)

    def cost(self, request: Request, fabric: FabricModel) -> float:
        """Modelled seconds for ``request`` (calibration factors included)."""
        return cost.algorithm_cost(request.op, self.name, request, fabric)

    def run(self, call: "Call"):
        """Generator moving the data of ``call``; yields handles to wait for."""
        raise NotImplementedError(f"{type(self).__name__}.run")

    def __repr__(self) -> str:
        return f"<algorithm {self.name} for {sorted(o.value for o in self.ops)}>"


class Call:
    """Everything an algorithm needs for one invocation (validated by the API).

    Buffers are flat 1-D arrays of one array module ``xp``; counts and
    displacements are int64 NumPy arrays in elements; peers and roots are
    group ranks. ``tag`` is this invocation's base tag.
    """

    _FIELDS = ("sendbuf", "recvbuf", "send_counts", "recv_counts", "send_displs",
               "recv_displs", "reduce_op", "root", "members", "identical", "send_peers",
               "recv_peers", "blocking", "peer_send", "peer_recv", "sym_check")
    __slots__ = ("op", "group", "backend", "xp", "fabric", "policy", "pool", "tag",
                 "layout", "rank", "size", "isend", "irecv") + _FIELDS

    def __init__(self, op: CollectiveOp, group, backend, xp, fabric, policy, pool, tag,
                 layout, **fields):
        self.op, self.group, self.backend, self.xp = op, group, backend, xp
        self.fabric, self.policy, self.pool, self.tag = fabric, policy, pool, tag
        self.layout = layout
        self.rank, self.size = group.rank, group.size
        from collectives.transport import transport_for

        p2p = transport_for(backend)
        #: ``isend(buf, peer, tag)`` / ``irecv(buf, peer, tag)``: non-blocking, return handles
        self.isend, self.irecv = p2p.isend, p2p.irecv
        for name in self._FIELDS:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"Call: unknown fields {sorted(fields)}")

    def is_inter(self, peer: int) -> bool:
        """Whether ``peer`` is on another node than this rank."""
        return self.layout.node[peer] != self.layout.node[self.rank]

    def ufunc(self):
        """The in-place-capable ufunc of this call's reduction, on ``xp``."""
        return getattr(self.xp, UFUNCS[self.reduce_op.value])

    def tags(self, phase: int) -> int:
        from collectives.progress import TAG_PHASE

        return self.tag + phase * TAG_PHASE


def displs(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum of ``counts`` (offsets of packed blocks)."""
    out = np.zeros(len(counts), np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=out[1:])
    return out


_REGISTRY: dict[CollectiveOp, list[Algorithm]] | None = None


def registry() -> dict[CollectiveOp, list[Algorithm]]:
    """op -> its algorithms, in the cost model's tie-break order."""
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[CollectiveOp, dict[str, Algorithm]] = {op: {} for op in CollectiveOp}
        for module_name in _MODULES:
            module = importlib.import_module(f"collectives.algorithms.{module_name}")
            for algo in module.ALGORITHMS:
                for op in algo.ops:
                    found[op][algo.name] = algo
        _REGISTRY = {op: [found[op][n] for n in cost.candidates(op) if n in found[op]]
                     for op in CollectiveOp}
    return _REGISTRY


def lookup(op: CollectiveOp, name: str) -> Algorithm:
    """The algorithm ``name`` for ``op``; ValueError listing the known names otherwise."""
    algos = registry()[op]
    for algo in algos:
        if algo.name == name:
            return algo
    raise ValueError(f"algorithm: expected one of {[a.name for a in algos]} for {op.value}, "
                     f"got {name!r}")


def names(op: CollectiveOp) -> Sequence[str]:
    return [a.name for a in registry()[op]]
