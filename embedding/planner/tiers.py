"""Memory tiers in the planner: host-resident shards with a device cache, and what they cost.

A candidate of :mod:`~embedding.planner.enumerate` keeps its shards in device
memory. When the hardware has a host tier (``Hardware.host_memory`` > 0),
every candidate that is not data-parallel also comes in *tiered variants*
with the same shards on the same ranks:

- ``cached`` with a device cache of ``c`` rows per shard (a few shares of the
  largest shard's rows, :data:`CACHE_SHARES`): device memory holds the cache
  rows' weights and optimizer state, the shard's lookup buffers and the
  staging slots of the step's missed rows; host memory holds the whole shard;
- ``host``: no cache, every looked-up row is copied in and written back.

Time, seconds per step, added to the shard's ``lookup`` (copy in) and
``emb_backward`` (write-back) parts: ``misses = lookups × (1 − hit rate)``
rows each way, ``2 × misses × row_bytes / host_bandwidth`` where
``row_bytes`` is a row slice with its optimizer state (the write-back of
dirty evictions moves as many rows as the misses bring in). The device-side
lookup and update of the rows costs what it costs in device memory.

Hit rate of a cache holding ``c`` of a shard's ``n`` rows: the table's
measured ``hit_rate`` when its constraints give one; else the ids follow
Zipf(``s``) (the table's ``zipf_exponent``, else the workload's, 1.05 by
default), spread over the shards (a hashed id space), and the cache holds
the hottest rows (an ideal LFU cache): ``H(c, s) / H(n, s)`` with the
generalized harmonic numbers ``H(k, s) = sum_{i <= k} i^-s``
(:func:`harmonic`, closed form for large ``k``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from embedding.planner.estimate import state_bytes
from embedding.planner.estimate import itemsize as _itemsize
from embedding.planner.types import (Candidate, Hardware, MemoryEstimate, PlanDoesNotFitError,
                                     TableConstraints, Workload, sum_parts)
from embedding.types import ShardingType, TableConfig, TableMemory, Tier
from topology.sizes import GIB, format_size as _bytes

__all__ = ["CACHE_SHARES", "harmonic", "zipf_hit_rate", "TierModel", "grow_caches",
           "host_check", "no_fit_error", "hit_model_line"]

#: Cache sizes offered, as shares of a candidate's largest shard's rows.
CACHE_SHARES = (0.5, 0.25, 0.1, 0.05, 0.02, 0.01)

_EXACT = 1000  # harmonic numbers summed term by term up to here


def harmonic(k: float, s: float) -> float:
    """The generalized harmonic number ``H(k, s) = sum_{i=1..k} i^-s`` (``k`` rows, ``s`` > 0).

    Exact up to 1000 terms; beyond, the sum to 1000 plus the Euler–Maclaurin
    tail ``∫ x^-s dx + (f(k) − f(m)) / 2 + (f'(k) − f'(m)) / 12`` from
    ``m = 1000`` (relative error below 1e-12 for ``s`` in (0, 3]).

    >>> round(harmonic(4, 1.0), 6)
    2.083333
    """
    k = math.floor(k)
    if k <= 0:
        return 0.0
    m = min(k, _EXACT)
    head = _head(m, s)
    if k == m:
        return head
    integral = math.log(k / m) if s == 1.0 else (k ** (1 - s) - m ** (1 - s)) / (1 - s)
    return head + integral + (k ** -s - m ** -s) / 2 + s * (m ** (-s - 1) - k ** (-s - 1)) / 12


@functools.lru_cache(maxsize=4096)
def _head(m: int, s: float) -> float:
    """``sum_{i=1..m} i^-s``, summed exactly once per ``(m, s)`` (the planner asks for the
    same head, ``m`` = 1000, of every large table it prices)."""
    return math.fsum(i ** -s for i in range(1, m + 1))


def zipf_hit_rate(cache_rows: float, rows: float, s: float) -> float:
    """Fraction of Zipf(``s``) lookups over ``rows`` rows that a cache of the hottest
    ``cache_rows`` rows serves: ``H(cache_rows, s) / H(rows, s)``."""
    if rows <= 0 or cache_rows >= rows:
        return 1.0
    return harmonic(cache_rows, s) / harmonic(rows, s) if cache_rows >= 1 else 0.0


class TierModel:
    """The tiered variants of one table's candidates (see the module docstring)."""

    def __init__(self, table: TableConfig, hardware: Hardware, workload: Workload,
                 constraints: TableConstraints | None = None):
        c = constraints or TableConstraints()
        self.t, self.hw = table, hardware
        self.lookups = float(workload.batch_size) * float(c.ids_per_sample
                                                           or workload.ids_per_sample)
        self.given = c.hit_rate
        self.s = c.zipf_exponent or workload.zipf_exponent
        if c.hit_rate is not None:
            self.source = f"measured {c.hit_rate:g}"
        elif c.zipf_exponent is not None:
            self.source = f"Zipf s={c.zipf_exponent:g} (given)"
        else:
            self.source = f"Zipf s={self.s:g} (assumed)"

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row slice of ``cols`` columns with its optimizer state."""
        return cols * _itemsize(self.t.dtype) + state_bytes(self.t, 1, cols)

    def hit_rate(self, cache_rows: int, shard_rows: int) -> float:
        """Fraction of a shard's lookups its cache of ``cache_rows`` rows serves."""
        if cache_rows >= shard_rows:
            return 1.0
        if cache_rows <= 0:
            return 0.0
        return self.given if self.given is not None else zipf_hit_rate(cache_rows, shard_rows,
                                                                       self.s)

    def variant(self, device: Candidate, cache_rows: int) -> Candidate:
        """``device`` (a candidate in device memory) with its rows in host memory and a
        device cache of ``cache_rows`` rows per shard (0: tier ``host``, no cache)."""
        device = device.device or device
        tier = Tier.CACHED if cache_rows > 0 else Tier.HOST
        shards, hits = [], []
        for s in device.shards:
            rb = self.row_bytes(s.num_cols)
            cached = min(int(cache_rows), s.num_rows)
            hit = self.hit_rate(cached, s.num_rows)
            lookups = self.lookups * s.num_rows / self.t.num_rows
            misses = min(lookups * (1.0 - hit), float(s.num_rows))
            one_way = misses * rb / self.hw.host_rate
            mem = MemoryEstimate(weights=cached * s.num_cols * _itemsize(self.t.dtype),
                                 optimizer=state_bytes(self.t, cached, s.num_cols),
                                 buffers=s.memory.buffers + int(math.ceil(misses)) * rb,
                                 host=s.num_rows * rb)
            parts = sum_parts(list(s.parts) + [("lookup", one_way), ("emb_backward", one_way)])
            shards.append(dataclasses.replace(s, memory=mem, parts=parts,
                                              host_seconds=2.0 * one_way))
            hits.append(hit * lookups)
        total = sum(self.lookups * s.num_rows / self.t.num_rows for s in device.shards)
        return dataclasses.replace(device, shards=tuple(shards),
                                   memory=TableMemory(tier, int(cache_rows)),
                                   hit_rate=sum(hits) / total if total else 1.0,
                                   hit_source=self.source, device=device)

    def variants(self, device: Candidate) -> list[Candidate]:
        """The cached variants of ``device`` (cache of :data:`CACHE_SHARES` of its largest
        shard's rows) and its ``host`` variant; none for a data-parallel candidate, and
        none whose shard needs more host memory than a node has."""
        if device.sharding is ShardingType.DATA_PARALLEL or not self.hw.host_memory:
            return []
        most = max(s.num_rows for s in device.shards)
        sizes = sorted({max(1, int(most * f)) for f in CACHE_SHARES if most * f >= 1},
                       reverse=True)
        out = [self.variant(device, rows) for rows in sizes if rows < most]
        out.append(self.variant(device, 0))
        return [c for c in out if max(s.memory.host for s in c.shards) <= self.hw.host_memory]


def host_check(choices: Sequence[Candidate], ranks: Sequence[Sequence[int]],
               hardware: Hardware) -> None:
    """:class:`PlanDoesNotFitError` (tier ``host``) when the host-resident shards placed
    on some node need more than ``hardware.host_memory``."""
    need = [0] * hardware.num_nodes
    for c, rs in zip(choices, ranks):
        for s, r in zip(c.shards, rs):
            need[hardware.node_of(r)] += s.memory.host
    node = max(range(len(need)), key=lambda n: need[n])
    if need[node] > hardware.host_memory:
        raise PlanDoesNotFitError(
            f"the host-resident shards on node {node} need {need[node] / GIB:.2f} GiB of host "
            f"memory, a node has {hardware.host_memory / GIB:.2f} GiB (short by "
            f"{(need[node] - hardware.host_memory) / GIB:.2f} GiB)",
            needed=need[node], available=hardware.host_memory, tier="host")


def grow_caches(choices: Sequence[Candidate], ranks: Sequence[Sequence[int]],
                hardware: Hardware, models: dict) -> list[Candidate]:
    """``choices`` with the device caches of cached tables grown into the device memory
    their ranks have left, the tables whose misses cost most first (``models`` maps a
    table to its :class:`TierModel`)."""
    cap = hardware.usable_memory - sum(c.spread_memory for c in choices)
    used = [0.0] * hardware.world_size
    for c, rs in zip(choices, ranks):
        for s, r in zip(c.shards, rs):
            used[r] += s.memory.total
    out = list(choices)
    order = sorted((i for i, c in enumerate(choices) if c.memory.tier is Tier.CACHED),
                   key=lambda i: -sum(s.host_seconds for s in choices[i].shards))
    for i in order:
        c, rs = out[i], ranks[i]
        model = models[c.table]
        most = max(s.num_rows for s in c.shards)
        room = min((cap - used[r]) / model.row_bytes(s.num_cols) for s, r in zip(c.shards, rs))
        rows = min(most, c.memory.cache_rows + int(max(room, 0.0)))
        while rows > c.memory.cache_rows:
            bigger = model.variant(c, rows)
            after = [used[r] - s.memory.total + b.memory.total
                     for s, b, r in zip(c.shards, bigger.shards, rs)]
            if all(a <= cap for a in after):
                for r, a in zip(rs, after):
                    used[r] = a
                out[i] = bigger
                break
            rows = c.memory.cache_rows + (rows - c.memory.cache_rows) * 9 // 10
    return out


def no_fit_error(cands: Sequence[Sequence[Candidate]], hardware: Hardware,
                 cause: PlanDoesNotFitError) -> PlanDoesNotFitError:
    """The error for tables that fit no combination of tiers: what they need in all, what
    device and host memory hold, and by how much each is short. Its ``device_short`` is
    the device bytes missing with every table that can be in host memory (without a host
    tier: with every table in device memory), ``host_short`` the host bytes missing with
    the devices full."""
    W, N = hardware.world_size, hardware.num_nodes
    dev_cap = hardware.usable_memory * W
    host_cap = hardware.host_memory * N
    spread = lambda c: c.spread_memory * W  # noqa: E731
    everything = sum(min(c.device_bytes + c.host_bytes + spread(c) for c in cs) for cs in cands)
    in_device = sum(min((c.device or c).device_bytes + spread(c) for c in cs) for cs in cands)
    least_device = sum(min(c.device_bytes + spread(c) for c in cs) for cs in cands)
    device_short = max(0, int(in_device - dev_cap))
    text = (f"the tables do not fit: they need {_bytes(everything)} in all (weights, "
            f"optimizer state and lookup buffers); device memory holds "
            f"{_bytes(dev_cap)} ({W} ranks x {_bytes(hardware.usable_memory)} "
            f"usable)")
    if hardware.host_memory:
        host_short = max(0, int(everything - max(dev_cap, least_device) - host_cap))
        text += (f" and host memory {_bytes(host_cap)} ({N} node(s) x "
                 f"{_bytes(hardware.host_memory)}); short by "
                 f"{_bytes(device_short)} of device memory with every table in it, "
                 f"by {_bytes(host_short)} of host memory with the devices full")
        if least_device > dev_cap:
            text += (f", and by {_bytes((least_device - dev_cap))} of device memory "
                     f"even with every table in host memory")
    else:
        host_short = 0
        text += (f"; short by {_bytes(device_short)} of device memory; no host tier "
                 f"(host memory 0)")
    if hardware.host_memory:  # what each tier lacks at best
        device_short = max(0, int(least_device - dev_cap))
    return PlanDoesNotFitError(f"{text} (the last placement tried: {cause})",
                               table=cause.table, needed=cause.needed,
                               available=cause.available, tier=cause.tier,
                               device_short=device_short, host_short=host_short)


def hit_model_line(choices: Sequence[Candidate], workload: Workload) -> str:
    """Where the hit rates of the tiered ``choices`` come from, for the printout."""
    tiered = [c for c in choices if c.tiered]
    if not tiered:
        return ""
    given = sorted({f"{c.table} {c.hit_source}" for c in tiered
                    if not c.hit_source.endswith("(assumed)")})
    assumed = (f"Zipf s={workload.zipf_exponent:g} assumed (a cache holds the hottest rows "
               f"of its shard)")
    if not given:
        return f"cache hit rates: {assumed}"
    return f"cache hit rates: {', '.join(given)}; others {assumed}"
