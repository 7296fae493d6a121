"""The trainer with quantized communication: AUC beside float32, bytes counted per step.

    mpirun -n 2 python scripts/mpi_pytest.py tests/mpi/test_train_qcomm.py
"""
from __future__ import annotations

import pytest

from embedding.train import Trainer, parse_config
from embedding.train.metrics import read_metrics
from test_train import shared_dir

pytestmark = pytest.mark.training

STEPS = 120


def config(out, comms, plan=None):
    doc = {"plan": plan or {},"tables": {"rows": [50, 70, 30, 200]},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "data": {"records": 48 * STEPS, "eval_records": 2160},
           "train": {"steps": STEPS, "batch_size": 48, "eval_every": 0, "log_every": STEPS,
                     "eval_batch_size": 240},  # splits over 2, 3 and 4 ranks
           "comms": comms, "output": {"dir": str(out)}}
    return parse_config(doc, "test")


def train(world, out, comms, plan=None, trainer=None):
    t = Trainer(config(out, comms, plan), world.world)
    t.train()
    t.close()
    record = None
    if world.rank == 0:
        record = [r for r in read_metrics(t.metrics.path) if r["event"] == "train"][-1]
    if trainer is not None:
        trainer.append(t)
    return t.last_eval["auc"], world.comm.bcast(record and record["comm_bytes"], root=0)


@pytest.mark.mpi(min_size=2)
def test_fp16_comms_keep_the_auc_and_halve_the_bytes(world, tmp_path, all_ranks):
    """Each 16-bit setting's held-out AUC within 0.005 of float32's: 2160 records of a model
    that reaches about 0.67, where rounding differences alone move the AUC by a few
    thousandths (measured at 3 ranks: int8/bf16 +0.0024 after row-wise AdaGrad's sum of
    squares took the device's order)."""
    base = shared_dir(world, tmp_path)
    auc32, bytes32 = train(world, f"{base}/fp32", {})
    auc16, bytes16 = train(world, f"{base}/fp16", {"forward": "fp16", "backward": "fp16",
                                                    "dense": "fp16", "loss_scale": 1024})
    auc_mix, bytes_mix = train(world, f"{base}/int8", {"forward": "int8", "backward": "bf16",
                                                        "dense": "bf16"})
    all_ranks(auc32 > 0.55, f"the float32 run did not learn: AUC {auc32}")
    all_ranks(abs(auc16 - auc32) <= 0.005, f"fp16 AUC {auc16} vs fp32 {auc32}")
    all_ranks(abs(auc_mix - auc32) <= 0.005, f"int8/bf16 AUC {auc_mix} vs fp32 {auc32}")
    all_ranks(all(v > 0 for v in bytes32.values()), f"nothing counted: {bytes32}")
    all_ranks(all(2 * bytes16[k] == bytes32[k] for k in bytes32), f"{bytes16} vs {bytes32}")
    # int8 rows of 8 values: 8 codes + 8 bytes of scale and bias for 32 bytes in fp32
    all_ranks(2 * bytes_mix["emb_forward"] == bytes32["emb_forward"]
              and 2 * bytes_mix["emb_backward"] == bytes32["emb_backward"]
              and 2 * bytes_mix["dense"] == bytes32["dense"], f"{bytes_mix} vs {bytes32}")


@pytest.mark.mpi(min_size=2)
def test_data_parallel_tables_follow_the_dense_setting(world, tmp_path, all_ranks):
    """Every table data-parallel: ``[comms] dense`` (and the fp16 loss scale) governs their
    gradient AllReduce as the dense model's; comm_bytes.dense counts both AllReduces.

    Tolerances: each step's global loss within 0.02 of the float32 run's, and the held-out
    AUC within 0.01 (2160 records of a model that reaches about 0.67: the AUC of any 16-bit
    setting, table-wise ones too, moves by a few thousandths at 4 ranks; measured here
    fp16 +0.003, bf16 -0.005, the losses within 0.008).
    """
    base = shared_dir(world, tmp_path)
    plan = {"shardings": ["data_parallel"]}
    runs = []
    auc32, bytes32 = train(world, f"{base}/dp32", {}, plan, runs)
    auc16, bytes16 = train(world, f"{base}/dp16", {"dense": "fp16", "loss_scale": 1024}, plan,
                           runs)
    auc_bf, bytes_bf = train(world, f"{base}/dpbf", {"dense": "bf16"}, plan, runs)
    t = runs[0]
    tables = sum(tb.num_rows * (tb.dim + 1) * 4 for tb in t.tables)  # gradients + flags
    all_ranks(auc32 > 0.55, f"the float32 run did not learn: AUC {auc32}")
    all_ranks(abs(auc16 - auc32) <= 0.01 and abs(auc_bf - auc32) <= 0.01,
              f"AUC fp16 {auc16}, bf16 {auc_bf} vs fp32 {auc32}")
    for r in runs[1:]:
        worst = max(abs(a - b) for (_, a), (_, b) in zip(r.losses, t.losses))
        all_ranks(len(r.losses) == len(t.losses) == STEPS and worst <= 0.02,
                  f"step losses differ from float32's by up to {worst}")
    all_ranks(bytes32["emb_forward"] == bytes32["emb_backward"] == 0, f"{bytes32}")
    all_ranks(bytes32["dense"] == t.model.flat_grads.nbytes + tables,
              f"dense bytes {bytes32['dense']}: the dense gradients' "
              f"{t.model.flat_grads.nbytes} + the tables' {tables}")
    all_ranks(2 * bytes16["dense"] == bytes32["dense"] == 2 * bytes_bf["dense"],
              f"{bytes16} and {bytes_bf} vs {bytes32}")
