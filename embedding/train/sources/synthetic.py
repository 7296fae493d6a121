"""``source = "synthetic"``: Criteo-shaped records with a planted model, made on every rank.

The held-out records are the ones after the training records of the same
generator, so the planted model's AUC can be measured on them.
"""
from __future__ import annotations

from embedding.train.sources.base import Source, no_files, no_parquet_columns
from embedding.train.types import DataSource, TrainConfig

__all__ = ["SOURCE"]


def check(cfg: TrainConfig, path: str) -> None:
    no_files(cfg, path)
    no_parquet_columns(cfg, path)


def open_synthetic(cfg: TrainConfig, group=None):
    from embedding.data import SyntheticConfig, SyntheticDataset
    from embedding.train.datasets import TrainData, WindowDataset, table_sizes_of

    d = cfg.data
    sizes = table_sizes_of(cfg)
    syn = SyntheticConfig(table_sizes=sizes, seed=cfg.train.seed, zipf_alpha=d.zipf_alpha,
                          logit_std=d.logit_std, dense_share=d.dense_share)
    full = SyntheticDataset(syn, d.records + d.eval_records)
    return TrainData(WindowDataset(full, 0, d.records),
                     WindowDataset(full, d.records, d.records + d.eval_records), sizes,
                     tuple(syn.feature_names), syn.num_dense, full, d.records)


SOURCE = Source(DataSource.SYNTHETIC, check, open_synthetic)
