"""CuPy twins of :mod:`embedding.kernels.cpu` (same signatures, CuPy arrays).

Sources come from :mod:`embedding.kernels.cuda_src` and are compiled once per
(dtype, device) with ``cupy.RawModule``. The backward sorts occurrences by
global row key with ``cupy.argsort`` (stable), finds the segments of equal
keys and runs ``segment_update``: one warp per unique row sums the row's
gradient contributions in sorted order and applies the optimizer in
registers — the per-occurrence gradients are never materialised.

Half tables (float16, bfloat16 weights or optimizer state) go to the kernels
as their raw ``uint16`` bits; the kernels compute in float32 and round their
stores as :mod:`embedding.precision` does (``rounding=`` of the update
functions, as in :mod:`embedding.kernels.cpu`).

Results agree with the NumPy twins as :mod:`embedding.kernels.cuda_src` says:
bit for bit for lookups, gradient sums and SGD, except that float32 compute
on the device flushes subnormal inputs and results to zero (CuPy compiles
with ``-ftz=true``).

``wire=`` (a :class:`~embedding.sharding.qcomm.Wire`) builds the module for
its format: the lookup writes the pooled rows encoded (float16 or bfloat16
bits, int8 FUSED8BIT rows) and the backward reads float16 or bfloat16
gradients as received; the rows never exist in the compute dtype in between.
"""
from __future__ import annotations

import numpy as np

from embedding.kernels.cuda_src import MAX_DIM, OPTIMIZER_CODES, ROUNDING_CODES, source_for
from embedding.kernels.layout import (Bags, TableLayout, check_wire_rows, encode_after,
                                      per_table_configs, wire_format, wire_shape)
from embedding.precision import compute_dtype
from neocomm.types import is_half

__all__ = ["pooled_lookup", "aggregate_grads", "apply_updates", "backward_update", "aggregate_rows",
           "available"]

_THREADS = 128          # 4 warps per block
_WARPS_PER_BLOCK = _THREADS // 32
_MAX_BLOCKS = 1 << 20   # grid-stride loops cover the rest
_MODULES: dict = {}
_LAYOUTS: dict = {}


def available() -> tuple[bool, str | None]:
    """``(True, None)`` when CuPy and a CUDA device are usable, else ``(False, reason)``."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return False, f"CuPy is not installed ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no CUDA device"
    except Exception as exc:  # pragma: no cover - depends on the environment
        return False, f"CUDA runtime unusable: {exc}"
    return True, None


def _cp():
    import cupy

    return cupy


def _function(dtype, name: str, state_dtype=None, wire: str | None = None):
    """Kernel ``name`` of the module for weight ``dtype``, float state ``state_dtype``
    (None: the compute dtype) and wire format ``wire`` (:func:`wire_format`; None: none)."""
    cp = _cp()
    sname = None if state_dtype is None else np.dtype(state_dtype).name
    if sname == compute_dtype(dtype).name:
        sname = None
    key = (np.dtype(dtype).name, sname, wire, cp.cuda.Device().id)
    mod = _MODULES.get(key)
    if mod is None:
        mod = cp.RawModule(code=source_for(np.dtype(dtype).name, sname, wire))
        _MODULES[key] = mod
    return mod.get_function(name)


def _bits(arr):
    """``arr`` as the kernels take it: half arrays as their ``uint16`` bits (a view)."""
    return arr.view(_cp().uint16) if is_half(arr.dtype) else arr


def _state_dtype(state: dict | None, weights_dtype):
    """The dtype of the float optimizer state in ``state`` (the compute dtype when none)."""
    for name in ("momentum", "exp_avg", "exp_avg_sq"):
        if state and name in state:
            return state[name].dtype
    return compute_dtype(weights_dtype)


def _blocks(warps: int) -> tuple[int]:
    return (max(1, min((int(warps) + _WARPS_PER_BLOCK - 1) // _WARPS_PER_BLOCK, _MAX_BLOCKS)),)


def _layout_arrays(layout: TableLayout):
    cp = _cp()
    key = (layout, cp.cuda.Device().id)
    arrs = _LAYOUTS.get(key)
    if arrs is None:
        arrs = (cp.asarray(np.asarray(layout.weight_offsets, np.int64)),
                cp.asarray(np.asarray(layout.dims, np.int32)),
                cp.asarray(np.asarray(layout.row_base, np.int64)))
        _LAYOUTS[key] = arrs
    return arrs


def _slot_arrays(bags: Bags):
    cp = _cp()
    return (cp.asarray(np.asarray(bags.slot_table, np.int32)),
            cp.asarray(np.asarray(bags.slot_col, np.int64)),
            cp.asarray(np.asarray(bags.slot_mean, np.int32)),
            cp.asarray(np.asarray(bags.slot_max, np.int32)))


def _per_id(bags: Bags, dtype):
    cp = _cp()
    if bags.weights is None:
        return cp.zeros(1, dtype), np.int32(0)
    return cp.ascontiguousarray(cp.asarray(bags.weights, dtype)), np.int32(1)


def pooled_lookup(layout: TableLayout, weights, bags: Bags, out=None, arg_out=None,
                  wire=None):
    """Device twin of :func:`embedding.kernels.cpu.pooled_lookup` (one launch).

    ``arg_out`` (int64, shaped like ``out``), when given, receives for the
    columns of max slots the index (into ``bags.indices``) of each column's
    first maximum, -1 for empty bags; its other columns are left as they are.
    ``wire``: as in the NumPy twin, the output in the wire format, encoded by
    the kernel (int8 rows of slots wider than ``MAX_DIM`` columns are encoded
    after the launch instead).
    """
    cp = _cp()
    bags.check(layout)
    dtype = compute_dtype(weights.dtype)
    fmt = wire_format(wire)
    if fmt is not None and arg_out is not None:
        raise ValueError("arg_out: the positions of maxima come with a compute-dtype output, "
                         "not with a wire format")
    if fmt == "int8":
        check_wire_rows(layout, bags, wire.row)
        if max((layout.dims[t] for t in bags.slot_table), default=0) > MAX_DIM:
            # int8 rows of slots too wide for the kernel's registers: pool, then encode
            return encode_after(pooled_lookup(layout, weights, bags), wire, out)
    shape, odt = wire_shape(bags, dtype, wire)
    if out is None:
        # half wire buffers are made as their bits, as the codec makes them (qcomm._to_bf16)
        out = cp.empty(shape, np.uint16).view(odt) if is_half(odt) else cp.empty(shape, odt)
    if not out.flags.c_contiguous:
        raise ValueError("out: expected a C-contiguous array")
    if fmt is not None and (tuple(out.shape) != shape or out.dtype != odt):
        raise ValueError(f"out: expected {shape} of {odt} (the wire format), got "
                         f"{tuple(out.shape)} of {out.dtype}")
    covered = sum(layout.dims[t] for t in bags.slot_table)
    if covered != bags.out_dim or len(set(bags.slot_col)) != bags.num_slots:
        out.fill(0)   # zero bits: the wire encoding of zeros too
    n = bags.num_bags
    if n == 0:
        return out
    woff, dims, _ = _layout_arrays(layout)
    st, sc, sm, sx = _slot_arrays(bags)
    idx = cp.ascontiguousarray(cp.asarray(bags.indices, cp.int64))
    off = cp.ascontiguousarray(cp.asarray(bags.offsets, cp.int64))
    pw, has_w = _per_id(bags, dtype)
    has_arg = np.int32(arg_out is not None)
    if arg_out is None:
        arg_out = cp.zeros(1, cp.int64)
    scale = None if fmt is None else wire.scale
    _function(weights.dtype, "pooled_lookup", wire=fmt)(
        _blocks(n), (_THREADS,),
        (_bits(weights), woff, dims, st, sc, sm, sx, idx, off, pw, has_w, np.int64(n),
         np.int32(bags.num_slots), np.int32(bags.batch_size), np.int64(bags.out_dim),
         _bits(out), arg_out, has_arg, dtype.type(1 if scale is None else scale),
         np.int32(scale is not None), np.int32(1 if fmt is None else wire.row)))
    return out


def _check_dims(layout: TableLayout) -> None:
    wide = [d for d in layout.dims if d > MAX_DIM]
    if wide:
        raise ValueError(f"dims: the device backward supports dims up to {MAX_DIM}, got {wide}")


def _segments(keys, row_base):
    """Stable sort of ``keys``; returns ``(order, sorted_keys, seg_start[U+1], seg_table)``."""
    cp = _cp()
    n = keys.size
    order = cp.argsort(keys)
    sk = keys[order]
    flag = cp.empty(n, cp.bool_)
    flag[0] = True
    cp.not_equal(sk[1:], sk[:-1], out=flag[1:])
    starts = cp.flatnonzero(flag).astype(cp.int64)
    seg_start = cp.concatenate([starts, cp.asarray([n], cp.int64)])
    seg_table = (cp.searchsorted(row_base, sk[starts], side="right") - 1).astype(cp.int32)
    return order.astype(cp.int64), sk, seg_start, seg_table


def _opt_args(configs, dtype, state: dict | None, weights, rounding=None):
    """Per-table optimizer arrays, state buffers and rounding arguments of ``segment_update``
    (``dtype``: the compute dtype; ``rounding`` as in :func:`apply_updates`)."""
    cp = _cp()
    dt = np.dtype(dtype).type
    dummy_t = cp.zeros(1, dtype)
    dummy_i = cp.zeros(1, cp.int64)
    if configs is None:
        return (cp.zeros(1, cp.int32), dummy_t, cp.zeros(1, cp.float64), dummy_t, dummy_t,
                dummy_t, dummy_t, dummy_i) + _rounding_args(None, 1)
    dummy_s = _bits(cp.zeros(1, _state_dtype(state, weights.dtype)))
    kinds = np.asarray([OPTIMIZER_CODES[c.kind.value] for c in configs], np.int32)
    hyper = np.asarray([[dt(c.lr), dt(c.eps), dt(c.beta1), dt(1) - dt(c.beta1), dt(c.beta2),
                         dt(1) - dt(c.beta2)] for c in configs], dtype).reshape(-1)
    betas = np.asarray([[c.beta1, c.beta2] for c in configs], np.float64).reshape(-1)
    state = {k: _bits(v) for k, v in (state or {}).items()}
    return (cp.asarray(kinds), cp.asarray(hyper), cp.asarray(betas), _bits(weights),
            state.get("momentum", dummy_s), state.get("exp_avg", dummy_s),
            state.get("exp_avg_sq", dummy_s), state.get("step", dummy_i)
            ) + _rounding_args(rounding, len(configs))


def _rounding_args(rounding, num_tables: int) -> tuple:
    """``(codes, seeds, step, master, row_keys, has_row_keys)`` of ``segment_update``: every
    table nearest when ``rounding`` is None, else from its ``(modes, seeds, step, master,
    keys)``."""
    cp = _cp()
    mask = (1 << 64) - 1
    no_keys = (cp.zeros(1, cp.int64), np.int32(0))
    if rounding is None:
        return (cp.zeros(num_tables, cp.int32), cp.zeros(num_tables, cp.uint64), np.uint64(0),
                cp.zeros(1, cp.float32)) + no_keys
    modes, seeds, step, master, keys = rounding
    codes = np.asarray([ROUNDING_CODES[m.value] for m in modes], np.int32)
    seeds = np.asarray([int(x) & mask for x in seeds], np.uint64)
    return (cp.asarray(codes), cp.asarray(seeds), np.uint64(int(step) & mask),
            cp.zeros(1, cp.float32) if master is None else master) + (
        no_keys if keys is None else (cp.ascontiguousarray(cp.asarray(keys, cp.int64)),
                                      np.int32(1)))


def _run_segments(layout, keys, dtype, grad_source: tuple, mode: int, configs=None,
                  weights=None, state=None, row_terms=None, rounding=None, wire=None):
    """Launch ``segment_update`` over the segments of ``keys``; returns the segment info.

    ``dtype`` is the compute dtype (gradients, sums); mode 1 runs the module
    of ``weights``' and ``state``'s dtypes. ``row_terms`` is ``(terms per
    occurrence, int32 flag per table)`` or None; ``wire`` the format of the
    bags' gradients (:func:`wire_format`)."""
    cp = _cp()
    woff, dims, row_base = _layout_arrays(layout)
    order, sk, seg_start, seg_table = _segments(keys, row_base)
    u = int(seg_start.size - 1)
    if mode == 0:
        seg_dims = dims[seg_table].astype(cp.int64)
        agg_off = cp.zeros(u + 1, cp.int64)
        cp.cumsum(seg_dims, out=agg_off[1:])
        agg = cp.empty(int(agg_off[-1]), dtype)
    else:
        agg_off = cp.zeros(1, cp.int64)
        agg = cp.zeros(1, dtype)
    kernel = (_function(dtype, "segment_update", wire=wire) if mode == 0 else
              _function(weights.dtype, "segment_update", _state_dtype(state, weights.dtype),
                        wire))
    kernel(
        _blocks(u), (_THREADS,),
        (sk, order, seg_start, seg_table, np.int64(u), row_base, woff, dims) + grad_source
        + (row_terms if row_terms is not None
           else (cp.zeros(1, dtype), cp.zeros(layout.num_tables, cp.int32)))
        + (np.int32(mode), agg, agg_off) + _opt_args(configs, dtype, state, weights, rounding))
    return sk, seg_start, seg_table, agg, agg_off


def _bag_source(layout, bags: Bags, grad_out, weights=None, wire=None):
    """Occurrence keys and the ``from_bags`` gradient-source arguments.

    Max slots need the table ``weights`` the lookup read: the lookup runs
    again to find each column's first maximum (the lookup's result is
    discarded; the weights have not changed since it ran). With a float16 or
    bfloat16 ``wire``, ``grad_out`` is in its format and the kernel widens it
    (times ``1 / wire.scale``) as it reads; the compute dtype is then
    ``wire.value_dtype``.
    """
    cp = _cp()
    fmt = wire_format(wire)
    dtype = grad_out.dtype if fmt is None else np.dtype(wire.value_dtype)
    _, _, row_base = _layout_arrays(layout)
    st, sc, sm, sx = _slot_arrays(bags)
    idx = cp.ascontiguousarray(cp.asarray(bags.indices, cp.int64))
    off = cp.ascontiguousarray(cp.asarray(bags.offsets, cp.int64))
    n_occ = int(idx.size)
    keys = cp.empty(n_occ, cp.int64)
    occ_bag = cp.empty(n_occ, cp.int64)
    nb = bags.num_bags
    if n_occ:
        _function(dtype, "occurrence_keys")(
            (max(1, min((nb + _THREADS - 1) // _THREADS, _MAX_BLOCKS)),), (_THREADS,),
            (row_base, st, idx, off, np.int64(nb), np.int32(bags.num_slots),
             np.int32(bags.batch_size), keys, occ_bag))
    pw, has_w = _per_id(bags, dtype)
    grad_out = _bits(cp.ascontiguousarray(grad_out))
    scale = None if fmt is None else wire.scale
    max_arg = cp.zeros(1, cp.int64)
    if bags.any_max and n_occ:
        if weights is None:
            raise ValueError("weights: the gradient of max pooling needs the table weights the "
                             "lookup read")
        max_arg = cp.empty((bags.out_rows, bags.out_dim), cp.int64)
        pooled_lookup(layout, weights, bags, cp.empty((bags.out_rows, bags.out_dim),
                                                      compute_dtype(weights.dtype)), max_arg)
    source = (np.int32(1), grad_out, dtype.type(1 if scale is None else 1.0 / scale),
              np.int32(scale is not None), occ_bag, off, sc, sm, sx, max_arg, pw, has_w,
              np.int32(bags.num_slots), np.int32(bags.batch_size), np.int64(bags.out_dim),
              cp.zeros(1, dtype), cp.zeros(1, cp.int64))
    return keys, source


def _split_tables(layout, sk, seg_start, seg_table, agg, agg_off):
    cp = _cp()
    counts = cp.bincount(seg_table, minlength=layout.num_tables).get()
    first = np.concatenate([[0], np.cumsum(counts)])
    starts = seg_start[:-1]
    agg_off_h = agg_off.get()
    out = []
    for t in range(layout.num_tables):
        a, b = int(first[t]), int(first[t + 1])
        d = layout.dims[t]
        rows = sk[starts[a:b]] - layout.row_base[t]
        grads = agg[int(agg_off_h[a]):int(agg_off_h[a]) + (b - a) * d].reshape(b - a, d)
        out.append((rows, grads))
    return out


def aggregate_grads(layout: TableLayout, bags: Bags, grad_out, weights=None, wire=None):
    """Device twin of :func:`embedding.kernels.cpu.aggregate_grads` (``wire`` as there)."""
    cp = _cp()
    bags.check(layout)
    _check_dims(layout)
    fmt = _grad_format(wire)
    keys, source = _bag_source(layout, bags, grad_out, weights, wire if fmt else None)
    dtype = source[2].dtype
    if keys.size == 0:
        return [(cp.zeros(0, cp.int64), cp.zeros((0, d), dtype)) for d in layout.dims]
    return _split_tables(layout, *_run_segments(layout, keys, dtype, source, 0, wire=fmt))


def backward_update(layout: TableLayout, config, weights, state: dict, bags: Bags,
                    grad_out, rounding=None, wire=None) -> None:
    """Device twin of :func:`embedding.kernels.cpu.backward_update` (fused: sort + one launch;
    ``wire`` as there)."""
    bags.check(layout)
    _check_dims(layout)
    cdt = compute_dtype(weights.dtype)
    fmt = _grad_format(wire)
    if fmt is None:
        keys, source = _bag_source(layout, bags, grad_out.astype(cdt, copy=False), weights)
    else:
        if np.dtype(wire.value_dtype) != cdt:
            raise ValueError(f"wire: gradients decode to {np.dtype(wire.value_dtype)}, the "
                             f"tables compute in {cdt}")
        keys, source = _bag_source(layout, bags, grad_out, weights, wire)
    if keys.size == 0:
        return
    _run_segments(layout, keys, cdt, source, 1, per_table_configs(config, layout.num_tables),
                  weights, state, rounding=rounding, wire=fmt)


def _grad_format(wire):
    """The wire format gradients are read in (float16, bfloat16) or None; ValueError for int8."""
    fmt = wire_format(wire)
    if fmt == "int8":
        raise ValueError("wire: gradients travel in fp32, fp16 or bf16, not int8")
    return fmt


def apply_updates(layout: TableLayout, config, weights, state: dict, sparse,
                  unique: bool = True, row_terms=None, rounding=None) -> None:
    """Device twin of :func:`embedding.kernels.cpu.apply_updates` (duplicates always summed;
    ``rounding`` as there)."""
    cp = _cp()
    _check_dims(layout)
    if len(sparse) != layout.num_tables:
        raise ValueError(f"sparse: expected {layout.num_tables} (rows, grads) pairs, got "
                         f"{len(sparse)}")
    dtype = compute_dtype(weights.dtype)
    keys, flats, row_offs, terms = [], [], [], []
    given = np.zeros(layout.num_tables, np.int32)  # tables whose row terms replace mean(g*g)
    base = 0
    for t, (rows, grads) in enumerate(sparse):
        n = int(len(rows))
        if n == 0:
            continue
        d = layout.dims[t]
        term = None if row_terms is None else row_terms[t]
        given[t] = term is not None
        terms.append(cp.zeros(n, dtype) if term is None else cp.asarray(term, dtype))
        keys.append(cp.asarray(rows, cp.int64) + layout.row_base[t])
        flats.append(cp.asarray(grads, dtype).reshape(-1))
        row_offs.append(base + cp.arange(n, dtype=cp.int64) * d)
        base += n * d
    if not keys:
        return
    keys = cp.concatenate(keys)
    grad_rows = cp.concatenate(flats)
    grad_row_offsets = cp.concatenate(row_offs)
    source = _row_source(dtype, grad_rows, grad_row_offsets)
    terms_arg = (cp.concatenate(terms), cp.asarray(given)) if given.any() else None
    _run_segments(layout, keys, dtype, source, 1, per_table_configs(config, layout.num_tables),
                  weights, state, terms_arg, rounding)


def _row_source(dtype, grad_rows, grad_row_offsets):
    """``segment_update``'s gradient source from flat gradient rows (``from_bags`` 0; the bag
    arguments are unused)."""
    cp = _cp()
    zi, zs, zt = cp.zeros(1, cp.int64), cp.zeros(1, cp.int32), cp.zeros(1, dtype)
    return (np.int32(0), zt, np.dtype(dtype).type(1), np.int32(0), zi, zi, zi, zs, zs, zi, zt,
            np.int32(0), np.int32(1), np.int32(1), np.int64(0), grad_rows, grad_row_offsets)


def aggregate_rows(rows, grads, num_rows: int):
    """Device twin of :func:`embedding.kernels.cpu.aggregate_rows` (rows come out sorted)."""
    cp = _cp()
    rows = cp.asarray(rows, cp.int64)
    grads = cp.ascontiguousarray(grads)
    if rows.size == 0:
        return rows, grads
    d = int(grads.shape[1])
    if d > MAX_DIM:
        raise ValueError(f"grads: the device kernels support dims up to {MAX_DIM}, got {d}")
    layout = TableLayout((int(num_rows),), (d,))
    source = _row_source(grads.dtype, grads.reshape(-1), cp.arange(rows.size, dtype=cp.int64) * d)
    return _split_tables(layout, *_run_segments(layout, rows, grads.dtype, source, 0))[0]
