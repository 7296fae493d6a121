"""The compiled kernels that order a batch's ids (numba, imported with
:mod:`embedding.kernels._jit`, which serves them): the backward's stable sort of
occurrences by row (:func:`sort_by_row`) and the hash dedup of ids
(:func:`unique_inverse`). Plain loops over integers: what they return is what
NumPy's stable sort and ``np.unique`` give (``tests/unit/embedding/
test_kernels_compiled.py``)."""
from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["JIT_OPTIONS", "RADIX_BITS", "sort_by_row", "unique_inverse"]

#: how every compiled kernel is built (these and :mod:`embedding.kernels._jit`'s): the GIL
#: released (a caller's threads run tables side by side), cached beside its module, no bounds
#: checks, NumPy's floating-point error model
JIT_OPTIONS = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")

#: bits of one pass of :func:`sort_by_row`'s radix sort (its counts stay in the L1 cache)
RADIX_BITS = 11


@nb.njit(**JIT_OPTIONS)
def sort_by_row(idx, bag_lo, bag_hi, bag_occ, rows, w, weighted):
    """A stable sort by row of the occurrences of bags: ``(bad, occ, ws, uniq, starts,
    lengths)``.

    Bag ``k`` holds the ids ``idx[bag_lo[k]:bag_hi[k]]`` (per-id weights at the same
    positions of ``w``, when ``weighted``); each of them is an occurrence of ``bag_occ[k]``.
    ``occ``/``ws`` are the occurrences' ``bag_occ`` and weights in row order (bag order
    within a row), ``uniq`` the rows read (ascending) and each one's run of occurrences;
    ``bad`` is the position in ``idx`` of an id outside ``[0, rows)`` (then nothing else is
    valid), else -1. An occurrence of its own is a bag of one id.

    A counting sort over the rows when there are few rows per occurrence, reading the ids
    where they lie; else a radix sort of the ids (:func:`_radix_by_row`): its cost follows
    the ids, not the table's rows."""
    nb_ = bag_lo.size
    n = 0
    for k in range(nb_):
        n += bag_hi[k] - bag_lo[k]
    if rows > 8 * n + (1 << 16):
        ids = np.empty(n, idx.dtype)
        occ_in = np.empty(n, bag_occ.dtype)
        ws_in = np.empty(n if weighted else 0, w.dtype)
        at = 0
        for k in range(nb_):
            for i in range(bag_lo[k], bag_hi[k]):
                r = idx[i]
                if r < 0 or r >= rows:
                    return i, bag_occ[:0], w[:0], idx[:0], idx[:0], idx[:0]
                ids[at] = r
                occ_in[at] = bag_occ[k]
                if weighted:
                    ws_in[at] = w[i]
                at += 1
        occ, ws, uniq, starts, lengths = _radix_by_row(ids, rows, occ_in, ws_in, weighted)
        return -1, occ, ws, uniq, starts, lengths
    start = np.zeros(rows + 1, np.int32)   # n < 2**31 (the caller checks)
    nu = 0
    for k in range(nb_):
        for i in range(bag_lo[k], bag_hi[k]):
            r = idx[i]
            if r < 0 or r >= rows:
                return i, bag_occ[:0], w[:0], idx[:0], idx[:0], idx[:0]
            c = start[r + 1]
            nu += c == 0
            start[r + 1] = c + 1
    # one pass over the rows without a branch on whether a row was read (about half of
    # them are, at random: a branch there mispredicted its way to 1.5x this sort's time);
    # a row not read is written at ``u`` and overwritten by the next one read
    uniq = np.empty(nu + 1, np.int64)
    starts = np.empty(nu + 1, np.int64)
    lengths = np.empty(nu + 1, np.int64)
    u = 0
    at = 0
    for r in range(rows):
        c = start[r + 1]
        start[r] = at
        uniq[u] = r
        starts[u] = at
        lengths[u] = c
        u += c > 0
        at += c
    uniq, starts, lengths = uniq[:nu], starts[:nu], lengths[:nu]
    occ = np.empty(n, bag_occ.dtype)
    ws = np.empty(n if weighted else 0, w.dtype)
    for k in range(nb_):
        o = bag_occ[k]
        for i in range(bag_lo[k], bag_hi[k]):
            r = idx[i]
            p = start[r]
            start[r] = p + 1
            occ[p] = o
            if weighted:
                ws[p] = w[i]
    return -1, occ, ws, uniq, starts, lengths


@nb.njit(**JIT_OPTIONS)
def _radix_by_row(ids, rows, occ_in, ws_in, weighted):
    """:func:`sort_by_row` of one-id bags by a radix sort of ``ids`` (all in ``[0, rows)``):
    passes of at most :data:`RADIX_BITS` bits. ``(occ, ws, uniq, starts, lengths)``."""
    n = ids.size
    bits = 1
    while (rows - 1) >> bits:
        bits += 1
    passes = (bits + RADIX_BITS - 1) // RADIX_BITS
    step = (bits + passes - 1) // passes
    mask = (1 << step) - 1
    order = np.arange(n)
    spare = np.empty(n, np.int64)
    count = np.empty(mask + 2, np.int64)
    for p in range(passes):
        shift = p * step
        count[:] = 0
        for i in range(n):
            count[((ids[order[i]] >> shift) & mask) + 1] += 1
        for k in range(mask + 1):
            count[k + 1] += count[k]
        for i in range(n):
            k = order[i]
            digit = (ids[k] >> shift) & mask
            spare[count[digit]] = k
            count[digit] += 1
        order, spare = spare, order
    occ = np.empty(n, occ_in.dtype)
    ws = np.empty(n if weighted else 0, ws_in.dtype)
    nu = 0
    last = -1
    for i in range(n):
        k = order[i]
        occ[i] = occ_in[k]
        if weighted:
            ws[i] = ws_in[k]
        r = ids[k]
        if r != last:
            nu += 1
            last = r
    uniq = np.empty(nu, np.int64)
    starts = np.empty(nu, np.int64)
    lengths = np.empty(nu, np.int64)
    u = -1
    last = -1
    for i in range(n):
        r = ids[order[i]]
        if r != last:
            u += 1
            uniq[u] = r
            starts[u] = i
            lengths[u] = 0
            last = r
        lengths[u] += 1
    return occ, ws, uniq, starts, lengths


@nb.njit(**JIT_OPTIONS)
def unique_inverse(ids):
    """``np.unique(ids, return_inverse=True, return_counts=True)`` of int64 ``ids``: the
    distinct ids found with a hash table (Fibonacci hashing, linear probing), then only they
    are sorted."""
    n = ids.size
    bits = 1
    while (1 << bits) < 2 * n:
        bits += 1
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    golden = np.uint64(0x9E3779B97F4A7C15)
    slot_key = np.empty(mask + 1, np.int64)
    slot_of = np.full(mask + 1, -1, np.int64)
    seen = np.empty(n, np.int64)      # the distinct ids, first seen first
    which = np.empty(n, np.int64)     # each id's place in ``seen``
    nd = 0
    for i in range(n):
        x = ids[i]
        h = np.int64((np.uint64(x) * golden) >> shift)
        while True:
            k = slot_of[h]
            if k < 0:
                slot_of[h] = nd
                slot_key[h] = x
                seen[nd] = x
                which[i] = nd
                nd += 1
                break
            if slot_key[h] == x:
                which[i] = k
                break
            h = (h + 1) & mask
    order = np.argsort(seen[:nd])
    rank = np.empty(nd, np.int64)
    for r in range(nd):
        rank[order[r]] = r
    uniq = seen[:nd][order]
    inverse = np.empty(n, np.int64)
    counts = np.zeros(nd, np.int64)
    for i in range(n):
        v = rank[which[i]]
        inverse[i] = v
        counts[v] += 1
    return uniq, inverse, counts
