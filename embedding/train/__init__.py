"""The DLRM trainer: sharded embeddings, data-parallel dense layers, checkpoints, metrics.

>>> from embedding.train import Trainer, load_config
>>> trainer = Trainer(load_config("train.toml"))   # on every rank (after neocomm.init())
>>> result = trainer.train()                       # doctest: +SKIP

For a loop of your own, :func:`batches` reads the data of a config as the
trainer does. ``neocomm train`` runs it from the command line; docs/training.md describes
the configuration, the step and the outputs.
"""
from __future__ import annotations

from embedding.train.config import apply_overrides, load_config, parse_config, to_toml
from embedding.train.data import batches, open_data
from embedding.train.loop import Trainer, TrainResult
from embedding.train.plot import PlotUnavailable, plot_metrics
from embedding.train.types import (ConfigError, DataSource, Phase, TrainConfig,
                                   TrainingError)

__all__ = ["Trainer", "TrainResult", "TrainConfig", "load_config", "parse_config",
           "apply_overrides", "to_toml", "ConfigError", "TrainingError", "DataSource", "Phase",
           "plot_metrics", "PlotUnavailable", "batches", "open_data"]
