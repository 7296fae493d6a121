"""What a data source of the trainer is: a name, a check of its ``[data]`` table, a constructor.

A :class:`Source` checks the ``[data]`` table of a config it is named in
(:class:`~embedding.train.types.ConfigError` naming the key) when the config
is loaded, and opens the config's data as a
:class:`~embedding.train.datasets.TrainData` when training starts. The checks
that several sources share are here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from embedding.train.types import ConfigError, DataSource, TrainConfig

__all__ = ["Source", "files_required", "no_files", "no_parquet_columns"]


@dataclass(frozen=True)
class Source:
    """One data source: ``kind`` (its ``data.source`` name), ``check(cfg, path)`` raising
    ConfigError for a ``[data]`` table it cannot read (``path``: the config file, for
    messages), and ``open(cfg, group)`` returning the config's TrainData (``group``: the
    process group whose ranks all call it, or None)."""

    kind: DataSource
    check: Callable[[TrainConfig, str], None]
    open: Callable[..., object]

    @property
    def name(self) -> str:
        return self.kind.value


def files_required(cfg: TrainConfig, path: str) -> None:
    """A source of files needs ``data.path``."""
    if not cfg.data.path:
        raise ConfigError(path, "data.path", f"required when data.source is "
                          f"{cfg.data.source.value!r}")


def no_files(cfg: TrainConfig, path: str) -> None:
    """A source that makes its records reads no files."""
    d = cfg.data
    if d.path or d.eval_path:
        raise ConfigError(path, "data.path", f"set, but data.source is {d.source.value!r}; "
                          "set source = \"parquet\", \"criteo\" or \"binary\" to read files")


def no_parquet_columns(cfg: TrainConfig, path: str) -> None:
    """Sources other than Parquet name no columns and read no Parquet files."""
    d = cfg.data
    for key in ("label", "dense", "sparse"):
        if getattr(d, key):
            raise ConfigError(path, f"data.{key}", f"names Parquet columns; set source = "
                              f"\"parquet\" (data.source is {d.source.value!r})")
    parquet = [p for p in d.path + d.eval_path if p.endswith(".parquet")]
    if parquet:
        raise ConfigError(path, "data.path", f"{parquet[0]} is a Parquet file; set "
                          f"source = \"parquet\" and name its columns (data.label, "
                          f"data.dense, [[data.sparse]])")
