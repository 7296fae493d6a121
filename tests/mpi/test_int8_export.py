"""Int8 tables on several ranks: an export of a checkpoint sets every rank's shards, under
row-wise, cyclic row-wise and column-wise plans, to the export's rows and columns.

    mpirun -n 2 python -m pytest --with-mpi tests/mpi/test_int8_export.py
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from embedding.checkpoint import Checkpoint, Int8Export
from embedding.train import Trainer
from embedding.train.export import export_int8, load_export_weights
from embedding.train.save import find_checkpoint

from test_train_parquet import config

pytestmark = pytest.mark.training


@pytest.mark.mpi(min_size=2)  # row- and column-wise shards need two ranks
@pytest.mark.parametrize("sharding", ["row_wise", "cyclic_row_wise", "column_wise"])
def test_every_rank_takes_its_shards_of_the_export(world, example, all_ranks, sharding):
    cfg = config(example, f"{example}/{sharding}")
    dim = 64 if sharding == "column_wise" else 8  # column slices are at least 32 wide
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, shardings=(sharding,)),
                              train=dataclasses.replace(cfg.train, steps=2),
                              model=dataclasses.replace(cfg.model, embedding_dim=dim,
                                                        bottom_mlp=(16, dim)))
    t = Trainer(cfg, world.world)
    t.train()
    t.close()
    ckpt = find_checkpoint(f"{example}/{sharding}")
    if world.rank == 0:
        export_int8(ckpt, f"{example}/{sharding}-int8")
    world.comm.barrier()
    ex = Int8Export(f"{example}/{sharding}-int8")
    served = Trainer(cfg, world.world, outputs=False)
    served.resume(str(ckpt))
    names = load_export_weights(ex, Checkpoint(ckpt), served.coll, served.plan)
    all_ranks(names == sorted(ex.tables), f"{names}")
    kinds = {tp.sharding.value for tp in served.plan.tables}
    all_ranks(kinds == {sharding}, f"the plan has {kinds}")
    bad = []
    for s in served.coll.local_shards():
        want = ex.rows(s.table)[s.shard.row_slice, s.shard.col_slice]
        if not np.array_equal(np.asarray(s.weight), want):
            bad.append((s.table, s.shard))
    served.close()
    all_ranks(not bad, f"shards not set to the export's rows: {bad}")
