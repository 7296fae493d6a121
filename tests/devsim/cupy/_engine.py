"""The stand-in's device: memory, streams whose work runs later, and the hazards they report.

Rules this module enforces (the ones real hardware punishes):

- **Device memory is not host memory.** Every allocation gets a device
  address of its own (in a range the process never maps), so passing a
  device pointer where host memory is expected fails as it would on a GPU.
- **Streams are asynchronous.** Work queued on a stream (asynchronous
  copies, NCCL calls, kernels that depend on pending work) runs on the
  stream's own worker thread, *as late as the rules allow*: a copy runs
  only when something forces it (a synchronisation, an event, an NCCL call
  queued behind it, a host read of its result). Host code that skips a
  ``synchronize()`` therefore reads stale data, deterministically.
- **Pinned host memory is read and written asynchronously.** A copy from or
  to pinned memory keeps a snapshot of the host bytes; when it finally runs
  and finds that the host changed them meanwhile, it raises
  :class:`HazardError` naming the buffer and where the copy was issued.
- **Streams race.** Work on one stream that touches memory with work still
  pending on another stream (and no event ordering them) raises
  :class:`HazardError`.
- **The memory pool recycles by stream.** As in CuPy's pool, every
  allocation belongs to the stream that was current when it was made, and
  freeing it (the last array viewing it dropped) puts its block back in that
  stream's arena at once, with no synchronisation; the next allocation of a
  fitting size on that stream gets the same block (and device address). The
  reuse raises :class:`HazardError`, naming both streams, when another
  stream used the block's last allocation in work that is not known to have
  completed: neither did the host synchronise with that work (a stream or
  event ``synchronize()``, an event or stream found ``done``, a blocking
  copy to the host) nor does the allocating stream wait for it (an event
  wait, directly or through other streams). Whether the stand-in happened
  to run that work already does not matter: on a GPU it may still be
  queued, and the new owner would overwrite memory it reads (or have its
  data overwritten).

Errors raised on a worker thread are kept by the stream and raised by its
next synchronisation (as CUDA reports asynchronous errors).
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import itertools
import os
import sys
import threading
import weakref

import numpy as np

__all__ = ["HazardError", "CudaError", "Allocation", "StreamState", "num_devices",
           "pool_round", "note_use", "note_wait", "host_knows_done",
           "current_device", "set_device", "current_stream", "set_current_stream",
           "null_stream", "adopt", "resolve", "register_pinned", "is_pinned", "call_site",
           "before_compute", "enqueue", "synchronize_device"]


class CudaError(RuntimeError):
    """A CUDA runtime error of the stand-in (bad pointer, bad device)."""


class HazardError(RuntimeError):
    """A use of device memory that real hardware would make a race or corruption."""


def num_devices() -> int:
    """Devices per host (``DEVSIM_DEVICES``, default 8, as on a DGX node)."""
    return int(os.environ.get("DEVSIM_DEVICES", "8"))


_HERE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # tests/devsim/


@functools.lru_cache(maxsize=None)
def _inside(filename: str) -> bool:
    """Whether ``filename`` is part of the stand-in (however the path to it was spelled)."""
    return os.path.realpath(filename).startswith(_HERE)


def call_site() -> str:
    """``file:line in function`` of the first caller outside the stand-in."""
    f = sys._getframe(1)
    while f is not None and _inside(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    parts = path.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{f.f_lineno} in {f.f_code.co_name}"


# -- memory ---------------------------------------------------------------------

_ALIGN = 512
_next_address = itertools.count()
_ADDRESS_BASE = 0x7E00_0000_0000  # no process maps this range: a device pointer dereferenced
#                                   on the host faults, as it does without unified memory
_lock = threading.RLock()
_bases: list[int] = []                       # sorted device base addresses
_live: dict[int, "weakref.ref[Allocation]"] = {}
_alloc_bump = [_ADDRESS_BASE]


class Allocation:
    """One device allocation: its device address, device, backing bytes, the stream whose
    pool arena its block returns to when it is freed, and the stream work that used it."""

    __slots__ = ("ptr", "nbytes", "device", "host", "host_addr", "id", "stream", "block",
                 "uses", "__weakref__")
    _ids = itertools.count(1)

    def __init__(self, host: np.ndarray, device: int):
        self.host = host                      # C-contiguous; the "device memory"
        self.nbytes = host.nbytes
        self.host_addr = host.__array_interface__["data"][0]
        self.device = device
        self.id = next(Allocation._ids)
        self.stream = current_stream() if device == current_device() else null_stream(device)
        self.uses: dict = {}  # stream -> (tick, what, site): its last work on this memory
        size = pool_round(self.nbytes)
        block = _pool_take(self.stream, size, self.nbytes)
        with _lock:
            if block is None:
                block = _Block(_alloc_bump[0], size)
                _alloc_bump[0] += size
            self.ptr, self.block = block.ptr, block
            bisect.insort(_bases, self.ptr)
            _live[self.ptr] = weakref.ref(self)
            _by_id[self.id] = self
        weakref.finalize(self, _free, self.ptr, block, self.uses, self.stream)

    def address_of(self, view: np.ndarray) -> int:
        """Device address of ``view`` (a view of this allocation's bytes)."""
        return self.ptr + (view.__array_interface__["data"][0] - self.host_addr)


def _forget(ptr: int) -> None:
    with _lock:
        _live.pop(ptr, None)
        i = bisect.bisect_left(_bases, ptr)
        if i < len(_bases) and _bases[i] == ptr:
            del _bases[i]


# -- the memory pool --------------------------------------------------------------

_by_id: "weakref.WeakValueDictionary[int, Allocation]" = weakref.WeakValueDictionary()


def pool_round(nbytes: int) -> int:
    """The block size the pool gives an allocation of ``nbytes`` (CuPy rounds every
    allocation up to a multiple of 512 bytes)."""
    return max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)


class _Block:
    """A block of the pool: its device address and size; while free, the stream work that
    used the allocation that held it last (``{stream: (tick, what, site)}``)."""

    __slots__ = ("ptr", "size", "last_uses")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size, self.last_uses = ptr, size, {}


def _free(ptr: int, block: _Block, uses: dict, stream: "StreamState") -> None:
    """The allocation at ``ptr`` was freed: its block goes back to the arena of the stream
    that allocated it, at once (CuPy's ``free`` inserts the chunk with no synchronisation)."""
    _forget(ptr)
    with _lock:
        block.last_uses = dict(uses)
        arena = stream.arena
        if block.size not in arena:
            bisect.insort(stream.arena_sizes, block.size)
        arena.setdefault(block.size, []).append(block)


def _pool_take(stream: "StreamState", size: int, nbytes: int) -> "_Block | None":
    """The free block of ``stream``'s arena that the next allocation of ``size`` bytes gets
    (the smallest that fits, the most recently freed of that size), or None; HazardError
    when another stream used the block in work not known to have completed (module doc)."""
    with _lock:
        sizes = stream.arena_sizes
        i = bisect.bisect_left(sizes, size)
        if i == len(sizes):
            return None
        fit = sizes[i]
        blocks = stream.arena[fit]
        block = blocks.pop()
        if not blocks:
            del stream.arena[fit]
            del sizes[i]
        for other, (tick, what, site) in block.last_uses.items():
            if other is stream or other.known_done >= tick or stream.waited.get(other, 0) >= tick:
                continue
            raise HazardError(
                f"memory pool reuse races with another stream: an allocation of {nbytes} bytes "
                f"on {stream!r} (at {call_site()}) gets the block at {block.ptr:#x}, freed from "
                f"an array that {what} (issued at {site}) on {other!r} used, and that work is "
                f"not known to have completed. CuPy's pool hands a freed block to the next "
                f"allocation on the stream that allocated it without synchronising: keep the "
                f"array alive until that work has completed (record an event after it and "
                f"release the array once the event is done), or make {stream!r} wait for that "
                f"event (stream.wait_event) before it allocates again")
    return block


def note_use(stream: "StreamState", ids, what: str, site: str) -> None:
    """Work ``what`` issued on ``stream`` uses the allocations ``ids`` (for the pool)."""
    with _lock:
        stream.tick += 1
        for i in ids:
            alloc = _by_id.get(i)
            if alloc is not None:
                alloc.uses[stream] = (stream.tick, what, site)


def host_knows_done(stream: "StreamState", tick: int | None = None,
                    waited: dict | None = None) -> None:
    """The host saw ``stream``'s work up to ``tick`` (default: all issued) complete, and
    with it the work of other streams that work waited for (``waited``: its waits then)."""
    with _lock:
        if tick is None:
            tick, waited = stream.tick, dict(stream.waited)
        stream.known_done = max(stream.known_done, tick)
        for other, t in (waited or {}).items():
            other.known_done = max(other.known_done, t)


def note_wait(stream: "StreamState", other: "StreamState", tick: int, waited: dict) -> None:
    """``stream``'s later work runs after ``other``'s up to ``tick`` and, through it, after
    the work ``waited`` (``other``'s waits when its event was recorded)."""
    with _lock:
        for s, t in list(waited.items()) + [(other, tick)]:
            if s is not stream and stream.waited.get(s, 0) < t:
                stream.waited[s] = t


def adopt(host: np.ndarray, device: int | None = None) -> Allocation:
    """An allocation backed by ``host`` (made C-contiguous)."""
    host = np.ascontiguousarray(host)
    if host.ndim == 0:
        host = host.reshape(1)
    return Allocation(host, current_device() if device is None else device)


def resolve(ptr: int, nbytes: int, what: str) -> tuple[Allocation, np.ndarray]:
    """The allocation holding ``[ptr, ptr + nbytes)`` and those bytes as a uint8 view;
    :class:`CudaError` when the range is not inside one live device allocation."""
    with _lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        alloc = _live[_bases[i]]() if i >= 0 else None
    if alloc is None or ptr + nbytes > alloc.ptr + alloc.nbytes or nbytes < 0:
        raise CudaError(f"{what}: {nbytes} bytes at device address {ptr:#x} are not inside "
                        f"one live device allocation (an invalid or host pointer)")
    off = ptr - alloc.ptr
    return alloc, alloc.host.reshape(-1).view(np.uint8)[off:off + nbytes]


# -- pinned host memory -----------------------------------------------------------

_pinned: list[tuple[int, int]] = []  # sorted (start, end) real host address ranges


def register_pinned(start: int, nbytes: int) -> None:
    with _lock:
        bisect.insort(_pinned, (start, start + nbytes))


def unregister_pinned(start: int) -> None:
    with _lock:
        for i, (s, _) in enumerate(_pinned):
            if s == start:
                del _pinned[i]
                return


def is_pinned(addr: int) -> bool:
    """Whether host address ``addr`` lies in pinned memory of this process."""
    with _lock:
        i = bisect.bisect_right(_pinned, (addr, float("inf"))) - 1
        return i >= 0 and _pinned[i][0] <= addr < _pinned[i][1]


# -- devices and current streams --------------------------------------------------

_tls = threading.local()


def current_device() -> int:
    return getattr(_tls, "device", 0)


def set_device(device: int) -> None:
    n = num_devices()
    if not 0 <= int(device) < n:
        raise CudaError(f"cudaErrorInvalidDevice: device {device} does not exist "
                        f"({n} device(s) on this host)")
    _tls.device = int(device)


_NULL: dict[int, "StreamState"] = {}
_ALL_STREAMS: "weakref.WeakSet[StreamState]" = weakref.WeakSet()


def null_stream(device: int | None = None) -> "StreamState":
    device = current_device() if device is None else device
    with _lock:
        s = _NULL.get(device)
        if s is None:
            s = _NULL[device] = StreamState(device, 0)
    return s


def current_stream() -> "StreamState":
    stack = getattr(_tls, "streams", None)
    dev = current_device()
    if stack and stack.get(dev):
        return stack[dev][-1]
    return null_stream(dev)


def set_current_stream(state: "StreamState | None", push: bool) -> None:
    stacks = getattr(_tls, "streams", None)
    if stacks is None:
        stacks = _tls.streams = {}
    dev = state.device if state is not None else current_device()
    stack = stacks.setdefault(dev, [])
    if push:
        stack.append(state)
    elif stack:
        stack.pop()


# -- stream work ------------------------------------------------------------------

class _Item:
    __slots__ = ("seq", "run", "eager", "reads", "writes", "what", "site", "waits")

    def __init__(self, run, *, eager=False, reads=(), writes=(), what="", site="", waits=False):
        self.run, self.eager, self.what, self.site = run, eager, what, site
        self.reads, self.writes, self.waits = frozenset(reads), frozenset(writes), waits
        self.seq = -1

    def touches(self, ids) -> bool:
        return bool(self.reads & ids or self.writes & ids)


_stream_ptrs = itertools.count(0x5000)


class StreamState:
    """A CUDA stream: an ordered queue of work run by a worker thread."""

    def __init__(self, device: int, ptr: int | None = None):
        self.device = device
        self.ptr = next(_stream_ptrs) if ptr is None else ptr
        self._q: collections.deque[_Item] = collections.deque()
        self._cv = threading.Condition()
        self._seq = 0          # seq of the last enqueued item
        self._forced = 0       # items with seq <= this may run
        self._executed = 0     # seq of the last finished item
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.arena: dict[int, list] = {}   # the pool's free blocks of this stream, by size
        self.arena_sizes: list[int] = []  # their sizes, sorted
        self.tick = 0                     # work issued on this stream (queued or run at once)
        self.known_done = 0               # the last tick the host knows completed
        self.waited: dict = {}            # stream -> tick its work here waits for (events)
        _ALL_STREAMS.add(self)

    def __repr__(self) -> str:
        return f"<stream {'null' if self.ptr == 0 else hex(self.ptr)} of device {self.device}>"

    # the host side
    def enqueue(self, item: _Item) -> int:
        if item.reads or item.writes:
            note_use(self, item.reads | item.writes, item.what, item.site)
        with self._cv:
            self._seq += 1
            item.seq = self._seq
            self._q.append(item)
            if item.eager:  # the device reaches it without the host's help
                self._forced = self._seq
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"devsim-{self!r}")
                self._thread.start()
            self._cv.notify_all()
            return self._seq

    @property
    def last(self) -> int:
        return self._seq

    def force(self, upto: int | None = None) -> None:
        with self._cv:
            self._forced = max(self._forced, self._seq if upto is None else upto)
            self._cv.notify_all()

    def done_upto(self, seq: int) -> bool:
        with self._cv:
            return self._executed >= seq

    def wait_upto(self, seq: int) -> None:
        self.force(seq)
        with self._cv:
            while self._executed < seq:
                self._cv.wait(0.05)

    def synchronize(self) -> None:
        """Run everything queued, then raise the first error any of it raised (the host
        waits: everything issued so far is known to have completed)."""
        with _lock:
            tick, waited = self.tick, dict(self.waited)
        self.wait_upto(self.last)
        host_knows_done(self, tick, waited)
        self.raise_error()

    def raise_error(self) -> None:
        with self._cv:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def pending(self, ids=None, waits=False) -> list[_Item]:
        with self._cv:
            return [it for it in self._q
                    if (ids is not None and it.touches(ids)) or (waits and it.waits)]

    # the device side
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._q and self._q[0].seq <= self._forced):
                    self._cv.wait()
                item = self._q[0]
                failed = self._error is not None
            if not failed:
                try:
                    item.run()
                except BaseException as exc:  # kept for the host's next synchronisation
                    if not isinstance(exc, (HazardError, CudaError)) and \
                            not type(exc).__name__.startswith("Nccl"):
                        exc = CudaError(f"{item.what} (issued at {item.site}) failed on "
                                        f"{self!r}: {type(exc).__name__}: {exc}")
                    with self._cv:
                        if self._error is None:
                            self._error = exc
            with self._cv:
                self._q.popleft()
                self._executed = item.seq
                self._cv.notify_all()
            # what the item held (arrays its closure kept) is freed now, outside the lock
            item = None


def enqueue(stream: StreamState, run, **kw) -> int:
    """Queue ``run`` on ``stream`` (see :class:`_Item` for the keywords)."""
    return stream.enqueue(_Item(run, **kw))


def before_compute(reads: set, writes: set, what: str) -> bool:
    """Check a compute step on the current stream touching allocations ``reads``/``writes``.

    Returns True when the step must be queued behind pending work of the
    current stream (it touches memory that work uses); raises
    :class:`HazardError` when pending work of another stream touches it.
    """
    stream = current_stream()
    ids = reads | writes
    if ids:
        note_use(stream, ids, what, call_site())
    if not ids:
        return bool(stream.pending(waits=True))
    mine = stream.pending(ids, waits=True)
    if mine:
        # queued behind: work on other streams it may race with is judged when it runs
        return True
    _check_races(stream, reads, writes, what)
    return False


def _check_races(stream: StreamState, reads: set, writes: set, what: str) -> None:
    for other in list(_ALL_STREAMS):
        if other is stream:
            continue
        for item in other.pending(reads | writes):
            if item.writes & (reads | writes) or item.reads & writes:
                raise HazardError(
                    f"race between streams: {what} on {stream!r} (at {call_site()}) touches "
                    f"device memory that {item.what} (issued at {item.site}) on {other!r} "
                    f"still uses; order them with an event (stream.wait_event) or a "
                    f"synchronize()")


def synchronize_device(device: int | None = None) -> None:
    device = current_device() if device is None else device
    for s in list(_ALL_STREAMS):
        if s.device == device:
            s.synchronize()


def host_bytes(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of host memory at ``addr`` (for copies through raw pointers)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
