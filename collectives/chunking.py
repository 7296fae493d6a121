"""RDMA-aware chunking: chunk sizes per link class, staging buffers, chunked transfers.

Large messages are cut into chunks sized for the link they cross (intra- or
inter-node), aligned to the element size and, from one MTU up, to the 4 KiB
RoCE MTU. Chunks are numbered per message and spread round-robin over the
node's NICs ("lanes"; chunk ``k`` travels on lane ``k % lanes`` under its
own tag, so each lane is an ordered stream of its own). At most
``NEOCOMM_PIPELINE_DEPTH`` chunks of a message are in flight, and staging
copies come from a bounded :class:`StagingPool` that is reused across calls,
so memory does not grow with the message size.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from collectives import settings
from collectives.types import ROCE_MTU, FabricModel

__all__ = ["ChunkPolicy", "StagingPool", "check_chunk_bytes", "align_chunk", "chunk_ranges",
           "transfer", "staging_pool"]


def check_chunk_bytes(value, itemsize: int, name: str = "chunk_bytes") -> int:
    """``value`` as a chunk size in bytes: a positive integer multiple of ``itemsize``.

    Raises ValueError (TypeError for non-integers) naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer number of bytes, got {value!r}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name}: expected a positive number of bytes, got {value}")
    if value % itemsize:
        raise ValueError(f"{name}: expected a multiple of the element size ({itemsize} "
                         f"bytes), got {value}")
    return value


def align_chunk(chunk_bytes: int, itemsize: int) -> int:
    """Elements per chunk: ``chunk_bytes`` rounded down to a multiple of the MTU when it
    is at least one MTU (and of the element size always)."""
    unit = itemsize * ROCE_MTU // math.gcd(itemsize, ROCE_MTU)
    if chunk_bytes >= unit:
        chunk_bytes -= chunk_bytes % unit
    return max(1, chunk_bytes // itemsize)


@dataclass(frozen=True)
class ChunkPolicy:
    """How one call cuts its messages: elements per chunk over intra- and
    inter-node links, NIC lanes, and chunks in flight per message.
    ``ahead``: receives of a later round may be posted before the sends of the
    round that feeds them (MPI); off where a posted receive holds up the
    operations behind it until it completes (NCCL's stream order)."""

    intra: int
    inter: int
    lanes: int = 1
    depth: int = 4
    ahead: bool = True

    @classmethod
    def whole(cls) -> "ChunkPolicy":
        """Every message one chunk, one in flight: the policy of a transport that pairs
        sends and receives in posting order (NCCL), which chunks and pipelines on the
        device itself. Each round of an algorithm is then one matched group on every
        rank; chunk pipelines ahead of the round would pair the wrong messages, and a
        receive posted ahead of the round that feeds it would deadlock the stream."""
        return cls(intra=2**62, inter=2**62, lanes=1, depth=1, ahead=False)

    @classmethod
    def resolve(cls, fabric: FabricModel, itemsize: int, chunk_bytes=None) -> "ChunkPolicy":
        """The policy for one call: ``chunk_bytes`` (per call), else the
        ``NEOCOMM_CHUNK_BYTES*`` settings, else the fabric's link chunk sizes.
        With ``NEOCOMM_CHUNKING=0`` every message is one chunk. ValueError or
        TypeError for a bad chunk size."""
        if chunk_bytes is not None:
            check_chunk_bytes(chunk_bytes, itemsize)
        snap = settings.current()
        key = (fabric.intra.chunk_bytes, fabric.inter.chunk_bytes, fabric.nics_per_node,
               fabric.nodes, itemsize, chunk_bytes, snap)
        hit = _POLICIES.get(key)
        if hit is None:
            if snap.error:
                raise ValueError(snap.error)
            hit = _POLICIES[key] = cls._resolve(fabric, itemsize, chunk_bytes, snap)
        return hit

    @classmethod
    def _resolve(cls, fabric, itemsize, chunk_bytes, snap) -> "ChunkPolicy":
        if not snap.chunking:
            return cls(intra=2**62, inter=2**62, lanes=1, depth=snap.depth)
        sizes = []
        for link_class, link in (("intra", fabric.intra), ("inter", fabric.inter)):
            if chunk_bytes is not None:
                raw = int(chunk_bytes)
            else:
                forced = snap.chunk_intra if link_class == "intra" else snap.chunk_inter
                if forced is not None:
                    raw = check_chunk_bytes(forced, itemsize,
                                            f"NEOCOMM_CHUNK_BYTES (for {link_class}-node links)")
                else:
                    raw = max(itemsize, int(link.chunk_bytes) - int(link.chunk_bytes) % itemsize)
            sizes.append(align_chunk(raw, itemsize))
        lanes = fabric.nics_per_node if fabric.nodes > 1 else 1
        return cls(intra=sizes[0], inter=sizes[1], lanes=max(1, min(8, lanes)),
                   depth=snap.depth)

    def elems(self, inter: bool) -> int:
        return self.inter if inter else self.intra


_POLICIES: dict = {}


class StagingPool:
    """A bounded set of reusable staging buffers for one array module.

    ``take(count, dtype)`` returns a 1-D array of ``count`` elements viewed
    on a pooled byte buffer; ``give(array)`` returns it. The pool keeps at
    most ``limit`` buffers; a buffer too small for a request is replaced, so
    it holds at most ``limit`` times the largest chunk in use. One operation
    never needs more than ``2 * depth + 2`` buffers; when many asynchronous
    operations are in flight at once, buffers beyond the limit are lent and
    dropped when given back (counted in ``overflows``).
    """

    def __init__(self, xp, limit: int):
        self.xp = xp
        self.limit = int(limit)
        self._free: list = []
        self._busy: list = []  # (view, raw)
        self._lock = threading.Lock()
        self.high_water = 0  # bytes held at most, over the pool's life
        self.overflows = 0  # buffers lent beyond the limit (many operations in flight)

    @property
    def held_bytes(self) -> int:
        return sum(int(r.nbytes) for r in self._free) + sum(int(r.nbytes) for _, r in self._busy)

    def take(self, count: int, dtype):
        dtype = np.dtype(dtype)
        need = max(1, int(count) * dtype.itemsize)
        with self._lock:
            fits = [i for i, r in enumerate(self._free) if r.nbytes >= need]
            if fits:
                raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            else:
                if len(self._free) + len(self._busy) >= self.limit and self._free:
                    smallest = min(range(len(self._free)), key=lambda i: self._free[i].nbytes)
                    self._free.pop(smallest)  # replaced by a larger one
                elif len(self._busy) >= self.limit:
                    self.overflows += 1  # many operations in flight: lent, not kept
                size = -(-need // ROCE_MTU) * ROCE_MTU
                raw = self.xp.empty(size, dtype=np.uint8)
            view = raw[:need].view(dtype)[:count]
            self._busy.append((view, raw))
            self.high_water = max(self.high_water, self.held_bytes)
            return view

    def give(self, view) -> None:
        with self._lock:
            for i, (v, raw) in enumerate(self._busy):
                if v is view:
                    del self._busy[i]
                    if len(self._free) + len(self._busy) < self.limit:
                        self._free.append(raw)
                    return
        raise ValueError("give: the array was not taken from this pool")

    def in_use(self) -> int:
        return len(self._busy)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_POOLS: dict[str, StagingPool] = {}


def staging_pool(xp) -> StagingPool:
    """The process's staging pool for array module ``xp`` (numpy or cupy)."""
    key = xp.__name__
    limit = settings.staging_buffers()
    pool = _POOLS.get(key)
    if pool is None or pool.limit != limit:
        pool = StagingPool(xp, limit)
        _POOLS[key] = pool
    return pool


class _Stream:
    __slots__ = ("peer", "view", "send", "chunk", "next", "inflight")

    def __init__(self, peer, view, send, chunk):
        self.peer, self.view, self.send, self.chunk = peer, view, send, chunk
        self.next = 0
        self.inflight = 0


def transfer(call, sends: Sequence[tuple[int, object]], recvs: Sequence[tuple[int, object]],
             tag: int | None = None):
    """Generator: send each ``(peer, view)`` of ``sends`` and receive each of ``recvs``.

    Every message is cut into chunks of the link class of its peer, with at
    most ``depth`` chunks of each message in flight. It waits for *any*
    chunk to complete and refills that message's window at once, so a rank
    never sits on a finished chunk while a peer waits for the next one
    (waiting for the oldest chunk instead can deadlock rings of ranks).
    Views are 1-D; empty ones are skipped (the peer must skip them too).
    Chunk ``k`` of a message travels under tag ``tag + k % lanes`` (``tag``
    defaults to the call's base tag).
    """
    policy = call.policy
    streams = [_Stream(p, v, True, policy.elems(call.is_inter(p))) for p, v in sends if v.size]
    streams += [_Stream(p, v, False, policy.elems(call.is_inter(p))) for p, v in recvs if v.size]
    lanes, depth = policy.lanes, policy.depth
    base = call.tag if tag is None else tag
    inflight: list = []
    while True:
        for st in streams:
            count = st.view.size
            while st.inflight < depth and st.next * st.chunk < count:
                k = st.next
                piece = st.view[k * st.chunk:min(count, (k + 1) * st.chunk)]
                t = base + k % lanes
                if st.send:
                    h = call.isend(piece, st.peer, t)
                else:
                    h = call.irecv(piece, st.peer, t)
                st.next += 1
                st.inflight += 1
                inflight.append((h, st))
        if not inflight:
            return
        yield tuple(h for h, _ in inflight)
        still = []
        for h, st in inflight:
            if h.done or h.test():
                h.wait()  # runs the handle's completion checks
                st.inflight -= 1
            else:
                still.append((h, st))
        inflight = still
