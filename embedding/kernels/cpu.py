"""NumPy kernels: the reference semantics and the CPU path.

All three functions take a :class:`~embedding.kernels.layout.TableLayout`,
the flat weights (and state) buffers and :class:`~embedding.kernels.layout.Bags`.
They loop in Python over slots and tables only — never over ids.

A communication ``wire`` (:func:`~embedding.kernels.layout.wire_format`) is
applied block by block inside the same loops: the lookup pools one
(group, slot) block of bags into a scratch block and encodes it into the
output while it is in cache; the backward widens each block of received
gradients as it copies it into the gradient source. No full-size buffer in
the compute dtype is made on either side.
"""
from __future__ import annotations

import numpy as np

from embedding.checkpoint.fused8bit import SCALE_BIAS_BYTES, encode_into
from embedding.kernels import compiled
from embedding.kernels.layout import (Bags, TableLayout, check_wire_rows, per_table_configs,
                                      wire_format, wire_shape)
from embedding.kernels.pool import host_cores, run_all as _map
from embedding.kernels.segments import (jagged_max, jagged_sum, jagged_sum_permuted,
                                        segments_of_sorted, stable_argsort)
from embedding.optim import sparse_update
from embedding.types import OptimizerKind
from embedding.precision import Rounding, compute_dtype, round_to

__all__ = ["pooled_lookup", "aggregate_grads", "apply_updates", "backward_update",
           "aggregate_rows", "table_view"]


def table_view(layout: TableLayout, flat: np.ndarray, t: int, per_row: bool = False):
    """Table ``t``'s ``[rows, dim]`` view of a flat weights buffer (``[rows]`` when ``per_row``)."""
    if per_row:
        base = layout.row_base[t]
        return flat[base:base + layout.rows[t]]
    off = layout.weight_offsets[t]
    return flat[off:off + layout.rows[t] * layout.dims[t]].reshape(layout.rows[t],
                                                                  layout.dims[t])


def _weights_of(bags: Bags, dtype):
    if bags.weights is None:
        return None
    return np.asarray(bags.weights, dtype=dtype)


def pooled_lookup(layout: TableLayout, weights: np.ndarray, bags: Bags,
                  out: np.ndarray | None = None, threads: int = 1, wire=None) -> np.ndarray:
    """Pool every bag of every slot into ``out`` (``[G * B, out_dim]``, see layout doc).

    Sum pooling adds the (weighted) rows in bag order; mean pooling then
    multiplies by ``1 / length``; max pooling keeps each column's largest
    (weighted) value (empty bags give zeros). Columns of ``out``
    that no slot covers are set to zero. ``threads > 1`` runs blocks of bags
    on a thread pool (NumPy releases the GIL in the gathers and adds).
    Half weights (float16, bfloat16) are pooled in float32 (exact rows, float32
    sums) and ``out`` is float32.

    ``wire`` (a :class:`~embedding.sharding.qcomm.Wire`): ``out`` is the
    pooled rows in its format, the bytes ``wire.encode`` makes of them
    (float16 or bfloat16 values, times ``wire.scale`` when set; or int8
    FUSED8BIT rows of ``wire.row`` values, which must divide ``out_dim`` and
    every slot's column and dim: :func:`~embedding.kernels.layout.wire_shape`),
    each block of bags encoded as soon as it is pooled.
    """
    bags.check(layout)
    b, s_count, g_count = bags.batch_size, bags.num_slots, bags.num_groups
    cdt = compute_dtype(weights.dtype)
    fmt = wire_format(wire)
    if fmt == "int8":
        check_wire_rows(layout, bags, wire.row)
    shape, odt = wire_shape(bags, cdt, wire)
    if out is None:
        out = np.empty(shape, odt)
    elif fmt is not None and (out.shape != shape or out.dtype != odt
                              or not out.flags.c_contiguous):
        raise ValueError(f"out: expected a C-contiguous {shape} of {odt} (the wire format), "
                         f"got {out.shape} of {out.dtype}")
    covered = sum(layout.dims[t] for t in bags.slot_table)
    if covered != bags.out_dim or len(set(bags.slot_col)) != s_count:
        out[...] = 0   # zero bits: the wire encoding of zeros too
    if b == 0 or s_count == 0 or g_count == 0:
        return out
    offsets = np.asarray(bags.offsets, np.int64)
    lengths = np.diff(offsets)
    w = _weights_of(bags, cdt)
    idx = np.asarray(bags.indices, np.int64)
    jit = compiled.kernels(weights.dtype) if weights.dtype == cdt else None
    if fmt is None and _one_id_per_bag(layout, bags, lengths, out):
        # every bag holds one id (sum, mean and max all pool to the weighted row): one gather
        # of the rows in output order, straight into ``out``
        d = layout.dims[0]
        tables = list(bags.slot_table)
        ids = idx.reshape(g_count, s_count, b)
        limit = np.asarray(layout.rows, np.int64)[tables][None, :, None]
        bad = (ids < 0) | (ids >= limit)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            t = tables[pos // b % s_count]
            raise _bad_id(idx, pos, t, layout.rows[t])
        base = np.asarray(layout.row_base, np.int64)[tables]
        rows = (ids + base[None, :, None]).transpose(0, 2, 1).reshape(-1)
        flat_out = out.reshape(-1, d)
        if w is not None:
            w = w.reshape(g_count, s_count, b).transpose(0, 2, 1).reshape(-1)
        if jit is not None and out.dtype == weights.dtype:
            jit.for_dim(d).gather_rows(weights.reshape(-1, d), rows, _none_as_empty(w, cdt),
                                       w is not None, flat_out)
            return out
        if weights.dtype == flat_out.dtype:
            np.take(weights.reshape(-1, d), rows, axis=0, out=flat_out)
        else:
            flat_out[...] = np.take(weights.reshape(-1, d), rows, axis=0)
        if w is not None:
            flat_out *= w[:, None]
        return out

    def block(gs: int) -> None:
        g, s = divmod(gs, s_count)
        t = bags.slot_table[s]
        d = layout.dims[t]
        first = gs * b
        c0 = bags.slot_col[s]
        if jit is not None:
            _compiled_block(jit, layout, weights, t, bags, idx, offsets[first:first + b + 1],
                            w, lengths[first:first + b], s, out, g * b, c0, fmt, wire)
            return
        dst = out[g * b:(g + 1) * b, c0:c0 + d] if fmt is None else np.empty((b, d), cdt)
        ln = lengths[first:first + b]
        if bags.slot_max[s]:
            jagged_max(table_view(layout, weights, t), idx, offsets[first:first + b], ln, w,
                       out=dst)
        else:
            jagged_sum(table_view(layout, weights, t), idx, offsets[first:first + b], ln, w,
                       out=dst)
            if bags.slot_mean[s]:
                dst *= _inverse_lengths(ln, cdt)[:, None]
        if fmt is not None:
            _encode_block(dst, out, g * b, c0, fmt, wire)

    _map(block, range(g_count * s_count), threads)
    return out


def _compiled_block(jit, layout, weights, t, bags, idx, offsets, w, lengths, s, out, r0, c0,
                    fmt, wire) -> None:
    """One (group, slot) block of :func:`pooled_lookup` by the compiled kernels: straight into
    ``out`` when it is plain and C-contiguous, else through a ``[b, d]`` scratch block."""
    table = table_view(layout, weights, t)
    b, d = len(lengths), table.shape[1]
    direct = fmt is None and out.flags.c_contiguous
    target = out if direct else np.empty((b, d), table.dtype)
    at, col = (r0, c0) if direct else (0, 0)
    wv = _none_as_empty(w, table.dtype)
    if bags.slot_max[s]:
        bad = jit.for_dim(d).pool_max(table, idx, offsets, wv, w is not None, target, at, col,
                                      _NO_ARG, False)
    else:
        mean = bool(bags.slot_mean[s])
        inv = _inverse_lengths(lengths, table.dtype) if mean else np.empty(0, table.dtype)
        bad = jit.for_dim(d).pool_sum(table, idx, offsets, wv, w is not None, inv, mean, target,
                                      at, col)
    if bad >= 0:
        raise _bad_id(idx, bad, t, table.shape[0])
    if fmt is not None:
        _encode_block(target, out, r0, c0, fmt, wire)
    elif not direct:
        out[r0:r0 + b, c0:c0 + d] = target


_NO_ARG = np.empty((0, 0), np.int64)


def _none_as_empty(a, dtype):
    """``a``, or an empty array of ``dtype`` for an absent one (compiled kernels take arrays)."""
    return np.empty(0, dtype) if a is None else a


def _bad_id(idx, pos: int, t: int, rows: int, at: bool = True) -> IndexError:
    """The error for id ``idx[pos]`` of local table ``t`` (``at``: name its position)."""
    where = f"indices[{pos}]" if at else "indices"
    return IndexError(f"{where}: id {int(idx[pos])} is out of range for local table {t} "
                      f"({rows} rows)")


def _encode_block(vals: np.ndarray, out: np.ndarray, r0: int, c0: int, fmt: str, wire) -> None:
    """Write ``wire``'s encoding of the pooled block ``vals`` (``[b, d]``, compute dtype, from
    column ``c0`` of output rows ``r0:``) into the wire output ``out`` (``vals`` may be
    overwritten)."""
    b, d = vals.shape
    if fmt == "int8":
        row = wire.row
        units = out.reshape(out.shape[0], -1, row + SCALE_BIAS_BYTES)
        encode_into(vals.astype(np.float32, copy=False).reshape(b, d // row, row),
                    units[r0:r0 + b, c0 // row:(c0 + d) // row])
        return
    if wire.scale is not None:
        vals *= vals.dtype.type(wire.scale)
    out[r0:r0 + b, c0:c0 + d] = vals   # cast as astype rounds (nearest even)


def _one_id_per_bag(layout: TableLayout, bags: Bags, lengths: np.ndarray, out) -> bool:
    """Whether a lookup is one gather: one id per bag, one dim for every table, the slots
    side by side in slot order filling ``out`` (C-contiguous). (Faster than the per-table
    loops, which write a table's columns of every output row: a cache miss per bag once
    ``out`` outgrows the cache.)"""
    d = layout.dims[0]
    return (len(set(layout.dims)) == 1 and out.flags.c_contiguous
            and bags.out_dim == bags.num_slots * d
            and bags.slot_col == tuple(range(0, bags.num_slots * d, d))
            and bool((lengths == 1).all()))


def aggregate_grads(layout: TableLayout, bags: Bags, grad_out: np.ndarray,
                    threads: int = 1, weights: np.ndarray | None = None, wire=None
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per table, ``(rows, grads)``: the unique rows the bags read and their summed gradients.

    ``grad_out`` is the gradient of :func:`pooled_lookup`'s output. Each id
    occurrence contributes ``grad_out[bag row, slot columns] * scale * w``
    (``scale = 1/length`` for mean slots, ``w`` its per-id weight); the
    contributions of one row are summed in occurrence order (stable sort by
    row). ``rows`` are unique, in no particular order (the device twin
    returns them sorted).

    Max slots need the table ``weights`` the lookup read: an occurrence
    contributes to a column only where it is the bag's first maximum
    (``grad_out * w`` there, zero elsewhere).

    ``wire`` (float16 or bfloat16): ``grad_out`` is in its format, as
    received; each block is widened to ``wire.value_dtype`` (and multiplied
    by ``1 / wire.scale`` when set) as it is copied in, exactly as
    ``wire.decode`` would have done.
    """
    _check_backward(layout, bags, weights)
    dtype, inverse = _gradient_dtype(grad_out, wire)

    segments = _segments_of(layout, bags, grad_out, weights, wire, dtype, inverse)
    jit = compiled.kernels(dtype)

    def one(t: int):
        seg = segments(t)
        d = layout.dims[t]
        if seg is None:
            return np.zeros(0, np.int64), np.zeros((0, d), dtype)
        gsrc, occ, ws, uniq, starts, lens = seg
        if jit is not None:
            out = np.empty((len(uniq), d), dtype)
            _run_segments(jit, jit.AGGREGATE, seg, d, out, _no_rule(dtype))
            return uniq, out
        grads, perm = jagged_sum_permuted(gsrc, occ, starts, lens, ws)
        return (uniq if perm is None else uniq[perm]), grads

    return _map(one, range(layout.num_tables), threads)


def _check_backward(layout: TableLayout, bags: Bags, weights) -> None:
    """ValueError unless ``bags`` fit ``layout`` and, with max slots, ``weights`` are given."""
    bags.check(layout)
    if bags.any_max and weights is None:
        raise ValueError("weights: the gradient of max pooling needs the table weights the "
                         "lookup read")


def _gradient_dtype(grad_out: np.ndarray, wire):
    """``(dtype, inverse)``: the dtype gradients are summed in and the factor undoing the
    wire's scale (None: no scale)."""
    fmt = wire_format(wire)
    if fmt == "int8":
        raise ValueError("wire: gradients travel in fp32, fp16 or bf16, not int8")
    dtype = grad_out.dtype if fmt is None else np.dtype(wire.value_dtype)
    return dtype, None if fmt is None or wire.scale is None else dtype.type(1.0 / wire.scale)


def _segments_of(layout: TableLayout, bags: Bags, grad_out: np.ndarray, weights, wire, dtype,
                 inverse):
    """A function of table ``t``: its occurrences sorted by row, ``(gsrc, occ, ws, rows,
    starts, lengths)``, or None when no bag reads it.

    Occurrence ``j`` (in row order, stable) contributes ``gsrc[occ[j]] * ws[j]`` (``ws`` None:
    no per-id weights); ``gsrc`` holds each bag's gradient block already scaled (``1 / wire
    scale``, ``1 / length`` for mean slots) or, for max slots, each occurrence's share;
    ``rows[u]`` (unique, ascending) sums occurrences ``starts[u]:starts[u] + lengths[u]``.
    """
    fmt = wire_format(wire)
    b, s_count = bags.batch_size, bags.num_slots
    offsets = np.asarray(bags.offsets, np.int64)
    lengths = np.diff(offsets)
    idx = np.asarray(bags.indices, np.int64)
    w = _weights_of(bags, dtype)
    one_each = bool((lengths == 1).all())  # one id per bag: occurrence k is gradient row k
    jit = compiled.kernels(dtype)
    # the compiled kernels read a sum slot's gradients straight from ``grad_out``
    direct = fmt is None and grad_out.dtype == dtype and grad_out.flags.c_contiguous

    def one(t: int):
        d = layout.dims[t]
        blocks = [(g, s) for g in range(bags.num_groups) for s in range(s_count)
                  if bags.slot_table[s] == t]
        if not blocks or b == 0:
            return None
        if jit is not None and direct and not any(bags.slot_mean[s] or bags.slot_max[s]
                                                  for _, s in blocks):
            return _direct_segments(jit, layout, t, bags, blocks, idx, offsets, lengths, w,
                                    grad_out, one_each)
        gsrc = [np.empty((len(blocks) * b, d), dtype)]
        ids_parts, row_parts, w_parts = [], [], []
        at = len(blocks) * b  # rows of gsrc so far (max slots append one per occurrence)
        for k, (g, s) in enumerate(blocks):
            first = (g * s_count + s) * b
            col = bags.slot_col[s]
            ln = lengths[first:first + b]
            lo, hi = offsets[first], offsets[first + b]
            grad = grad_out[g * b:(g + 1) * b, col:col + d]
            ids_parts.append(idx[lo:hi])
            if w is not None:
                w_parts.append(w[lo:hi])
            if bags.slot_max[s]:
                if fmt is not None:
                    grad = grad.astype(dtype)
                    if inverse is not None:
                        grad *= inverse
                gsrc.append(_max_occurrence_grads(table_view(layout, weights, t), idx,
                                                  offsets[first:first + b], ln, w, grad, lo,
                                                  hi))
                row_parts.append(np.arange(at, at + hi - lo, dtype=np.int64))
                at += hi - lo
                continue
            dst = gsrc[0][k * b:(k + 1) * b]
            dst[...] = grad
            if inverse is not None:
                dst *= inverse
            if bags.slot_mean[s]:
                dst *= _inverse_lengths(ln, dtype)[:, None]
            rows = np.arange(k * b, (k + 1) * b, dtype=np.int64)
            row_parts.append(rows if one_each else np.repeat(rows, ln))
        ids = _cat(ids_parts)
        if ids.size == 0:
            return None
        gsrc = _cat(gsrc)
        if jit is not None:
            ws_in = _cat(w_parts) if w is not None else np.empty(0, dtype)
            return _sorted(jit, ids, t, layout.rows[t], gsrc.reshape(-1),
                           _cat(row_parts) * d, ws_in, w is not None)
        if ids.min() < 0 or ids.max() >= layout.rows[t]:
            raise _bad_id(ids, int(np.flatnonzero((ids < 0) | (ids >= layout.rows[t]))[0]), t,
                          layout.rows[t], at=False)
        order = stable_argsort(ids, layout.rows[t] - 1)
        uniq, starts, lens = segments_of_sorted(ids[order])
        ws = _cat(w_parts)[order] if w is not None else None
        return gsrc, _cat(row_parts)[order], ws, uniq, starts, lens

    return one


def _sorted(jit, ids, t: int, rows: int, src, occ, ws_in, weighted: bool):
    """The compiled kernels' segments of table ``t``: ``(src, occ, ws, uniq, starts, lengths)``
    with ``src`` flat and ``occ`` each occurrence's offset in it, sorted by row (IndexError
    naming a bad id)."""
    if ids.size >= 1 << 31:
        raise ValueError(f"indices: {ids.size} ids of local table {t} in one batch; at most "
                         f"{(1 << 31) - 1} are supported")
    bad, occ, ws, uniq, starts, lens = jit.sort_by_row(ids, rows, occ, ws_in, weighted)
    if bad >= 0:
        raise _bad_id(ids, bad, t, rows, at=False)
    return src, occ, ws if weighted else None, uniq, starts, lens


def _direct_segments(jit, layout, t: int, bags: Bags, blocks, idx, offsets, lengths, w,
                     grad_out, one_each: bool):
    """:func:`_segments_of` of table ``t`` when all its slots are sum-pooled and ``grad_out``
    is plain: each occurrence reads its bag's gradient where it lies in ``grad_out``."""
    b, s_count, width = bags.batch_size, bags.num_slots, grad_out.shape[1]
    ids_parts, occ_parts, w_parts = [], [], []
    bag = np.arange(b, dtype=np.int64) * width
    for g, s in blocks:
        first = (g * s_count + s) * b
        lo, hi = offsets[first], offsets[first + b]
        ids_parts.append(idx[lo:hi])
        if w is not None:
            w_parts.append(w[lo:hi])
        rows = bag + (g * b * width + bags.slot_col[s])
        occ_parts.append(rows if one_each else np.repeat(rows, lengths[first:first + b]))
    ids = _cat(ids_parts)
    if ids.size == 0:
        return None
    ws_in = _cat(w_parts) if w is not None else np.empty(0, grad_out.dtype)
    return _sorted(jit, ids, t, layout.rows[t], grad_out.reshape(-1), _cat(occ_parts), ws_in,
                   w is not None)


def _max_occurrence_grads(table, idx, starts, lengths, w, grad, lo: int, hi: int):
    """``[hi - lo, d]``: each occurrence's share of its bag's gradient under max pooling.

    The occurrence that holds a column's maximum (the first, on ties) gets
    the bag's gradient there; every other occurrence gets zero. The per-id
    weight is applied later, with the other slots' weights.
    """
    d = table.shape[1]
    arg = np.empty((len(starts), d), np.int64)
    jagged_max(table, idx, starts, lengths, w, arg_out=arg)
    out = np.zeros((hi - lo, d), grad.dtype)
    bag, col = np.nonzero(arg >= 0)
    out[arg[bag, col] - lo, col] = grad[bag, col]
    return out


def aggregate_rows(rows: np.ndarray, grads: np.ndarray, num_rows: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Sum the gradient rows of duplicate ``rows`` (stable: in the given order)."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
        return rows, grads
    order = stable_argsort(rows, num_rows - 1)
    uniq, starts, lens = segments_of_sorted(rows[order])
    if uniq.size == rows.size:
        return uniq, grads[order]
    res, perm = jagged_sum_permuted(grads, order, starts, lens)
    return (uniq, res) if perm is None else (uniq[perm], res)


def apply_updates(layout: TableLayout, config, weights: np.ndarray,
                  state: dict, sparse: list[tuple[np.ndarray, np.ndarray]],
                  unique: bool = True, threads: int = 1, row_terms=None,
                  rounding=None) -> None:
    """Apply each table's optimizer to its ``(rows, grads)``.

    ``config`` is one :class:`OptimizerConfig` or one per table.
    With ``unique=False`` duplicate rows are summed first (e.g. gradients
    gathered from several ranks). ``row_terms[t]`` (or None), aligned with
    table t's unique rows, replaces row-wise AdaGrad's ``mean(g * g)``.

    ``rounding`` (half weights): ``(modes, seeds, step, master, keys)`` with one
    :class:`~embedding.precision.Rounding` and one seed per table, the update
    counter, the float32 master buffer (laid out like ``weights``; None
    when no table has ``MASTER`` rounding) and the int64 number each row
    hashes as, by global row (``layout.row_base[t] + row``; None: the row
    itself). A ``MASTER`` table's rule runs on its master rows, then the
    stored rows are their nearest rounding; a ``STOCHASTIC`` table's new rows
    are rounded with the bits of ``(seed, step, t, key of the row, column)``.
    None: every table rounds to nearest.
    """
    from embedding.optim import state_specs

    configs = per_table_configs(config, layout.num_tables)
    if len(sparse) != layout.num_tables:
        raise ValueError(f"sparse: expected {layout.num_tables} (rows, grads) pairs, got "
                         f"{len(sparse)}")

    jit = _update_kernels(weights, state, configs)

    def one(t: int) -> None:
        rows, grads = sparse[t]
        if len(rows) == 0:
            return
        term = None if row_terms is None else row_terms[t]
        if jit is not None and grads.dtype == weights.dtype and (
                term is None or np.asarray(term).dtype == weights.dtype):
            _compiled_update(jit, layout, configs[t], weights, state, t, rows, grads, unique,
                             term)
            return
        if not unique:
            rows, grads = aggregate_rows(rows, grads, layout.rows[t])
        views = {sp.name: table_view(layout, state[sp.name], t, sp.per_row)
                 for sp in state_specs(configs[t].kind)}
        weight, store = _rounded_store(layout, weights, t, rounding)
        sparse_update(configs[t], weight, views, rows, grads, term, store)

    _map(one, range(layout.num_tables), threads)


def _update_kernels(weights: np.ndarray, state: dict, configs):
    """The compiled module when it can apply every table's optimizer in the weights' own dtype
    (float32 or float64 tables whose float state is stored in that dtype), else None."""
    jit = compiled.kernels(weights.dtype)
    if jit is None:
        return None
    from embedding.optim import state_specs

    for c in configs:
        for sp in state_specs(c.kind):
            if sp.dtype is None and state[sp.name].dtype != weights.dtype:
                return None
    return jit


def _compiled_update(jit, layout, config, weights, state, t, rows, grads, unique, term) -> None:
    """:func:`apply_updates` of table ``t`` by the compiled kernels (duplicates summed in the
    given order first when not ``unique``)."""
    rows = np.asarray(rows, np.int64)
    grads = np.ascontiguousarray(grads)
    n = layout.rows[t]
    if rows.min() < 0 or rows.max() >= n:
        bad = int(np.flatnonzero((rows < 0) | (rows >= n))[0])
        raise IndexError(f"rows[{bad}]: row {int(rows[bad])} is out of range for local table "
                         f"{t} ({n} rows)")
    d = grads.shape[1]
    if not unique:
        order = stable_argsort(rows, n - 1)
        uniq, starts, lens = segments_of_sorted(rows[order])
        if uniq.size < rows.size:
            if term is not None:
                raise ValueError("row_terms: given per row, so the rows must be unique")
            seg = (grads.reshape(-1), order * d, None, uniq, starts, lens)
            _run_segments(jit, None, seg, d, None,
                          _rule(jit, config, layout, weights, state, t, uniq, grads.dtype))
            return
    n_rows = np.arange(len(rows), dtype=np.int64)   # each row its own one-occurrence segment
    seg = (grads.reshape(-1), n_rows * d, None, rows, n_rows, np.ones(len(rows), np.int64))
    _run_segments(jit, None, seg, d, None,
                  _rule(jit, config, layout, weights, state, t, rows, grads.dtype), term)


def _rule(jit, config, layout: TableLayout, weights, state, t: int, rows, dtype) -> tuple:
    """The compiled update's arguments for table ``t``'s optimizer on unique ``rows``:
    ``(code, weight, momentum, exp_avg, exp_avg_sq, bc1, bc2, width, lr, eps, b1, b2, 1 - b1,
    1 - b2)``, every scalar in the compute dtype, as :func:`embedding.optim.sparse_update`
    rounds them (Adam's per-row step counts are advanced here, its bias corrections computed
    in float64 and rounded, as there)."""
    dt = np.dtype(dtype).type
    rule = list(_no_rule(dtype))
    rule[1] = table_view(layout, weights, t)
    kind = config.kind
    if kind is OptimizerKind.SGD:
        rule[0] = jit.SGD
    elif kind is OptimizerKind.ROWWISE_ADAGRAD:
        rule[0] = jit.ROWWISE_ADAGRAD
        rule[2] = table_view(layout, state["momentum"], t, per_row=True)
    elif kind is OptimizerKind.ADAM:
        rule[0] = jit.ADAM
        rule[3] = table_view(layout, state["exp_avg"], t)
        rule[4] = table_view(layout, state["exp_avg_sq"], t)
        step = table_view(layout, state["step"], t, per_row=True)
        k = step[rows] + 1
        step[rows] = k
        kf = k.astype(np.float64)
        rule[5] = (1.0 - np.power(float(config.beta1), kf)).astype(dtype)
        rule[6] = (1.0 - np.power(float(config.beta2), kf)).astype(dtype)
    else:
        raise ValueError(f"config.kind: unsupported optimizer {kind}")
    rule[7:] = [dt(layout.dims[t]), dt(config.lr), dt(config.eps), dt(config.beta1),
                dt(config.beta2), dt(1) - dt(config.beta1), dt(1) - dt(config.beta2)]
    return tuple(rule)


def _no_rule(dtype) -> tuple:
    """:func:`_rule`'s shape with nothing to update (the aggregate-only kernels' arguments)."""
    dt = np.dtype(dtype)
    one, two = np.empty(0, dt), np.empty((0, 0), dt)
    z = dt.type(0)
    return (0, two, one, two, two, one, one, z, z, z, z, z, z, z)


def _run_segments(jit, code, seg, d: int, out, rule, term=None) -> None:
    """:func:`~embedding.kernels._jit.segment_update` over a table's sorted occurrences ``seg``
    (:func:`_segments_of`; ``d`` values per gradient row): into ``out``, or (``out`` None)
    through ``rule`` (:func:`_rule`; ``code`` None: the rule's own; ``term``: row-wise
    AdaGrad's per-row terms)."""
    gsrc, occ, ws, uniq, starts, lens = seg
    kind, weight, mom, ea, es, bc1, bc2, width, lr, eps, b1, b2, a1, a2 = rule
    if code is None:
        code = kind
    dtype = gsrc.dtype
    terms = np.empty(0, dtype) if term is None else np.ascontiguousarray(term)
    jit.for_dim(d).segment_update(code, gsrc, d, occ, _none_as_empty(ws, dtype), ws is not None,
                                  starts, lens, uniq,
                                  out if out is not None else np.empty((0, 0), dtype), weight,
                                  mom, ea, es, bc1, bc2, terms, term is not None, width, lr, eps,
                                  b1, b2, a1, a2)


def backward_update(layout: TableLayout, config, weights: np.ndarray,
                    state: dict, bags: Bags, grad_out: np.ndarray, threads: int = 1,
                    rounding=None, wire=None) -> None:
    """Fused backward + optimizer: aggregate per row, then update the touched rows
    (``rounding`` as in :func:`apply_updates`, ``wire`` as in :func:`aggregate_grads`).

    The compiled kernels do both in one pass over each table's touched rows: a row's
    gradient is summed into a ``dim``-long buffer and the optimizer applied to the row there
    and then (no ``[rows, dim]`` gradient is written)."""
    configs = per_table_configs(config, layout.num_tables)
    jit = _update_kernels(weights, state, configs)
    dtype, inverse = _gradient_dtype(grad_out, wire)
    if jit is None or dtype != weights.dtype:
        apply_updates(layout, configs, weights, state,
                      aggregate_grads(layout, bags, grad_out, threads, weights, wire),
                      threads=threads, rounding=rounding)
        return
    _check_backward(layout, bags, weights)
    # every table's occurrences first: a bad id raises before any row changes
    segments = _map(_segments_of(layout, bags, grad_out, weights, wire, dtype, inverse),
                    range(layout.num_tables), threads)

    def one(t: int) -> None:
        seg = segments[t]
        if seg is not None:
            _run_segments(jit, None, seg, layout.dims[t], None,
                          _rule(jit, configs[t], layout, weights, state, t, seg[3], dtype))

    _map(one, range(layout.num_tables), threads)


def _rounded_store(layout: TableLayout, weights: np.ndarray, t: int, rounding):
    """``(weight the rule reads, store)`` of table ``t`` for :func:`sparse_update`."""
    view = table_view(layout, weights, t)
    if rounding is None or compute_dtype(weights.dtype) == weights.dtype:
        return view, None
    modes, seeds, step, master, keys = rounding
    mode = modes[t]
    if mode is Rounding.MASTER:
        mview = table_view(layout, master, t)

        def store(rows, new):
            mview[rows] = new
            view[rows] = round_to(new, view.dtype)
        return mview, store
    if mode is Rounding.STOCHASTIC:
        base = layout.row_base[t]

        def store(rows, new):
            hashed = rows if keys is None else keys[base + np.asarray(rows, np.int64)]
            view[rows] = round_to(new, view.dtype, mode, seed=seeds[t], step=step, table=t,
                                  rows=hashed)
        return view, store
    return view, None


def _cat(parts):
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _inverse_lengths(lengths, dtype):
    """``1 / max(length, 1)`` rounded once in ``dtype`` (as the device kernels compute it)."""
    dt = np.dtype(dtype)
    return dt.type(1) / np.maximum(lengths, 1).astype(dt)
