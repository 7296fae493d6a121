"""Weights of a sharded collection: their initialisation, identical under any plan, and copies.

:func:`init_weights` draws element ``(r, c)`` of a table from a counter-based
hash of (seed, table name, element), so every plan (and every rank count)
starts from the same tables; :func:`dynamic_initializer` does the same for
the rows a dynamic table inserts. :func:`assign` copies across array backends.
(:mod:`embedding.collection` re-exports them.)
"""
from __future__ import annotations

import zlib

import numpy as np

from embedding.types import TableConfig

__all__ = ["assign", "init_weights", "dynamic_initializer"]


def assign(dst, src) -> None:
    """``dst[...] = src`` across array backends (a host-resident shard is NumPy on a GPU rank)."""
    if isinstance(dst, np.ndarray):
        dst[...] = src if isinstance(src, np.ndarray) else (
            src.get() if hasattr(src, "get") else np.asarray(src))
    else:
        import cupy

        dst[...] = cupy.asarray(src, dtype=dst.dtype)


# -- initialisation -------------------------------------------------------------
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def init_weights(coll, seed: int = 0) -> None:
    """Uniform ``±sqrt(1/num_rows)`` weights (TorchRec's default), identical for any plan.

    Element ``(r, c)`` of table ``t`` is a counter-based hash of (seed,
    table name, ``r * dim + c``) for the table row ``r`` (a strided shard's
    local row ``i`` is table row ``row_offset + i * row_stride``), so every
    shard computes its own piece and a table reads the same under any sharding (``coll``: a
    :class:`~embedding.collection.ShardedEmbeddingCollection`). A packed
    member's rows get the member's own weights (its name, rows and bound), as unpacked.

    A dynamic table's new id gets the row a fixed table gives row ``id``
    (bound ``sqrt(1/num_rows)`` of its capacity), when the id first comes.
    """
    by_name = {t.name: t for t in coll.tables}
    for s in coll.local_shards():
        pack = next((p for p in coll.plan.packs if p.name == s.table), None)
        if pack is None:
            parts = [(by_name[s.table], slice(None), s.shard)]
        else:  # each member's rows as that table's: the same weights packed or not
            parts = [(by_name[m.table], local, sh) for m, local, sh in pack.parts(s.shard)]
        for table, local, sh in parts:
            if table.dynamic:
                s.tables.set_initializer(s.index, dynamic_initializer(table, seed))
                continue
            w = s.weight[local]
            chunk = max(1, (1 << 20) // max(sh.num_cols, 1))
            for r0 in range(0, sh.num_rows, chunk):
                r1 = min(sh.num_rows, r0 + chunk)
                rows = sh.row_offset + np.arange(r0, r1, dtype=np.int64) * sh.row_stride
                block = _uniform_block(seed, table.name, table.dim, rows, sh.col_offset,
                                       sh.col_offset + sh.num_cols)
                bound = np.sqrt(1.0 / table.num_rows)
                assign(w[r0:r1], (2.0 * block - 1.0) * bound)
    coll.sync_masters()


def dynamic_initializer(table: TableConfig, seed: int = 0):
    """``init(ids) -> [len(ids), dim]`` float64 weights of new ids of dynamic ``table``: the
    counter-based hash of (seed, table name, element) keyed by id, as :func:`init_weights`
    keys a fixed table's by row."""
    bound = np.sqrt(1.0 / table.num_rows)

    def init(ids: np.ndarray) -> np.ndarray:
        return (2.0 * _uniform_block(seed, table.name, table.dim, np.asarray(ids, np.int64), 0,
                                     table.dim) - 1.0) * bound

    return init


def _uniform_block(seed: int, name: str, dim: int, rows: np.ndarray, c0: int, c1: int
                   ) -> np.ndarray:
    """Uniform [0, 1) numbers of the elements of table rows ``rows`` × columns ``[c0, c1)``."""
    salt = np.uint64((zlib.crc32(name.encode()) << 32) ^ (int(seed) & 0xFFFFFFFF))
    idx = (np.asarray(rows).astype(np.uint64)[:, None] * np.uint64(dim)
           + np.arange(c0, c1, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        x = idx ^ salt
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
