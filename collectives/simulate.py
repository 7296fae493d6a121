"""Predicted collective times: the cost model that selects algorithms, asked for a sweep.

For each size of a sweep, :func:`predict` prices every algorithm of an
operation on a :class:`~collectives.types.FabricModel` with the same code
the runtime's selection uses (:func:`collectives.select.explain` and
:func:`collectives.select.select`) for the call ``neocomm bench`` makes at
that size (:func:`bench_request`), so a prediction and a measurement of one
size describe the same call. Bandwidths follow nccl-tests (see
:mod:`collectives.bench`): ``algbw = size / time``, ``busbw = algbw *
bus_factor``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Prediction", "predict", "bench_request", "count_of", "sweep", "bus_factor",
           "many_to_many_peers"]

#: operations whose buffer splits into one block per rank
_BLOCKED = (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V, CollectiveOp.REDUCE_SCATTER,
            CollectiveOp.ALL_GATHER, CollectiveOp.MANY_TO_MANY)


def bus_factor(op: CollectiveOp, n: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op is CollectiveOp.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY):
        return 1.0
    return (n - 1) / n


def sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """Sizes ``min_bytes, min_bytes * factor, ...`` up to ``max_bytes`` (nccl-tests' -b -e -f)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"sizes: expected 0 < -b <= -e, got {min_bytes}, {max_bytes}")
    if factor <= 1 and min_bytes != max_bytes:
        raise ValueError(f"-f: expected a factor > 1, got {factor}")
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        out.append(int(s))
        if factor <= 1:
            break
        s *= factor
    return out


def count_of(op: CollectiveOp, size: int, itemsize: int, ranks: int) -> int:
    """Elements of the per-rank buffer of ``size`` bytes (a whole block per rank where the
    operation splits it; at least one element)."""
    unit = ranks if op in _BLOCKED else 1
    return max(unit, size // itemsize // unit * unit)


def many_to_many_peers(ranks: int) -> int:
    """How many peers each rank sends to in the bench's ManyToMany (the next half)."""
    return max(1, ranks // 2)


def bench_request(op: CollectiveOp, size: int, itemsize: int, ranks: int, *,
                  device: bool = False, root: int = 0, symmetric: int = 0) -> Request:
    """The :class:`Request` the runtime builds for ``neocomm bench``'s call of ``size`` bytes
    (rounded as the bench rounds it: :func:`count_of`)."""
    op = CollectiveOp.parse(op)
    nbytes = count_of(op, size, itemsize, ranks) * itemsize
    block = nbytes // ranks if op in _BLOCKED else 0
    kw: dict = {}
    if op is CollectiveOp.ALL_TO_ALL_V:
        kw = dict(max_block=block, uniform=False)
    elif op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER):
        kw = dict(max_block=block)
    elif op is CollectiveOp.BROADCAST:
        kw = dict(root=root)
    elif op is CollectiveOp.ONE_TO_MANY:
        kw = dict(max_block=nbytes, root=root, peers=ranks - 1)  # one payload for all
    elif op is CollectiveOp.MANY_TO_MANY:
        peers = many_to_many_peers(ranks)
        per = nbytes // itemsize // peers * itemsize
        kw = dict(max_block=per, peers=peers, uniform=False)
        nbytes = per * peers
    return Request(op, nbytes, itemsize, ranks, device=device, symmetric=symmetric, **kw)


@dataclass(frozen=True)
class Prediction:
    """One algorithm at one size: modelled ``time`` (s; None where it declines, saying why
    in ``reason``), nccl-tests' bandwidths in GB/s, and whether selection picks it."""

    size: int
    count: int
    algo: str
    time: float | None
    algbw: float
    busbw: float
    selected: bool
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def predict(op: CollectiveOp, fabric: FabricModel, sizes, *, itemsize: int = 4,
            device: bool = False) -> list[list[Prediction]]:
    """Per size, one :class:`Prediction` per algorithm of ``op`` (candidate order) on a
    group of ``fabric.size`` ranks; the one selection picks has ``selected``."""
    from collectives.cost import call_overhead
    from collectives.select import SelectionError, explain, select

    op = CollectiveOp.parse(op)
    n = fabric.size
    out = []
    for size in sizes:
        request = bench_request(op, int(size), itemsize, n, device=device)
        try:
            chosen = select(request, fabric, forced=None).name
        except SelectionError:
            chosen = None
        rows = []
        extra = call_overhead(request, fabric)  # (explain: the algorithms alone)
        for name, seconds, reason in explain(request, fabric):
            seconds = seconds + extra if seconds else seconds
            algbw = request.nbytes / seconds / 1e9 if seconds else 0.0
            rows.append(Prediction(request.nbytes, request.nbytes // itemsize, name, seconds,
                                   algbw, algbw * bus_factor(op, n), name == chosen, reason))
        out.append(rows)
    return out
