"""``source = "binary"``: one file of the checksummed binary format, memory-mapped.

The file records its table sizes; ``[tables]`` may cap them (ids then need
``tables.id_policy``). Without ``eval_path`` the last ``eval_records`` records
are held out.
"""
from __future__ import annotations

from embedding.train.sources.base import Source, files_required, no_parquet_columns
from embedding.train.types import ConfigError, DataSource, TrainConfig

__all__ = ["SOURCE"]


def check(cfg: TrainConfig, path: str) -> None:
    files_required(cfg, path)
    no_parquet_columns(cfg, path)
    d = cfg.data
    if len(d.path) > 1 or len(d.eval_path) > 1:
        raise ConfigError(path, "data.path", "the binary source reads one file (convert "
                          "several with neocomm data convert)")


def open_binary(cfg: TrainConfig, group=None):
    from embedding.data import BinaryDataset
    from embedding.train.datasets import TrainData, hold_out

    d = cfg.data
    train = BinaryDataset(d.path[0], verify=d.verify)
    held = BinaryDataset(d.eval_path[0], verify=d.verify) if d.eval_path else None
    sizes = _sizes(cfg, train, held)
    names = train.feature_names or tuple(f"f{i}" for i in range(train.num_sparse))
    num_dense = train.num_dense
    if held is None:
        train, held = hold_out(cfg, train, ", ".join(d.path))
    return TrainData(train, held, tuple(sizes), tuple(names), int(num_dense))


def _sizes(cfg: TrainConfig, train, held) -> tuple[int, ...]:
    """The file's table sizes, checked against the held-out file and ``[tables]``, capped."""
    from embedding.data import scale_table_sizes

    path = cfg.source
    sizes = train.table_sizes
    if held is not None and held.table_sizes != sizes:
        raise ConfigError(path, "data.eval_path", f"{cfg.data.eval_path[0]} has table sizes "
                          f"{list(held.table_sizes)}, {cfg.data.path[0]} has {list(sizes)}")
    if cfg.tables.rows and tuple(cfg.tables.rows) != tuple(sizes):
        raise ConfigError(path, "tables.rows", f"{cfg.data.path[0]} was written for table "
                          f"sizes {list(sizes)}, the config gives {list(cfg.tables.rows)}")
    if cfg.tables.cap and max(sizes) > cfg.tables.cap:
        if cfg.tables.id_policy == "error":
            raise ConfigError(path, "tables.cap", f"capping tables at {cfg.tables.cap} rows "
                              f"leaves ids of {cfg.data.path[0]} out of range; set "
                              f"tables.id_policy = \"modulo\" or \"hash\"")
        sizes = scale_table_sizes(sizes, cap=cfg.tables.cap, min_rows=1)
    return tuple(sizes)


SOURCE = Source(DataSource.BINARY, check, open_binary)
