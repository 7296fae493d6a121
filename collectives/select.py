"""Algorithm selection: the cheapest supported one, or the one the user forces.

By default every candidate of the operation is asked whether it
``supports`` the request on the group's fabric, and the cheapest by the
cost model wins (ties go to the earlier candidate, by each algorithm's
``order``). ``algo=`` on the call, or ``NEOCOMM_ALGO_<OP>=name``, forces
one; a forced algorithm that cannot run is an error, not a silent fallback. When no candidate can run, the
error lists every candidate and why it declined.
"""
from __future__ import annotations

from collectives import settings
from collectives.algorithms import Algorithm, registry
from collectives.types import FabricModel, Request

__all__ = ["select", "explain", "SelectionError"]


class SelectionError(ValueError):
    """No algorithm can run a request (or the forced one cannot)."""


_CACHE: dict = {}
_CACHE_LIMIT = 4096
#: The registry the cached choices were made from (a refreshed registry empties the cache).
_CACHE_OF: list = [None]


def select(request: Request, fabric: FabricModel, forced: str | None = None) -> Algorithm:
    """The algorithm to run ``request`` with; SelectionError when there is none."""
    op = request.op
    name = (forced or "").strip().lower() or settings.algorithm_override(op.value)
    algos = registry()
    if _CACHE_OF[0] is not algos:
        _CACHE.clear()
        _CACHE_OF[0] = algos
    key = (request, fabric, name)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    algo = _select(request, fabric, name)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = algo
    return algo


def _select(request: Request, fabric: FabricModel, name: str) -> Algorithm:
    op = request.op
    algos = registry()[op]
    if name:
        for algo in algos:
            if algo.name == name:
                reason = algo.supports(request, fabric)
                if reason is not None:
                    raise SelectionError(f"algorithm {name!r} cannot run this {op.value}: "
                                         f"{reason}")
                return algo
        raise SelectionError(f"algo: unknown algorithm {name!r} for "
                             f"{op.value}; expected one of {[a.name for a in algos]} "
                             f"(or unset NEOCOMM_ALGO_{op.name})")
    best, best_cost, declined = None, 0.0, []
    for algo in algos:
        reason = algo.supports(request, fabric)
        if reason is not None:
            declined.append(f"{algo.name}: {reason}")
            continue
        seconds = algo.cost(request, fabric)
        if best is None or seconds < best_cost:
            best, best_cost = algo, seconds
    if best is None:
        raise SelectionError(f"no algorithm can run this {op.value}: " + "; ".join(declined))
    return best


def explain(request: Request, fabric: FabricModel) -> list[tuple[str, float | None, str | None]]:
    """Every candidate for ``request``: ``(name, modelled seconds or None, reason it
    declined or None)``, in candidate order."""
    rows = []
    for algo in registry()[request.op]:
        reason = algo.supports(request, fabric)
        rows.append((algo.name, None if reason else algo.cost(request, fabric), reason))
    return rows
