"""Named sets of embedding tables: the Criteo 1TB DLRM tables and synthetic sets.

``preset(name)`` returns the tables of a named set and ``preset_pooling(name)``
their mean ids per sample where it is not one; names are listed in
:data:`PRESETS`, plus ``synthetic-N`` for N synthetic tables.
"""
from __future__ import annotations

import random
from typing import Callable

from embedding.types import TableConfig

__all__ = ["PRESETS", "preset", "preset_names", "preset_pooling", "criteo_1tb",
           "criteo_1tb_uncapped", "synthetic", "synthetic_pooling", "CRITEO_1TB_ROWS",
           "CRITEO_1TB_UNCAPPED_ROWS"]

#: Rows of the 26 categorical features of MLPerf DLRM on Criteo 1TB, ids
#: capped at 40M (public: the MLPerf training reference).
CRITEO_1TB_ROWS = (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
                   2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
                   39664984, 585935, 12972, 108, 36)

#: Rows of the 26 features without the cap, 882,000,000 in all (see
#: :func:`criteo_1tb_uncapped` for which numbers are public and which are not).
CRITEO_1TB_UNCAPPED_ROWS = (187000000, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63,
                            158519099, 2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14,
                            292775614, 25641295, 214000000, 585935, 12972, 108, 36)


def _tables(rows, dim: int, prefix: str = "cat") -> list[TableConfig]:
    return [TableConfig(name=f"{prefix}_{i}", num_rows=n, dim=dim) for i, n in enumerate(rows)]


def criteo_1tb(dim: int = 128) -> list[TableConfig]:
    """The 26 tables of MLPerf DLRM on Criteo 1TB: ids capped at 40M, dim 128,
    float32, SGD; about 89.5 GiB of weights."""
    return _tables(CRITEO_1TB_ROWS, dim)


def criteo_1tb_uncapped(dim: int = 128) -> list[TableConfig]:
    """The 26 Criteo 1TB tables without the 40M cap, dim 128, float32, SGD.

    Public (NVIDIA's TensorFlow2 DLRM, frequency threshold 0): 882M categories
    in all, the largest feature 292,775,614 rows, 113B parameters, 421 GiB at
    dim 128 in float32.

    Made up: which feature is the largest (``cat_19``, the largest capped
    one here) and the rows of the other three features that the cap cut
    (``cat_0`` 187,000,000, ``cat_9`` 158,519,099, ``cat_21`` 214,000,000),
    chosen to keep their capped order and to bring the total to exactly
    882,000,000 rows (420.6 GiB; the largest table 139.6 GiB). The other 22
    features are below the cap and keep their MLPerf cardinalities.
    """
    return _tables(CRITEO_1TB_UNCAPPED_ROWS, dim)


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


#: name -> builder of the table set.
PRESETS: dict[str, Callable[[], list[TableConfig]]] = {
    "criteo-1tb": criteo_1tb,
    "criteo-1tb-uncapped": criteo_1tb_uncapped,
}


def preset_names() -> list[str]:
    """Names :func:`preset` accepts (``synthetic-N`` stands for any N >= 1)."""
    return sorted(PRESETS) + ["synthetic-N"]


def _synthetic_count(name) -> int | None:
    if isinstance(name, str) and name.startswith("synthetic-"):
        count = name[len("synthetic-"):]
        if count.isdigit() and int(count) > 0:
            return int(count)
    return None


def preset(name: str) -> list[TableConfig]:
    """The tables of the set called ``name``; ValueError naming the known sets otherwise."""
    if name in PRESETS:
        return PRESETS[name]()
    count = _synthetic_count(name)
    if count is not None:
        return synthetic(count)
    raise ValueError(f"preset: expected one of {preset_names()}, got {name!r}")


def preset_pooling(name: str) -> dict[str, float]:
    """Mean ids per sample of the set's tables that differ from one id per sample
    (empty for the Criteo sets: every Criteo feature is one-hot)."""
    preset(name)  # the same errors for unknown names
    count = _synthetic_count(name)
    return synthetic_pooling(count) if count is not None else {}
