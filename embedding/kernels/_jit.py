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
caller raises, naming it. The kernels that order a batch's ids (the
backward's sort by row, the id dedup) are in :mod:`embedding.kernels._rowsort`
and served from here.
"""
from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from embedding.kernels._rowsort import JIT_OPTIONS as _OPTS
from embedding.kernels._rowsort import RADIX_BITS, sort_by_row, unique_inverse

__all__ = ["Kernels", "FIXED_DIMS", "ANY_DIM", "for_dim", "update_for", "pool_sum_rows",
           "VECTOR_ROW_BYTES", "AGGREGATE", "SGD", "ROWWISE_ADAGRAD", "ADAM", "RADIX_BITS",
           "sort_by_row", "unique_inverse"]

#: the lookup prefetches rows this many ids ahead (FBGEMM's CPU kernels' default; 32 ids
#: ahead for rows of 64 bytes ran one process 1.1-1.25x faster, but two ranks sharing the
#: host's cache and memory about 10 % slower); the backward prefetches the rows it updates,
#: and the gradient rows it sums, half as far ahead (measured best here)
AHEAD = 16
AHEAD_ROWS = 8
#: the lookup's register sums (:func:`_bag_sum`) prefetch rows of one cache line this many ids
#: ahead: with a few instructions an id, 16 ahead did not cover the memory's latency (a
#: 2-rank step at dim 16 and 32 ids per bag ran 10 % faster at 32 ahead; wider rows were no
#: faster, or 2-3 % slower at 32 columns)
AHEAD_LINE_ROWS = 32
#: bytes of a cache line: a row is prefetched line by line
LINE = 64
#: lanes of the device's warp (row-wise AdaGrad's sum of squares is reduced in their order)
WARP = 32


def _prefetch_lines(context, builder, start, nbytes) -> None:
    """Emit LLVM prefetches (a read, high locality; hints that never fault) of every cache
    line of the ``nbytes`` bytes from address ``start``."""
    intp = context.get_value_type(types.intp)
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
        "llvm.prefetch.p0i8")
    with cgutils.for_range_slice(builder, start, builder.add(start, nbytes),
                                 ir.Constant(intp, LINE), intp=intp) as (address, _):
        builder.call(fn, [builder.inttoptr(address, i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _element_ptr(context, builder, aty, arr, pos):
    """A pointer to ``arr[pos]`` of the 1-D array ``arr`` (type ``aty``), no bounds check."""
    n, = cgutils.unpack_tuple(builder, arr.shape)
    return cgutils.get_item_pointer2(context, builder, arr.data, [n],
                                     cgutils.unpack_tuple(builder, arr.strides), aty.layout,
                                     [pos], wraparound=False, boundscheck=False)


def _load_at(context, builder, aty, arr, pos):
    """``arr[pos]`` of the 1-D array ``arr`` (type ``aty``) as an intp (no bounds check)."""
    return context.cast(builder, builder.load(_element_ptr(context, builder, aty, arr, pos)),
                        aty.dtype, types.intp)


def _emit_prefetch_row(context, builder, ity, ids, pos, base, stride, rows, nbytes) -> None:
    """Prefetch the ``nbytes`` from ``base + ids[pos] * stride`` when ``pos`` is a position of
    the 1-D array ``ids`` (type ``ity``) and ``ids[pos]`` lies in ``[0, rows)``."""
    intp = context.get_value_type(types.intp)
    n, = cgutils.unpack_tuple(builder, ids.shape)
    with builder.if_then(builder.icmp_signed("<", pos, n), likely=True):
        row = _load_at(context, builder, ity, ids, pos)
        inside = builder.and_(builder.icmp_signed(">=", row, ir.Constant(intp, 0)),
                              builder.icmp_signed("<", row, rows))
        with builder.if_then(inside, likely=True):
            _prefetch_lines(context, builder, builder.add(base, builder.mul(row, stride)),
                            nbytes)


def _emit_prefetch_at(context, builder, oty, at, pos, base, item, size, width) -> None:
    """Prefetch ``flat[at[pos]:at[pos] + width]`` (``flat`` 1-D and contiguous from ``base``,
    ``size`` elements of ``item`` bytes) when ``pos`` is a position of ``at`` (type ``oty``)
    and that range lies inside ``flat``."""
    intp = context.get_value_type(types.intp)
    n, = cgutils.unpack_tuple(builder, at.shape)
    with builder.if_then(builder.icmp_signed("<", pos, n), likely=True):
        first = _load_at(context, builder, oty, at, pos)
        inside = builder.and_(builder.icmp_signed(">=", first, ir.Constant(intp, 0)),
                              builder.icmp_signed("<=", builder.add(first, width), size))
        with builder.if_then(inside, likely=True):
            _prefetch_lines(context, builder, builder.add(base, builder.mul(first, item)),
                            builder.mul(width, item))


@intrinsic
def _prefetch_id(typingctx, table, idx, j):
    """Ask the CPU to bring the row of ``idx[j]`` of ``table`` (2-D, its rows contiguous) into
    cache, every cache line of it, when ``j`` is a position of ``idx`` and ``idx[j]`` a row of
    ``table``.

    Written as LLVM IR rather than as a compiled helper: the same loop in a helper inlined by
    numba ran the lookup 1.1-1.7x slower (``docs/embedding.md``)."""
    sig = types.void(table, idx, j)

    def codegen(context, builder, signature, args):
        tty, ity, jty = signature.args
        intp = context.get_value_type(types.intp)
        tab = context.make_array(tty)(context, builder, args[0])
        ids = context.make_array(ity)(context, builder, args[1])
        rows, cols = cgutils.unpack_tuple(builder, tab.shape)
        stride, step = cgutils.unpack_tuple(builder, tab.strides)
        _emit_prefetch_row(context, builder, ity, ids,
                           context.cast(builder, args[2], jty, types.intp),
                           builder.ptrtoint(tab.data, intp), stride, rows,
                           builder.mul(cols, step))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _prefetch_at(typingctx, flat, occ, j, d):
    """Ask the CPU to bring ``flat[occ[j]:occ[j] + d]`` (``flat`` 1-D, contiguous) into cache
    when ``j`` is a position of ``occ`` and that range lies inside ``flat``."""
    sig = types.void(flat, occ, j, d)

    def codegen(context, builder, signature, args):
        fty, oty, jty, dty = signature.args
        intp = context.get_value_type(types.intp)
        src = context.make_array(fty)(context, builder, args[0])
        at = context.make_array(oty)(context, builder, args[1])
        size, = cgutils.unpack_tuple(builder, src.shape)
        item = ir.Constant(intp, context.get_abi_sizeof(context.get_data_type(fty.dtype)))
        _emit_prefetch_at(context, builder, oty, at,
                          context.cast(builder, args[2], jty, types.intp),
                          builder.ptrtoint(src.data, intp), item, size,
                          context.cast(builder, args[3], dty, types.intp))
        return context.get_dummy_value()
    return sig, codegen


#: the widest row, in bytes, whose bag sum :func:`_bag_sum` holds in registers: 1 KiB is 16
#: AVX-512 registers of float32 (256 values); wider rows spill and ran no faster (dims 256
#: and 512, float32: 1.37x and 1.00x the loop over an accumulator in memory)
VECTOR_ROW_BYTES = 1024


@intrinsic
def _bag_sum(typingctx, dim, table, idx, s, e, w, weighted, inv, i, mean, out, orow, c0):
    """The sum of the rows ``idx[s:e]`` (``s < e``) of ``table``, each times ``w[j]`` when
    ``weighted``, times ``inv[i]`` when ``mean``, written to ``out[orow, c0:c0 + dim]``;
    returns -1, or the first position of ``idx`` that names no row of ``table`` (nothing
    written then).

    The sum is one LLVM vector of ``dim`` values (``dim`` a compile-time constant), so it
    stays in registers from the first row to the last, where a loop over an accumulator
    array loads and stores it for every row (1.4-1.8x slower on the lookup benchmark's
    bags). Each lane does the reference's arithmetic in its order: the first row
    (weighted), then each next row added; no fused multiply-add, no reassociation. Rows of
    ``table`` and ``out`` must be contiguous and of one dtype; every id is compared with
    the table's rows as an unsigned number (a negative id is out of range too), and the
    rows :data:`AHEAD` ids ahead (:data:`AHEAD_LINE_ROWS` for rows of one cache line) are
    prefetched, every cache line of them."""
    if not isinstance(dim, types.IntegerLiteral):
        return None
    if not (table.dtype == out.dtype == w.dtype == inv.dtype) or \
            table.dtype not in (types.float32, types.float64):
        return None
    width = dim.literal_value
    sig = types.intp(dim, table, idx, s, e, w, weighted, inv, i, mean, out, orow, c0)

    def codegen(context, builder, signature, args):
        (_, tty, ity, sty, ety, wty, _, nty, jty, _, oty, rty, cty) = signature.args
        intp, vty, size = _vector_of(context, tty.dtype, width)
        tab = context.make_array(tty)(context, builder, args[1])
        ids = context.make_array(ity)(context, builder, args[2])
        wts = context.make_array(wty)(context, builder, args[5])
        invs = context.make_array(nty)(context, builder, args[7])
        dst = context.make_array(oty)(context, builder, args[10])
        first = context.cast(builder, args[3], sty, types.intp)
        end = context.cast(builder, args[4], ety, types.intp)
        weighted_, mean_ = args[6], args[9]
        rows, _ = cgutils.unpack_tuple(builder, tab.shape)
        stride, _ = cgutils.unpack_tuple(builder, tab.strides)
        base = builder.ptrtoint(tab.data, intp)
        ahead = ir.Constant(intp, AHEAD_LINE_ROWS if width * size <= LINE else AHEAD)

        def check(j):
            """``(whether idx[j] is a row of the table, the row)``."""
            r = _load_at(context, builder, ity, ids, j)
            return builder.icmp_unsigned("<", r, rows), r

        def row(j, r):
            """Row ``r`` (that of position ``j``), times ``w[j]`` when weighted."""
            _emit_prefetch_row(context, builder, ity, ids, builder.add(j, ahead), base, stride,
                               rows, ir.Constant(intp, width * size))
            v = builder.load(builder.inttoptr(builder.add(base, builder.mul(r, stride)),
                                              vty.as_pointer()), align=size)
            return _times_weight(context, builder, v, vty, weighted_, wty, wts, j)

        bad = builder.function.append_basic_block("bag_sum.bad")
        acc, bad_at = _vector_sum(builder, vty, first, end, row, check=check, bad=bad)

        unscaled = builder.block
        with builder.if_then(mean_):
            f = builder.load(_element_ptr(context, builder, nty, invs,
                                          context.cast(builder, args[8], jty, types.intp)))
            scaled = builder.fmul(acc, _splat(builder, f, vty))
            scaled_at = builder.block
        total = builder.phi(vty)
        total.add_incoming(scaled, scaled_at)
        total.add_incoming(acc, unscaled)
        ostride, _ = cgutils.unpack_tuple(builder, dst.strides)
        at = builder.add(builder.ptrtoint(dst.data, intp), builder.add(
            builder.mul(context.cast(builder, args[11], rty, types.intp), ostride),
            builder.mul(context.cast(builder, args[12], cty, types.intp),
                        ir.Constant(intp, size))))
        builder.store(total, builder.inttoptr(at, vty.as_pointer()), align=size)
        stored = builder.block
        leave = builder.function.append_basic_block("bag_sum.leave")
        builder.branch(leave)

        builder.position_at_end(bad)
        where = builder.phi(intp)
        for pos, block in bad_at:
            where.add_incoming(pos, block)
        builder.branch(leave)

        builder.position_at_end(leave)
        result = builder.phi(intp)
        result.add_incoming(ir.Constant(intp, -1), stored)
        result.add_incoming(where, bad)
        return result
    return sig, codegen


@intrinsic
def _segment_sum(typingctx, dim, src, occ, ws, weighted, s, e, acc):
    """``acc[:dim]`` = the sum over ``j`` in ``[s, e)`` (``s < e``) of the gradient rows
    ``src[occ[j]:occ[j] + dim]`` (``src`` flat and contiguous), each times ``ws[j]`` when
    ``weighted``, in order of ``j``: :func:`_bag_sum`'s vector in registers for the
    backward's segments (the rows :data:`AHEAD_ROWS` occurrences ahead prefetched). A
    ``dim`` of 0 does nothing (the kernels for any dim sum in a loop instead)."""
    if not isinstance(dim, types.IntegerLiteral):
        return None
    width = dim.literal_value
    sig = types.void(dim, src, occ, ws, weighted, s, e, acc)
    if width and not (src.dtype == ws.dtype == acc.dtype
                      and src.dtype in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        if not width:
            return context.get_dummy_value()
        (_, fty, oty, wty, _, sty, ety, aty) = signature.args
        intp, vty, size = _vector_of(context, fty.dtype, width)
        flat = context.make_array(fty)(context, builder, args[1])
        at = context.make_array(oty)(context, builder, args[2])
        wts = context.make_array(wty)(context, builder, args[3])
        out = context.make_array(aty)(context, builder, args[7])
        weighted_ = args[4]
        first = context.cast(builder, args[5], sty, types.intp)
        end = context.cast(builder, args[6], ety, types.intp)
        total, = cgutils.unpack_tuple(builder, flat.shape)
        base = builder.ptrtoint(flat.data, intp)
        item = ir.Constant(intp, size)

        def row(j):
            _emit_prefetch_at(context, builder, oty, at,
                              builder.add(j, ir.Constant(intp, AHEAD_ROWS)), base, item, total,
                              ir.Constant(intp, width))
            k = _load_at(context, builder, oty, at, j)
            v = builder.load(builder.inttoptr(builder.add(base, builder.mul(k, item)),
                                              vty.as_pointer()), align=size)
            return _times_weight(context, builder, v, vty, weighted_, wty, wts, j)

        sum_, _ = _vector_sum(builder, vty, first, end, lambda j, _: row(j))
        builder.store(sum_, builder.bitcast(out.data, vty.as_pointer()), align=size)
        return context.get_dummy_value()
    return sig, codegen


def _vector_of(context, dtype, width: int):
    """``(intp, vector, element bytes)``: the LLVM types of an index and of a vector of
    ``width`` values of the numba ``dtype``, and the bytes of one value."""
    elt = context.get_value_type(dtype)
    return (context.get_value_type(types.intp), ir.VectorType(elt, width),
            context.get_abi_sizeof(elt))


def _vector_sum(builder, vty, first, end, row, check=None, bad=None):
    """Emit the sum of the vectors ``row(j, checked)`` for ``j`` in ``[first, end)`` (``first <
    end``, intp values), in order of ``j``, held in registers (LLVM phis) from the first to
    the last; ``check(j)`` -> ``(ok, checked)`` is asked first for each ``j``, which goes to
    the block ``bad`` where not ``ok``. Leaves the builder after the loop; returns ``(sum,
    [(j, block) that went to bad])``."""
    intp = first.type
    one = ir.Constant(intp, 1)
    fn = builder.function
    loop = fn.append_basic_block("sum.loop")
    step = fn.append_basic_block("sum.step")
    done = fn.append_basic_block("sum.done")
    bad_at = []

    def checked(j):
        if check is None:
            return None
        ok, value = check(j)
        bad_at.append((j, builder.block))
        go_on = fn.append_basic_block("sum.ok")
        builder.cbranch(ok, go_on, bad)
        builder.position_at_end(go_on)
        return value

    acc0 = row(first, checked(first))
    second = builder.add(first, one)
    started = builder.block
    builder.branch(loop)
    builder.position_at_end(loop)
    j = builder.phi(intp)
    acc = builder.phi(vty)
    j.add_incoming(second, started)
    acc.add_incoming(acc0, started)
    builder.cbranch(builder.icmp_signed("<", j, end), step, done)
    builder.position_at_end(step)
    summed = builder.fadd(acc, row(j, checked(j)))
    following = builder.add(j, one)
    stepped = builder.block
    j.add_incoming(following, stepped)
    acc.add_incoming(summed, stepped)
    builder.branch(loop)
    builder.position_at_end(done)
    return acc, bad_at


def _splat(builder, x, vty):
    """The vector ``vty`` of ``x`` in every lane."""
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count)
    one_lane = builder.insert_element(ir.Constant(vty, ir.Undefined), x,
                                      ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one_lane, ir.Constant(vty, ir.Undefined), lanes)


def _times_weight(context, builder, v, vty, weighted, wty, wts, j):
    """The vector ``v`` times ``wts[j]`` (``wts`` 1-D, type ``wty``) when ``weighted``."""
    plain = builder.block
    with builder.if_then(weighted):
        times = builder.fmul(v, _splat(builder, builder.load(
            _element_ptr(context, builder, wty, wts, j)), vty))
        scaled = builder.block
    out = builder.phi(vty)
    out.add_incoming(times, scaled)
    out.add_incoming(v, plain)
    return out


#: optimizer codes of :func:`segment_update`
AGGREGATE, SGD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2, 3


def _build(D: int, V: int = 0):
    """The per-dim kernels, ``D`` values per row fixed at compile time (LLVM then unrolls and
    vectorizes each row's loops whole), or any dim (``D == 0``); ``V``: the backward sums
    rows of ``V`` values in registers (:func:`_segment_sum`), or in a loop (0)."""
    @nb.njit(**_OPTS)
    def pool_sum(table, idx, offsets, w, weighted, inv, mean, out, r0, c0):
        """``out[r0 + i, c0:c0 + d]`` = the (weighted) sum of bag ``i``'s rows, times ``inv[i]``
        when ``mean``; bag ``i`` is ``idx[offsets[i]:offsets[i + 1]]``."""
        rows = table.shape[0]
        d = D if D else table.shape[1]
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
    def gather_rows(flat, rows, w, weighted, out):
        """``out[k] = flat[rows[k]]`` (times ``w[k]`` when ``weighted``), the rows prefetched
        :data:`AHEAD` ids ahead: one id per bag, every row already checked by the caller."""
        d = D if D else flat.shape[1]
        for k in range(rows.size):
            _prefetch_id(flat, rows, k + AHEAD)
            r = rows[k]
            if weighted:
                wt = w[k]
                for c in range(d):
                    out[k, c] = flat[r, c] * wt
            else:
                for c in range(d):
                    out[k, c] = flat[r, c]

    @nb.njit(**_OPTS)
    def pool_max(table, idx, offsets, w, weighted, out, r0, c0, arg, want_arg):
        """Max pooling: each column's largest (weighted) value of bag ``i`` (the first on ties;
        zeros for an empty bag); ``arg[i, c]`` its position in ``idx`` (-1: empty bag)."""
        rows = table.shape[0]
        d = D if D else table.shape[1]
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
    def segment_update(kind, src, row_width, occ, ws, weighted, starts, lengths, uniq, out,
                       weight, mom, ea, es, bc1, bc2, terms, has_terms, width, lr, eps, b1, b2,
                       a1, a2):
        """For each segment ``u`` (occurrences ``starts[u]:starts[u] + lengths[u]`` of ``occ``,
        sorted by row): sum its gradient rows ``src[occ[j]:occ[j] + d] * ws[j]`` (``src`` flat,
        ``occ[j]`` where occurrence ``j``'s ``d = row_width`` values start) in order of ``j`` into a
        ``d``-long buffer, then either store the sum in ``out[u]`` (``kind == AGGREGATE``) or
        apply the optimizer to row ``uniq[u]`` of ``weight`` at once (``embedding.optim.
        sparse_update``'s arithmetic; ``terms[u]`` replaces row-wise AdaGrad's ``mean(g * g)``
        when ``has_terms``; ``bc1``, ``bc2``: Adam's per-row bias corrections).

        The gradient rows are read where they are: rows of a ``[n, d]`` block (``occ[j] = k *
        d``) or the columns of a table inside the whole output gradient (``occ[j] = bag *
        row_length + column``), so the backward copies nothing before it sums.

        One function with the loops written out: numba calls between compiled functions cost
        more than the work of a short segment."""
        d = D if D else row_width
        acc = np.empty(d, src.dtype)
        lanes = np.empty(WARP, src.dtype)
        rows_in_registers = V and src.strides[0] == src.itemsize
        for u in range(starts.size):
            s = starts[u]
            e = s + lengths[u]
            if kind != AGGREGATE:
                _prefetch_id(weight, uniq, u + AHEAD_ROWS)
            if rows_in_registers:
                _segment_sum(V, src, occ, ws, weighted, s, e, acc)
            else:
                k = occ[s]
                _prefetch_at(src, occ, s + AHEAD_ROWS, d)
                if weighted:
                    wt = ws[s]
                    for c in range(d):
                        acc[c] = src[k + c] * wt
                else:
                    for c in range(d):
                        acc[c] = src[k + c]
                for j in range(s + 1, e):
                    k = occ[j]
                    _prefetch_at(src, occ, j + AHEAD_ROWS, d)
                    if weighted:
                        wt = ws[j]
                        for c in range(d):
                            acc[c] += src[k + c] * wt
                    else:
                        for c in range(d):
                            acc[c] += src[k + c]
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
                    # the butterfly's lane 0: each round adds lane ``l + o`` into lane ``l``
                    # for the ``o`` lanes lane 0 still reads (31 adds, not 5 x 32)
                    o = WARP // 2
                    while o > 0:
                        for lane in range(o):
                            lanes[lane] = lanes[lane] + lanes[lane + o]
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

    return Kernels(pool_sum, gather_rows, pool_max, segment_update)


class Kernels(NamedTuple):
    """The kernels whose loops run over a row's ``d`` values (:func:`for_dim`)."""
    pool_sum: object
    gather_rows: object
    pool_max: object
    segment_update: object


#: dims the kernels are compiled for with the dim fixed (the common embedding dims): each is
#: compiled on its first use on a machine (seconds) and cached; other dims use the kernels
#: for any dim
FIXED_DIMS = (16, 32)
ANY_DIM = _build(0)
pool_sum, gather_rows, pool_max, segment_update = ANY_DIM
_by_dim: dict = {}


def for_dim(d: int) -> Kernels:
    """The kernels for rows of ``d`` values: compiled for ``d`` itself when it is one of
    :data:`FIXED_DIMS`, else :data:`ANY_DIM`."""
    if d not in FIXED_DIMS:
        return ANY_DIM
    k = _by_dim.get(d)
    if k is None:
        k = _by_dim[d] = _build(d, d)
    return k


_updates: dict = {}


def update_for(d: int, dtype):
    """:func:`segment_update` for rows of ``d`` values of ``dtype``: summing each row's
    gradients in registers (:func:`_segment_sum`, compiled for ``d`` on its first use and
    cached) where such a row fits :data:`VECTOR_ROW_BYTES`, else in a loop."""
    if d in FIXED_DIMS or not 0 < d * np.dtype(dtype).itemsize <= VECTOR_ROW_BYTES:
        return for_dim(d).segment_update
    k = _updates.get(d)
    if k is None:
        k = _updates[d] = _build(0, d).segment_update
    return k


def _build_rows(D: int):
    @nb.njit(**_OPTS)
    def pool_sum_rows(table, idx, offsets, w, weighted, inv, mean, out, r0, c0):
        """:func:`pool_sum` with each bag's sum held in registers (:func:`_bag_sum`), for
        rows of ``D`` values, contiguous in ``table`` and ``out`` and of one dtype."""
        for i in range(offsets.size - 1):
            s = offsets[i]
            e = offsets[i + 1]
            if e <= s:
                for c in range(D):
                    out[r0 + i, c0 + c] = 0
                continue
            bad = _bag_sum(D, table, idx, s, e, w, weighted, inv, i, mean, out, r0 + i, c0)
            if bad >= 0:
                return bad
        return -1
    return pool_sum_rows


_rows_by_dim: dict = {}


def pool_sum_rows(table: np.ndarray, out: np.ndarray):
    """The bag sum of :func:`_build_rows` for ``table``'s rows into ``out``'s, compiled for
    their dim on its first use (and cached); None where it does not apply: rows wider than
    :data:`VECTOR_ROW_BYTES`, a dtype other than float32 and float64 or not ``out``'s, rows
    that are not contiguous (:func:`pool_sum` serves those)."""
    d = table.shape[1]
    if not (table.dtype == out.dtype and table.dtype in (np.float32, np.float64)
            and 0 < d * table.itemsize <= VECTOR_ROW_BYTES
            and (d == 1 or (table.strides[1] == table.itemsize
                            and out.strides[1] == out.itemsize))):
        return None
    k = _rows_by_dim.get(d)
    if k is None:
        k = _rows_by_dim[d] = _build_rows(d)
    return k
