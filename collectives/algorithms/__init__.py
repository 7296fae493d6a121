"""Algorithms as plug-ins: one module each, found through :func:`registry`.

An algorithm is an :class:`Algorithm` listed in its module's ``ALGORITHMS``
tuple, with

- ``name``, ``ops`` (the operations it implements) and ``order`` (its
  place among the candidates of each of its ops: lower first; cost ties go
  to the earlier candidate);
- ``supports(request, fabric) -> reason or None``: None when it can run the
  request on a group of the fabric's shape, else why not (shown to users
  when nothing can run). The base class checks ``ops`` and then
  ``shape_reason(op, fabric, group_size)``, the part that depends only on
  the group's shape (what :func:`collectives.cost.shape_reason` and
  :func:`collectives.cost.costs` ask);
- ``cost(request, fabric) -> seconds``: its modelled time. The module
  writes its alpha-beta formula as ``formula(request, fabric)`` (for groups
  of two or more ranks, from the primitives of :mod:`collectives.alphabeta`);
  the base class prices a one-rank group as one local copy and applies the
  fabric's calibration factor;
- ``rounding_steps(request, fabric) -> int``: how many times a reduced
  element is rounded to its type at most (the error bound of float16 and
  bfloat16 sums, :mod:`neocomm.reduction`);
- ``run(call)``: a generator that moves the data of one :class:`Call` with
  the backend's non-blocking send/recv and local array compute, yielding
  the handles it waits for (:mod:`collectives.progress`).

Adding an algorithm is adding a module here: every module of this package
(every directory on its ``__path__``) whose name does not start with ``_``
is imported on the first :func:`registry` call and its ``ALGORITHMS``
registered; there is no list to edit. :func:`refresh` forgets the registry,
so modules added while the process runs are found by the next call.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Mapping, Sequence

import numpy as np

from neocomm.reduction import reducer

from collectives import alphabeta
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Algorithm", "Call", "registry", "refresh", "lookup", "names", "displs"]

class Algorithm:
    """Base of the algorithm plug-ins; subclasses set ``name``, ``ops``, ``order``,
    ``formula`` and ``run`` (and ``shape_reason`` or ``supports`` when they decline
    some groups or requests)."""

    name: str = ""
    ops: frozenset = frozenset()
    #: Place among the candidates of an op (lower first, ties by name): an int for
    #: every op, or a mapping op -> int. Cost ties go to the earlier candidate.
    order: "int | Mapping[CollectiveOp, int]" = 100

    def position(self, op: CollectiveOp) -> int:
        """This algorithm's place among the candidates of ``op`` (:attr:`order`)."""
        order = self.order
        return int(order[op]) if isinstance(order, Mapping) else int(order)

    def shape_reason(self, op: CollectiveOp, fabric: FabricModel,
                     group_size: int | None = None) -> str | None:
        """Why this algorithm cannot run ``op`` on a group of ``fabric``'s shape, or
        None. ``group_size``: the group's real size when its nodes hold different
        numbers of ranks (the fabric is then nodes x the largest node)."""
        return None

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        """None when this algorithm can run ``request``, else the reason it cannot."""
        if request.op not in self.ops:
            return f"does not implement {request.op.value}"
        return self.shape_reason(request.op, fabric, request.group_size)

    def rounding_steps(self, request: Request, fabric: FabricModel) -> int:
        """The most roundings to the element type on any element's way through this
        algorithm's reduction of ``request``: the ``steps`` of the error bound of
        :mod:`neocomm.reduction`. The default, ``p - 1``, holds for any reduction
        tree over ``p`` inputs (the backend's own included); algorithms with
        shallower trees say so."""
        return max(0, int(request.group_size) - 1)

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """Alpha-beta seconds of ``request`` on a group of two or more ranks, before
        calibration (math.inf when the algorithm cannot run it)."""
        raise NotImplementedError(f"{type(self).__name__}.formula")

    def cost(self, request: Request, fabric: FabricModel) -> float:
        """Modelled seconds for ``request``: :meth:`formula` (one local copy on a
        one-rank group) times the fabric's calibration factor of this algorithm."""
        fabric = fabric.effective(request)
        if fabric.size == 1:
            seconds = alphabeta.copy(fabric, request.nbytes)
        else:
            seconds = self.formula(request, fabric)
        return seconds * fabric.factor(request.op, self.name, request.nbytes)

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

    def reducer(self, dtype):
        """``f(a, b, out=c)``: this call's reduction of two arrays of ``dtype`` on ``xp``
        (``c`` may be ``a`` or ``b``). float16 and bfloat16 are widened to float32 a piece
        at a time and rounded once (:func:`neocomm.reduction.reducer`)."""
        return reducer(self.xp, dtype, self.reduce_op)

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
    """op -> its algorithms, in tie-break order (:attr:`Algorithm.order`, then name).

    Built on first use from the ``ALGORITHMS`` of every public module of this
    package; two algorithms of one name for one op are an error."""
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[CollectiveOp, dict[str, Algorithm]] = {op: {} for op in CollectiveOp}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            for algo in getattr(module, "ALGORITHMS", ()):
                for op in algo.ops:
                    if algo.name in found[op]:
                        raise ValueError(f"algorithm {algo.name!r} for {op.value} is defined "
                                         f"twice (again in {module.__name__})")
                    found[op][algo.name] = algo
        _REGISTRY = {op: sorted(found[op].values(), key=lambda a: (a.position(op), a.name))
                     for op in CollectiveOp}
    return _REGISTRY


def refresh() -> None:
    """Forget the registry: the next :func:`registry` call discovers the modules again
    (those added since included)."""
    global _REGISTRY
    importlib.invalidate_caches()
    _REGISTRY = None


def lookup(op: CollectiveOp, name: str) -> Algorithm:
    """The algorithm ``name`` for ``op``; ValueError listing the known names otherwise."""
    algos = registry()[op]
    for algo in algos:
        if algo.name == name:
            return algo
    raise ValueError(f"algorithm: expected one of {[a.name for a in algos]} for {op.value}, "
                     f"got {name!r}")


def names(op: CollectiveOp) -> Sequence[str]:
    """Names of the algorithms of ``op``, in tie-break order."""
    return [a.name for a in registry()[op]]
