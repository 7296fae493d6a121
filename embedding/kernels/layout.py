"""Layouts shared by the fused kernels: packed tables and bags of ids.

A :class:`TableLayout` packs several tables (each ``rows × dim``, any mix
of dims) into one flat buffer: table ``t`` occupies elements
``[weight_offset[t], weight_offset[t] + rows[t] * dim[t])`` in row-major
order, and its rows are numbered ``row_base[t] + row`` in the global row
space that per-row optimizer state uses. This is the table-offset scheme
that lets one kernel launch serve every local table.

:class:`Bags` is the input of a lookup: ``G`` groups (e.g. the source ranks
of an AlltoAll) × ``S`` slots (a slot is one feature read through one
table) × ``B`` bags, bag ``i = (g * S + s) * B + b`` holding ids
``indices[offsets[i]:offsets[i + 1]]``. Its pooled row lands in output row
``g * B + b`` at columns ``[slot_col[s], slot_col[s] + dim[slot_table[s]])``.

A lookup may write its output, and a backward read the output's gradient,
in a communication *wire* format (a :class:`~embedding.sharding.qcomm.Wire`:
``dtype``, ``value_dtype``, ``row``, ``scale``): :func:`wire_format` names it
and :func:`wire_shape` gives the output's shape in it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["TableLayout", "Bags", "SUPPORTED_DTYPES", "per_table_configs", "host_array",
           "wire_format", "wire_shape", "check_wire_rows", "encode_after"]

#: Weight dtypes of the kernels (the CUDA sources are generated for each).
SUPPORTED_DTYPES = ("float32", "float64")


def host_array(arr) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy or CuPy array (a device array is copied off)."""
    return arr if isinstance(arr, np.ndarray) else arr.get()


def wire_format(wire) -> str | None:
    """The storage a wire codec moves values in: ``"float16"``, ``"bfloat16"`` or ``"int8"``
    (FUSED8BIT rows of ``wire.row`` values); None for no codec or one that moves values as
    they are (fp32)."""
    if wire is None or getattr(wire, "identity", False):
        return None
    dt = np.dtype(wire.dtype)
    if dt == np.uint8:
        return "int8"
    if dt.name in ("float16", "bfloat16"):
        return dt.name
    raise ValueError(f"wire: expected a float16, bfloat16 or int8 (uint8) codec, got {dt}")


def wire_shape(bags: "Bags", dtype, wire) -> tuple[tuple[int, int], np.dtype]:
    """``(shape, dtype)`` of a lookup's output of ``bags`` in ``wire``'s format (``dtype``, the
    compute dtype, when there is none): ``[G * B, out_dim]``, or ``[G * B, out_dim / row *
    (row + 8)]`` uint8 for int8 rows."""
    fmt = wire_format(wire)
    if fmt is None:
        return (bags.out_rows, bags.out_dim), np.dtype(dtype)
    return (bags.out_rows, int(wire.count(bags.out_dim))), np.dtype(wire.dtype)


def encode_after(pooled, wire, out=None):
    """``pooled`` (``[rows, cols]``) in ``wire``'s format (``[rows, wire.count(cols)]``),
    into ``out`` when given: the second pass over the rows a lookup makes when its kernel
    cannot encode."""
    rows = wire.encode(pooled.reshape(-1)).reshape(pooled.shape[0], -1)
    if out is None:
        return rows
    out[...] = rows
    return out


def check_wire_rows(layout: "TableLayout", bags: "Bags", row: int) -> None:
    """ValueError unless int8 rows of ``row`` values tile ``out_dim`` and every slot's columns
    (an int8 row never straddles two slots)."""
    bad = [s for s, (t, c) in enumerate(zip(bags.slot_table, bags.slot_col))
           if c % row or layout.dims[t] % row]
    if row < 1 or bags.out_dim % row or bad:
        raise ValueError(f"wire.row: int8 rows of {row} values must divide out_dim "
                         f"({bags.out_dim}) and every slot's column and dim; "
                         f"slots {bad[:4]} do not fit")


def per_table_configs(optimizer, num_tables: int) -> tuple:
    """One :class:`~embedding.types.OptimizerConfig` per table from one config or a sequence."""
    from embedding.types import OptimizerConfig

    if isinstance(optimizer, OptimizerConfig):
        return (optimizer,) * num_tables
    configs = tuple(optimizer)
    if len(configs) != num_tables or not all(isinstance(c, OptimizerConfig) for c in configs):
        raise TypeError(f"optimizer: expected an OptimizerConfig or {num_tables} of them, got "
                        f"{optimizer!r}")
    return configs


@dataclass(frozen=True)
class TableLayout:
    """Tables of ``rows[t] × dims[t]`` packed in one flat buffer (see module doc).

    A table may have zero rows (a row-wise shard that holds no rows); no id
    may then address it.
    """

    rows: tuple[int, ...]
    dims: tuple[int, ...]

    def __post_init__(self):
        rows = tuple(int(r) for r in self.rows)
        dims = tuple(int(d) for d in self.dims)
        if len(rows) != len(dims):
            raise ValueError(f"dims: expected one dim per table ({len(rows)}), got {len(dims)}")
        for t, (r, d) in enumerate(zip(rows, dims)):
            if r < 0 or d <= 0:
                raise ValueError(f"rows/dims of table {t}: expected rows >= 0 and dim > 0, "
                                 f"got {r} x {d}")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "dims", dims)

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @cached_property
    def row_base(self) -> tuple[int, ...]:
        """First global row of each table."""
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.rows)[:-1]]))

    @cached_property
    def weight_offsets(self) -> tuple[int, ...]:
        """First flat element of each table."""
        sizes = [r * d for r, d in zip(self.rows, self.dims)]
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))

    @cached_property
    def total_rows(self) -> int:
        return int(sum(self.rows))

    @cached_property
    def total_elements(self) -> int:
        return int(sum(r * d for r, d in zip(self.rows, self.dims)))


@dataclass(frozen=True, eq=False)
class Bags:
    """Bags of ids to pool over a :class:`TableLayout` (see module doc).

    ``weights`` are optional per-id weights (one per index). ``slot_mean[s]``
    divides slot ``s``'s pooled rows by their bag length; ``slot_max[s]``
    pools slot ``s`` by the maximum of each column instead of the sum (of the
    weighted rows; the gradient of a column goes to the bag's first id
    holding its maximum). Empty bags give zeros. ``slot_max`` may be left
    empty (no max slot). Arrays are NumPy or CuPy, matching the kernels that
    read them.
    """

    indices: object
    offsets: object
    slot_table: tuple[int, ...]
    slot_col: tuple[int, ...]
    slot_mean: tuple[bool, ...]
    batch_size: int
    out_dim: int
    num_groups: int = 1
    weights: object = None
    slot_max: tuple[bool, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "slot_table", tuple(int(t) for t in self.slot_table))
        object.__setattr__(self, "slot_col", tuple(int(c) for c in self.slot_col))
        object.__setattr__(self, "slot_mean", tuple(bool(m) for m in self.slot_mean))
        s = len(self.slot_table)
        object.__setattr__(self, "slot_max", tuple(bool(m) for m in self.slot_max)
                           or (False,) * s)
        if len(self.slot_col) != s or len(self.slot_mean) != s or len(self.slot_max) != s:
            raise ValueError(f"slot_col/slot_mean/slot_max: expected {s} entries each, got "
                             f"{len(self.slot_col)}, {len(self.slot_mean)} and "
                             f"{len(self.slot_max)}")
        both = [i for i in range(s) if self.slot_mean[i] and self.slot_max[i]]
        if both:
            raise ValueError(f"slot_mean/slot_max: slot {both[0]} cannot pool by both mean and "
                             f"max")
        if int(self.batch_size) < 0 or int(self.num_groups) < 0:
            raise ValueError(f"batch_size/num_groups: expected >= 0, got {self.batch_size} and "
                             f"{self.num_groups}")
        expected = self.num_bags + 1
        if len(self.offsets) != expected:
            raise ValueError(f"offsets: expected num_groups*slots*batch_size + 1 = {expected} "
                             f"entries, got {len(self.offsets)}")
        if self.weights is not None and len(self.weights) != len(self.indices):
            raise ValueError(f"weights: expected one per index ({len(self.indices)}), got "
                             f"{len(self.weights)}")

    @classmethod
    def pooling_flags(cls, poolings) -> dict:
        """``slot_mean`` and ``slot_max`` (as keyword arguments) of one pooling per slot."""
        from embedding.types import Pooling

        poolings = tuple(poolings)
        return {"slot_mean": tuple(p is Pooling.MEAN for p in poolings),
                "slot_max": tuple(p is Pooling.MAX for p in poolings)}

    def table_of_ids(self) -> np.ndarray:
        """The table each of ``indices`` reads (host int64 array, one entry per id)."""
        if not self.num_bags:
            return np.zeros(0, np.int64)
        offsets = np.asarray(host_array(self.offsets), np.int64)
        # the ids of block (group, slot) are one run, read through the slot's table
        per_block = np.diff(offsets[::self.batch_size])
        block_table = np.tile(np.asarray(self.slot_table, np.int64), self.num_groups)
        return np.repeat(block_table, per_block)

    @property
    def any_max(self) -> bool:
        return any(self.slot_max)

    @property
    def num_slots(self) -> int:
        return len(self.slot_table)

    @property
    def num_bags(self) -> int:
        return int(self.num_groups) * len(self.slot_table) * int(self.batch_size)

    @property
    def out_rows(self) -> int:
        return int(self.num_groups) * int(self.batch_size)

    def check(self, layout: TableLayout) -> None:
        """ValueError when slots name unknown tables or overflow ``out_dim``."""
        for s, (t, c) in enumerate(zip(self.slot_table, self.slot_col)):
            if not 0 <= t < layout.num_tables:
                raise ValueError(f"slot_table[{s}]: expected a table in [0, "
                                 f"{layout.num_tables}), got {t}")
            if c < 0 or c + layout.dims[t] > self.out_dim:
                raise ValueError(f"slot_col[{s}]: columns [{c}, {c + layout.dims[t]}) do not "
                                 f"fit out_dim {self.out_dim}")
