"""The benchmark harness end to end: every op, checked iterations agree across ranks."""
from __future__ import annotations

import pytest

import collectives as C
from collectives.algorithms import names
from collectives.bench import PEER, BenchConfig, run_bench
from collectives.types import CollectiveOp

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x1", "1x2", "2x2", why=(
    "the harness on one rank, on one node and across nodes"))]


@pytest.mark.parametrize("op", list(CollectiveOp))
def test_every_op_benchmarks_without_wrong_elements(world, all_ranks, op):
    cfg = BenchConfig(op, min_bytes=4096, max_bytes=16384, factor=4, iters=2, warmup=1,
                      check=1, repeat=1, algos=("auto", "all"))
    rows = run_bench(cfg, world.world)
    algos = {r.algo for r in rows}
    ok = PEER in algos and "auto" in algos and all(r.wrong == 0 for r in rows)
    ok = ok and all(r.time > 0 and r.busbw >= 0 for r in rows)
    ok = ok and all(r.ratio is not None for r in rows if r.algo != PEER)
    ok = ok and all(r.chosen in names(op) for r in rows if r.algo == "auto")
    all_ranks(ok, str([(r.size, r.algo, r.chosen, r.wrong) for r in rows]))


@pytest.mark.parametrize("prepared", [False, True])
def test_auto_rows_name_the_algorithm_their_plan_runs(world, all_ranks, prepared):
    cfg = BenchConfig(CollectiveOp.ALL_REDUCE, min_bytes=4096, max_bytes=4096, iters=1,
                      warmup=1, check=0, repeat=1, algos=("auto", "ring"), prepared=prepared)
    rows = {r.algo: r for r in run_bench(cfg, world.world)}
    plan = C.state_of(None).plans.latest("all_reduce")
    want = rows["auto"].chosen in names(CollectiveOp.ALL_REDUCE) and rows["ring"].chosen == "ring"
    all_ranks(want and (prepared or plan.algo == rows["auto"].chosen),
              str({a: r.chosen for a, r in rows.items()}))


def test_half_precision_reduction_and_unknown_algorithm(world, all_ranks):
    cfg = BenchConfig(CollectiveOp.ALL_REDUCE, 2048, 2048, 1.0, iters=1, warmup=0, check=2,
                      repeat=1, algos=("ring",), dtype="float16")
    rows = run_bench(cfg, world.world)
    all_ranks(all(r.wrong == 0 for r in rows))
    with pytest.raises(ValueError, match="unknown algorithm"):
        run_bench(BenchConfig(CollectiveOp.ALL_REDUCE, algos=("bogus",)), world.world)


@pytest.mark.parametrize("op", [CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER])
def test_bfloat16_products_checked_within_the_bound(world, all_ranks, op):
    """bfloat16 products through the MPI peer (the backend's user ops) and our algorithms,
    checked against the exact products within the bound of neocomm.reduction."""
    from neocomm.types import bfloat16

    if bfloat16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    cfg = BenchConfig(op, 4096, 4096, 1.0, iters=1, warmup=0, check=2, repeat=1,
                      algos=("native", "ring", "rabenseifner"), dtype="bfloat16",
                      reduce_op="prod")
    rows = run_bench(cfg, world.world)
    all_ranks({r.algo for r in rows} == {PEER, "native", "ring", "rabenseifner"}
              and all(r.wrong == 0 for r in rows), str([(r.algo, r.wrong) for r in rows]))


@pytest.mark.parametrize("op", [CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER,
                                CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_GATHER,
                                CollectiveOp.BROADCAST])
def test_symmetric_buffers(world, all_ranks, op):
    """-R: every algorithm and the MPI peer on symmetric buffers, checked."""
    group = world.world if world.num_nodes == 1 else world.intra_node
    cfg = BenchConfig(op, min_bytes=8192, max_bytes=8192, factor=1, iters=2, warmup=1,
                      check=2, repeat=1, algos=("native", "symmetric", "auto"),
                      root=group.size - 1, symmetric=True)
    rows = run_bench(cfg, group)
    all_ranks({r.algo for r in rows} == {PEER, "native", "symmetric", "auto"}
              and all(r.wrong == 0 for r in rows), str([(r.algo, r.wrong) for r in rows]))


def test_calibration_on_symmetric_buffers(world, all_ranks):
    """--calibrate with -R prices the symmetric algorithm as the calls ran it."""
    import json
    import math
    import os
    import tempfile

    from neocomm.cli import main

    if world.num_nodes != 1 or world.size < 2:
        pytest.skip("needs 2 or more ranks in one node")
    folder = world.comm.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
    path = os.path.join(folder, "cal.json")
    status = main(["bench", "all_reduce", "-R", "--algo", "native,symmetric",
                   "-b", "64K", "-e", "256K", "-f", "4", "-n", "2", "-w", "1", "-r", "1",
                   "--calibrate", path])
    world.comm.Barrier()
    with open(path, encoding="utf-8") as fh:
        factors = json.load(fh)["algorithm_factors"]
    sym = [v for k, v in factors.items() if k.startswith("all_reduce/symmetric")]
    all_ranks(status == 0 and len(sym) == 3 and all(0 < v < math.inf for v in sym),
              f"status {status}, factors {factors}")


def test_several_ops_run_in_one_job_a_file_each(world, all_ranks, tmp_path, capsys):
    """``neocomm bench OP OP ... --json 'name_{op}.json'``: each op its own table and file,
    in the order given, each once (``all`` is every op); an ``--algo`` that one of them
    lacks is refused before any op runs, and so is one file for several ops; ``--calibrate``
    keeps every op's factors in its one file."""
    import json
    import os

    from neocomm.cli import main

    folder = world.comm.bcast(str(tmp_path) if world.rank == 0 else None)
    pattern = os.path.join(folder, "bench_{op}.json")
    sweep = ["-b", "4K", "-e", "4K", "-n", "1", "-w", "1", "-r", "1"]
    status = main(["bench", "broadcast", "all_gather", "broadcast", *sweep, "--json", pattern])
    out = capsys.readouterr().out
    world.comm.Barrier()  # rank 0 writes the files after the last call
    heads = [line.split(":")[0] for line in out.splitlines() if line.startswith("# neocomm")]
    files = sorted(os.listdir(folder))
    ok = status == 0 and files == ["bench_all_gather.json", "bench_broadcast.json"]
    if world.rank == 0:
        ok = ok and heads == ["# neocomm bench broadcast", "# neocomm bench all_gather"]
        for op in ("all_gather", "broadcast"):
            with open(pattern.format(op=op), encoding="utf-8") as fh:
                data = json.load(fh)
            ok = ok and data["op"] == op and data["rows"] and all(
                r["wrong"] == 0 for r in data["rows"])
    all_ranks(ok, f"status {status}, files {files}, tables {heads}")
    world.comm.Barrier()
    for name in files:
        if world.rank == 0:
            os.unlink(os.path.join(folder, name))
    world.comm.Barrier()
    refused = main(["bench", "all_reduce", "all_to_all", "--algo", "ring", *sweep,
                    "--json", pattern])
    err = capsys.readouterr().err
    one_file = main(["bench", "all", *sweep, "--json", os.path.join(folder, "one.json")])
    err += capsys.readouterr().err
    all_ranks(refused == 2 and one_file == 2 and not os.listdir(folder), err)
    if world.rank == 0:
        assert "--algo: unknown algorithm 'ring' for all_to_all" in err, err
        assert "--json " + os.path.join(folder, "one.json") + ": 8 ops write a file each" \
            in err, err
    # --calibrate gathers every op's factors in the one file
    cal = os.path.join(folder, "cal.json")
    status = main(["bench", "all_reduce", "reduce_scatter", "--algo", "native,ring", *sweep,
                   "--calibrate", cal])
    world.comm.Barrier()
    with open(cal, encoding="utf-8") as fh:
        factors = {k for k in json.load(fh)["algorithm_factors"] if "@" not in k}
    all_ranks(status == 0 and factors == {"all_reduce/native", "all_reduce/ring",
                                          "reduce_scatter/native", "reduce_scatter/ring"},
              f"status {status}, factors {sorted(factors)}")


def test_bench_times_the_users_call_unless_bare(world, all_ranks, monkeypatch):
    """By default every timed call agrees its arguments, as a user's call does; --bare
    times the collective alone. The footer's per-call overhead is the smallest size's
    time beyond the MPI peer's."""
    import json
    import os
    import tempfile

    from neocomm.agree import Agreement
    from neocomm.cli import main

    seen = []
    real = Agreement.run
    monkeypatch.setattr(Agreement, "run",
                        lambda self, *a, **kw: (seen.append(self.op), real(self, *a, **kw))[1])
    folder = world.comm.bcast(tempfile.mkdtemp() if world.rank == 0 else None)
    agreements = {}
    for bare in (False, True):
        seen.clear()
        path = os.path.join(folder, f"bench-{bare}.json")
        status = main(["bench", "all_to_all", "-b", "4K", "-e", "16K", "-f", "4", "-n", "3",
                       "-w", "1", "-r", "1", "-c", "0", "--json", path]
                      + (["--bare"] if bare else []))
        all_ranks(status == 0, f"status {status}")
        agreements[bare] = sum(op == "all_to_all" for op in seen)
        if world.rank == 0:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            small = min(r["size"] for r in data["rows"])
            at = {r["algo"]: r["time"] for r in data["rows"] if r["size"] == small}
            assert data["bare"] is bare
            assert abs(data["overhead_us"]["auto"] - (at["auto"] - at["mpi"]) * 1e6) < 1e-6
    # 2 sizes x (1 warm-up + 3 timed) calls at least agree by default; none when bare
    all_ranks(agreements[False] >= 8 and agreements[True] == 0, str(agreements))


def test_the_overhead_script_times_every_way_of_calling(world, all_ranks, capsys):
    """scripts/overhead_bench.py runs each way of calling beside its mpi4py twin and
    prints one row per way on rank 0, with both times measured."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "overhead_bench.py"
    spec = importlib.util.spec_from_file_location("overhead_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--iters", "30", "--rounds", "1", "--bytes", "512"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ")]
    if world.rank == 0:
        times = [(float(r[-4]), float(r[-3])) for r in rows]
        ok = len(rows) == 13 and all(a > 0 and b > 0 for a, b in times)
    else:
        ok = rows == []
    all_ranks(ok, f"rank {world.rank}: {rows}")
