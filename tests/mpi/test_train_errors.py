"""Bad data, non-finite tensors and unusable checkpoints stop training on every rank, together.

    mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_train_errors.py

Each case poisons one rank's part of one batch (or one file) and checks that
every rank raises the same error naming the step and the tensor (or the
file and record), and that the last good checkpoint is still the latest.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from embedding.checkpoint import latest_checkpoint
from embedding.data import Batch, BinaryWriter, SyntheticConfig, SyntheticDataset
from embedding.train import ConfigError, Trainer, TrainingError, parse_config
from embedding.train.data import open_data

pytestmark = pytest.mark.training

BATCH = 48
ROWS = [50, 70, 30, 200]


def small_config(out, **sections):
    doc = {"tables": {"rows": ROWS},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "data": {"records": 4800, "eval_records": 96},
           "train": {"steps": 5, "batch_size": BATCH, "eval_every": 0, "log_every": 5},
           "checkpoint": {"every": 2},
           "output": {"dir": str(out)}}
    for name, body in sections.items():
        doc.setdefault(name, {}).update(body)
    return parse_config(doc, "test")


def shared_dir(world, tmp_path) -> str:
    return world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)


class Poisoned:
    """``dataset`` with record ``record``'s label or dense features (one ``column``, or all)
    replaced by ``value``."""

    def __init__(self, dataset, record: int, field: str, value: float, column=None):
        self.dataset, self.record, self.field, self.value = dataset, record, field, value
        self.column = slice(None) if column is None else column
        self.num_records = dataset.num_records
        self.feature_names = dataset.feature_names

    def read(self, start, stop):
        b = self.dataset.read(start, stop)
        if not start <= self.record < stop:
            return b
        dense, labels = b.dense.copy(), b.labels.copy()
        if self.field == "dense":
            dense[self.record - start, self.column] = self.value
        else:
            labels[self.record - start] = self.value
        return Batch(dense, labels, b.values, b.lengths, b.feature_names)


def poisoned_run(world, out, step: int, rank: int, field: str, value: float, column=None):
    """Train with a record of ``rank``'s slice of ``step``'s batch poisoned; the error."""
    cfg = small_config(out)
    data = open_data(cfg)
    record = (step - 1) * BATCH + rank * (BATCH // world.size) + 1
    data = dataclasses.replace(data, train=Poisoned(data.train, record, field, value, column))
    t = Trainer(cfg, world.world, data=data)
    with pytest.raises(TrainingError) as info:
        t.train()
    t.close()
    return t, info.value


def test_nan_feature_stops_every_rank_and_keeps_the_checkpoint(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    bad_rank = world.size - 1
    t, err = poisoned_run(world, f"{base}/nan", 3, bad_rank, "dense", float("nan"), column=3)
    all_ranks(err.step == 3 and err.tensor == "dense", f"{err.step} {err.tensor}: {err}")
    all_ranks(err.ranks == (bad_rank,), f"ranks {err.ranks}")
    all_ranks("step 3" in str(err) and "dense" in str(err), str(err))
    latest = latest_checkpoint(f"{base}/nan/checkpoints")
    all_ranks(latest is not None and latest.name == "step-000000000002", f"{latest}")
    all_ranks(t.step == 2, f"stopped after step {t.step}")


def test_label_outside_0_1_names_step_and_tensor(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    _, err = poisoned_run(world, f"{base}/label", 2, 0, "labels", 2.0)
    all_ranks(err.step == 2 and err.tensor == "labels", f"{err.step} {err.tensor}: {err}")
    all_ranks("outside {0, 1}" in str(err), str(err))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's overflow warnings, expected
def test_infinite_loss_stops_before_any_update(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    t, err = poisoned_run(world, f"{base}/inf", 4, world.size // 2, "dense", 3.0e38)
    all_ranks(err.step == 4 and err.tensor in ("loss", "d_pooled", "dense_grads"),
              f"{err.tensor}: {err}")
    latest = latest_checkpoint(f"{base}/inf/checkpoints")
    all_ranks(latest is not None and latest.name == "step-000000000002", f"{latest}")
    all_ranks(np.isfinite(t.model.flat_params).all(), "the dense model was updated")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_overflowing_optimizer_state_is_not_checkpointed(world, tmp_path, all_ranks):
    # A huge but finite feature: the loss stays finite, squared gradients overflow the
    # optimizer state; the checkpoint of that step is refused and step 2's stays the latest.
    base = shared_dir(world, tmp_path)
    _, err = poisoned_run(world, f"{base}/big", 4, 0, "dense", 1e30, column=3)
    all_ranks(err.step == 4 and "holds NaN or inf" in str(err) and "not written" in str(err),
              str(err))
    latest = latest_checkpoint(f"{base}/big/checkpoints")
    all_ranks(latest is not None and latest.name == "step-000000000002", f"{latest}")


def _binary_file(path, records: int) -> None:
    ds = SyntheticDataset(SyntheticConfig(table_sizes=tuple(ROWS), seed=0), records)
    with BinaryWriter(path, ROWS, num_dense=13, chunk_records=8) as w:
        w.write_batch(ds.read(0, records))


def test_corrupt_data_file_names_file_and_record(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    path = f"{base}/data.bin"
    if world.rank == 0:
        _binary_file(path, 960)
        from embedding.data import BinaryDataset

        ds = BinaryDataset(path)
        record = 3 * BATCH + 5  # in the batch of step 4
        offset = ds.header_bytes + record * ds.dtype.itemsize + 10
        with open(path, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0xFF]))
    world.comm.Barrier()
    cfg = small_config(f"{base}/corrupt", data={"source": "binary", "path": path,
                                                "records": 1, "eval_records": 96})
    t = Trainer(cfg, world.world)
    with pytest.raises(TrainingError) as info:
        t.train()
    t.close()
    msg = str(info.value)
    all_ranks(info.value.step == 4 and "data.bin" in msg and "record" in msg and "crc32" in msg,
              msg)


def test_truncated_data_file_fails_on_every_rank(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    path = f"{base}/cut.bin"
    if world.rank == 0:
        _binary_file(path, 960)
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.truncate(size - 1000)
    world.comm.Barrier()
    cfg = small_config(f"{base}/cut", data={"source": "binary", "path": path, "records": 1})
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, world.world)
    msg = str(info.value)
    all_ranks("cut.bin" in msg and "truncated" in msg and "record" in msg, msg)


def test_bad_checkpoints_are_refused_with_the_reason(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    t = Trainer(small_config(f"{base}/ck", train={"steps": 2}), world.world)
    t.train()
    t.close()
    ckpt = f"{base}/ck/checkpoints/step-000000000002"
    # A model that does not match the manifest: another embedding dimension, another MLP.
    for sections, field in (({"model": {"embedding_dim": 4, "bottom_mlp": [16, 4]}}, "dim"),
                            ({"model": {"top_mlp": [8, 1]}}, "dense"),
                            ({"sparse_optimizer": {"kind": "sgd"}}, "sparse_optimizer")):
        other = Trainer(small_config(f"{base}/ck", **sections), world.world)
        with pytest.raises(TrainingError) as info:
            other.resume(ckpt)
        other.close()
        all_ranks(field in str(info.value) and info.value.tensor == "checkpoint",
                  f"{field}: {info.value}")
    # A file whose bytes no longer match its checksum.
    if world.rank == 0:
        victim = sorted(p for p in os.listdir(f"{ckpt}/rank-00000") if "weight" in p)[0]
        with open(f"{ckpt}/rank-00000/{victim}", "r+b") as fh:
            fh.seek(-3, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-3, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0x55]))
    world.comm.Barrier()
    again = Trainer(small_config(f"{base}/ck"), world.world)
    with pytest.raises(TrainingError) as info:
        again.resume("latest")
    again.close()
    all_ranks("checksum" in str(info.value) and "refusing" in str(info.value), str(info.value))


def test_config_that_does_not_fit_the_world_is_refused_everywhere(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    if world.size > 1:
        with pytest.raises(ConfigError) as info:
            Trainer(small_config(f"{base}/cfg", train={"batch_size": 49}), world.world)
        all_ranks(info.value.key == "train.batch_size" or "train.batch_size" in str(info.value),
                  str(info.value))
    plan = f"{base}/plan.json"
    if world.rank == 0:
        from embedding.types import Shard, ShardingPlan, ShardingType, TablePlan

        tables = tuple(TablePlan(f"f{i}", ShardingType.TABLE_WISE, (Shard(0, 0, n, 0, 8),))
                       for i, n in enumerate(ROWS))
        with open(plan, "w") as fh:
            fh.write(ShardingPlan(world.size + 1, 1, tables).to_json())
    world.comm.Barrier()
    with pytest.raises(ConfigError) as info:
        Trainer(small_config(f"{base}/cfg", plan={"file": plan}), world.world)
    all_ranks("plan.file" in str(info.value) and f"{world.size + 1} ranks" in str(info.value),
              str(info.value))
