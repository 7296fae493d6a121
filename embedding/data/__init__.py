"""Data pipeline of the DLRM trainer: Criteo text, a binary format, synthetic data, readers.

* :mod:`~embedding.data.criteo`: the Criteo text format and its preprocessing;
* :mod:`~embedding.data.binary`: a checksummed, memory-mapped binary format;
* :mod:`~embedding.data.synthetic`: Criteo-shaped data with a planted model;
* :mod:`~embedding.data.reader`: rank-sliced and broadcast readers.

See docs/data.md for the binary layout and the synthetic generator.
"""
from __future__ import annotations

from embedding.data.batch import Batch, shard_bounds
from embedding.data.binary import BinaryDataset, BinaryWriter, Verify, convert_text, write_batches
from embedding.data.criteo import Preprocessor, Vocabulary, read_criteo_text
from embedding.data.reader import BroadcastReader, ShardedReader, one_to_many_transport
from embedding.data.synthetic import (TABLE_PRESETS, SyntheticConfig, SyntheticDataset,
                                      planted_auc, scale_table_sizes, table_size_preset)
from embedding.data.types import (CRITEO_1TB_TABLE_SIZES, NUM_DENSE, NUM_SPARSE, BatchError,
                                  CategoricalEncoding, DataFormatError, MissingCategorical)

__all__ = ["Batch", "shard_bounds", "BinaryDataset", "BinaryWriter", "Verify", "convert_text",
           "write_batches", "Preprocessor", "Vocabulary", "read_criteo_text", "ShardedReader",
           "BroadcastReader", "one_to_many_transport", "SyntheticConfig", "SyntheticDataset",
           "planted_auc", "scale_table_sizes", "table_size_preset", "TABLE_PRESETS",
           "CRITEO_1TB_TABLE_SIZES", "NUM_DENSE", "NUM_SPARSE", "BatchError",
           "CategoricalEncoding", "DataFormatError", "MissingCategorical"]
