"""Loading a checkpoint onto another plan or world size, losing no row.

Every embedding shard (and its optimizer state) was written with a
:class:`~embedding.checkpoint.types.TensorSlice`: which elements of the
global tensor it holds (a box, strided along rows for a cyclic row-wise
shard). :func:`read_box` assembles any (strided) box of a global tensor
from whichever files hold its elements, reading only those elements of
each file (memory-mapped), and refuses a box that no file covers entirely.
Where files overlap (a replicated table, per-row state of column shards)
the lowest rank wins. :func:`read_for_plan` does this for every shard a
target plan gives to one rank.

Example: a table of 10 rows written row-wise by 4 ranks as rows [0, 3),
[3, 6), [6, 8), [8, 10) is read for a 3-rank plan as [0, 4), [4, 7),
[7, 10): the second target shard takes row 3-5 from rank 1's file and row 6
from rank 2's. Read for a 2-rank cyclic plan, rank 1's shard (rows 1, 3, 5,
7, 9) takes rows 1 from rank 0's file, 3 and 5 from rank 1's, 7 from rank
2's and 9 from rank 3's.
"""
from __future__ import annotations

import itertools

import numpy as np

from embedding.checkpoint.reader import Checkpoint
from embedding.checkpoint.types import CheckpointError, TensorSlice

__all__ = ["read_box", "read_for_plan", "shard_box", "shard_slice"]

#: Target rows assembled at a time (bounds the index arrays of a strided read).
_ROW_CHUNK = 1 << 18
#: Below this many runs of coordinates held by the same files, classes are found by runs.
_FEW_RUNS = 64


def read_box(ckpt: Checkpoint, table: str, tensor: str, offset, shape, stride=None
             ) -> np.ndarray:
    """Elements ``offset + i * stride`` (per dimension, ``i < shape``) of the global tensor
    ``table/tensor`` (a copy); ``stride`` defaults to all ones (a box)."""
    offset = tuple(int(x) for x in offset)
    shape = tuple(int(x) for x in shape)
    sources = [r for r in ckpt.manifest.files
               if r.slice is not None and r.slice.table == table and r.slice.tensor == tensor]
    if not sources:
        raise KeyError(f"{table}/{tensor} is not in checkpoint {ckpt.path}")
    sources.sort(key=lambda r: (r.rank, r.path))
    gshape = sources[0].slice.global_shape
    stride = (1,) * len(gshape) if stride is None else tuple(int(x) for x in stride)
    if len(stride) != len(gshape) or any(st < 1 for st in stride):
        raise ValueError(f"stride: expected {len(gshape)} steps >= 1 for {table}/{tensor} of "
                         f"shape {gshape}, got {stride}")
    if len(offset) != len(gshape) or len(shape) != len(gshape) or any(
            o < 0 or n < 0 or (n and o + (n - 1) * st >= g)
            for o, n, st, g in zip(offset, shape, stride, gshape)):
        step = f" with stride {stride}" if any(st != 1 for st in stride) else ""
        raise ValueError(f"offset/shape: box {offset} + {shape}{step} is outside "
                         f"{table}/{tensor} of shape {gshape}")
    out = np.empty(shape, np.dtype(sources[0].dtype))
    if out.size == 0:
        return out
    arrays: dict[int, np.ndarray] = {}
    # Along rows in chunks, so that the index arrays stay small for any table.
    for r0 in range(0, shape[0], _ROW_CHUNK):
        r1 = min(shape[0], r0 + _ROW_CHUNK)
        lo = (offset[0] + r0 * stride[0],) + offset[1:]
        _fill(ckpt, f"{table}/{tensor}", sources, arrays, out[r0:r1], lo, stride)
    return out


def _fill(ckpt: Checkpoint, what: str, sources, arrays: dict, out: np.ndarray, offset,
          stride) -> None:
    """Fill ``out`` with the global elements ``offset + i * stride`` from ``sources``.

    Along each dimension the target coordinates fall into classes by the set
    of sources holding them; every combination of classes (a cell) is held
    wholly by each source of the intersection of their sets, or by none. The
    lowest of them fills the cell; a cell no source holds is lost.
    """
    coords = [o + np.arange(n, dtype=np.int64) * st
              for o, n, st in zip(offset, out.shape, stride)]
    span = [(int(c[0]), int(c[-1])) for c in coords]
    held, masks = [], []   # sources holding some target element; per dimension, which
    for i, rec in enumerate(sources):
        sl = rec.slice
        last = [o + (n - 1) * st for o, n, st in zip(sl.offset, rec.shape, sl.stride)]
        if any(n == 0 for n in rec.shape) or any(
                f > b or la < a for f, la, (a, b) in zip(sl.offset, last, span)):
            continue
        mask = []
        for c, o, n, st in zip(coords, sl.offset, rec.shape, sl.stride):
            if st == 1:
                mask.append((c >= o) & (c < o + n))
            else:
                q, r = np.divmod(c - o, st)
                mask.append((c >= o) & (r == 0) & (q < n))
        if all(m.any() for m in mask):
            held.append(i)
            masks.append(mask)
    if not held:
        raise _lost(ckpt, what, coords)
    classes = [_classes(np.stack([m[d] for m in masks], axis=1)) for d in range(out.ndim)]
    for cell in itertools.product(*classes):
        holders = np.logical_and.reduce([has for _, has in cell])
        if not holders.any():
            raise _lost(ckpt, what, [c[pos] for c, (pos, _) in zip(coords, cell)])
        i = held[int(np.argmax(holders))]
        sl = sources[i].slice
        if i not in arrays:
            arrays[i] = ckpt.open_array(sources[i])
        dst = _index([_step(pos) for pos, _ in cell])
        src = _index([_step((c[pos] - o) // st) for c, (pos, _), o, st
                      in zip(coords, cell, sl.offset, sl.stride)])
        out[dst] = arrays[i][src]


def _classes(sig: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows of the boolean ``sig`` [coordinates, sources] grouped by equal rows:
    ``[(positions, the row)]``, positions ascending."""
    starts = np.flatnonzero(np.any(sig[1:] != sig[:-1], axis=1)) + 1
    if len(starts) < _FEW_RUNS:  # a few runs of equal rows (contiguous files): no sort
        runs: dict[bytes, list] = {}
        for a, b in zip(np.r_[0, starts], np.r_[starts, len(sig)]):
            runs.setdefault(sig[a].tobytes(), []).append(np.arange(a, b))
        return [(np.concatenate(r), sig[r[0][0]]) for r in runs.values()]
    if sig.shape[1] < 63:  # one bit per file
        keys = sig.astype(np.int64) @ (np.int64(1) << np.arange(sig.shape[1], dtype=np.int64))
    else:
        packed = np.ascontiguousarray(np.packbits(sig, axis=1))
        keys = packed.view(np.dtype((np.void, packed.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1).astype(np.int16 if len(first) < (1 << 15) else np.int64)
    order = np.argsort(inverse, kind="stable")  # a radix sort of small class numbers
    ends = np.cumsum(np.bincount(inverse, minlength=len(first)))
    return [(order[e - n:e], sig[first[k]])
            for k, (e, n) in enumerate(zip(ends, np.diff(ends, prepend=0)))]


def _lost(ckpt: Checkpoint, what: str, coords) -> CheckpointError:
    where = " x ".join(_describe(c) for c in coords)
    return CheckpointError(f"{what}: elements {where} are in no file of the checkpoint (it "
                           f"cannot fill this shard)", path=str(ckpt.path))


def _step(idx: np.ndarray):
    """``idx`` as a slice when it is an arithmetic progression (a view, no gather)."""
    if len(idx) == 1:
        return slice(int(idx[0]), int(idx[0]) + 1)
    step = int(idx[1] - idx[0])
    if step > 0 and np.all(np.diff(idx) == step):
        return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return idx


def _index(parts: list):
    """One index of per-dimension slices or arrays (an open mesh when two or more are arrays)."""
    if sum(not isinstance(p, slice) for p in parts) < 2:
        return tuple(parts)
    return np.ix_(*[np.arange(p.start, p.stop, p.step or 1) if isinstance(p, slice) else p
                    for p in parts])


def _describe(coords: np.ndarray) -> str:
    """``[a, b)`` for a run of coordinates, ``[a, b) step s`` or a list for others."""
    step = _step(coords)
    if isinstance(step, slice):
        return f"[{step.start}, {step.stop})" + (f" step {step.step}" if step.step not in
                                                   (None, 1) else "")
    shown = ", ".join(str(int(x)) for x in coords[:4])
    return f"{{{shown}{', …' if len(coords) > 4 else ''}}} ({len(coords)} indices)"


def shard_box(shard, global_shape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape, stride)`` of a plan :class:`~embedding.types.Shard` in a
    ``global_shape`` tensor.

    2-D tensors (weights, per-element state) take rows and columns; 1-D
    tensors (per-row state) take the shard's rows. The row stride is the
    shard's ``row_stride`` (1 unless cyclic row-wise).
    """
    if len(global_shape) == 2:
        return ((shard.row_offset, shard.col_offset), (shard.num_rows, shard.num_cols),
                (shard.row_stride, 1))
    if len(global_shape) == 1:
        return (shard.row_offset,), (shard.num_rows,), (shard.row_stride,)
    raise ValueError(f"global_shape: expected a 1-D or 2-D tensor, got {global_shape}")


def shard_slice(table: str, tensor: str, shard, global_shape) -> TensorSlice:
    """The :class:`TensorSlice` to save a plan shard's part of ``table/tensor`` with.

    ``global_shape`` is ``(num_rows, dim)`` for weights and per-element
    state, ``(num_rows,)`` for per-row state; the saved array must be the
    shard's box of it (:func:`shard_box`).
    """
    off, _, stride = shard_box(shard, tuple(global_shape))
    return TensorSlice(table, tensor, off, tuple(global_shape), stride)


def read_for_plan(ckpt: Checkpoint, plan, rank: int, tensors=None
                  ) -> dict[tuple[str, str, int], np.ndarray]:
    """Every shard that ``plan`` (a :class:`~embedding.types.ShardingPlan`) gives ``rank``.

    Returns ``{(table, tensor, shard_index): array}`` where ``shard_index``
    indexes ``plan.table(table).shards``; ``tensors`` limits which tensors
    are read (default: every tensor the checkpoint holds for the table, the
    weight and its optimizer state).
    """
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank: expected 0 <= rank < {plan.world_size}, got {rank}")
    available = ckpt.tensors()
    out = {}
    for tp in plan.tables:
        names = [t for (tab, t) in available if tab == tp.table]
        if not names:
            raise CheckpointError(f"table {tp.table!r} of the plan is not in the checkpoint",
                                  path=str(ckpt.path))
        if tensors is not None:
            missing = [t for t in tensors if t not in names]
            if missing:
                raise CheckpointError(f"table {tp.table!r}: tensors {missing} are not in the "
                                      f"checkpoint (it has {sorted(names)})", path=str(ckpt.path))
            names = list(tensors)
        for i, shard in enumerate(tp.shards):
            if shard.rank != rank:
                continue
            for name in names:
                gshape = available[(tp.table, name)][0]
                out[(tp.table, name, i)] = read_box(ckpt, tp.table, name,
                                                    *shard_box(shard, gshape))
    return out
