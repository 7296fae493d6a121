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
from embedding.kernels.occurrences import (_bad_id, _compiled_update, _inverse_lengths,
                                           _no_rule, _none_as_empty, _rule, _run_segments,
                                           _segments_of, _update_kernels, _weights_of,
                                           table_view)
from embedding.kernels.pool import run_all as _map
from embedding.kernels.segments import (jagged_max, jagged_sum, jagged_sum_permuted,
                                        segments_of_sorted, stable_argsort)
from embedding.optim import sparse_update
from embedding.precision import Rounding, compute_dtype, round_to

__all__ = ["pooled_lookup", "aggregate_grads", "apply_updates", "backward_update",
           "aggregate_rows", "table_view"]


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
        lo, hi = int(offsets[first]), int(offsets[first + b])
        ids = idx[lo:hi]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= layout.rows[t]):
            # as the compiled kernels do: NumPy would wrap a negative id to a row from the end
            raise _bad_id(idx, lo + int(np.flatnonzero((ids < 0) | (ids >= layout.rows[t]))[0]),
                          t, layout.rows[t])
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
        kernel = jit.pool_sum_rows(table, target) or jit.for_dim(d).pool_sum
        bad = kernel(table, idx, offsets, wv, w is not None, inv, mean, target, at, col)
    if bad >= 0:
        raise _bad_id(idx, bad, t, table.shape[0])
    if fmt is not None:
        _encode_block(target, out, r0, c0, fmt, wire)
    elif not direct:
        out[r0:r0 + b, c0:c0 + d] = target


_NO_ARG = np.empty((0, 0), np.int64)


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


