"""The benchmark harness and CLI pieces that need no MPI."""
from __future__ import annotations

import argparse
import json

import pytest

from collectives.bench import BenchConfig, bus_factor, sizes
from collectives.types import CollectiveOp
from collectives.cli import bench as cli


def test_bus_factors_follow_nccl_tests():
    assert bus_factor(CollectiveOp.ALL_REDUCE, 4) == pytest.approx(1.5)
    for op in (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER, CollectiveOp.ALL_TO_ALL,
               CollectiveOp.ALL_TO_ALL_V):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert bus_factor(CollectiveOp.BROADCAST, 8) == 1.0
    assert bus_factor(CollectiveOp.ALL_REDUCE, 1) == 1.0


def test_sweep_sizes():
    cfg = BenchConfig(CollectiveOp.ALL_REDUCE, min_bytes=1 << 10, max_bytes=1 << 14, factor=2)
    assert sizes(cfg) == [1024, 2048, 4096, 8192, 16384]
    assert sizes(BenchConfig(CollectiveOp.ALL_REDUCE, 4096, 4096, 1.0)) == [4096]
    with pytest.raises(ValueError, match="-b <= -e"):
        sizes(BenchConfig(CollectiveOp.ALL_REDUCE, 8192, 4096))
    with pytest.raises(ValueError, match="factor"):
        sizes(BenchConfig(CollectiveOp.ALL_REDUCE, 1024, 4096, 1.0))


def _parse(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_cli_rejects_bad_arguments(capsys):
    assert cli.run(_parse(["not_an_op"])) == 2
    assert "op: expected one of" in capsys.readouterr().err
    assert cli.run(_parse(["all_reduce", "allgather", "not_an_op"])) == 2
    assert "got 'not_an_op' (or 'all')" in capsys.readouterr().err
    assert cli.run(_parse(["all_reduce", "allgather", "--json", "b.json"])) == 2
    assert "--json b.json: 2 ops write a file each; name it with {op}" \
        in capsys.readouterr().err
    assert cli.run(_parse(["all_reduce", "-n", "0"])) == 2
    assert "-n: expected >= 1" in capsys.readouterr().err
    assert cli.run(_parse([])) == 2


def test_cli_lists_algorithms(capsys):
    """--list prints one line per op, in CollectiveOp order, naming exactly the algorithms
    the registry holds for it, in tie-break order (what --algo and select accept)."""
    from collectives.algorithms import names

    assert cli.run(_parse(["--list"])) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [(row[0], row[1:]) for row in rows] == [(op.value, list(names(op)))
                                                   for op in CollectiveOp]


def test_plot_tables(tmp_path):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "plot_bench.py")
    spec = importlib.util.spec_from_file_location("plot_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = {"kind": "neocomm-bench", "op": "all_reduce", "ranks": 2, "nodes": 1,
           "dtype": "float32", "iters": 5, "repeat": 3, "peak_rss_bytes": 1 << 20,
           "staging_high_water_bytes": 0,
           "rows": [{"size": 1024, "algo": "mpi", "time": 1e-5, "busbw": 0.1, "wrong": 0},
                    {"size": 1024, "algo": "ring", "time": 5e-6, "busbw": 0.2, "wrong": 0,
                     "ratio": 2.0}]}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(run))
    table = mod.markdown(mod.load(str(f)))
    assert "| 1 KiB | 10 | 5 |" in table and "2.00" in table
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a `neocomm bench"):
        mod.load(str(bad))
