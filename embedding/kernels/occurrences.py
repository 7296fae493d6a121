"""The CPU backward's occurrences: each table's ids sorted by row with the gradient rows
they read, and the compiled update over them (:func:`~embedding.kernels._jit.segment_update`).

:mod:`embedding.kernels.cpu` builds its backward (``aggregate_grads``, ``apply_updates``,
``backward_update``) on these; they take the same
:class:`~embedding.kernels.layout.TableLayout`, flat buffers and
:class:`~embedding.kernels.layout.Bags`.
"""
from __future__ import annotations

import numpy as np

from embedding.kernels import compiled
from embedding.kernels.layout import Bags, TableLayout, wire_format
from embedding.kernels.segments import jagged_max, segments_of_sorted, stable_argsort
from embedding.types import OptimizerKind

__all__ = ["table_view"]


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


def _none_as_empty(a, dtype):
    """``a``, or an empty array of ``dtype`` for an absent one (compiled kernels take arrays)."""
    return np.empty(0, dtype) if a is None else a


def _bad_id(idx, pos: int, t: int, rows: int, at: bool = True) -> IndexError:
    """The error for id ``idx[pos]`` of local table ``t`` (``at``: name its position)."""
    where = f"indices[{pos}]" if at else "indices"
    return IndexError(f"{where}: id {int(idx[pos])} is out of range for local table {t} "
                      f"({rows} rows)")


def _cat(parts):
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _inverse_lengths(lengths, dtype):
    """``1 / max(length, 1)`` rounded once in ``dtype`` (as the device kernels compute it)."""
    dt = np.dtype(dtype)
    return dt.type(1) / np.maximum(lengths, 1).astype(dt)


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
    idx = np.asarray(bags.indices, np.int64)
    w = _weights_of(bags, dtype)
    jit = compiled.kernels(dtype)
    # the compiled kernels read a sum slot's gradients straight from ``grad_out``
    direct = (jit is not None and fmt is None and grad_out.dtype == dtype
              and grad_out.flags.c_contiguous)

    def one(t: int):
        d = layout.dims[t]
        blocks = [(g, s) for g in range(bags.num_groups) for s in range(s_count)
                  if bags.slot_table[s] == t]
        if not blocks or b == 0:
            return None
        spans = [offsets[(g * s_count + s) * b:(g * s_count + s + 1) * b + 1]
                 for g, s in blocks]
        if all(sp[0] == sp[-1] for sp in spans):
            return None
        if direct and not any(bags.slot_mean[s] or bags.slot_max[s] for _, s in blocks):
            # each occurrence reads its bag's gradient where it lies in ``grad_out``
            width = grad_out.shape[1]
            bag = np.arange(b, dtype=np.int64) * width
            occ = [bag + (g * b * width + bags.slot_col[s]) for g, s in blocks]
            return _sorted(jit, idx, spans, occ, w, t, layout.rows[t], grad_out.reshape(-1))
        gsrc = [np.empty((len(blocks) * b, d), dtype)]
        occ, at = [], len(blocks) * b  # rows of gsrc so far (max slots add one an occurrence)
        for k, ((g, s), sp) in enumerate(zip(blocks, spans)):
            col = bags.slot_col[s]
            ln = np.diff(sp)
            lo, hi = sp[0], sp[-1]
            grad = grad_out[g * b:(g + 1) * b, col:col + d]
            if bags.slot_max[s]:
                if fmt is not None:
                    grad = grad.astype(dtype)
                    if inverse is not None:
                        grad *= inverse
                gsrc.append(_max_occurrence_grads(table_view(layout, weights, t), idx, sp[:-1],
                                                  ln, w, grad, lo, hi))
                # each occurrence a bag of its own, reading its own share
                spans[k] = np.arange(lo, hi + 1, dtype=np.int64)
                occ.append(np.arange(at, at + hi - lo, dtype=np.int64))
                at += hi - lo
                continue
            dst = gsrc[0][k * b:(k + 1) * b]
            dst[...] = grad
            if inverse is not None:
                dst *= inverse
            if bags.slot_mean[s]:
                dst *= _inverse_lengths(ln, dtype)[:, None]
            occ.append(np.arange(k * b, (k + 1) * b, dtype=np.int64))
        gsrc = _cat(gsrc)
        if jit is not None:
            return _sorted(jit, idx, spans, [o * d for o in occ], w, t, layout.rows[t],
                           gsrc.reshape(-1))
        return _sorted_by_numpy(idx, spans, occ, w, t, layout.rows[t], gsrc)

    return one


def _bags_of(spans, occ):
    """``(lo, hi, occ)`` of each bag: ``spans[k]`` are the offsets of a run of bags (``k + 1``
    offsets for ``k`` bags), ``occ[k]`` what each of those bags' occurrences read."""
    return _cat([sp[:-1] for sp in spans]), _cat([sp[1:] for sp in spans]), _cat(occ)


def _sorted(jit, idx, spans, occ, w, t: int, rows: int, src):
    """Table ``t``'s occurrences sorted by row by the compiled kernels, ``(src, occ, ws, uniq,
    starts, lengths)`` (IndexError naming a bad id): the ids of the bags of ``spans`` (offsets
    into ``idx``, :func:`_bags_of`), each occurrence of a bag reading the flat ``src`` at its
    bag's ``occ``; ``w``: per-id weights beside ``idx``, or None."""
    lo, hi, bag_occ = _bags_of(spans, occ)
    n = int((hi - lo).sum())
    if n >= 1 << 31:
        raise ValueError(f"indices: {n} ids of local table {t} in one batch; at most "
                         f"{(1 << 31) - 1} are supported")
    weighted = w is not None
    bad, occ, ws, uniq, starts, lens = jit.sort_by_row(idx, lo, hi, bag_occ, rows,
                                                       _none_as_empty(w, src.dtype), weighted)
    if bad >= 0:
        raise _bad_id(idx, bad, t, rows, at=False)
    return src, occ, ws if weighted else None, uniq, starts, lens


def _sorted_by_numpy(idx, spans, occ, w, t: int, rows: int, gsrc):
    """:func:`_sorted` by NumPy, the reference: ``occ`` counts rows of ``gsrc``
    (``[occurrences' gradient rows, dim]``), as the result's does."""
    lo, hi, bag_occ = _bags_of(spans, occ)
    pos = _cat([np.arange(sp[0], sp[-1], dtype=np.int64) for sp in spans])
    ids = idx[pos]
    if ids.min() < 0 or ids.max() >= rows:
        raise _bad_id(ids, int(np.flatnonzero((ids < 0) | (ids >= rows))[0]), t, rows,
                      at=False)
    order = stable_argsort(ids, rows - 1)
    uniq, starts, lens = segments_of_sorted(ids[order])
    ws = w[pos][order] if w is not None else None
    return gsrc, np.repeat(bag_occ, hi - lo)[order], ws, uniq, starts, lens


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
    """:func:`~embedding.kernels._jit.segment_update` (``update_for``) over a table's sorted
    occurrences ``seg`` (:func:`_segments_of`; ``d`` values per gradient row): into ``out``,
    or (``out`` None) through ``rule`` (:func:`_rule`; ``code`` None: the rule's own;
    ``term``: row-wise AdaGrad's per-row terms)."""
    gsrc, occ, ws, uniq, starts, lens = seg
    kind, weight, mom, ea, es, bc1, bc2, width, lr, eps, b1, b2, a1, a2 = rule
    if code is None:
        code = kind
    dtype = gsrc.dtype
    terms = np.empty(0, dtype) if term is None else np.ascontiguousarray(term)
    jit.update_for(d, dtype)(code, gsrc, d, occ, _none_as_empty(ws, dtype), ws is not None,
                             starts, lens, uniq,
                             out if out is not None else np.empty((0, 0), dtype), weight, mom,
                             ea, es, bc1, bc2, terms, term is not None, width, lr, eps, b1, b2,
                             a1, a2)
