"""Multi-way number partitioning under capacity limits: greedy (LPT) and Karmarkar–Karp.

Both partitioners take the same arguments and return the bin of every item:

- ``costs[i]``: what item ``i`` adds to its bin's load (the objective is the
  largest load, so both try to even the loads out);
- ``sizes[i]`` and ``capacity``: what item ``i`` takes of its bin's room
  (memory); ``capacity`` is one number or one per bin;
- ``preload`` / ``preload_sizes``: load and size already in each bin;
- ``groups[i]``: items with the same non-None label go to distinct bins (the
  column slices of one table).

They raise :class:`~embedding.planner.types.PartitionError` when an item
fits in no bin.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

from embedding.planner.types import PartitionError

__all__ = ["greedy_partition", "karmarkar_karp", "makespan", "lpt_bound"]


def makespan(costs: Sequence[float], bins: Sequence[int], num_bins: int,
             preload: Sequence[float] | None = None) -> float:
    """The largest bin load of an assignment."""
    loads = list(preload) if preload is not None else [0.0] * num_bins
    for cost, b in zip(costs, bins):
        loads[b] += cost
    return max(loads) if loads else 0.0


def lpt_bound(num_bins: int) -> float:
    """Graham's worst-case ratio of LPT to the optimum on ``num_bins`` identical
    bins, ``4/3 - 1/(3 m)``; the Karmarkar–Karp differencing method shares this
    upper bound (Michiels et al., 2012)."""
    return 4.0 / 3.0 - 1.0 / (3.0 * num_bins)


def _prepare(costs, num_bins, sizes, capacity, preload, preload_sizes, groups):
    n = len(costs)
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins: expected an int >= 1, got {num_bins!r}")
    costs = [float(c) for c in costs]
    bad = [i for i, c in enumerate(costs) if c < 0]
    if bad:
        raise ValueError(f"costs: expected non-negative numbers, got {costs[bad[0]]:g} at "
                         f"index {bad[0]}")
    sizes = [0.0] * n if sizes is None else [float(s) for s in sizes]
    groups = [None] * n if groups is None else list(groups)
    for name, seq in (("sizes", sizes), ("groups", groups)):
        if len(seq) != n:
            raise ValueError(f"{name}: expected {n} entries (one per item), got {len(seq)}")
    if capacity is None:
        cap = [float("inf")] * num_bins
    elif isinstance(capacity, (int, float)):
        cap = [float(capacity)] * num_bins
    else:
        cap = [float(c) for c in capacity]
    load = [0.0] * num_bins if preload is None else [float(x) for x in preload]
    used = [0.0] * num_bins if preload_sizes is None else [float(x) for x in preload_sizes]
    for name, seq in (("capacity", cap), ("preload", load), ("preload_sizes", used)):
        if len(seq) != num_bins:
            raise ValueError(f"{name}: expected {num_bins} entries (one per bin), got {len(seq)}")
    return costs, sizes, cap, load, used, groups


def _fail(i: int, size: float, cap, used, allowed) -> PartitionError:
    room = max((cap[b] - used[b] for b in allowed), default=0.0)
    return PartitionError(f"item {i} of size {size:.6g} fits in no bin (most room "
                          f"{room:.6g})", item=i, needed=size, available=room)


def _place_all(order, costs, sizes, cap, load, used, groups, key: Callable) -> list[int]:
    k = len(cap)
    load, used = list(load), list(used)
    taken: dict = {}
    out = [-1] * len(costs)
    for i in order:
        g = groups[i]
        banned = taken.get(g, ()) if g is not None else ()
        best, best_key = -1, None
        for b in range(k):
            if b in banned or used[b] + sizes[i] > cap[b]:
                continue
            kb = key(b, load, used, cap)
            if best_key is None or kb < best_key:
                best, best_key = b, kb
        if best < 0:
            raise _fail(i, sizes[i], cap, used, [b for b in range(k) if b not in banned])
        out[i] = best
        load[best] += costs[i]
        used[best] += sizes[i]
        if g is not None:
            taken.setdefault(g, set()).add(best)
    return out


def greedy_partition(costs: Sequence[float], num_bins: int, *,
                     sizes: Sequence[float] | None = None,
                     capacity: float | Sequence[float] | None = None,
                     preload: Sequence[float] | None = None,
                     preload_sizes: Sequence[float] | None = None,
                     groups: Sequence | None = None) -> list[int]:
    """Longest processing time first: items by cost, largest first, each to the
    least-loaded bin with room (ties: least used, then lowest index).

    When an item finds no room that way, the items are placed again largest
    size first (least-loaded bin with room), then best fit decreasing (the
    bin with the least room that still fits); the last failure is raised.
    """
    costs, sizes, cap, load, used, groups = _prepare(costs, num_bins, sizes, capacity,
                                                     preload, preload_sizes, groups)
    n = len(costs)
    by_cost = sorted(range(n), key=lambda i: (-costs[i], -sizes[i], i))
    by_size = sorted(range(n), key=lambda i: (-sizes[i], -costs[i], i))
    least_loaded = lambda b, lo, us, cp: (lo[b], us[b], b)  # noqa: E731
    tightest = lambda b, lo, us, cp: (cp[b] - us[b], lo[b], b)  # noqa: E731
    error = None
    for order, key in ((by_cost, least_loaded), (by_size, least_loaded), (by_size, tightest)):
        try:
            return _place_all(order, costs, sizes, cap, load, used, groups, key)
        except PartitionError as exc:
            error = exc
    raise error


def karmarkar_karp(costs: Sequence[float], num_bins: int, *,
                   sizes: Sequence[float] | None = None,
                   capacity: float | Sequence[float] | None = None,
                   preload: Sequence[float] | None = None,
                   preload_sizes: Sequence[float] | None = None,
                   groups: Sequence | None = None) -> list[int]:
    """Multi-way largest differencing (Karmarkar and Karp, 1982).

    Every item (every group of items) starts as a partial partition of
    ``num_bins`` subsets; the preload is one more, its subsets labelled with
    their bins. The two partial partitions whose largest and smallest subset
    differ most are merged, the largest subset of one with the smallest of
    the other, until one is left: its subsets are the bins. Sizes play no part
    in the differencing; afterwards items leave bins over capacity, largest
    first, for the least-loaded bin with room.
    """
    costs, sizes, cap, load, used, groups = _prepare(costs, num_bins, sizes, capacity,
                                                     preload, preload_sizes, groups)
    k = num_bins
    members: dict = {}
    singles = []
    for i, g in enumerate(groups):
        if g is None:
            singles.append([i])
        else:
            members.setdefault(g, []).append(i)
    for g, items in members.items():
        if len(items) > k:
            raise PartitionError(f"group {g!r} has {len(items)} items for {k} bins",
                                 item=items[k], needed=sizes[items[k]], available=0.0)
    counter = itertools.count()
    heap = []

    def push(entries):
        entries.sort(key=lambda e: -e[0])
        heapq.heappush(heap, (entries[-1][0] - entries[0][0], next(counter), entries))

    # Leaves: item i is i >= 0, bin b is -1 - b; merged subsets are pairs.
    push([[load[b], -1 - b] for b in range(k)])
    for items in itertools.chain(singles, members.values()):
        push([[costs[i], i] for i in items] + [[0.0, None] for _ in range(k - len(items))])
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = []
        for ea, eb in zip(a, reversed(b)):  # a descending, b ascending
            tree = ea[1] if eb[1] is None else eb[1] if ea[1] is None else (ea[1], eb[1])
            merged.append([ea[0] + eb[0], tree])
        push(merged)
    out = [-1] * len(costs)
    for _, tree in heap[0][2]:
        leaves, stack, label = [], [tree], None
        while stack:
            node = stack.pop()
            if isinstance(node, tuple):
                stack.extend(node)
            elif node is not None:
                if node < 0:
                    label = -1 - node
                else:
                    leaves.append(node)
        for i in leaves:
            out[i] = label
    return _repair(out, costs, sizes, cap, load, used, groups)


def _repair(out, costs, sizes, cap, load, used, groups) -> list[int]:
    """Move items off bins over capacity: largest size first, to the least-loaded
    bin with room that holds no item of the same group."""
    k = len(cap)
    load, used = list(load), list(used)
    members: dict = {}
    for i, b in enumerate(out):
        load[b] += costs[i]
        used[b] += sizes[i]
        if groups[i] is not None:
            members.setdefault(groups[i], []).append(i)
    for b in range(k):
        if used[b] <= cap[b]:
            continue
        for i in sorted((i for i, x in enumerate(out) if x == b), key=lambda i: -sizes[i]):
            if used[b] <= cap[b]:
                break
            g = groups[i]
            banned = {out[j] for j in members.get(g, ())} if g is not None else set()
            targets = [t for t in range(k) if t != b and t not in banned
                       and used[t] + sizes[i] <= cap[t]]
            if not targets:
                continue
            t = min(targets, key=lambda t: (load[t], used[t], t))
            out[i] = t
            load[b] -= costs[i]
            used[b] -= sizes[i]
            load[t] += costs[i]
            used[t] += sizes[i]
        if used[b] > cap[b]:
            worst = max((i for i, x in enumerate(out) if x == b), key=lambda i: sizes[i])
            room = [cap[t] - used[t] + (sizes[worst] if t == b else 0.0) for t in range(k)]
            raise PartitionError(f"item {worst} of size {sizes[worst]:.6g} fits in no bin "
                                 f"(most room {max(room):.6g})", item=worst,
                                 needed=sizes[worst], available=max(room))
    return out
