"""Checkpoints of a sharded DLRM: atomic per-rank writes, a JSON manifest, resharded loads.

Write with :func:`save_checkpoint` (or :class:`CheckpointWriter` and its
``commit``), find the newest complete one with :func:`latest_checkpoint`,
open it with :func:`load_checkpoint`, refuse a misfit with
:meth:`Checkpoint.check_compatible`, and read any plan's shards with
:func:`read_for_plan`. Files are ``.npy`` without pickle, each with a
checksum in the manifest. :func:`quantize_rows` / :func:`dequantize_rows`
convert rows to and from FBGEMM's FUSED8BIT int8 layout, and
:class:`Int8Export` reads an int8 export of a checkpoint's tables
(``neocomm checkpoint export``).
"""
from __future__ import annotations

from embedding.checkpoint.fused8bit import FUSED8BIT, dequantize_rows, quantize_rows
from embedding.checkpoint.int8 import Int8Export
from embedding.checkpoint.reader import (Checkpoint, CheckpointInfo, FileStatus,
                                         latest_checkpoint, list_checkpoints, load_checkpoint)
from embedding.checkpoint.reshard import read_box, read_for_plan, shard_box, shard_slice
from embedding.checkpoint.types import (CheckpointError, CheckpointMismatchError, ChecksumError,
                                        FileRecord, Manifest, TensorSlice)
from embedding.checkpoint.writer import CheckpointWriter, checkpoint_name, prune, save_checkpoint

__all__ = ["save_checkpoint", "CheckpointWriter", "checkpoint_name", "prune", "Checkpoint",
           "CheckpointInfo", "FileStatus", "load_checkpoint", "latest_checkpoint",
           "list_checkpoints", "read_box", "read_for_plan", "shard_box", "shard_slice",
           "TensorSlice",
           "FileRecord", "Manifest", "CheckpointError", "ChecksumError",
           "CheckpointMismatchError", "FUSED8BIT", "quantize_rows", "dequantize_rows",
           "Int8Export"]
