"""The stable hash of ``encoding = "hash"``: the same row for a value in any process.

Integers (any width, read as int64) are mixed by splitmix64's finaliser of
their two's-complement uint64; strings by 64-bit FNV-1a of their UTF-8
bytes, then the same finaliser. It depends on nothing but the value: not on
the process, the platform or the order.
"""
from __future__ import annotations

import numpy as np

from embedding.data.synthetic import _mix64
from embedding.data.types import pyarrow_module as _pa

__all__ = ["stable_hash", "hash_strings", "hash_ints"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)




def hash_ints(values) -> np.ndarray:
    """splitmix64's finaliser of each int64 value's two's complement (uint64)."""
    with np.errstate(over="ignore"):
        return _mix64(np.asarray(values, np.int64).view(np.uint64))


def hash_strings(values) -> np.ndarray:
    """64-bit FNV-1a of each string's UTF-8 bytes, then splitmix64's finaliser (uint64).

    ``values`` is a pyarrow string array without nulls, or a sequence of str.
    """
    pa = _pa()
    arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(
        list(values), pa.large_string())
    if isinstance(arr, pa.ChunkedArray):
        arr = pa.concat_arrays(arr.chunks) if arr.num_chunks else pa.array([], pa.large_string())
    arr = arr.cast(pa.large_string())
    n = len(arr)
    h = np.full(n, _FNV_OFFSET, np.uint64)
    if n == 0:
        return _mix64(h)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], np.int64)[arr.offset:arr.offset + n + 1]
    data = (np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8))
    starts, lengths = offsets[:-1], np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: the active set is a prefix
    sl, ss = lengths[order], starts[order]
    hs = h[order]
    longer = np.searchsorted(-sl, -np.arange(int(sl[0])), side="left")  # strings longer than j
    with np.errstate(over="ignore"):
        for j, k in enumerate(longer.tolist()):  # the first k
            hs[:k] = (hs[:k] ^ data[ss[:k] + j].astype(np.uint64)) * _FNV_PRIME
        h[order] = hs
        return _mix64(h)


def stable_hash(values) -> np.ndarray:
    """The stable hash (uint64) of ints or strings, as the ``hash`` encoding uses it."""
    pa = _pa()
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            return hash_strings(values)
        return hash_ints(np.asarray(values.to_numpy(zero_copy_only=False), np.int64))
    seq = list(values)
    if seq and all(isinstance(v, str) for v in seq):
        return hash_strings(seq)
    return hash_ints(np.asarray(seq, np.int64))
