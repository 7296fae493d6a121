"""neocomm inside an application's own MPI job: a world on a sub-communicator, next to the
application's traffic on MPI.COMM_WORLD.

Each test launches a real job through ``neocomm run`` (a hang ends in the launcher's timeout)
and checks what every rank printed.
"""
from __future__ import annotations

import re

from _jobs import python_job

JOB_TIMEOUT = 120


def test_two_worlds_on_halves_of_the_job_beside_the_applications_traffic(tmp_path):
    out = python_job(tmp_path, """
import numpy as np
from mpi4py import MPI

import collectives as C
import neocomm
from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.planner import Hardware, plan_sharding
from embedding.types import TableConfig

app = MPI.COMM_WORLD
half = app.rank % 2
sub = app.Split(half, app.rank)
w = neocomm.init(comm=sub)          # one neocomm world per half: even ranks, odd ranks
assert (w.size, w.rank) == (app.size // 2, app.rank // 2), (w.size, w.rank)
# the application's own collective in flight on COMM_WORLD while neocomm works on its half
mine, total = np.array([app.rank], np.int64), np.zeros(1, np.int64)
req = app.Iallreduce(mine, total)
summed = C.all_reduce(np.full(4, float(app.rank)), np.empty(4))
tables = [TableConfig("t", 40, 4, "sum", ("f",)), TableConfig("u", 30, 4, "sum", ("g",))]
plan = plan_sharding(tables, Hardware(w.size, 1, 1 << 30)).plan
coll = ShardedEmbeddingCollection(tables, plan, w.world, seed=1)
kjt = KeyedJagged(["f", "g"], np.array([1, 2, 3, 4]), np.array([1, 1, 1, 1]))
pooled = coll.forward(kjt)
coll.backward(np.ones_like(pooled))
req.Wait()
app.Barrier()                       # and another one after neocomm's
print(f"OK rank {app.rank} half {half} neocomm {summed[0]:.0f} app {total[0]} "
      f"pooled {pooled.shape}", flush=True)
""", n=4, timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode == 0, out.output
    lines = dict((int(m[1]), m) for m in re.finditer(
        r"OK rank (\d) half (\d) neocomm (\d+) app (\d+) pooled \((\d+), (\d+)\)", out.stdout))
    assert sorted(lines) == [0, 1, 2, 3], out.output
    for rank, m in lines.items():
        # half 0 holds ranks 0 and 2, half 1 ranks 1 and 3; the application sums all four
        assert int(m[3]) == (2 if rank % 2 == 0 else 4) and int(m[4]) == 6, m[0]
        assert (int(m[5]), int(m[6])) == (2, 8), m[0]
