"""The simulator's pick is the runtime's: on this job's own fabric, the algorithm
``neocomm simulate`` predicts for each size is the one the call runs."""
from __future__ import annotations

import pytest

from collectives.bench import BenchConfig, run_bench
from collectives.fabric import fabric_for
from collectives.simulate import predict
from collectives.types import CollectiveOp

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.layouts("all", why=(
    "the pick to agree with changes with the rank count and the nodes"))]


@pytest.mark.parametrize("op", list(CollectiveOp), ids=lambda op: op.value)
def test_the_predicted_algorithm_is_the_one_that_runs(world, all_ranks, op):
    cfg = BenchConfig(op, min_bytes=1 << 10, max_bytes=4 << 20, factor=64, iters=1, warmup=0,
                      check=0, repeat=1, algos=("auto",))
    ran = [r.chosen for r in run_bench(cfg, world.world) if r.algo == "auto"]
    table = predict(op, fabric_for(world.world), [1 << 10, 1 << 16, 4 << 20])
    predicted = [next(r.algo for r in rows if r.selected) for rows in table]
    all_ranks(ran == predicted, f"ran {ran}, predicted {predicted}")
