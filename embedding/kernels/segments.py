"""Vectorised segment primitives of the NumPy kernels.

Two building blocks carry the CPU path:

- :func:`stable_argsort` of bounded non-negative integer keys, as LSD radix
  passes over 16-bit digits (NumPy's stable sort of ``uint16`` is a radix
  sort), several times faster than a comparison sort of int64 keys;
- :func:`jagged_sum`, segment sums of gathered rows computed *by position*:
  segments are ordered longest first, so the ``j``-th element of every
  segment still running is one contiguous prefix, and each step is one
  gather plus one in-place add over that prefix. Rows are summed in segment
  order ``j = 0, 1, ...`` exactly like the CUDA kernels do, so the two
  paths agree to the last bit where no fused multiply-add intervenes and no
  float32 value is subnormal (the device flushes those to zero).
  ``np.add.reduceat`` along axis 0 has a per-row cost that makes it several
  times slower for ``[N, dim]`` rows, and the positional form never
  materialises the ``[N, dim]`` gathered rows.
"""
from __future__ import annotations

import numpy as np

from embedding.precision import compute_dtype

__all__ = ["stable_argsort", "segments_of_sorted", "jagged_sum", "jagged_sum_permuted",
           "jagged_max", "positions_of_segments"]

#: Below this many keys a comparison sort is as fast as radix passes.
_RADIX_MIN = 2048
#: When fewer segments than this are still running, finish them with one scatter-add
#: (a positional pass costs a fixed few microseconds; the scatter-add a few ns per element).
_TAIL_SEGMENTS = 128


def stable_argsort(keys: np.ndarray, max_key: int | None = None) -> np.ndarray:
    """Stable argsort of non-negative integer ``keys`` (all ``<= max_key``)."""
    keys = np.asarray(keys)
    n = keys.size
    if n == 0:
        return np.zeros(0, np.intp)
    if max_key is None:
        max_key = int(keys.max())
    if n < _RADIX_MIN or max_key >= 1 << 48:
        return np.argsort(keys, kind="stable")
    if max_key < 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    order = None
    shift = 0
    while (max_key >> shift) > 0:
        digit = ((keys >> shift) & 0xFFFF).astype(np.uint16)
        if order is None:
            order = np.argsort(digit, kind="stable")
        else:
            order = order[np.argsort(digit[order], kind="stable")]
        shift += 16
    return order


def segments_of_sorted(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(unique_keys, starts, lengths)`` of runs of equal keys in a sorted array."""
    n = sorted_keys.size
    if n == 0:
        z = np.zeros(0, np.int64)
        return sorted_keys[:0], z, z
    flag = np.empty(n, bool)
    flag[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=flag[1:])
    starts = np.flatnonzero(flag)
    lengths = np.diff(np.append(starts, n))
    return sorted_keys[starts], starts, lengths


def positions_of_segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[k], starts[k] + lengths[k])`` over k (vectorised)."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    nz = lengths > 0
    st = np.asarray(starts, np.int64)[nz]
    ln = lengths[nz]
    out = np.ones(total, np.int64)
    heads = np.zeros(len(ln), np.int64)
    np.cumsum(ln[:-1], out=heads[1:])
    out[0] = st[0]
    out[heads[1:]] = st[1:] - (st[:-1] + ln[:-1] - 1)
    return np.cumsum(out)


def jagged_sum(source: np.ndarray, index: np.ndarray, starts: np.ndarray,
               lengths: np.ndarray, weights: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """``out[k] = sum_j source[index[starts[k] + j]] * weights[starts[k] + j]``, j < lengths[k].

    ``source`` is ``[M, d]``; ``out`` (``[K, d]``, written, not accumulated)
    may be a strided view. Rows are added in order of ``j`` in ``out``'s dtype
    (narrower source rows are widened first); empty segments give zeros.
    ``weights=None`` means all ones.
    """
    k = len(starts)
    if out is None:
        out = np.empty((k, source.shape[1]), source.dtype)
    if k == 0:
        return out
    res, perm = jagged_sum_permuted(source, index, starts, lengths, weights, out=out)
    if perm is not None:
        out[perm] = res
    return out


def jagged_sum_permuted(source: np.ndarray, index: np.ndarray, starts: np.ndarray,
                        lengths: np.ndarray, weights: np.ndarray | None = None,
                        out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`jagged_sum` without the final un-permutation: ``(res, perm)``.

    ``res[i]`` is the sum of segment ``perm[i]`` (``perm`` None: identity,
    and then ``res`` is ``out`` when given). Saves a scatter pass when the
    caller does not need segment order (e.g. per-row gradients).
    """
    k = len(starts)
    d = source.shape[1]
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    lmin, lmax = int(lengths.min()), int(lengths.max())
    if lmin == lmax:
        if out is None:
            out = np.empty((k, d), source.dtype)
        if lmax == 0:
            out[...] = 0
        else:
            _uniform_sum(source, index, starts, lmax, weights, out)
        return out, None
    perm = stable_argsort(lmax - lengths, lmax)
    sl = lengths[perm]
    st = starts[perm]
    neg = -sl  # ascending: the count of segments longer than j is searchsorted(neg, -j)
    res = np.empty((k, d), source.dtype if out is None else out.dtype)
    n = int(np.searchsorted(neg, 0, side="left"))
    res[n:] = 0
    _gather_into(source, index[st[:n]], weights, st[:n], res[:n], add=False)
    j = 1
    while j < lmax:
        n = int(np.searchsorted(neg, -j, side="left"))
        if n < _TAIL_SEGMENTS:
            break
        _gather_into(source, index[st[:n] + j], weights, st[:n] + j, res[:n], add=True)
        j += 1
    if j < lmax:
        # the few long segments still running (hot ids): their remaining rows in one gather,
        # then one unbuffered scatter-add that visits them in order, so each segment sums
        # res[r] + rows[0] + rows[1] + ... like the device kernel (reduce and reduceat may
        # sum pairwise)
        rem = sl[:n] - j
        pos = positions_of_segments(st[:n] + j, rem)
        rows = np.take(source, index[pos], axis=0).astype(res.dtype, copy=False)
        if weights is not None:
            rows *= weights[pos][:, None]
        seg = np.repeat(np.arange(n, dtype=np.int64) * d, rem)
        flat = (seg[:, None] + np.arange(d, dtype=np.int64)).ravel()
        part = np.ascontiguousarray(res[:n])
        np.add.at(part.reshape(-1), flat, rows.reshape(-1))
        res[:n] = part
    return res, perm


def jagged_max(source: np.ndarray, index: np.ndarray, starts: np.ndarray,
               lengths: np.ndarray, weights: np.ndarray | None = None,
               out: np.ndarray | None = None, arg_out: np.ndarray | None = None) -> np.ndarray:
    """``out[k, c] = max_j source[index[starts[k] + j], c] * weights[starts[k] + j]``.

    The maximum per column over the segment's (weighted) rows; empty
    segments give zeros. ``arg_out`` (int64, ``[K, d]``), when given,
    receives the position ``starts[k] + j`` of the first ``j`` attaining each
    column's maximum (-1 for empty segments), as the device kernel picks it:
    a later row replaces the running maximum only when strictly greater.
    """
    k = len(starts)
    d = source.shape[1]
    if out is None:
        out = np.empty((k, d), compute_dtype(source.dtype))
    if k == 0:
        return out
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    lmax = int(lengths.max())
    perm = stable_argsort(lmax - lengths, lmax)  # longest first: running ones are a prefix
    sl, st = lengths[perm], starts[perm]
    neg = -sl
    best = np.zeros((k, d), out.dtype)
    arg = np.full((k, d), -1, np.int64)
    for j in range(lmax):
        n = int(np.searchsorted(neg, -j, side="left"))
        pos = st[:n] + j
        rows = np.take(source, index[pos], axis=0).astype(out.dtype, copy=False)
        if weights is not None:
            rows *= weights[pos][:, None]
        if j == 0:
            best[:n] = rows
            arg[:n] = pos[:, None]
            continue
        better = rows > best[:n]
        np.copyto(best[:n], rows, where=better)
        np.copyto(arg[:n], np.broadcast_to(pos[:, None], better.shape), where=better)
    out[perm] = best
    if arg_out is not None:
        arg_out[perm] = arg
    return out


def _gather_into(source, idx, weights, wpos, dst, add: bool) -> None:
    rows = np.take(source, idx, axis=0).astype(dst.dtype, copy=False)
    if weights is not None:
        rows *= weights[wpos][:, None]
    if add:
        dst += rows
    else:
        dst[...] = rows


def _uniform_sum(source, index, starts, length, weights, out) -> None:
    """Every segment has ``length`` elements."""
    if length == 1 and weights is None and out.flags.c_contiguous and out.dtype == source.dtype:
        np.take(source, index[starts], axis=0, out=out)
        return
    _gather_into(source, index[starts], weights, starts, out, add=False)
    for j in range(1, length):
        pos = starts + j
        _gather_into(source, index[pos], weights, pos, out, add=True)
