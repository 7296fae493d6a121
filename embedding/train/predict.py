"""Scoring with a trained model: one score per input row, the input's key columns kept.

:func:`predict` rebuilds the model from a checkpoint alone — its manifest
holds the training configuration, the data's vocabularies and the dense
columns' transform statistics (none for a checkpoint older than them) — plans its
tables for the ranks at hand (any number: shards are re-read for the new
plan), scores every row of a Parquet file (a list of files or a
directory) exactly as held-out evaluation does, and has rank 0 write
``OUT.parquet``: the kept columns, then ``score`` (the predicted
probability, float32) and ``logit`` (float32), in the input's row order.
The input needs the model's feature columns; its label column is optional
(when there, the AUC on it is reported too).

By default the kept columns are the input's columns the model does not
read as features (keys, the label); ``keep`` names them instead.

With ``tables`` (an int8 export of the same checkpoint, see
:mod:`embedding.train.export`) the exported tables' weights are the
export's dequantized rows; the dense model and any table the export lacks
come from the checkpoint. Scoring the same labelled file with and without
it compares the int8 tables' AUC with the float32 tables'.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from embedding.train.save import find_checkpoint
from embedding.train.types import ConfigError, DataSource

__all__ = ["predict", "find_checkpoint"]


def _scoring_config(ckpt, data, batch_size, ranks: int):
    from embedding.train.config import parse_config

    raw = ckpt.state.get("config")
    if not isinstance(raw, dict):
        raise ConfigError(str(ckpt.path), "", "this checkpoint does not record its training "
                          "configuration (written by an older neocomm); it cannot be used "
                          "for predictions")
    cfg = parse_config(raw, f"{ckpt.path} (its training configuration)")
    if cfg.data.source is not DataSource.PARQUET:
        raise ConfigError(str(ckpt.path), "data.source", f"the model was trained on "
                          f"{cfg.data.source.value!r} data; predictions read Parquet with the "
                          f"model's named columns (train on Parquet to use them)")
    paths = (data,) if isinstance(data, (str, os.PathLike)) else tuple(data)
    # scores do not depend on the batch: without --batch-size the model's evaluation batch,
    # rounded down to a multiple of the ranks when it does not split over them
    evb = int(batch_size or cfg.train.eval_batch_size or cfg.train.batch_size)
    if evb and evb % ranks:
        evb = max(ranks, evb // ranks * ranks)
    train = dataclasses.replace(cfg.train, batch_size=0, eval_batch_size=evb)
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=(), eval_path=tuple(map(str, paths)),
                                      broadcast=False),
        train=train, plan=dataclasses.replace(cfg.plan, file=""),
        checkpoint=dataclasses.replace(cfg.checkpoint, resume=""))


def predict(checkpoint, data, out, *, keep=None, group=None, batch_size: int | None = None,
            device: str | None = None, tables=None) -> dict:
    """Score every row of ``data`` with the model of ``checkpoint`` into ``out`` (Parquet).

    Every rank of ``group`` calls it; failures are agreed and raised on every
    rank. Returns ``{"rows", "out", "checkpoint", "step", "columns"}`` and,
    when the input has labels, ``"auc"``, ``"log_loss"``, ``"accuracy"``;
    with ``tables`` (an int8 export's path) also ``"tables"`` (its directory)
    and ``"int8_tables"`` (the names of the tables it set).
    """
    from embedding.checkpoint import Checkpoint, CheckpointError
    from embedding.checkpoint.int8 import Int8Export, is_int8_export
    from embedding.data.parquet import (ParquetDataset, ParquetSource, check_label_column,
                                        table_rows)
    from embedding.data.types import DataFormatError
    from embedding.train.data import parquet_data
    from embedding.train.evaluate import metrics_of, score
    from embedding.train.export import load_export_weights
    from embedding.train.loop import Trainer
    from embedding.train.save import resume, saved_dense_transforms
    from embedding.train.setup import fail_together
    from embedding.train.state import read_vocabularies
    from neocomm.world import group_or_world

    group = group_or_world(group)
    exc, cfg, tdata, ckpt, kept, export = None, None, None, None, (), None
    try:
        if not str(out).endswith(".parquet"):
            raise ConfigError("command line", "--out", f"expected a .parquet file, got {out!r}")
        ckpt = Checkpoint(find_checkpoint(checkpoint))
        if is_int8_export(ckpt):
            raise ConfigError("command line", "--checkpoint", f"{ckpt.path} is an int8 export "
                              f"of tables, not a training checkpoint; pass it as --tables and "
                              f"the checkpoint it was made from as --checkpoint")
        if tables is not None:
            export = Int8Export(tables)
        if batch_size:
            from embedding.train.batching import global_batch

            global_batch(int(batch_size), group.size, source="command line", key="--batch-size")
        cfg = _scoring_config(ckpt, data, batch_size, group.size)
        if device is not None:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device))
        schema = cfg.data.schema()
        vocab = read_vocabularies(ckpt)
        rows = table_rows(schema, vocab)
        src = ParquetSource(cfg.data.eval_path, schema, label_optional=True)
        if src.has_label:
            check_label_column(src, schema.label)
        dense = saved_dense_transforms(ckpt, schema)  # as the model was trained
        dataset = ParquetDataset(src, schema, vocab, rows, check_labels=False, dense=dense)
        kept = _kept_columns(src, schema, keep)
        tdata = parquet_data(schema, None, [("input", dataset)], vocab, rows, dense=dense)
    except (ConfigError, CheckpointError, DataFormatError, ValueError, OSError, KeyError) as e:
        exc = e
    fail_together(group, "loading the model for predictions", exc)
    trainer = Trainer(cfg, group, data=tdata, outputs=False)
    int8 = []
    try:
        resume(trainer, str(ckpt.path))
        if export is not None:
            exc = None
            try:
                int8 = load_export_weights(export, ckpt, trainer.coll, trainer.plan)
            except (CheckpointError, ValueError, OSError) as e:
                exc = e
            fail_together(group, "loading the int8 tables", exc)
        logits, labels = score(trainer, tdata.eval, "prediction")
    finally:
        trainer.close()
    result = {"rows": int(logits.size), "out": str(out), "checkpoint": str(ckpt.path),
              "step": trainer.step, "columns": list(kept) + ["score", "logit"]}
    if export is not None:
        result.update(tables=str(export.path), int8_tables=int8)
    if tdata.eval.source.has_label and logits.size:
        try:
            result.update({k: v for k, v in metrics_of(logits, labels).items()
                           if k != "records"})
        except ValueError:  # one class only: no AUC, the scores stand
            pass
    exc = None
    if group.rank == 0:
        try:
            _write(tdata.eval.source, kept, logits, out)
        except (OSError, ValueError) as e:
            exc = e
    fail_together(group, "writing the predictions", exc)
    return result


def _kept_columns(src, schema, keep) -> tuple[str, ...]:
    from embedding.data.types import DataFormatError

    if keep is None:
        features = {d.column for d in schema.dense} | {f.column for f in schema.sparse}
        keep = tuple(c for c in src.types if c not in features)
    keep = tuple(keep)
    for c in keep:
        if c not in src.types:
            raise DataFormatError(f"--keep: no column {c!r}; it has {sorted(src.types)}",
                                  path=str(src.paths[0]))
        if c in ("score", "logit"):
            raise DataFormatError(f"the input has a column {c!r}, the name the predictions "
                                  f"file gives its own; name the columns to keep without it "
                                  f"(--keep)", path=str(src.paths[0]))
    return keep


def _write(src, kept, logits, out) -> None:
    """The kept columns row group by row group, with the scores, atomically into ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    prob = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    writer = None
    try:
        for index, (_, _, first, n) in enumerate(src.row_groups):
            cols = src.read_row_group(index, kept) if kept else pa.table({})
            table = pa.table({**{c: cols.column(c) for c in kept},
                              "score": pa.array(prob[first:first + n]),
                              "logit": pa.array(logits[first:first + n].astype(np.float32))})
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
        writer.close()
        writer = None
        os.replace(tmp, out)
    finally:
        if writer is not None:
            writer.close()
        if tmp.exists():
            tmp.unlink()
