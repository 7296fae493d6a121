"""Named sets of embedding tables: one registry for the planner and the trainer.

:data:`TABLE_SETS` holds the Criteo-shaped sets: 26 tables named after the
categorical features they serve, ``C1``..``C26`` (the trainer's feature
names), one id per sample each. ``synthetic-N`` adds N synthetic tables of
mixed sizes, dims and pooling, for the planner only.

=======================  ==============  ========================================
name                     rows in all     rows per table
=======================  ==============  ========================================
``criteo-1tb``           187,767,399     MLPerf DLRM on Criteo 1TB, ids capped at 40M
``criteo-1tb-uncapped``  882,000,000     the same without the cap (partly made up)
``criteo-1tb-100x``      1,886,835       ``ceil(n / 100)``, no table below ``min(n, 1000)``
``criteo-1tb-1000x``     199,028         ``ceil(n / 1000)``, no table below ``min(n, 1000)``
``tiny``                 3,469           ``ceil(n / 100000)``, no table below ``min(n, 100)``
``synthetic-N``          (varies)        N tables ``t0000``.. (:func:`synthetic`)
``neo-model-a|f|i``      (varies)        Neo's DLRM workloads (:mod:`embedding.neo`)
=======================  ==============  ========================================

``preset(name, dim=...)`` gives the planner its :class:`TableConfig` list
(dim 128 unless told), ``preset_pooling(name)`` the mean ids per sample
(none for the Criteo sets: one each), and ``table_rows(name)`` the trainer
its rows per feature. This module imports nothing of :mod:`embedding.data`, which imports it.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from embedding.types import OptimizerConfig, TableConfig, positive_arg

__all__ = ["TableSet", "TABLE_SETS", "table_set", "table_rows", "preset", "preset_names",
           "preset_pooling", "trainer_preset_names", "synthetic", "synthetic_pooling",
           "scale_table_sizes", "CRITEO_FEATURES", "CRITEO_1TB_ROWS",
           "CRITEO_1TB_UNCAPPED_ROWS", "DEFAULT_DIM", "NEO_SETS"]

#: Dimension of a set's tables when neither the set nor the caller gives one
#: (MLPerf DLRM's on Criteo 1TB), elements.
DEFAULT_DIM = 128

#: Names of the 26 Criteo categorical features, in order; a Criteo-shaped
#: set's tables carry them (the trainer's ``embedding.data.types.SPARSE_NAMES``).
CRITEO_FEATURES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))

#: Rows of the 26 tables of MLPerf DLRM on Criteo 1TB, ids capped at 40M, in
#: feature order C1..C26 (public: the MLPerf training reference).
CRITEO_1TB_ROWS: tuple[int, ...] = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
    2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771,
    25641295, 39664984, 585935, 12972, 108, 36)

#: Rows of the 26 features without the cap, 882,000,000 in all.
#:
#: Public (NVIDIA's TensorFlow2 DLRM, frequency threshold 0): 882M
#: categories in all, the largest feature 292,775,614 rows, 113B
#: parameters, 421 GiB at dim 128 in float32. Made up: which feature is the
#: largest (``C20``, the largest capped one) and the rows of the other three
#: features that the cap cut (``C1`` 187,000,000, ``C10`` 158,519,099,
#: ``C22`` 214,000,000), chosen to keep their capped order and to bring the
#: total to exactly 882,000,000 rows (420.6 GiB at dim 128; the largest table
#: 139.6 GiB). The other 22 features are below the cap and keep their MLPerf
#: cardinalities.
CRITEO_1TB_UNCAPPED_ROWS: tuple[int, ...] = (
    187000000, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 158519099,
    2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 292775614,
    25641295, 214000000, 585935, 12972, 108, 36)


def scale_table_sizes(sizes, *, scale: float = 1.0, cap: int | None = None,
                      min_rows: int = 1000) -> tuple[int, ...]:
    """Shrink table sizes to fit a machine: ``ceil(n / scale)``, at most ``cap``.

    A table is never shrunk below ``min(n, min_rows)`` rows, so the small
    tables (3, 4, 10 rows …) keep their exact size.
    """
    if scale < 1:
        raise ValueError(f"scale: expected >= 1, got {scale}")
    if cap is not None and cap <= 0:
        raise ValueError(f"cap: expected > 0, got {cap}")
    out = []
    for n in sizes:
        m = max(math.ceil(n / scale), min(n, min_rows))
        out.append(int(min(m, cap) if cap is not None else m))
    return tuple(out)


@dataclass(frozen=True)
class TableSet:
    """A named set of tables: ``rows[i]`` rows for the table ``names[i]``.

    ``dims`` are the set's own dimensions (empty: :data:`DEFAULT_DIM` for
    every table); ``ids_per_sample`` the mean ids per sample of each table
    (empty: one each); ``dtype`` the element type of every table's rows and
    ``optimizer`` its sparse optimizer (an :class:`~embedding.types.OptimizerKind`
    value). ``trainable`` says whether ``neocomm train`` can train the set: one
    table per Criteo feature, one id per sample, float32 rows and the default
    optimizer (the trainer's config sets its own).
    """

    name: str
    rows: tuple[int, ...]
    names: tuple[str, ...] = CRITEO_FEATURES
    dims: tuple[int, ...] = ()
    ids_per_sample: tuple[float, ...] = ()
    summary: str = ""
    dtype: str = "float32"
    optimizer: str = "sgd"

    def __post_init__(self):
        if len(self.names) != len(self.rows):
            raise ValueError(f"names: expected one per table ({len(self.rows)}), got "
                             f"{len(self.names)}")
        for key in ("dims", "ids_per_sample"):
            if getattr(self, key) and len(getattr(self, key)) != len(self.rows):
                raise ValueError(f"{key}: expected none or one per table ({len(self.rows)}), "
                                 f"got {len(getattr(self, key))}")

    @property
    def trainable(self) -> bool:
        """One table per Criteo feature, one id per sample: what the trainer reads."""
        return self.names == CRITEO_FEATURES and not self.ids_per_sample and \
            self.dtype == "float32" and self.optimizer == "sgd"

    def tables(self, dim: int | None = None) -> list[TableConfig]:
        """The set's tables, every one ``dim`` wide when given (else the set's dims)."""
        if dim is not None:
            positive_arg("dim", dim, int)
        dims = (dim,) * len(self.rows) if dim is not None else (
            self.dims or (DEFAULT_DIM,) * len(self.rows))
        optimizer = OptimizerConfig(kind=self.optimizer)
        return [TableConfig(name=t, num_rows=n, dim=d, dtype=self.dtype, optimizer=optimizer)
                for t, n, d in zip(self.names, self.rows, dims)]

    def pooling(self) -> dict[str, float]:
        """Mean ids per sample per table (empty when every table reads one id per sample)."""
        return dict(zip(self.names, self.ids_per_sample))


#: name -> table set: every fixed set, all Criteo-shaped (``synthetic-N`` is
#: made on demand by :func:`table_set`).
TABLE_SETS: dict[str, TableSet] = {s.name: s for s in (
    TableSet("criteo-1tb", CRITEO_1TB_ROWS,
             summary="MLPerf DLRM's 26 Criteo 1TB tables (ids capped at 40M)"),
    TableSet("criteo-1tb-uncapped", CRITEO_1TB_UNCAPPED_ROWS,
             summary="the 26 Criteo 1TB tables without the 40M cap"),
    TableSet("criteo-1tb-100x", scale_table_sizes(CRITEO_1TB_ROWS, scale=100),
             summary="criteo-1tb with ceil(n / 100) rows, no table below min(n, 1000)"),
    TableSet("criteo-1tb-1000x", scale_table_sizes(CRITEO_1TB_ROWS, scale=1000),
             summary="criteo-1tb with ceil(n / 1000) rows, no table below min(n, 1000)"),
    TableSet("tiny", scale_table_sizes(CRITEO_1TB_ROWS, scale=1e5, min_rows=100),
             summary="criteo-1tb with ceil(n / 100000) rows, no table below min(n, 100)"),
)}


def synthetic(num_tables: int, *, seed: int = 0, dims: tuple[int, ...] = (32, 64, 128),
              min_rows: int = 100, max_rows: int = 20_000_000) -> list[TableConfig]:
    """``num_tables`` tables with log-uniform rows in ``[min_rows, max_rows]``
    and dims drawn from ``dims`` (deterministic for a seed); a stand-in for a
    production model's many tables of very different sizes. Their pooling
    factors are :func:`synthetic_pooling`."""
    _check_count(num_tables)
    rng = random.Random(seed)
    lo, hi = float(min_rows), float(max_rows)
    out = []
    for i in range(num_tables):
        rows = int(round(lo * (hi / lo) ** rng.random()))
        out.append(TableConfig(name=f"t{i:04d}", num_rows=rows, dim=rng.choice(dims)))
    return out


def synthetic_pooling(num_tables: int, *, seed: int = 0, most: float = 100.0) -> dict[str, float]:
    """Mean ids per sample of the tables of :func:`synthetic`: log-uniform in
    ``[1, most]`` (one-hot features next to multi-hot ones such as histories),
    drawn from a stream of its own so the tables do not change with it."""
    _check_count(num_tables)
    rng = random.Random(f"pooling-{seed}")
    return {f"t{i:04d}": round(most ** rng.random(), 2) for i in range(num_tables)}


def _check_count(num_tables) -> None:
    if isinstance(num_tables, bool) or not isinstance(num_tables, int) or num_tables < 1:
        raise ValueError(f"num_tables: expected an int >= 1, got {num_tables!r}")


#: The sets of Neo's DLRM workloads (:mod:`embedding.neo`), made on demand.
NEO_SETS = ("neo-model-a", "neo-model-f", "neo-model-i")


def preset_names() -> list[str]:
    """Names :func:`preset` accepts (``synthetic-N`` stands for any N >= 1)."""
    return list(TABLE_SETS) + list(NEO_SETS) + ["synthetic-N"]


def trainer_preset_names() -> list[str]:
    """Names :func:`table_rows` accepts: the sets the trainer can train."""
    return [name for name, s in TABLE_SETS.items() if s.trainable]


def _synthetic_count(name) -> int | None:
    if isinstance(name, str) and name.startswith("synthetic-"):
        count = name[len("synthetic-"):]
        if count.isdigit() and int(count) > 0:
            return int(count)
    return None


def table_set(name: str) -> TableSet:
    """The set called ``name``; ValueError naming the known sets otherwise."""
    if name in TABLE_SETS:
        return TABLE_SETS[name]
    if name in NEO_SETS:
        from embedding import neo

        return TableSet(**neo.table_fields(neo.model(name)))
    count = _synthetic_count(name)
    if count is None:
        raise ValueError(f"preset: expected one of {preset_names()}, got {name!r}")
    tables, pooling = synthetic(count), synthetic_pooling(count)
    return TableSet(name, tuple(t.num_rows for t in tables), tuple(t.name for t in tables),
                    tuple(t.dim for t in tables), tuple(pooling[t.name] for t in tables),
                    summary=f"{count} synthetic tables of mixed sizes, dims and pooling")


def preset(name: str, *, dim: int | None = None) -> list[TableConfig]:
    """The tables of the set called ``name``, ``dim`` wide when given (else the set's
    dims: :data:`DEFAULT_DIM` for the Criteo sets); ValueError for an unknown name."""
    return table_set(name).tables(dim)


def preset_pooling(name: str) -> dict[str, float]:
    """Mean ids per sample of the set's tables (empty for the Criteo sets: every
    Criteo feature is one-hot)."""
    return table_set(name).pooling()


def table_rows(name: str) -> tuple[int, ...]:
    """Rows per feature (C1..C26) of a set the trainer can train.

    ValueError naming the trainer's sets for any other name, and saying why
    for ``synthetic-N`` (tables of their own dims and pooling, which the
    trainer's model cannot take).
    """
    s = table_set(name) if name in TABLE_SETS or name in NEO_SETS or _synthetic_count(name) \
        else None
    if s is not None and s.trainable:
        return s.rows
    if s is not None:
        raise ValueError(f"preset: {name!r} is a planner-only table set ({s.summary}); the "
                         f"trainer needs one table per Criteo feature at model.embedding_dim "
                         f"and one id per sample: expected one of {trainer_preset_names()} "
                         f"(or explicit tables.rows)")
    raise ValueError(f"preset: expected one of {trainer_preset_names()}, got {name!r}")
