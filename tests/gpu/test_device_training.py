"""A short DLRM training run on device arrays, against the same run on NumPy.

``train.device = "cuda"``: tables, activations and gradients are CuPy
arrays on each rank's GPU and the collectives go over NCCL (or the staged
backend); the stand-in when no GPU is here. Same data and seeds, so the
loss of every step and the held-out AUC must equal the NumPy run's to
float32 tolerance, with and without overlap, for every sharding type the
planner may pick.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp
from embedding.train import Trainer, parse_config

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.training]
STEPS = 5


def _config(out, device, **sections):
    doc = {"tables": {"rows": [50, 70, 30, 200]},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "data": {"records": 4800, "eval_records": 96},
           "train": {"steps": STEPS, "batch_size": 48, "eval_every": 0, "log_every": 1,
                     "device": device},
           "output": {"dir": str(out)}}
    for name, body in sections.items():
        doc.setdefault(name, {}).update(body)
    return parse_config(doc, "test")


def _train(cfg, world):
    t = Trainer(cfg, world.world)
    t.train()
    t.close()
    return t


@pytest.mark.parametrize("backend", ["nccl", "staged"])
@pytest.mark.parametrize("sharding,overlap", [("table_wise", True), ("row_wise", False),
                                              ("column_wise", True),
                                              ("table_row_wise", True),
                                              ("data_parallel", False),
                                              ("cyclic_row_wise", True)])
def test_device_training_matches_numpy(world, all_ranks, tmp_path, monkeypatch, backend,
                                       sharding, overlap):
    if sharding == "table_row_wise" and not world.uniform:
        pytest.skip("table_row_wise needs the same number of ranks on every node")
    monkeypatch.setenv("NEOCOMM_BACKEND", backend)
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    opts = dict(plan={"shardings": [sharding]}, train={"overlap": overlap})
    if sharding == "column_wise":  # column slices are 32 wide at least
        dim = 32 * world.size
        opts["model"] = {"embedding_dim": dim, "bottom_mlp": [16, dim]}
    host = _train(_config(f"{base}/cpu", "cpu", **opts), world)
    dev = _train(_config(f"{base}/cuda", "cuda", **opts), world)
    all_ranks(dev.coll.xp is cp and isinstance(dev.coll.local_shards()[0].weight, cp.ndarray),
              "the device run did not keep its tables on the device")
    a = np.array([loss for _, loss in host.losses])
    b = np.array([loss for _, loss in dev.losses])
    all_ranks(len(a) == len(b) == STEPS, f"{len(a)} and {len(b)} losses")
    all_ranks(np.allclose(a, b, rtol=1e-5, atol=1e-6), f"NumPy {a} vs device {b}")
    all_ranks(abs(host.last_eval["auc"] - dev.last_eval["auc"]) < 1e-4,
              f"AUC NumPy {host.last_eval} vs device {dev.last_eval}")


def test_device_training_with_half_tables_matches_numpy(world, all_ranks, tmp_path, monkeypatch):
    """bfloat16 tables with stochastic rounding: the device run draws the same rounding bits,
    so its losses follow the NumPy run's."""
    monkeypatch.setenv("NEOCOMM_BACKEND", "nccl")
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    opts = dict(plan={"shardings": ["table_wise"]},
                tables={"dtype": "bfloat16", "rounding": "stochastic", "rounding_seed": 5})
    host = _train(_config(f"{base}/cpu", "cpu", **opts), world)
    dev = _train(_config(f"{base}/cuda", "cuda", **opts), world)
    shard = dev.coll.local_shards()[0].weight
    all_ranks(isinstance(shard, cp.ndarray) and shard.dtype.name == "bfloat16",
              f"the device run keeps {type(shard).__name__} of {shard.dtype}")
    a = np.array([loss for _, loss in host.losses])
    b = np.array([loss for _, loss in dev.losses])
    all_ranks(len(a) == len(b) == STEPS, f"{len(a)} and {len(b)} losses")
    all_ranks(np.allclose(a, b, rtol=1e-5, atol=1e-6), f"NumPy {a} vs device {b}")
