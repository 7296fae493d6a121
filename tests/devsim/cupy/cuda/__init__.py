"""The stand-in's ``cupy.cuda``: devices, streams, events, pinned memory, device pointers."""
from __future__ import annotations

import ctypes
import operator

import numpy as np

from cupy import _engine

__all__ = ["Device", "Stream", "Event", "MemoryPointer", "PinnedMemoryPointer",
           "alloc_pinned_memory", "get_current_stream", "is_available", "runtime", "nccl"]


def is_available() -> bool:
    return _engine.num_devices() > 0


class Device:
    """A CUDA device of this host (``DEVSIM_DEVICES`` of them)."""

    def __init__(self, device=None):
        self.id = _engine.current_device() if device is None else int(device)
        self._prev: list[int] = []

    def use(self) -> None:
        _engine.set_device(self.id)

    def synchronize(self) -> None:
        _engine.synchronize_device(self.id)

    def __enter__(self):
        self._prev.append(_engine.current_device())
        _engine.set_device(self.id)
        return self

    def __exit__(self, *exc):
        _engine.set_device(self._prev.pop())

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


class Stream:
    """A CUDA stream; ``Stream.null`` is the default stream."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self._st = None if null else _engine.StreamState(_engine.current_device())

    @classmethod
    def _of(cls, state) -> "Stream":
        obj = cls.__new__(cls)
        obj._st = state
        return obj

    @property
    def _state(self) -> "_engine.StreamState":
        """The engine stream (``Stream.null``: the null stream of the current device)."""
        return _engine.null_stream() if self._st is None else self._st

    @property
    def ptr(self) -> int:
        return self._state.ptr

    @property
    def device_id(self) -> int:
        """The device the stream was made on; -1 for ``Stream.null``, as in CuPy."""
        return -1 if self._st is None else self._st.device

    def synchronize(self) -> None:
        self._state.synchronize()

    @property
    def done(self) -> bool:
        """Whether all queued work has run (asks the stream to run it)."""
        state = self._state
        tick, waited = state.tick, dict(state.waited)
        state.force()
        if not state.done_upto(state.last):
            return False
        _engine.host_knows_done(state, tick, waited)
        return True

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: "Event") -> None:
        """Work queued on this stream from now on waits until ``event`` completed."""
        if event._state is None:
            return
        other, seq = event._state, event._seq
        site = _engine.call_site()
        _engine.note_wait(self._state, other, event._tick, event._waited)

        def run():
            other.wait_upto(seq)
        _engine.enqueue(self._state, run, eager=True, what="wait_event", site=site, waits=True)

    def _check_device(self) -> None:
        """CuPy refuses to make a stream of another device current (``Stream.null`` is the
        null stream of whichever device is current)."""
        here = _engine.current_device()
        if self._st is not None and self._st.device != here:
            raise RuntimeError(f"The device that the stream is created on ({self._st.device}) "
                               f"does not match with the current device ({here})")

    def use(self) -> "Stream":
        self._check_device()
        _engine.set_current_stream(self._state, push=True)
        return self

    def __enter__(self):
        self._check_device()
        _engine.set_current_stream(self._state, push=True)
        return self

    def __exit__(self, *exc):
        _engine.set_current_stream(self._state, push=False)

    def __eq__(self, other):
        return isinstance(other, Stream) and other._state is self._state

    def __hash__(self):
        return id(self._state)


Stream.null = Stream._of(None)  # resolved per device on use


def get_current_stream(device_id: int = -1) -> Stream:
    """The current stream of device ``device_id`` (-1: the current device); an int, as
    CuPy's ``int device_id`` takes (None is a ``TypeError``)."""
    try:
        device_id = operator.index(device_id)
    except TypeError:
        raise TypeError("an integer is required") from None
    if device_id in (-1, _engine.current_device()):
        return Stream._of(_engine.current_stream())
    stacks = getattr(_engine._tls, "streams", None) or {}
    stack = stacks.get(device_id)
    return Stream._of(stack[-1] if stack else _engine.null_stream(device_id))


def _stream_state(stream) -> "_engine.StreamState":
    """The engine state of ``stream`` (None: the current stream)."""
    return _engine.current_stream() if stream is None else stream._state


class Event:
    """A point in a stream's work; ``done``/``query()`` ask it to run, without blocking."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        self._state = None
        self._seq = 0
        self._tick, self._waited = 0, {}  # the stream's work it follows (the memory pool)

    def record(self, stream: Stream | None = None) -> None:
        state = _stream_state(stream)
        self._state = state
        self._seq = state.last  # complete once everything queued before it has run
        self._tick, self._waited = state.tick, dict(state.waited)

    @property
    def done(self) -> bool:
        if self._state is None:
            return True
        self._state.force(self._seq)
        if not self._state.done_upto(self._seq):
            return False
        _engine.host_knows_done(self._state, self._tick, self._waited)
        return True

    def synchronize(self) -> None:
        if self._state is not None:
            self._state.wait_upto(self._seq)
            _engine.host_knows_done(self._state, self._tick, self._waited)
            self._state.raise_error()


class MemoryPointer:
    """A device address inside one allocation."""

    def __init__(self, alloc, ptr: int):
        self.mem, self.ptr = alloc, ptr

    @property
    def device_id(self) -> int:
        return self.mem.device

    @property
    def device(self) -> Device:
        return Device(self.mem.device)

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> "MemoryPointer":
        return MemoryPointer(self.mem, self.ptr + int(offset))

    def _bytes(self, nbytes: int) -> np.ndarray:
        return _engine.resolve(self.ptr, nbytes, "memcpy")[1]

    def copy_from_host_async(self, mem, size: int, stream=None) -> None:
        """Asynchronous when host ``mem`` is pinned: the host must not write it before the
        copy ran."""
        import cupy

        addr = mem if isinstance(mem, int) else ctypes.cast(mem, ctypes.c_void_p).value
        host = _engine.host_bytes(addr, size)
        alloc, dst = _engine.resolve(self.ptr, size, "copy_from_host_async")
        view = cupy.ndarray._wrap(dst, alloc)
        cupy._h2d(view, host, stream)

    def copy_from_host(self, mem, size: int) -> None:
        self.copy_from_host_async(mem, size)
        _engine.current_stream().synchronize()

    def copy_to_host_async(self, mem, size: int, stream=None) -> None:
        import cupy

        addr = mem if isinstance(mem, int) else ctypes.cast(mem, ctypes.c_void_p).value
        alloc, src = _engine.resolve(self.ptr, size, "copy_to_host_async")
        cupy._to_host(cupy.ndarray._wrap(src, alloc), stream, _engine.host_bytes(addr, size),
                      blocking=False)

    def copy_to_host(self, mem, size: int) -> None:
        self.copy_to_host_async(mem, size)
        _engine.current_stream().synchronize()


class PinnedMemoryPointer:
    """Page-locked host memory: NumPy views of it (``numpy.frombuffer(mem, ...)``) are
    copied asynchronously by ``cupy.asarray`` and ``ndarray.set``."""

    def __init__(self, nbytes: int):
        self.size = int(nbytes)
        self._buf = (ctypes.c_uint8 * max(self.size, 1))()
        self.ptr = ctypes.addressof(self._buf)
        _engine.register_pinned(self.ptr, self.size)

    def __int__(self) -> int:
        return self.ptr

    def __buffer__(self, flags):  # Python 3.12+
        return memoryview(self._buf).cast("B")[:self.size]

    def __del__(self):
        try:
            _engine.unregister_pinned(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def alloc_pinned_memory(size: int):
    """Allocate ``size`` bytes of pinned host memory (a buffer ``numpy.frombuffer`` can view);
    as CuPy's ``PinnedMemoryPointer``, it has ``ptr`` and a method ``size()``."""
    if operator.index(size) < 0:
        raise OverflowError("can't convert negative value to size_t")
    mem = PinnedMemoryPointer(size)
    buf = mem._buf
    nbytes = mem.size
    holder = type("PinnedBuffer", (type(buf),), {"ptr": mem.ptr, "size": lambda self: nbytes})
    view = holder.from_buffer(buf)
    view._owner = mem  # noqa: SLF001 - keeps the registration alive with the buffer
    return view


from cupy.cuda import runtime  # noqa: E402
from cupy.cuda import nccl  # noqa: E402
