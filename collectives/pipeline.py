"""Building blocks of pipelined algorithms: a window of chunks in flight, and
packed streams over scattered segments of a buffer.

A *segment list* describes a virtual stream made of pieces of one buffer:
``Segments(buf, starts, counts)`` is ``buf[starts[0]:starts[0]+counts[0]]``
followed by the next piece, and so on. Algorithms that send many small
blocks as one message (Bruck, hierarchical AlltoAll) pack a stream chunk by
chunk into a staging buffer, and unpack received chunks the same way, so
that memory stays bounded by the staging pool.
"""
from __future__ import annotations

import collections

import numpy as np

__all__ = ["Window", "Segments", "exchange_segments"]


class Window:
    """At most ``depth`` items in flight; each is ``(handles, on_done)``.

    ``yield from window.push(handles, on_done)`` adds one and, while more
    than ``depth`` are in flight, waits for the oldest and calls its
    ``on_done``; ``yield from window.drain()`` waits for all.
    """

    __slots__ = ("depth", "_items")

    def __init__(self, depth: int):
        self.depth = max(1, int(depth))
        self._items: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, handles, on_done=None):
        self._items.append((tuple(handles), on_done))
        while len(self._items) > self.depth:
            yield from self.pop()

    def pop(self):
        handles, on_done = self._items.popleft()
        if handles:
            yield handles
        if on_done is not None:
            on_done()

    def drain(self):
        while self._items:
            yield from self.pop()


class Segments:
    """A virtual stream made of ``counts[i]`` elements of ``buf`` at ``starts[i]``."""

    __slots__ = ("buf", "starts", "counts", "offsets", "total")

    def __init__(self, buf, starts, counts):
        self.buf = buf
        counts = np.asarray(counts, np.int64)
        keep = counts > 0
        self.starts = np.asarray(starts, np.int64)[keep]
        self.counts = counts[keep]
        self.offsets = np.zeros(len(self.counts) + 1, np.int64)
        np.cumsum(self.counts, out=self.offsets[1:])
        self.total = int(self.offsets[-1])

    def contiguous(self):
        """The stream as one view of ``buf`` when its pieces are adjacent, else None."""
        if len(self.counts) == 0:
            return self.buf[0:0]
        ends = self.starts[:-1] + self.counts[:-1]
        if (ends == self.starts[1:]).all():
            return self.buf[int(self.starts[0]):int(self.starts[0]) + self.total]
        return None

    def _pieces(self, lo: int, hi: int):
        i = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        while lo < hi:
            seg_off = int(self.offsets[i])
            start = int(self.starts[i]) + (lo - seg_off)
            take = min(hi, int(self.offsets[i + 1])) - lo
            yield lo, start, take
            lo += take
            i += 1

    def gather(self, lo: int, hi: int, out) -> None:
        """Copy stream elements ``[lo, hi)`` into ``out[:hi - lo]``."""
        for pos, start, n in self._pieces(lo, hi):
            out[pos - lo:pos - lo + n] = self.buf[start:start + n]

    def scatter(self, lo: int, hi: int, src) -> None:
        """Copy ``src[:hi - lo]`` into stream elements ``[lo, hi)``."""
        for pos, start, n in self._pieces(lo, hi):
            self.buf[start:start + n] = src[pos - lo:pos - lo + n]


def exchange_segments(call, send_peer: int, send: Segments, recv_peer: int, recv: Segments,
                      tag: int, stage_send: bool = False):
    """Generator: stream ``send`` to ``send_peer`` while receiving ``recv`` from
    ``recv_peer``, chunk by chunk through staging buffers (or straight from and
    into the buffer when a stream is contiguous).

    Chunk ``j`` of ``send`` is packed before chunk ``j`` of ``recv`` is
    unpacked, so both may name the same positions (Bruck's in-place steps);
    such callers pass ``stage_send=True``: both directions then go through
    staging and are cut into chunks of one size, the smaller of the policy's
    intra- and inter-node chunks (the same on every rank, so a sender and its
    receiver agree), so that no receive lands on positions the send has not
    packed yet, whichever link classes the two peers are across.
    """
    policy, pool = call.policy, call.pool
    dtype = send.buf.dtype
    if stage_send:
        c_send = c_recv = min(policy.intra, policy.inter)
    else:
        c_send = policy.elems(call.is_inter(send_peer))
        c_recv = policy.elems(call.is_inter(recv_peer))
    depth = policy.depth
    sends, recvs = Window(depth), collections.deque()
    n_send = -(-send.total // c_send)
    n_recv = -(-recv.total // c_recv)
    recv_direct = None if stage_send else recv.contiguous()
    send_direct = None if stage_send else send.contiguous()

    def post_recv(j):
        lo, hi = j * c_recv, min(recv.total, (j + 1) * c_recv)
        target = recv_direct[lo:hi] if recv_direct is not None else pool.take(hi - lo, dtype)
        h = call.irecv(target, recv_peer, tag + j % policy.lanes)
        recvs.append((j, lo, hi, target, h))

    for j in range(min(depth, n_recv)):
        post_recv(j)
    for j in range(max(n_send, n_recv)):
        if j < n_send:
            lo, hi = j * c_send, min(send.total, (j + 1) * c_send)
            if send_direct is not None:
                piece, release = send_direct[lo:hi], None
            else:
                piece = pool.take(hi - lo, dtype)
                send.gather(lo, hi, piece)
                release = (lambda v: (lambda: pool.give(v)))(piece)
            h = call.isend(piece, send_peer, tag + j % policy.lanes)
            yield from sends.push((h,), release)
        if j < n_recv:
            _, lo, hi, target, h = recvs.popleft()
            yield (h,)
            if recv_direct is None:
                recv.scatter(lo, hi, target)
                pool.give(target)
            if j + depth < n_recv:
                post_recv(j + depth)
    yield from sends.drain()
