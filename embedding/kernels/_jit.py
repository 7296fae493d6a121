"""The compiled loops of :mod:`embedding.kernels.compiled` (numba, imported on first use).

Each function is the NumPy kernel's arithmetic written as plain loops, in the
same order and with the same roundings: a row is widened to the compute
dtype, multiplied by its per-id weight, then added; a bag's sum starts from
its first row (not from zero, which would turn ``-0.0`` into ``0.0``); mean
pooling multiplies the sum by ``1 / length`` computed by the caller; no
fused multiply-add (numba contracts nothing without ``fastmath``). So the
compiled and NumPy paths agree bit for bit (``tests/unit/embedding/
test_kernels_compiled.py``).

All of them release the GIL, so the caller's thread pool runs tables (or
blocks of bags) side by side. Ids are checked against the table's rows;
a function that meets a bad id returns its position (else -1) and the
caller raises, naming it.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_OPTS = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")
#: the lookup prefetches rows this many ids ahead (FBGEMM's CPU kernels' default); the
#: backward prefetches the rows it updates half as far ahead (measured best here; the
#: gradient rows it sums are few enough to stay in cache, and prefetching them costs more
#: than it saves)
AHEAD = 16
AHEAD_ROWS = 8
#: bytes of a cache line: a row is prefetched line by line
LINE = 64
#: lanes of the device's warp (row-wise AdaGrad's sum of squares is reduced in their order)
WARP = 32


@intrinsic
def _prefetch_id(typingctx, table, idx, j):
    """Ask the CPU to bring the row of ``idx[j]`` of ``table`` (2-D, its rows contiguous) into
    cache, every cache line of it, when ``j`` is a position of ``idx`` and ``idx[j]`` a row of
    ``table`` (LLVM's prefetch: a read, high locality; a hint that never faults).

    Written as LLVM IR rather than as a compiled helper: the same loop in a helper inlined by
    numba ran the lookup 1.1-1.7x slower (``docs/embedding.md``)."""
    sig = types.void(table, idx, j)

    def codegen(context, builder, signature, args):
        tty, ity, jty = signature.args
        intp = context.get_value_type(types.intp)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        tab = context.make_array(tty)(context, builder, args[0])
        ids = context.make_array(ity)(context, builder, args[1])
        pos = context.cast(builder, args[2], jty, types.intp)
        n, = cgutils.unpack_tuple(builder, ids.shape)
        with builder.if_then(builder.icmp_signed("<", pos, n), likely=True):
            at = cgutils.get_item_pointer2(context, builder, ids.data, [n],
                                           cgutils.unpack_tuple(builder, ids.strides),
                                           ity.layout, [pos], wraparound=False,
                                           boundscheck=False)
            row = context.cast(builder, builder.load(at), ity.dtype, types.intp)
            rows, cols = cgutils.unpack_tuple(builder, tab.shape)
            stride, step = cgutils.unpack_tuple(builder, tab.strides)
            inside = builder.and_(builder.icmp_signed(">=", row, ir.Constant(intp, 0)),
                                  builder.icmp_signed("<", row, rows))
            with builder.if_then(inside, likely=True):
                start = builder.add(builder.ptrtoint(tab.data, intp), builder.mul(row, stride))
                stop = builder.add(start, builder.mul(cols, step))
                with cgutils.for_range_slice(builder, start, stop, ir.Constant(intp, LINE),
                                             intp=intp) as (address, _):
                    builder.call(fn, [builder.inttoptr(address, i8p), ir.Constant(i32, 0),
                                      ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


#: optimizer codes of :func:`segment_update`
AGGREGATE, SGD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


@nb.njit(**_OPTS)
def pool_sum(table, idx, offsets, w, weighted, inv, mean, out, r0, c0):
    """``out[r0 + i, c0:c0 + d]`` = the (weighted) sum of bag ``i``'s rows, times ``inv[i]``
    when ``mean``; bag ``i`` is ``idx[offsets[i]:offsets[i + 1]]``."""
    rows, d = table.shape
    acc = np.empty(d, out.dtype)
    for i in range(offsets.size - 1):
        s = offsets[i]
        e = offsets[i + 1]
        o = out[r0 + i]
        if e <= s:
            for c in range(d):
                o[c0 + c] = 0
            continue
        r = idx[s]
        if r < 0 or r >= rows:
            return s
        _prefetch_id(table, idx, s + AHEAD)
        if weighted:
            wt = w[s]
            for c in range(d):
                acc[c] = table[r, c] * wt
        else:
            for c in range(d):
                acc[c] = table[r, c]
        for j in range(s + 1, e):
            r = idx[j]
            if r < 0 or r >= rows:
                return j
            _prefetch_id(table, idx, j + AHEAD)
            if weighted:
                wt = w[j]
                for c in range(d):
                    acc[c] += table[r, c] * wt
            else:
                for c in range(d):
                    acc[c] += table[r, c]
        if mean:
            f = inv[i]
            for c in range(d):
                o[c0 + c] = acc[c] * f
        else:
            for c in range(d):
                o[c0 + c] = acc[c]
    return -1


@nb.njit(**_OPTS)
def pool_max(table, idx, offsets, w, weighted, out, r0, c0, arg, want_arg):
    """Max pooling: each column's largest (weighted) value of bag ``i`` (the first on ties;
    zeros for an empty bag); ``arg[i, c]`` its position in ``idx`` (-1: empty bag)."""
    rows, d = table.shape
    best = np.empty(d, out.dtype)
    at = np.empty(d, np.int64)
    for i in range(offsets.size - 1):
        s = offsets[i]
        e = offsets[i + 1]
        o = out[r0 + i]
        if e <= s:
            for c in range(d):
                o[c0 + c] = 0
                if want_arg:
                    arg[i, c] = -1
            continue
        for j in range(s, e):
            r = idx[j]
            if r < 0 or r >= rows:
                return j
            _prefetch_id(table, idx, j + AHEAD)
            for c in range(d):
                if weighted:
                    v = table[r, c] * w[j]
                else:
                    v = table[r, c]
                if j == s or v > best[c]:
                    best[c] = v
                    at[c] = j
        for c in range(d):
            o[c0 + c] = best[c]
            if want_arg:
                arg[i, c] = at[c]
    return -1


@nb.njit(**_OPTS)
def segment_update(kind, src, occ, ws, weighted, starts, lengths, uniq, out, weight, mom, ea,
                   es, bc1, bc2, terms, has_terms, width, lr, eps, b1, b2, a1, a2):
    """For each segment ``u`` (occurrences ``starts[u]:starts[u] + lengths[u]`` of ``occ``,
    sorted by row): sum its gradient rows ``src[occ[j]] * ws[j]`` in order of ``j`` into a
    ``d``-long buffer, then either store the sum in ``out[u]`` (``kind == AGGREGATE``) or
    apply the optimizer to row ``uniq[u]`` of ``weight`` at once (``embedding.optim.
    sparse_update``'s arithmetic; ``terms[u]`` replaces row-wise AdaGrad's ``mean(g * g)``
    when ``has_terms``; ``bc1``, ``bc2``: Adam's per-row bias corrections).

    One function with the loops written out: numba calls between compiled functions cost
    more than the work of a short segment."""
    d = src.shape[1]
    acc = np.empty(d, src.dtype)
    lanes = np.empty(WARP, src.dtype)
    pair = np.empty(WARP, src.dtype)
    for u in range(starts.size):
        s = starts[u]
        e = s + lengths[u]
        k = occ[s]
        if kind != AGGREGATE:
            _prefetch_id(weight, uniq, u + AHEAD_ROWS)
        if weighted:
            wt = ws[s]
            for c in range(d):
                acc[c] = src[k, c] * wt
        else:
            for c in range(d):
                acc[c] = src[k, c]
        for j in range(s + 1, e):
            k = occ[j]
            if weighted:
                wt = ws[j]
                for c in range(d):
                    acc[c] += src[k, c] * wt
            else:
                for c in range(d):
                    acc[c] += src[k, c]
        if kind == AGGREGATE:
            for c in range(d):
                out[u, c] = acc[c]
            continue
        r = uniq[u]
        if kind == SGD:
            for c in range(d):
                weight[r, c] = weight[r, c] - acc[c] * lr
        elif kind == ROWWISE_ADAGRAD:
            if has_terms:
                t = terms[u]
            else:   # mean(g * g) in the device's warp order (embedding.optim.mean_square)
                lanes[:] = 0
                for c in range(d):
                    lanes[c & (WARP - 1)] += acc[c] * acc[c]
                o = WARP // 2
                while o > 0:
                    for lane in range(WARP):
                        pair[lane] = lanes[lane] + lanes[lane ^ o]
                    lanes[:] = pair
                    o //= 2
                t = lanes[0] / width
            m = mom[r] + t
            mom[r] = m
            scale = lr / (np.sqrt(m) + eps)
            for c in range(d):
                weight[r, c] = weight[r, c] - acc[c] * scale
        elif kind == ADAM:
            f1 = bc1[u]
            f2 = bc2[u]
            for c in range(d):
                m = ea[r, c] * b1 + acc[c] * a1
                v = es[r, c] * b2 + (acc[c] * acc[c]) * a2
                ea[r, c] = m
                es[r, c] = v
                den = np.sqrt(v / f2) + eps
                weight[r, c] = weight[r, c] - ((m / f1) / den) * lr


@nb.njit(**_OPTS)
def sort_by_row(ids, rows, occ_in, ws_in, weighted):
    """A stable counting sort of occurrences by row (for tables of few rows per occurrence):
    ``(bad, occ, ws, uniq, starts, lengths)`` with ``occ``/``ws`` the occurrences' gradient
    rows and weights in row order, ``uniq`` the rows read (ascending) and each one's run;
    ``bad`` is the position of an id outside ``[0, rows)`` (then nothing else is valid),
    else -1."""
    n = ids.size
    start = np.zeros(rows + 1, np.int32)   # positions < n < 2**31 (the caller checks)
    for i in range(n):
        r = ids[i]
        if r < 0 or r >= rows:
            return i, occ_in[:0], ws_in[:0], ids[:0], ids[:0], ids[:0]
        start[r + 1] += 1
    nu = 0
    for r in range(rows):
        if start[r + 1] > 0:
            nu += 1
    uniq = np.empty(nu, np.int64)
    starts = np.empty(nu, np.int64)
    lengths = np.empty(nu, np.int64)
    u = 0
    for r in range(rows):
        c = start[r + 1]
        if c > 0:
            uniq[u] = r
            starts[u] = start[r]
            lengths[u] = c
            u += 1
        start[r + 1] = start[r] + c
    occ = np.empty(n, occ_in.dtype)
    ws = np.empty(n if weighted else 0, ws_in.dtype)
    for i in range(n):
        r = ids[i]
        p = start[r]
        start[r] = p + 1
        occ[p] = occ_in[i]
        if weighted:
            ws[p] = ws_in[i]
    return -1, occ, ws, uniq, starts, lengths


@nb.njit(**_OPTS)
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
