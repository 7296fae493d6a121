"""The stand-in's ``cupy.ndarray`` and the machinery of a compute step (the rules they keep
are in :mod:`cupy`'s docstring): an operation on device arrays runs at once or is queued
behind the stream work it depends on, and copies between host and device keep CUDA's
ordering and pinned-memory rules."""
from __future__ import annotations

import numpy as _np

import cupy
from cupy import _engine
from cupy._engine import HazardError
from cupy._names import FUNCTIONS as _FUNCTIONS, NDARRAY_ATTRIBUTES as _NDARRAY_ATTRIBUTES


def _supported(dtype: _np.dtype) -> _np.dtype:
    """``dtype``, or CuPy's error for a dtype the version in use does not have: bfloat16
    (``ml_dtypes``) came with CuPy 14; CuPy 13 and older refuse it."""
    if dtype.name == "bfloat16" and int(str(cupy.__version__).split(".")[0]) < 14:
        raise ValueError(f"Unsupported dtype {dtype.name} (CuPy {cupy.__version__})")
    return dtype


_GARBAGE = 0xFF  # fresh device memory reads as NaN / -1: code that relies on zeros fails

#: Functions whose result shape depends on the data: CuPy synchronises inside them.
_SYNCING = frozenset({"nonzero", "flatnonzero", "argwhere", "unique", "compress", "extract",
                      "bincount", "repeat", "trim_zeros", "histogram", "setdiff1d",
                      "intersect1d", "union1d", "in1d", "isin", "delete"})
#: ndarray methods that write the array itself.
_INPLACE = frozenset({"fill", "sort", "put", "partition", "itemset", "resize"})


class ndarray:
    """A device array (see the module docstring for the rules it keeps)."""

    __slots__ = ("_a", "_alloc", "__weakref__")
    __module__ = "cupy"  # as CuPy names it (and the stand-in did before this module)
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None:
            raise NotImplementedError("stand-in: ndarray(memptr=...) is not modelled")
        dtype = _supported(_np.dtype(dtype))
        n = int(_np.prod(shape, dtype=_np.int64)) * dtype.itemsize
        alloc = _engine.adopt(_np.full(max(n, 1), _GARBAGE, _np.uint8))
        view = alloc.host[:n].view(dtype).reshape(shape, order=order)
        self._a, self._alloc = view, alloc

    @classmethod
    def _wrap(cls, view: _np.ndarray, alloc) -> "ndarray":
        _supported(view.dtype)
        obj = cls.__new__(cls)
        obj._a, obj._alloc = view, alloc
        return obj

    # -- metadata (no device access) ------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)

    @property
    def flags(self):
        return _Flags(self._a.flags.c_contiguous, self._a.flags.f_contiguous,
                      self._a.base is None)

    @property
    def data(self):
        from cupy.cuda import MemoryPointer

        return MemoryPointer(self._alloc, self._alloc.address_of(self._a))

    @property
    def device(self):
        from cupy.cuda import Device

        return Device(self._alloc.device)

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "version": 3,
                "data": (self._alloc.address_of(a), False),
                "strides": None if a.flags.c_contiguous else a.strides,
                "stream": _engine.current_stream().ptr or 1}

    def __repr__(self) -> str:
        return f"stand-in cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    def __len__(self) -> int:
        return len(self._a)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_function__(self, func, types, args, kwargs):
        name = func.__name__
        fn = vars(cupy).get(name) if not name.startswith("_") else None
        if fn is None:
            if name not in _FUNCTIONS:  # CuPy has no twin: NumPy then raises TypeError
                return NotImplemented
            fn = _function(name)
        return fn(*args, **kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            return _apply(getattr(ufunc, method), inputs, kwargs, f"{ufunc.__name__}.{method}")
        return _apply(ufunc, inputs, kwargs, ufunc.__name__)

    # -- host reads (synchronise) -----------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        """Copy to the host; synchronises the stream unless ``blocking=False``."""
        return _to_host(self, stream, out, blocking)

    def set(self, arr, stream=None):
        """Copy host ``arr`` in, on the current stream (asynchronous from pinned memory)."""
        if not isinstance(arr, _np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        _h2d(self, arr, stream)

    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __bool__(self):
        return bool(self.get())

    def __index__(self):
        return self.get().__index__()

    def __complex__(self):
        return complex(self.get())

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    # -- views (no device access) ----------------------------------------
    def _view(self, view: _np.ndarray) -> "ndarray":
        return ndarray._wrap(view, self._alloc)

    def reshape(self, *shape, order="C"):
        return _maybe_view(self, lambda a: a.reshape(*shape, order=order), "reshape")

    def ravel(self, order="C"):
        return _maybe_view(self, lambda a: a.ravel(order), "ravel")

    def view(self, dtype=None):
        return self._view(self._a.view() if dtype is None else self._a.view(dtype))

    def transpose(self, *axes):
        return self._view(self._a.transpose(*axes))

    T = property(lambda self: self._view(self._a.T))

    def squeeze(self, axis=None):
        return self._view(self._a.squeeze(axis))

    # -- compute -------------------------------------------------------------
    def __getitem__(self, index):
        index = _index(index)
        if _has_bool_array(index):
            _engine.current_stream().synchronize()
        return _apply(lambda a, i: a[i], (self, index), {}, "getitem")

    def __setitem__(self, index, value):
        index = _index(index)
        if isinstance(value, _np.ndarray):
            value = cupy.asarray(value)
        _apply(_setitem, (self, index, value), {}, "setitem", writes=(self,))

    def copy(self, order="C"):
        return _apply(lambda a: a.copy(order), (self,), {}, "copy")

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and _np.dtype(dtype) == self.dtype:
            return self
        return _apply(lambda a: a.astype(dtype, order=order), (self,), {}, "astype")

    def argsort(self, axis=-1, kind=None):
        return cupy.argsort(self, axis, kind)

    def sort(self, axis=-1, kind=None):
        """In place, stably (CuPy takes ``kind`` None or "stable" only)."""
        _check_kind(kind)
        _apply(lambda a: a.sort(axis=axis, kind="stable"), (self,), {}, "sort", writes=(self,))

    def __getattr__(self, name):
        attr = getattr(_np.ndarray, name, None)
        if attr is None or name.startswith("_") or name not in _NDARRAY_ATTRIBUTES:
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (stand-in: "
                                 f"nor has real CuPy's)")
        if not callable(attr):
            return _apply(lambda a: getattr(a, name), (self,), {}, name)
        writes = (self,) if name in _INPLACE else ()
        return lambda *args, **kwargs: _apply(
            lambda a, *r, **k: getattr(a, name)(*r, **k), (self, *args), kwargs, name,
            writes=writes)


def _binary(ufunc_name, reflected=False, inplace=False):
    uf = getattr(_np, ufunc_name)

    def op(self, other):
        if isinstance(other, _np.ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        if inplace:
            return _apply(uf, (self, other), {"out": self}, ufunc_name)
        args = (other, self) if reflected else (self, other)
        return _apply(uf, args, {}, ufunc_name)

    return op


for _dunder, _uf in (("add", "add"), ("sub", "subtract"), ("mul", "multiply"),
                     ("truediv", "true_divide"), ("floordiv", "floor_divide"), ("mod", "remainder"),
                     ("pow", "power"), ("and", "bitwise_and"), ("or", "bitwise_or"),
                     ("xor", "bitwise_xor"), ("lshift", "left_shift"), ("rshift", "right_shift"),
                     ("matmul", "matmul")):
    setattr(ndarray, f"__{_dunder}__", _binary(_uf))
    setattr(ndarray, f"__r{_dunder}__", _binary(_uf, reflected=True))
    if _dunder != "matmul":
        setattr(ndarray, f"__i{_dunder}__", _binary(_uf, inplace=True))
for _dunder, _uf in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"),
                     ("ge", "greater_equal"), ("eq", "equal"), ("ne", "not_equal")):
    setattr(ndarray, f"__{_dunder}__", _binary(_uf))
for _dunder, _uf in (("neg", "negative"), ("pos", "positive"), ("abs", "absolute"),
                     ("invert", "invert")):
    setattr(ndarray, f"__{_dunder}__",
            (lambda uf: lambda self: _apply(getattr(_np, uf), (self,), {}, uf))(_uf))
ndarray.__hash__ = None


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, c, f, own):
        self.c_contiguous, self.f_contiguous, self.owndata = c, f, own

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]


# -- the machinery of a compute step ----------------------------------------------

def _setitem(a, index, value):
    a[index] = value


def _index(index):
    """Index arrays from the host become device arrays (as CuPy converts them)."""
    if isinstance(index, tuple):
        return tuple(cupy.asarray(i) if isinstance(i, _np.ndarray) else i for i in index)
    return cupy.asarray(index) if isinstance(index, _np.ndarray) else index


def _has_bool_array(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, ndarray) and i.dtype == _np.bool_ for i in items)


def _collect(obj, found: list) -> None:
    if isinstance(obj, ndarray):
        found.append(obj)
    elif isinstance(obj, _np.ndarray):
        raise TypeError(f"Unsupported type {type(obj)}")
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, found)


def _unwrap(obj):
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, list):
        return [_unwrap(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_unwrap(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v) for k, v in obj.items()}
    return obj


def _owner(res: _np.ndarray, arrays) -> "object | None":
    """The allocation of ``arrays`` that ``res`` is a view of, if any."""
    if res.size == 0 and res.base is None:
        return None
    lo = res.__array_interface__["data"][0]
    for arr in arrays:
        alloc = arr._alloc
        if alloc.host_addr <= lo < alloc.host_addr + alloc.nbytes:
            return alloc
    return None


def _wrap_result(res, arrays):
    if isinstance(res, _np.ndarray):
        owner = _owner(res, arrays)
        if owner is not None:
            return ndarray._wrap(res, owner)
        alloc = _engine.adopt(res)
        return ndarray._wrap(alloc.host.reshape(-1)[:res.size].reshape(res.shape), alloc)
    if isinstance(res, _np.generic):
        alloc = _engine.adopt(_np.asarray(res))
        return ndarray._wrap(alloc.host.reshape(-1)[:1].reshape(()), alloc)
    if isinstance(res, tuple):
        return tuple(_wrap_result(r, arrays) for r in res)
    if isinstance(res, list):
        return [_wrap_result(r, arrays) for r in res]
    return res


def _apply(fn, args, kwargs, what: str, writes=()):
    """Run ``fn`` on the NumPy views of the device arrays in ``args``/``kwargs``."""
    arrays: list = []
    _collect(args, arrays)
    _collect(kwargs, arrays)
    devices = {a._alloc.device for a in arrays}
    if len(devices) > 1:
        raise ValueError(f"{what}: arrays on devices {sorted(devices)} (the stand-in has no "
                         f"peer access between devices)")
    out = kwargs.get("out")
    outs = list(writes) + ([out] if isinstance(out, ndarray) else
                           [o for o in out if isinstance(o, ndarray)] if isinstance(out, tuple)
                           else [])
    write_ids = {a._alloc.id for a in outs}
    read_ids = {a._alloc.id for a in arrays}
    queued = _engine.before_compute(read_ids, write_ids, what)
    uargs, ukwargs = _unwrap(args), _unwrap(kwargs)
    if not queued:
        return _wrap_result(fn(*uargs, **ukwargs), arrays)
    stream = _engine.current_stream()
    if what in _SYNCING:
        stream.synchronize()
        return _wrap_result(fn(*uargs, **ukwargs), arrays)
    site = _engine.call_site()
    if outs:  # the result is (written into) known arrays: queue the step
        result = out if out is not None else None
        _engine.enqueue(stream, lambda: fn(*uargs, **ukwargs), reads=read_ids,
                        writes=write_ids, what=what, site=site)
        return result if result is not None else (args[0] if writes else None)
    # a fresh result: its shape from a dry run, its values when the queued step runs
    dry = fn(*uargs, **ukwargs)
    if isinstance(dry, _np.ndarray) and _owner(dry, arrays) is not None:
        return _wrap_result(dry, arrays)  # a view: no data is touched
    placeholders = _wrap_result(_garbage_like(dry), [])
    targets = placeholders if isinstance(placeholders, tuple) else (placeholders,)
    target_ids = {t._alloc.id for t in targets if isinstance(t, ndarray)}

    def run():
        res = fn(*uargs, **ukwargs)
        res = res if isinstance(res, tuple) else (res,)
        for t, r in zip(targets, res):
            if isinstance(t, ndarray):
                if _np.shape(r) != t.shape:
                    raise HazardError(f"{what} (issued at {site}): its result shape depends on "
                                      f"the data; the stand-in cannot queue it")
                t._a[...] = r
    _engine.enqueue(stream, run, reads=read_ids, writes=target_ids, what=what, site=site)
    return placeholders


def _garbage_like(res):
    if isinstance(res, tuple):
        return tuple(_garbage_like(r) for r in res)
    if isinstance(res, (_np.ndarray, _np.generic)):
        out = _np.empty_like(_np.asarray(res))
        out.reshape(-1).view(_np.uint8)[:] = _GARBAGE
        return out
    return res


def _maybe_view(arr, fn, what):
    res = fn(arr._a)
    if _owner(res, [arr]) is not None:
        return ndarray._wrap(res, arr._alloc)
    return _apply(fn, (arr,), {}, what)


def _function(name: str):
    fn = getattr(_np, name, None)
    if fn is None or not callable(fn) or name not in _FUNCTIONS:
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (stand-in: nor has "
                             f"real CuPy)")
    return lambda *args, **kwargs: _apply(fn, args, kwargs, name)


# -- host <-> device ------------------------------------------------------------

def _h2d(dst: ndarray, src: _np.ndarray, stream=None) -> None:
    """Queue a host-to-device copy into ``dst``: asynchronous from pinned memory (the host
    must not write ``src`` until it ran), staged at once from pageable memory."""
    from cupy.cuda import _stream_state

    s = _stream_state(stream)
    src = _np.ascontiguousarray(src).reshape(dst.shape)
    addr = src.__array_interface__["data"][0]
    pinned = src.nbytes > 0 and _engine.is_pinned(addr)
    site = _engine.call_site()
    snapshot = src.copy()
    if pinned:
        def run():
            now = _engine.host_bytes(addr, src.nbytes)
            if not _np.array_equal(now, snapshot.reshape(-1).view(_np.uint8)):
                raise HazardError(
                    f"pinned host buffer at {addr:#x} ({src.nbytes} bytes) was written by the "
                    f"host while an asynchronous host-to-device copy from it (issued at {site}) "
                    f"was still pending; synchronize the stream (or wait on an event) before "
                    f"reusing the buffer")
            dst._a[...] = src
    else:
        def run():
            dst._a[...] = snapshot
    _engine.enqueue(s, run, writes={dst._alloc.id}, what="host-to-device copy", site=site)


def _to_host(arr: ndarray, stream, out, blocking):
    from cupy.cuda import _stream_state

    s = _stream_state(stream)
    if out is None:
        out = _np.empty(arr.shape, arr.dtype)
    elif out.shape != arr.shape or out.dtype != arr.dtype:
        raise ValueError(f"out: shape/dtype {out.shape}/{out.dtype} does not match the array's "
                         f"{arr.shape}/{arr.dtype}")
    addr = out.__array_interface__["data"][0]
    pinned = out.nbytes > 0 and _engine.is_pinned(addr)
    if not blocking and pinned:
        site = _engine.call_site()
        snapshot = out.copy()

        def run():
            if not _np.array_equal(out.view(_np.uint8), snapshot.view(_np.uint8)):
                raise HazardError(
                    f"pinned host buffer at {addr:#x} ({out.nbytes} bytes) was written by the "
                    f"host while an asynchronous device-to-host copy into it (issued at {site}) "
                    f"was still pending")
            out[...] = arr._a
        _engine.enqueue(s, run, reads={arr._alloc.id}, what="device-to-host copy", site=site)
        return out
    # pageable memory (or blocking): the copy completes before the call returns
    _engine.note_use(s, {arr._alloc.id}, "device-to-host copy", _engine.call_site())
    s.synchronize()
    _engine._check_races(s, {arr._alloc.id}, set(), "device-to-host copy")
    out[...] = arr._a
    return out

def _check_kind(kind) -> None:
    """CuPy sorts stably and takes no other ``kind``: ``ValueError`` as CuPy raises."""
    if kind is not None and kind != "stable":
        raise ValueError("kind can only be None or 'stable'")
