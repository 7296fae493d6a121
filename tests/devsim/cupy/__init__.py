"""A test-only stand-in for the parts of CuPy that neocomm uses, with CuPy's and CUDA's rules.

It is imported as ``cupy`` (``tests/devsim`` first on ``sys.path``) when no
real GPU is there. Arrays live in device memory of their own
(:mod:`cupy._engine`): a device array is never a NumPy array, NumPy arrays
are refused as operands (``TypeError: Unsupported type``) and implicit
conversion to NumPy raises, as CuPy does; ``numpy`` functions called on
device arrays dispatch here (``__array_function__``/``__array_ufunc__``), as
they do with CuPy. Compute runs at once when it touches no memory that
pending stream work uses, and is queued behind that work otherwise (with
its result's shape taken from a dry run); operations whose result shape
depends on the data synchronise first, as CuPy's do. Copies from pinned
host memory are asynchronous (``cupy.asarray(pinned)``, ``ndarray.set``);
``ndarray.get()`` and ``cupy.asnumpy`` synchronise. Raw kernels
(``RawModule``) run their CUDA source on a CPU OpenCL device
(``tests/devsim/opencl.py``).
"""
from __future__ import annotations

import numpy as _np

from cupy import _engine
from cupy._array import _apply, _check_kind, _function, _h2d, _to_host, ndarray  # noqa: F401
from cupy._engine import HazardError  # noqa: F401  (re-exported for tests)

__version__ = "14.0.0"  # DEVSIM_CUPY_VERSION overrides (see cuda.nccl's unique ids)
import os as _os

__version__ = _os.environ.get("DEVSIM_CUPY_VERSION", __version__)
STANDIN = True  # lets a test tell the stand-in from the real CuPy

# dtypes are NumPy's
for _name in ("bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
              "float16", "float32", "float64", "complex64", "complex128", "dtype", "iinfo",
              "finfo", "result_type", "can_cast", "promote_types", "newaxis", "inf", "nan", "pi",
              "e", "intp", "integer", "floating", "number", "generic", "signedinteger",
              "unsignedinteger", "byte", "ubyte", "short", "ushort", "intc", "uintc", "longlong",
              "ulonglong", "half", "single", "double", "float_", "int_", "uint"):
    if hasattr(_np, _name):
        globals()[_name] = getattr(_np, _name)


def iinfo(type):  # noqa: A002 - CuPy's parameter name
    return _np.iinfo(type)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _function(name)


# -- creation and conversion ---------------------------------------------------------

def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype, order=order)


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return ndarray(prototype.shape if shape is None else shape,
                   prototype.dtype if dtype is None else dtype)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return obj.astype(dtype or obj.dtype, copy=copy)
    return _from_host(_np.array(obj, dtype=dtype, copy=None, ndmin=ndmin, order="C"), blocking)


def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or _np.dtype(dtype) == a.dtype else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__"):
        view = _from_interface(a.__cuda_array_interface__)
        return view if dtype is None or _np.dtype(dtype) == view.dtype else view.astype(dtype)
    return _from_host(_np.asarray(a, dtype=dtype, order="C"), blocking)


def _from_interface(cai: dict) -> ndarray:
    """A view (no copy) of another library's device array, by its CUDA Array Interface.

    As CuPy does: the memory must be device memory (a host pointer fails, as a kernel
    reading it would), the array keeps the device that memory is on, and the producer's
    ``stream`` (version 3) is synchronised first (0 is not a valid value; 1 and 2 are the
    legacy and per-thread default streams).
    """
    if cai.get("mask") is not None:
        raise ValueError("CUDA Array Interface: masked arrays are not supported")
    shape = tuple(int(n) for n in cai["shape"])
    dtype = _np.dtype(cai["typestr"])
    ptr = int(cai["data"][0])
    strides = cai.get("strides")
    count = int(_np.prod(shape, dtype=_np.int64))
    if count == 0:
        return ndarray(shape, dtype)
    if strides is None:  # C-contiguous
        strides = tuple(dtype.itemsize * int(_np.prod(shape[i + 1:], dtype=_np.int64))
                        for i in range(len(shape)))
    strides = tuple(int(x) for x in strides)
    lo = sum(st * (n - 1) for st, n in zip(strides, shape) if st < 0)
    hi = sum(st * (n - 1) for st, n in zip(strides, shape) if st > 0) + dtype.itemsize
    alloc, _ = _engine.resolve(ptr + lo, hi - lo, "cupy.asarray(__cuda_array_interface__)")
    stream = cai.get("stream") if int(cai.get("version", 0)) >= 3 else None
    if stream is not None:
        _stream_of_interface(int(stream), alloc.device).synchronize()
    view = _np.ndarray(shape, dtype, buffer=alloc.host.reshape(-1).view(_np.uint8),
                       offset=ptr - alloc.ptr, strides=strides)
    return ndarray._wrap(view, alloc)


def _stream_of_interface(ptr: int, device: int):
    if ptr == 0:
        raise ValueError("CUDA Array Interface: stream 0 is not allowed (it is ambiguous; "
                         "use 1 for the legacy default stream)")
    if ptr in (1, 2):
        return _engine.null_stream(device)
    for st in list(_engine._ALL_STREAMS):
        if st.ptr == ptr:
            return st
    raise _engine.CudaError(f"cudaErrorInvalidResourceHandle: stream {ptr:#x} of a CUDA Array "
                            f"Interface is not a live stream")


def _from_host(host: _np.ndarray, blocking: bool) -> ndarray:
    """A device copy of ``host``: CuPy copies a pinned source directly and asynchronously
    (the host must not write it before the copy ran), a pageable one through a buffer."""
    out = ndarray(host.shape, host.dtype)
    if host.ndim == 0:
        out._a[...] = host
        return out
    _h2d(out, host)
    if blocking:
        _engine.current_stream().synchronize()
    return out


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return asarray(_np.ascontiguousarray(a, dtype=dtype))
    if a._a.flags.c_contiguous and (dtype is None or _np.dtype(dtype) == a.dtype):
        return a
    return _apply(lambda x: _np.ascontiguousarray(x, dtype=dtype), (a,), {},
                  "ascontiguousarray")


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, out=out, blocking=blocking)
    return _np.asarray(a)



def argsort(a, axis=-1, kind=None):
    """Stable, as CuPy's (a radix sort); ``kind`` None or "stable" only."""
    _check_kind(kind)
    return _apply(lambda x: _np.argsort(x, axis=axis, kind="stable"), (a,), {}, "argsort")


def sort(a, axis=-1, kind=None):
    _check_kind(kind)
    return _apply(lambda x: _np.sort(x, axis=axis, kind="stable"), (a,), {}, "sort")


def get_array_module(*args):
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def fuse(*args, **kwargs):  # pragma: no cover - not used by neocomm
    raise NotImplementedError("stand-in: cupy.fuse is not modelled")


from cupy import cuda  # noqa: E402
from cupy import testing  # noqa: E402
from cupy._raw import RawKernel, RawModule  # noqa: E402
