"""The trainer's data: a config's data sets, opened by its source, and batches of them.

:func:`open_data` turns a :class:`~embedding.train.types.TrainConfig` into a
:class:`~embedding.train.datasets.TrainData` through the config's source
(:mod:`embedding.train.sources`: synthetic, Criteo text, binary, Parquet);
:func:`batches` reads them as the trainer does. The data sets themselves
(windows, reads that fail together) are in :mod:`embedding.train.datasets`,
re-exported here.
"""
from __future__ import annotations

from embedding.train.datasets import (GuardedDataset, MemoryDataset, TrainData, WindowDataset,
                                     filler_batch, load_criteo_text, table_sizes_of)
from embedding.train.sources.parquet import open_parquet, parquet_data
from embedding.train.types import TrainConfig

__all__ = ["TrainData", "open_data", "batches", "WindowDataset", "MemoryDataset",
           "GuardedDataset", "filler_batch", "load_criteo_text", "table_sizes_of",
           "open_parquet", "parquet_data"]


def open_data(cfg: TrainConfig, group=None) -> TrainData:
    """The data sets of ``cfg`` (ConfigError for a misfit config, DataFormatError for bad files),
    opened by its source (:data:`~embedding.train.sources.SOURCES`).

    With ``group`` (every rank calls it) the ranks share the work of a Parquet
    source's scan (:func:`open_parquet`)."""
    from embedding.train.sources import source_of

    return source_of(cfg.data.source).open(cfg, group)


def batches(config, split: str = "train", *, rank: int = 0, world_size: int = 1,
            epochs: int | None = 1, data: TrainData | None = None):
    """Batches of ``config``'s data, read exactly as the trainer reads them: for your own loop.

    ``config`` is a :class:`TrainConfig` or the path of its TOML file.
    ``split`` is ``"train"`` or the name of an evaluation set (a Parquet
    ``eval_path`` file's stem, or ``"held-out"``). Rank ``rank`` of
    ``world_size`` gets its slice of each global batch of
    ``train.batch_size`` (``train.eval_batch_size`` for evaluation sets; 0, the
    default, rounded down to a multiple of ``world_size`` as the trainer does),
    shuffled as ``[data] shuffle`` says; training batches come for
    ``epochs`` epochs (None: forever), the last partial global batch of an
    epoch dropped as in training; an evaluation set comes once, every record
    once, its last global batch possibly smaller. Each item is a
    :class:`~embedding.data.batch.Batch`: ``dense``, ``labels``, and
    ``to_jagged()`` for :meth:`ShardedEmbeddingCollection.forward
    <embedding.collection.ShardedEmbeddingCollection.forward>`. ``data``
    reuses data sets already opened (:func:`open_data`).
    """
    from embedding.data.batch import shard_bounds
    from embedding.data.reader import ShardedReader
    from embedding.train.config import load_config

    from embedding.train.batching import global_batch

    cfg = config if isinstance(config, TrainConfig) else load_config(config)
    shard_bounds(world_size, rank, world_size)  # checks rank and world_size
    data = data if data is not None else open_data(cfg)
    if split == "train":
        if data.train is None:
            raise ValueError("split: this data has no training records")
        gb = global_batch(cfg.train.batch_size, world_size, source=cfg.source)
        reader = ShardedReader(data.train, gb, rank, world_size,
                               shuffle=cfg.data.shuffle, seed=cfg.train.seed,
                               shuffle_window=cfg.data.window)
        epoch = 0
        while epochs is None or epoch < epochs:
            yield from reader
            epoch += 1
        return
    sets = dict(data.evaluation_sets)
    if split not in sets:
        raise ValueError(f"split: expected 'train' or one of the evaluation sets "
                         f"{list(sets)}, got {split!r}")
    ds = sets[split]
    egb = (cfg.train.eval_batch_size or cfg.train.batch_size
           or global_batch(0, world_size))  # (any size: the ranks' slices may differ by one)
    n = ds.num_records
    for first in range(0, n, egb):
        size = min(egb, n - first)
        # the last batch may not split evenly: the first ranks take one record more
        a = rank * (size // world_size) + min(rank, size % world_size)
        b = a + size // world_size + (rank < size % world_size)
        yield ds.read(first + a, first + b)
