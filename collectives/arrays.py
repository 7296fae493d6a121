"""Buffers of any array library in and out of the collectives, without copies.

The collectives run on NumPy (host) and CuPy (device) arrays. A caller's
other arrays are seen through a view of the same memory:

- a ``torch.Tensor``: on the CPU through ``Tensor.numpy()``, on a GPU
  through DLPack into CuPy (bfloat16 through an int16 view and
  ``ml_dtypes.bfloat16``);
- anything with ``__cuda_array_interface__`` (Numba, JAX on GPU …):
  ``cupy.asarray``;
- anything with ``__dlpack__``: ``numpy.from_dlpack`` or
  ``cupy.from_dlpack`` by its device;
- anything with the buffer protocol (``memoryview``, ``bytearray``,
  ``array.array``): ``numpy.asarray(memoryview(x))``.

Results come back in the caller's kind: the caller's own receive buffer
when it gave one, else a tensor of the same library sharing the result's
memory (torch), or the NumPy / CuPy array for the other kinds. A buffer
that cannot be viewed (a non-contiguous tensor, a tensor on another GPU
than the rank's, a dtype the collectives do not carry) becomes a
:class:`Refused` placeholder whose message names the argument, its type,
device and dtype; the call's argument check reports it on every rank.
"""
from __future__ import annotations

import functools
import inspect

import numpy as np

__all__ = ["Refused", "native", "to_torch", "foreign_arrays"]

_NDARRAY = np.ndarray


class Refused:
    """A caller's buffer that has no view the collectives can take (see module doc)."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"Refused({self.message!r})"


def _describe(x) -> str:
    t = type(x)
    dev = getattr(x, "device", None)
    dt = getattr(x, "dtype", None)
    where = f"device {dev}, " if dev is not None else ""
    return f"a {t.__module__}.{t.__qualname__} ({where}dtype {dt})"


def _torch_view(t, name: str):
    """``(view, "torch")`` of a tensor, or ``(Refused, None)``."""
    import torch

    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        return Refused(f"{name}: {_describe(t)} must be contiguous, got strides "
                       f"{tuple(t.stride())} for shape {tuple(t.shape)}; pass "
                       f"{name}.contiguous()"), None
    bf16 = t.dtype == torch.bfloat16
    if t.device.type == "cpu":
        try:
            if bf16:
                from neocomm.types import bfloat16

                if bfloat16 is None:
                    raise TypeError("bfloat16 needs ml_dtypes")
                return t.view(torch.int16).numpy().view(bfloat16), "torch"
            return t.numpy(), "torch"
        except (TypeError, RuntimeError) as exc:
            return Refused(f"{name}: {_describe(t)} has no NumPy view ({exc})"), None
    if t.device.type == "cuda":
        import cupy

        here = cupy.cuda.Device().id
        if t.device.index is not None and t.device.index != here:
            return Refused(f"{name}: {_describe(t)} is on another GPU than this rank's "
                           f"(cuda:{here})"), None
        if bf16:
            from neocomm.types import bfloat16

            return cupy.from_dlpack(t.view(torch.int16)).view(bfloat16), "torch"
        return cupy.from_dlpack(t), "torch"
    return Refused(f"{name}: {_describe(t)}: the collectives take CPU and CUDA tensors"), None


def native(x, name: str):
    """``(view, kind)``: the NumPy / CuPy view of a caller's buffer and its kind
    (None: already native, or not an array at all; ``"torch"``; ``"other"``)."""
    t = type(x)
    if x is None or t is np.ndarray or t.__module__.startswith("cupy"):
        return x, None
    if t.__module__.startswith("torch"):
        return _torch_view(x, name)
    try:
        if hasattr(x, "__cuda_array_interface__"):
            import cupy

            return cupy.asarray(x), "other"
        if hasattr(x, "__dlpack__"):
            kind = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else 1
            if kind == 1:  # kDLCPU
                return np.from_dlpack(x), "other"
            import cupy

            return cupy.from_dlpack(x), "other"
        if _has_buffer(x):
            return np.asarray(memoryview(x)), "other"
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        return Refused(f"{name}: {_describe(x)} has no view the collectives can take "
                       f"({exc})"), None
    return x, None  # not an array: the call's check says so


def _has_buffer(x) -> bool:
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


def _back(result, views: dict, kind: str | None):
    """A call's result in the caller's kind: its own buffer where it gave one. Of a tuple
    (``(recvbuf, recv_counts)`` …) only the buffer, first, is converted: counts stay NumPy."""
    if isinstance(result, tuple):
        return (_back(result[0], views, kind),) + result[1:] if result else result
    own = views.get(id(result))
    if own is not None and own[0] is result:
        return own[1]
    if kind == "torch" and hasattr(result, "dtype") and hasattr(result, "shape"):
        return to_torch(result)
    return result


def to_torch(arr):
    """A tensor sharing the memory of a NumPy (CPU) or CuPy (CUDA) array, bfloat16 included."""
    import torch

    bf16 = arr.dtype.name == "bfloat16"
    if type(arr) is np.ndarray:
        return (torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if bf16
                else torch.from_numpy(arr))
    if bf16:
        import cupy

        return torch.from_dlpack(arr.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(arr)


class _Converted:
    """An asynchronous call's handle whose ``wait()`` gives the result in the caller's kind."""

    __slots__ = ("_handle", "_convert")

    def __init__(self, handle, convert):
        self._handle, self._convert = handle, convert

    def wait(self):
        return self._convert(self._handle.wait())

    def test(self) -> bool:
        return self._handle.test()

    @property
    def done(self) -> bool:
        return self._handle.done


def foreign_arrays(*names: str, prepared: bool = False):
    """Decorate a collective so that its buffer arguments ``names`` may be of any kind
    (module doc). Native buffers pass through at the cost of a type check each.
    ``prepared``: the call returns a :class:`~collectives.persistent.PreparedCollective`, whose
    ``result`` is converted once."""

    def deco(fn):
        params = list(inspect.signature(fn).parameters)
        where = [(n, params.index(n)) for n in names]

        def convert(args, kw):
            """The call on views of the caller's buffers, its result in the caller's kind."""
            views, kind, args = {}, None, list(args)
            for n, i in where:
                positional = i < len(args)
                x = args[i] if positional else kw.get(n)
                v, k = native(x, n)
                if v is x:
                    continue
                views[id(v)] = (v, x)
                kind = kind or k
                if positional:
                    args[i] = v
                else:
                    kw[n] = v
            out = fn(*args, **kw)
            if prepared:
                out.result = _back(out.result, views, kind)
                return out
            if hasattr(out, "wait") and not isinstance(out, tuple):
                return _Converted(out, lambda r: _back(r, views, kind))
            return _back(out, views, kind)

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            n = len(args)
            for name, i in where:  # the common case: NumPy, CuPy or None, passed through
                x = args[i] if i < n else kw.get(name)
                if x is not None and type(x) is not _NDARRAY and \
                        not type(x).__module__.startswith("cupy"):
                    return convert(args, kw)
            return fn(*args, **kw)

        return wrapper

    return deco
