"""``source = "criteo"``: Criteo text files (``.gz`` too), parsed into memory.

Ids are hashed into the tables of ``[tables]`` (one per categorical
feature); without ``eval_path`` the last ``eval_records`` records are held out.
"""
from __future__ import annotations

from embedding.train.sources.base import Source, files_required, no_parquet_columns
from embedding.train.types import ConfigError, DataSource, TrainConfig

__all__ = ["SOURCE"]


def check(cfg: TrainConfig, path: str) -> None:
    files_required(cfg, path)
    no_parquet_columns(cfg, path)


def open_criteo(cfg: TrainConfig, group=None):
    from embedding.data.types import NUM_SPARSE, SPARSE_NAMES
    from embedding.train.datasets import TrainData, hold_out, load_criteo_text, table_sizes_of

    d = cfg.data
    sizes = table_sizes_of(cfg)
    if len(sizes) != NUM_SPARSE:
        raise ConfigError(cfg.source, "tables.rows", f"Criteo text has {NUM_SPARSE} categorical "
                          f"features; expected {NUM_SPARSE} tables, got {len(sizes)}")
    train = load_criteo_text(d.path, sizes, d.missing)
    held = load_criteo_text(d.eval_path, sizes, d.missing) if d.eval_path else None
    num_dense = int(train.dense.shape[1])
    if held is None:
        train, held = hold_out(cfg, train, ", ".join(d.path))
    return TrainData(train, held, tuple(sizes), tuple(SPARSE_NAMES), num_dense)


SOURCE = Source(DataSource.CRITEO, check, open_criteo)
