"""The trainer's records: a JSON-lines metrics log and the held-out evaluation's numbers.

Rank 0 appends one JSON object per line to ``metrics.jsonl``; every record
has ``event`` and ``time`` (seconds since the epoch):

* ``start``: ``step`` (0, or the step resumed from), ``world_size``,
  ``config`` (every key), ``plan`` (sharding per table), ``planted_auc``
  (synthetic data: the planted model's AUC on the held-out records);
* ``train``: ``step``, ``loss`` (global mean loss of that step), ``loss_avg``
  (mean over the steps since the last record), ``samples_per_s`` (global),
  ``step_ms`` and ``phases_ms`` (rank 0's mean per step of each phase); with
  host-resident tables ``cache`` (hit rate, bytes each way per step over all
  ranks, ms per step per rank and its share of the step); ``comm_bytes``: the bytes rank 0
  passed per step to the collectives of the pooled embeddings (``emb_forward``), their
  gradients (``emb_backward``) and the AllReduces in the ``dense`` precision (``dense``:
  the dense model's gradients and the data-parallel tables'), in their ``[comms]``
  precisions (each send buffer's size, the block a rank keeps included);
  ``emb_calls``: rank 0's embedding kernel calls (``kernels``: fused lookups, gradient
  aggregations and updates) and collective calls (``collectives``: input dists, output
  dists and their reverses) per step (``ShardedEmbeddingCollection.take_calls``);
* ``eval``: ``step``, ``auc``, ``log_loss``, ``accuracy``, ``records`` (of the first
  evaluation set) and ``sets``: the same numbers for every evaluation set by name;
* ``checkpoint``: ``step``, ``path``, ``seconds``;
* ``end``: ``step``, ``seconds``, ``samples``, ``auc``; ``error``: ``step``, ``message``.

A resumed run appends to the same log.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["MetricsLog", "read_metrics", "phase_summary"]


class MetricsLog:
    """Appends records to ``path`` (``enabled=False`` on ranks other than 0: writes nothing)."""

    def __init__(self, path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = bool(enabled)
        self._fh = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        """One record; flushed at once so a killed run keeps what it logged."""
        if self._fh is None:
            return
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self._fh.write(json.dumps(record, default=_jsonable) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _jsonable(o):
    if hasattr(o, "value"):
        return o.value
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def read_metrics(path) -> list[dict]:
    """Every record of a metrics log (lines that do not parse are skipped)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def phase_summary(phases_ms: dict[str, float]) -> str:
    """``"data 1.2 ms (3%), input_dist …"``: each phase's mean per step and share."""
    total = sum(phases_ms.values()) or 1.0
    return ", ".join(f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in phases_ms.items())
