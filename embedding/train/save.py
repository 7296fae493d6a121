"""Checkpointing the trainer and resuming it, on every rank, agreed.

:func:`save` writes the checkpoint of the current step through
:mod:`embedding.checkpoint` (each rank its shards, rank 0 the dense model
and the manifest, one atomic rename): a run killed at any point leaves the
previous checkpoint the latest complete one. Arrays holding NaN or inf are
refused before anything is written. :func:`resume` finds the checkpoint,
checks it against the model (tables, dense architecture, optimizers, global
batch) and loads each rank's shards for *this* plan and world size.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from embedding.checkpoint import (Checkpoint, CheckpointError, CheckpointMismatchError,
                                  CheckpointWriter, latest_checkpoint, prune)
from embedding.dense import NonFiniteError
from embedding.train.setup import fail_together
from embedding.train.state import (check_state, check_vocabularies, dense_arrays, load_dense,
                                   load_shards, shard_arrays, vocabulary_arrays)

__all__ = ["save", "resume", "manifest_state", "find_checkpoint"]

_log = logging.getLogger(__name__)


def find_checkpoint(where) -> Path:
    """``where`` itself when it is a checkpoint, else the latest complete one under it
    (a checkpoint root, or an output directory with ``checkpoints/``)."""
    p = Path(where)
    if (p / "manifest.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CheckpointError("no checkpoint there (expected a checkpoint directory, its parent "
                          "or a training output directory)", path=str(p))


def manifest_state(trainer) -> dict:
    """The JSON state of the manifest: step, data position, model and optimizer kinds, the
    whole configuration (``neocomm predict`` rebuilds the model from it) and, for a Parquet
    source, the dense columns' transforms and statistics (``dense_transforms``)."""
    from embedding.train.config import config_to_dict

    cfg = trainer.cfg
    if trainer._pending is not None:  # the next batch is already read: its position
        position = trainer._pending[0].position
    else:
        position = trainer.reader.state_dict()
    dense = trainer.data.dense_transforms
    extra = ({"dense_transforms": dense.to_state()}
             if dense is not None and not dense.legacy else {})
    return {"step": trainer.step, "samples": trainer.step * cfg.train.batch_size,
            "reader": position, "seed": cfg.train.seed,
            # The only randomness after initialisation: the order of the global batches,
            # a permutation drawn from (seed, epoch) when shuffling; the position fixes it.
            "rng": {"data_order": _order_name(cfg), "seed": cfg.train.seed,
                    "epoch": position.get("epoch")},
            "global_batch_size": cfg.train.batch_size, "world_size": trainer.size,
            "eval": trainer.last_eval, "config": config_to_dict(cfg),
            **trainer.state_expectations(), **extra}


def _order_name(cfg) -> str:
    if not cfg.data.shuffle:
        return "sequential"
    if cfg.data.window:
        return f"records shuffled in windows of {cfg.data.window} from (seed, epoch)"
    return "permutation of the batches from (seed, epoch)"


def save(trainer) -> Path:
    """Write and publish the checkpoint of ``trainer.step``; returns its directory."""
    t0 = time.perf_counter()
    step, group, rank = trainer.step, trainer.group, trainer.rank
    arrays, slices = shard_arrays(trainer.coll, trainer.plan, rank)
    if rank == 0:
        arrays.update(dense_arrays(trainer.model, trainer.optimizer))
        arrays.update(vocabulary_arrays(trainer.data.vocabularies))
    writer = CheckpointWriter(trainer.checkpoint_dir, step, rank, trainer.size)
    exc = None
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            exc = NonFiniteError(f"{name} holds NaN or inf; the checkpoint of step {step} is "
                                 f"not written", step=step, tensor=name)
            break
    if exc is None:
        try:
            writer.write(arrays, slices)
        except (OSError, ValueError, TypeError) as e:
            exc = e
    fail_together(group, "checkpoint", exc, step=step, tag="checkpoint")
    exc = None
    if rank == 0:
        try:
            writer.commit(plan=trainer.plan, tables=trainer.tables,
                          state=manifest_state(trainer))
        except (OSError, ValueError, TypeError) as e:
            exc = e
    fail_together(group, "checkpoint", exc, step=step, tag="checkpoint")
    if rank == 0:
        try:
            prune(trainer.checkpoint_dir, trainer.cfg.checkpoint.keep)
        except OSError as e:  # an old checkpoint that will not go away is no reason to stop
            _log.warning("could not remove old checkpoints under %s: %s",
                         trainer.checkpoint_dir, e)
    seconds = time.perf_counter() - t0
    trainer.metrics.write("checkpoint", step=step, path=str(writer.final),
                          seconds=round(seconds, 3))
    trainer.progress.message(f"step {step}: checkpoint written to {writer.final} "
                             f"({seconds:.1f} s)")
    return writer.final


def resume(trainer, where: str) -> int:
    """Load ``where`` into ``trainer``: ``latest``, ``auto`` (none: start fresh) or a directory.

    Returns the step resumed at (0 when ``auto`` found nothing). Every rank
    raises the same error when any rank cannot load its part.
    """
    group = trainer.group
    exc, ckpt, found = None, None, 1
    try:
        if where in ("latest", "auto"):
            path = latest_checkpoint(trainer.checkpoint_dir)
            if path is None:
                if where == "latest":
                    raise CheckpointError("no complete checkpoint to resume from",
                                          path=str(trainer.checkpoint_dir))
                found = 0
        else:
            path = Path(where)
        if found:
            ckpt = Checkpoint(path)
            _load(trainer, ckpt)
    except (CheckpointError, ValueError, OSError, KeyError) as e:
        exc = e
    step = ckpt.step if ckpt is not None and exc is None else 0
    fail_together(group, "resuming from a checkpoint", exc, tag="checkpoint",
                  signature=[("found", found), ("step", step)])
    if not found:
        _log.info("no checkpoint under %s; starting from step 0", trainer.checkpoint_dir)
        return 0
    trainer.step = step
    trainer.last_checkpoint = ckpt.path
    trainer.last_eval = ckpt.state.get("eval")
    trainer.progress.message(f"resumed from {ckpt.path} at step {step}")
    return step


def _load(trainer, ckpt: Checkpoint) -> None:
    cfg = trainer.cfg
    model = trainer.model
    check_vocabularies(ckpt, trainer.data.vocabularies)  # (before the sizes: it says why)
    saved_dense = _check_dense_transforms(trainer, ckpt)
    ckpt.check_compatible(trainer.tables, arrays={
        "dense/params": ((model.buffers.numel,), model.dtype.str)})
    check_state(ckpt, trainer.state_expectations())
    state = ckpt.state
    written = int(state.get("global_batch_size", -1))
    carry = False  # the data position moves to this run's batches
    if written != cfg.train.batch_size:
        if trainer.given_batch or written <= 0:
            raise CheckpointMismatchError(
                f"written with a global batch of {state.get('global_batch_size')}, this run "
                f"has {cfg.train.batch_size}; the data position only carries over with the "
                f"same global batch (train.batch_size; 0 takes the checkpoint's when it "
                f"splits over the ranks)", path=str(ckpt.path), field="batch_size")
        # the default batch: the checkpoint's when it splits over this run's ranks
        carry = bool(written % trainer.size)
    if int(state.get("seed", -1)) != cfg.train.seed:
        raise CheckpointMismatchError(
            f"written with seed {state.get('seed')}, this run has seed {cfg.train.seed}",
            path=str(ckpt.path), field="seed")
    _use_dense_transforms(trainer, saved_dense)
    load_shards(ckpt, trainer.coll, trainer.plan, trainer.rank)
    load_dense(ckpt, model, trainer.optimizer)
    if written != cfg.train.batch_size and not carry:
        trainer.use_batch(written)
        trainer.progress.message(f"global batch {written}, as the checkpoint's")
    if trainer.reader is not None:  # (a model loaded for scoring has no training reader)
        position = state["reader"]
        if carry:
            position = trainer.reader.carry_over(position)
        trainer.reader.load_state_dict(position)
    if carry and trainer.reader is not None:
        trainer.progress.message(
            f"the checkpoint's global batch of {written} does not split over {trainer.size} "
            f"ranks: training goes on with {cfg.train.batch_size} from epoch "
            f"{position.get('epoch', '?')}, batch {position.get('batch', '?')}")


def saved_dense_transforms(ckpt, schema):
    """The dense transforms ``ckpt`` was trained with: its manifest's ``dense_transforms``,
    or, for a checkpoint written before dense transforms existed, ``schema``'s dense
    columns as they are (fill only)."""
    from embedding.data.transforms import DenseTransforms

    state = ckpt.state.get("dense_transforms")
    if state is None:
        return DenseTransforms.untransformed(schema)
    return DenseTransforms.from_state(state)


def _check_dense_transforms(trainer, ckpt: Checkpoint):
    """The checkpoint's dense transforms (None without a Parquet source); a checkpoint whose
    columns, fill, clip or transform differ from the config's is refused, naming the key."""
    if trainer.data.dense_transforms is None:
        return None
    schema = trainer.cfg.data.schema()
    saved = saved_dense_transforms(ckpt, schema)
    old = "dense_transforms" not in ckpt.state
    have = [c.column for c in saved.columns]
    want = [d.column for d in schema.dense]
    if have != want:
        raise CheckpointMismatchError(f"the checkpoint's dense columns are {have}, the "
                                      f"config's {want}", path=str(ckpt.path),
                                      field="data.dense")
    if not old:
        for i, (d, c) in enumerate(zip(schema.dense, saved.columns)):
            for key, a, b in (("transform", c.transform, d.transform),
                              ("clip", c.clip, d.clip), ("fill", c.fill, d.fill)):
                if a != b:
                    raise CheckpointMismatchError(
                        f"data.dense[{i}].{key} of column {d.column!r} is {b!r} in the "
                        f"config, {a!r} in the checkpoint; the model was trained on the "
                        f"checkpoint's inputs", path=str(ckpt.path),
                        field=f"data.dense[{i}].{key}")
    return saved


def _use_dense_transforms(trainer, saved) -> None:
    """Put the checkpoint's dense statistics in place of the scanned ones: the model goes on
    seeing its inputs as it was trained."""
    mine = trainer.data.dense_transforms
    if saved is None or mine is None:
        return
    if saved != mine or saved.legacy != mine.legacy:
        mine.load(saved)
        if saved.legacy:
            trainer.progress.message("the checkpoint has no dense statistics (written before "
                                     "dense transforms): its dense columns go in as they are")
        elif trainer.reader is not None:
            trainer.progress.message("the dense columns are transformed with the "
                                     "checkpoint's statistics (the training files' differ)")
