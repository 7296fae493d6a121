"""``source = "parquet"``: Parquet files and directories, read by named columns.

``label``, ``dense`` and the ``[[data.sparse]]`` tables name the columns
(:mod:`embedding.data.schema`). One scan of the training files checks every
file and column and builds the vocabularies and the dense columns' statistics;
every ``eval_path`` entry is an evaluation set of its own, else the last
``eval_records`` records are held out.
"""
from __future__ import annotations

from embedding.data.schema import SchemaError
from embedding.train.sources.base import Source, files_required
from embedding.train.types import ConfigError, DataSource, TrainConfig

__all__ = ["SOURCE", "open_parquet", "parquet_data"]


def check(cfg: TrainConfig, path: str) -> None:
    files_required(cfg, path)
    d = cfg.data
    if not d.label:
        raise ConfigError(path, "data.label", "required with source = \"parquet\": the "
                          "name of the 0/1 label column")
    if not d.sparse:
        raise ConfigError(path, "data.sparse", "required with source = \"parquet\": "
                          "one [[data.sparse]] table per categorical feature (name, "
                          "column, table, pooling)")
    try:
        d.schema().check()
    except SchemaError as exc:
        raise ConfigError(path, exc.key, exc.reason) from None


def _set_names(paths) -> list[str]:
    """Names of evaluation sets: each path's stem, made unique (``test``, ``test-2``)."""
    from pathlib import Path

    out: list[str] = []
    for p in paths:
        base = Path(p).stem or str(p)
        name, k = base, 2
        while name in out:
            name, k = f"{base}-{k}", k + 1
        out.append(name)
    return out


def open_parquet(cfg: TrainConfig, vocabularies: dict | None = None,
                 group=None, dense=None):
    """The Parquet sets of ``cfg``: every file and column checked, the vocabularies built.

    The vocabularies and the dense columns' statistics come from the
    training files (``path``, held-out records included when there is no
    ``eval_path``) unless given (a checkpoint's, for scoring: ``dense`` then
    defaults to the dense columns as they are). Every ``eval_path`` entry is one evaluation
    set, its labels checked before anything is trained. With ``group``
    (every rank calls it), the ranks share the scan of the training files,
    each reading a part of the row groups; errors are agreed.
    """
    from embedding.data.parquet import (ParquetDataset, ParquetSource, check_label_column, scan,
                                        table_rows)
    from embedding.data.transforms import DenseTransforms
    from embedding.train.datasets import hold_out
    from embedding.train.setup import fail_together

    d = cfg.data
    schema = d.schema()
    train_src, exc = None, None
    try:
        train_src = ParquetSource(d.path, schema) if d.path else None
    except (OSError, ValueError) as e:
        exc = e
    shared = group is not None and group.size > 1 and vocabularies is None and d.path
    if shared:
        fail_together(group, "opening the data", exc)  # before the shared scan: all or none
    elif exc is not None:
        raise exc
    ids = None
    if vocabularies is None:
        try:
            stats = scan(train_src, schema, comm=group.comm if shared else None)
        except SchemaError as e:  # a setting the data cannot take (minmax of a constant)
            raise ConfigError(cfg.source, e.key, e.reason) from None
        vocabularies, rows = stats.vocabularies, dict(stats.table_rows)
        dense = stats.dense
        ids = {}
        for f in schema.sparse:  # pooling factors: ids per record, summed over a table's
            c = stats.columns[f.column]
            per = c.mean_length if c.mean_length is not None else 1.0 - c.null_share
            ids[f.table] = ids.get(f.table, 0.0) + per
    else:
        vocabularies = dict(vocabularies)
        dense = dense if dense is not None else DenseTransforms.untransformed(schema)
        try:
            rows = table_rows(schema, vocabularies)
        except KeyError as exc:
            raise ConfigError(cfg.source, "data.sparse", exc.args[0]) from None
    # every label was checked here, before training: the reads need not check them again
    train = (ParquetDataset(train_src, schema, vocabularies, rows, check_labels=False,
                            dense=dense) if train_src is not None else None)
    sets = []
    for name, p in zip(_set_names(d.eval_path), d.eval_path):
        src = ParquetSource(p, schema)
        check_label_column(src, schema.label)
        sets.append((name, ParquetDataset(src, schema, vocabularies, rows,
                                          check_labels=False, dense=dense)))
    if not sets and train is not None:
        train, held = hold_out(cfg, train, train_src.describe())
        sets.append(("held-out", held))
    return parquet_data(schema, train, sets, vocabularies, rows, ids, dense)


def parquet_data(schema, train, sets, vocabularies: dict, rows: dict,
                 ids_per_sample: dict | None = None, dense=None):
    """The :class:`~embedding.train.datasets.TrainData` of a Parquet schema's data sets
    (``sets``: name, data set)."""
    from embedding.train.datasets import TrainData

    return TrainData(train, sets[0][1] if sets else None,
                     tuple(int(rows[f.table]) for f in schema.sparse), schema.feature_names,
                     schema.num_dense, feature_tables=tuple(f.table for f in schema.sparse),
                     feature_pooling=tuple(f.pooling for f in schema.sparse),
                     eval_sets=tuple(sets), vocabularies=vocabularies,
                     ids_per_sample=ids_per_sample, dense_transforms=dense)


def _open(cfg: TrainConfig, group=None):
    return open_parquet(cfg, group=group)


SOURCE = Source(DataSource.PARQUET, check, _open)
