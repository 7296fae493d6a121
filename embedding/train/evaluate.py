"""Held-out evaluation: every rank scores its slice, the scores are gathered, AUC is exact.

The held-out records are cut into global batches of ``train.eval_batch_size``
(default: the training batch) exactly as training batches are, so the same
records are scored whatever the world size. Every record is scored once: a
last partial batch is read as the last whole batch's worth of records (the
tail overlapping the batch before), and only the records past the whole
batches count. Each rank runs the embedding forward (input dist of the next
batch overlapped) and the dense forward on its slice; the logits, labels and
which rows count are gathered with :func:`collectives.all_gather` and every
rank computes the same exact AUC and log-loss.
"""
from __future__ import annotations

import numpy as np

from embedding.dense import NonFiniteError, auc, log_loss, sigmoid
from embedding.dense._xp import to_numpy
from embedding.train.data import GuardedDataset
from embedding.train.setup import fail_together, make_reader
from embedding.train.step import PhaseTimer
from embedding.train.types import TrainingError

__all__ = ["evaluate", "planted_auc", "eval_batches"]


def eval_batches(trainer) -> tuple[int, int, int]:
    """``(global batch, whole batches, records past them)`` of the held-out set."""
    cfg = trainer.cfg.train
    egb = cfg.eval_batch_size or cfg.batch_size
    n = trainer.data.eval.num_records
    return egb, n // egb, n % egb


class _WithTail:
    """A data set read as its whole batches of ``egb`` records and, when records are
    left over, one batch more: its last ``egb`` records (``shift`` back from where a
    whole batch would start). Rows of that batch count from index ``first_tail`` of the
    data set on; the earlier ones were scored in the batch before."""

    def __init__(self, dataset, egb: int):
        self.dataset = dataset
        n = int(dataset.num_records)
        self.whole, tail = n // egb, n % egb
        self.edge = self.whole * egb  # where the extra batch starts, as read
        self.shift = tail - egb if tail and self.whole else 0
        self.num_records = self.edge + (egb if self.shift else 0)

    def read(self, start: int, stop: int):
        if start >= self.edge:  # (a rank's slice never crosses a batch)
            return self.dataset.read(start + self.shift, stop + self.shift)
        return self.dataset.read(start, stop)

    def counts(self, start: int, size: int) -> np.ndarray:
        """Which of the ``size`` rows read from ``start`` (as read) are scored."""
        index = np.arange(start, start + size)
        if start < self.edge:
            return np.ones(size, bool)
        return index + self.shift >= self.edge


def evaluate(trainer) -> dict:
    """``{"auc", "log_loss", "records"}`` on the held-out set at the trainer's step."""
    import collectives

    from embedding.data.batch import shard_bounds

    data, group = trainer.data, trainer.group
    egb = eval_batches(trainer)[0]
    tailed = _WithTail(data.eval, egb)
    nb = tailed.num_records // egb
    guard = GuardedDataset(tailed, data.num_dense, data.feature_names)
    reader = make_reader(guard, egb, group, broadcast=trainer.cfg.data.broadcast, shuffle=False,
                         seed=trainer.cfg.train.seed, feature_names=data.feature_names)
    mine = shard_bounds(egb, group.rank, group.size)[0]  # this rank's first row of a batch
    timer = PhaseTimer()
    step = trainer.step
    model, stages = trainer.model, trainer.stages
    f, d = len(trainer.tables), trainer.cfg.model.embedding_dim
    scores, labels, kept, problem = [], [], [], None

    def start():
        prep = trainer.prepare(reader, guard, step, timer)
        return prep, stages.start(prep.kjt)

    cur = start() if nb else None
    for j in range(nb):
        prep, dist = cur
        pooled, _ = stages.forward(dist, timer)
        if j + 1 < nb:
            cur = start()
        b = prep.batch.batch_size
        logits = model.forward(model.xp.asarray(prep.batch.dense), pooled.reshape(b, f, d))
        scores.append(to_numpy(logits).astype(np.float64))
        labels.append(np.asarray(prep.batch.labels, np.float64))
        kept.append(tailed.counts(j * egb + mine, b))
        problem = problem or prep.problem
    s = np.concatenate(scores) if scores else np.zeros(0)
    y = np.concatenate(labels) if labels else np.zeros(0)
    keep = np.concatenate(kept).astype(np.float64) if kept else np.zeros(0)
    if problem is None and not np.isfinite(s).all():
        problem = NonFiniteError(f"step {step}: held-out logits hold "
                                 f"{int((~np.isfinite(s)).sum())} NaN or inf value(s)",
                                 step=step, tensor="eval_logits")
    fail_together(group, "evaluation", problem, step=step)
    if trainer.size > 1:
        s = collectives.all_gather(s, group=group).reshape(-1)
        y = collectives.all_gather(y, group=group).reshape(-1)
        keep = collectives.all_gather(keep, group=group).reshape(-1)
    s, y = s[keep > 0], y[keep > 0]
    try:
        return {"auc": auc(y, s), "log_loss": log_loss(y, sigmoid(s)), "records": int(y.size)}
    except ValueError as exc:  # one class only: the same on every rank
        err = TrainingError(f"evaluation at step {step}: {exc}", step=step, tensor="labels")
        err.agreed = True
        raise err from None


def planted_auc(trainer) -> float | None:
    """AUC of the synthetic data's planted model on exactly the records :func:`evaluate` scores."""
    planted = trainer.data.planted
    if planted is None:
        return None
    egb, whole, tail = eval_batches(trainer)
    if whole == 0:
        return None
    a = trainer.data.eval_offset
    batch, p = planted.read_with_probabilities(a, a + egb * whole + tail)
    return auc(batch.labels, p)
