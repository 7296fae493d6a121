"""Held-out evaluation: every rank scores its slice, the scores are gathered, AUC is exact.

The held-out records are cut into global batches of ``train.eval_batch_size``
(default: the training batch) exactly as training batches are, so the same
records are scored whatever the world size. Every record is scored once: a
last partial batch is read as the last whole batch's worth of records (the
tail overlapping the batch before), and only the records past the whole
batches count. Each rank runs the embedding forward (input dist of the next
batch overlapped) and the dense forward on its slice; the logits, labels and
which rows count are gathered with :func:`collectives.all_gather` and every
rank computes the same exact AUC, log-loss and accuracy, for every evaluation
set (:attr:`~embedding.train.data.TrainData.evaluation_sets`).
:func:`score` is the same pass for any data set, in record order (``neocomm
predict``).
"""
from __future__ import annotations

import numpy as np

from embedding.dense import NonFiniteError, auc, log_loss, sigmoid
from embedding.dense._xp import to_numpy
from embedding.train.data import GuardedDataset
from embedding.train.setup import fail_together, make_reader
from embedding.train.step import PhaseTimer
from embedding.train.types import TrainingError

__all__ = ["evaluate", "score", "metrics_of", "planted_auc", "eval_batches"]


def eval_batches(trainer) -> tuple[int, int, int]:
    """``(global batch, whole batches, records past them)`` of the held-out set."""
    cfg = trainer.cfg.train
    egb = cfg.eval_batch_size or cfg.batch_size
    n = trainer.data.eval.num_records
    return egb, n // egb, n % egb


class _WithTail:
    """A data set read as its whole batches of ``egb`` records and, when records are
    left over, one batch more: its last ``egb`` records (``shift`` back from where a
    whole batch would start), whose rows before ``edge`` of the data set were scored
    in the batch before. A data set smaller than one batch is read as one batch of
    its records repeated (``short``); only the first ``n`` rows count."""

    def __init__(self, dataset, egb: int):
        self.dataset = dataset
        self.n = n = int(dataset.num_records)
        self.whole, tail = n // egb, n % egb
        self.edge = self.whole * egb  # where the extra batch starts, as read
        self.shift = tail - egb if tail and self.whole else 0
        self.short = bool(tail) and not self.whole
        self.num_records = self.edge + (egb if self.shift or self.short else 0)

    def read(self, start: int, stop: int):
        if self.short:
            from embedding.data.batch import Batch

            once = self.dataset.read(0, self.n)
            reps = -(-stop // self.n)
            return (Batch.concat([once] * reps) if reps > 1 else once).slice(start, stop)
        if start >= self.edge:  # (a rank's slice never crosses a batch)
            return self.dataset.read(start + self.shift, stop + self.shift)
        return self.dataset.read(start, stop)

    def record_index(self, start: int, size: int) -> np.ndarray:
        """The data set's record of each of the ``size`` rows read from ``start`` (as read);
        -1 for a row scored in the batch before (or a repeat)."""
        index = np.arange(start, start + size, dtype=np.int64)
        if self.short:
            return np.where(index < self.n, index, -1)
        if start < self.edge:
            return index
        index += self.shift
        return np.where(index >= self.edge, index, -1)


def score(trainer, dataset, what: str = "evaluation") -> tuple[np.ndarray, np.ndarray]:
    """``(logits, labels)`` (float64) of every record of ``dataset``, in record order, on
    every rank: each rank scores its slice of each batch and the slices are gathered."""
    import collectives

    from embedding.data.batch import shard_bounds

    data, group = trainer.data, trainer.group
    egb = eval_batches(trainer)[0]
    tailed = _WithTail(dataset, egb)
    nb = tailed.num_records // egb
    guard = GuardedDataset(tailed, data.num_dense, data.feature_names)
    reader = make_reader(guard, egb, group, broadcast=trainer.cfg.data.broadcast, shuffle=False,
                         seed=trainer.cfg.train.seed, feature_names=data.feature_names)
    mine = shard_bounds(egb, group.rank, group.size)[0]  # this rank's first row of a batch
    timer = PhaseTimer()
    step = trainer.step
    model, stages = trainer.model, trainer.stages
    f, d = len(data.feature_names), trainer.cfg.model.embedding_dim
    scores, labels, index, problem = [], [], [], None

    def start():
        prep = trainer.prepare(reader, guard, step, timer)
        return prep, stages.start(prep.kjt)

    cur = start() if nb else None
    for j in range(nb):
        prep, dist = cur
        pooled, _ = stages.forward(dist, timer, grad=False)
        if j + 1 < nb:
            cur = start()
        b = prep.batch.batch_size
        logits = model.forward(model.xp.asarray(prep.batch.dense), pooled.reshape(b, f, d))
        scores.append(to_numpy(logits).astype(np.float64).reshape(-1))
        labels.append(np.asarray(prep.batch.labels, np.float64))
        index.append(tailed.record_index(j * egb + mine, b))
        problem = problem or prep.problem
    s = np.concatenate(scores) if scores else np.zeros(0)
    y = np.concatenate(labels) if labels else np.zeros(0)
    idx = np.concatenate(index) if index else np.zeros(0, np.int64)
    if problem is None and not np.isfinite(s).all():
        problem = NonFiniteError(f"step {step}: {what} logits hold "
                                 f"{int((~np.isfinite(s)).sum())} NaN or inf value(s)",
                                 step=step, tensor="eval_logits")
    fail_together(group, what, problem, step=step)
    if trainer.size > 1:
        s = collectives.all_gather(s, group=group).reshape(-1)
        y = collectives.all_gather(y, group=group).reshape(-1)
        idx = collectives.all_gather(idx, group=group).reshape(-1)
    keep = idx >= 0
    order = np.argsort(idx[keep], kind="stable")
    return s[keep][order], y[keep][order]


def metrics_of(logits: np.ndarray, labels: np.ndarray) -> dict:
    """``{"auc", "log_loss", "accuracy", "records"}`` (accuracy: the logit's sign, 0.5)."""
    return {"auc": auc(labels, logits), "log_loss": log_loss(labels, sigmoid(logits)),
            "accuracy": float(np.mean((logits > 0) == (labels > 0.5))) if labels.size else 0.0,
            "records": int(labels.size)}


def evaluate(trainer) -> dict:
    """``{"auc", "log_loss", "accuracy", "records", "sets"}`` at the trainer's step.

    ``sets`` maps each evaluation set's name to its numbers; the top-level
    numbers are the first set's (the one progress and summaries show).
    """
    sets = {}
    for name, dataset in trainer.data.evaluation_sets:
        s, y = score(trainer, dataset, "evaluation")
        try:
            sets[name] = metrics_of(s, y)
        except ValueError as exc:  # one class only: the same on every rank
            step = trainer.step
            err = TrainingError(f"evaluation of {name} at step {step}: {exc}", step=step,
                                tensor="labels")
            err.agreed = True
            raise err from None
    first = next(iter(sets.values()))
    return {**first, "sets": sets}


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
