"""Loading a checkpoint onto another plan or world size, losing no row.

Every embedding shard (and its optimizer state) was written with a
:class:`~embedding.checkpoint.types.TensorSlice`: which box of the global
tensor it holds. :func:`read_box` assembles any box of a global tensor from
whichever files overlap it, reading only the overlapping part of each file
(memory-mapped), and refuses a box that no file covers entirely. Where files
overlap (a replicated table, per-row state of column shards) the lowest rank
wins. :func:`read_for_plan` does this for every shard a target plan gives to
one rank.

Example: a table of 10 rows written row-wise by 4 ranks as rows [0, 3),
[3, 6), [6, 8), [8, 10) is read for a 3-rank plan as [0, 4), [4, 7),
[7, 10): the second target shard takes row 3-5 from rank 1's file and row 6
from rank 2's.
"""
from __future__ import annotations

import itertools

import numpy as np

from embedding.checkpoint.reader import Checkpoint
from embedding.checkpoint.types import CheckpointError, TensorSlice

__all__ = ["read_box", "read_for_plan", "shard_box", "shard_slice"]


def read_box(ckpt: Checkpoint, table: str, tensor: str, offset, shape) -> np.ndarray:
    """Elements ``[offset, offset + shape)`` of the global tensor ``table/tensor`` (a copy)."""
    offset = tuple(int(x) for x in offset)
    shape = tuple(int(x) for x in shape)
    sources = [r for r in ckpt.manifest.files
               if r.slice is not None and r.slice.table == table and r.slice.tensor == tensor]
    if not sources:
        raise KeyError(f"{table}/{tensor} is not in checkpoint {ckpt.path}")
    sources.sort(key=lambda r: (r.rank, r.path))
    gshape = sources[0].slice.global_shape
    if len(offset) != len(gshape) or len(shape) != len(gshape) or any(
            o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, shape, gshape)):
        raise ValueError(f"offset/shape: box {offset} + {shape} is outside {table}/{tensor} of "
                         f"shape {gshape}")
    lo = offset
    hi = tuple(o + s for o, s in zip(offset, shape))
    boxes = []  # (record, src_lo, src_hi) clipped to the target box
    for rec in sources:
        s_lo = rec.slice.offset
        s_hi = tuple(o + n for o, n in zip(s_lo, rec.shape))
        c_lo = tuple(max(a, b) for a, b in zip(lo, s_lo))
        c_hi = tuple(min(a, b) for a, b in zip(hi, s_hi))
        if all(a < b for a, b in zip(c_lo, c_hi)):
            boxes.append((rec, s_lo, c_lo, c_hi))
    out = np.empty(shape, np.dtype(sources[0].dtype))
    if out.size == 0:
        return out
    # Cut the target box into cells along every source boundary; each cell is
    # covered wholly or not at all by each source, so the first covering
    # source (lowest rank) fills it, and an uncovered cell is a lost region.
    cuts = []
    for d in range(len(shape)):
        pts = {lo[d], hi[d]}
        for _, _, c_lo, c_hi in boxes:
            pts.update((c_lo[d], c_hi[d]))
        cuts.append(sorted(pts))
    arrays = {}
    pending: dict[int, list] = {}
    for cell in itertools.product(*(zip(c[:-1], c[1:]) for c in cuts)):
        for i, (rec, s_lo, c_lo, c_hi) in enumerate(boxes):
            if all(c_lo[d] <= a and b <= c_hi[d] for d, (a, b) in enumerate(cell)):
                pending.setdefault(i, []).append(cell)
                break
        else:
            where = " x ".join(f"[{a}, {b})" for a, b in cell)
            raise CheckpointError(f"{table}/{tensor}: elements {where} are in no file of the "
                                  f"checkpoint (it cannot fill this shard)", path=str(ckpt.path))
    for i, cells in pending.items():
        rec, s_lo, _, _ = boxes[i]
        if i not in arrays:
            arrays[i] = ckpt.open_array(rec)
        src = arrays[i]
        for cell in cells:
            dst_idx = tuple(slice(a - o, b - o) for (a, b), o in zip(cell, lo))
            src_idx = tuple(slice(a - o, b - o) for (a, b), o in zip(cell, s_lo))
            out[dst_idx] = src[src_idx]
    return out


def shard_box(shard, global_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of a plan :class:`~embedding.types.Shard` in a ``global_shape`` tensor.

    2-D tensors (weights, per-element state) take rows and columns; 1-D
    tensors (per-row state) take the shard's rows.
    """
    if len(global_shape) == 2:
        return (shard.row_offset, shard.col_offset), (shard.num_rows, shard.num_cols)
    if len(global_shape) == 1:
        return (shard.row_offset,), (shard.num_rows,)
    raise ValueError(f"global_shape: expected a 1-D or 2-D tensor, got {global_shape}")


def shard_slice(table: str, tensor: str, shard, global_shape) -> TensorSlice:
    """The :class:`TensorSlice` to save a plan shard's part of ``table/tensor`` with.

    ``global_shape`` is ``(num_rows, dim)`` for weights and per-element
    state, ``(num_rows,)`` for per-row state; the saved array must be the
    shard's box of it (:func:`shard_box`).
    """
    off, _ = shard_box(shard, tuple(global_shape))
    return TensorSlice(table, tensor, off, tuple(global_shape))


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
                off, shape = shard_box(shard, gshape)
                out[(tp.table, name, i)] = read_box(ckpt, tp.table, name, off, shape)
    return out
