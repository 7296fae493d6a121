"""Every collective and algorithm, blocking and asynchronous, and the differential fuzzer,
on ranks of real hosts joined by TCP: the MPI test files themselves, run under
``neocomm run --hostfile`` at 2 hosts x 1 rank, 2 x 2 and 2 + 1 (hosts of uneven size).

The fuzzer's figures for docs/reliability.md (cases, refusals; wrong results fail the test):

    FUZZ_EXAMPLES=2000 python -m pytest -s tests/cluster/test_collectives_across_hosts.py

Emulated nodes share one host's memory and scheduler; here messages between hosts
cross a network with its own timing and completion order, as on a cluster (Bruck's
AlltoAll once returned wrong elements here and nowhere else).
"""
from __future__ import annotations

import os
import re

import pytest
from conftest import explain, neocomm_run

#: the MPI test files that check results against NumPy or MPI itself, elementwise
FILES = ["tests/mpi/test_collectives.py", "tests/mpi/test_collectives_async.py",
         "tests/mpi/test_collectives_arrays.py", "tests/mpi/test_fuzz.py"]


@pytest.mark.parametrize("slots", [{"node-a": 1, "node-b": 1}, {"node-a": 2, "node-b": 2},
                                   {"node-a": 2, "node-b": 1}], ids=["2x1", "2x2", "2+1"])
def test_collectives_are_exact_across_hosts(two_hosts, slots):
    c = two_hosts
    nprocs = sum(slots.values())
    hf = c.hostfile(slots, name=f"hosts-{'-'.join(map(str, slots.values()))}")
    outdir = os.path.join(c.workdir, f"out-{nprocs}-{len(slots)}")
    os.makedirs(outdir, exist_ok=True)
    report = os.path.join(outdir, "fuzz.txt")
    env = c.launch_env(MPI_PYTEST_OUTDIR=outdir, NEOCOMM_TIMEOUT="120", FUZZ_REPORT=report)
    done = neocomm_run(c, nprocs, ["python", "scripts/mpi_pytest.py", *FILES], hostfile=hf,
                       env=env, timeout=900)
    reports = []
    for name in sorted(os.listdir(outdir)):
        if name.endswith(".log"):
            with open(os.path.join(outdir, name)) as fh:
                reports.append(f"--- {name}\n{fh.read()[-3000:]}")
    if os.path.exists(report):  # the fuzzer's figures (shown with pytest -s)
        with open(report) as fh:
            for line in fh:
                print(f"{'+'.join(map(str, slots.values()))} on 2 hosts: {line.strip()}")
    assert done.returncode == 0, explain(done) + "\n".join(reports)
    summary = re.findall(r"(\d+) (passed|failed|errors?)", done.stdout.splitlines()[-1])
    counts = {word: int(n) for n, word in summary}
    assert counts.get("passed", 0) > 50 and not counts.get("failed"), done.stdout[-2000:]
    c.assert_clean()


def test_bench_all_to_all_every_algorithm_checked_at_2x2(two_hosts):
    """What a user types to compare AlltoAll algorithms between two hosts: every row
    checked, none wrong (Bruck's once was, here and on no emulated layout)."""
    import json

    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2}, name="hosts-bench")
    out = os.path.join(c.workdir, "bench-a2a.json")
    done = neocomm_run(c, 4, ["neocomm", "bench", "all_to_all", "-b", "256K", "-e", "1M",
                              "-f", "4", "-n", "2", "-w", "1", "-c", "1", "--algo", "all",
                              "--json", out], hostfile=hf, timeout=600)
    assert done.returncode == 0, explain(done)
    with open(out) as fh:
        rows = json.load(fh)["rows"]
    assert {"bruck", "mpi"} <= {row["algo"] for row in rows}, rows
    assert all(row["wrong"] == 0 for row in rows), [r for r in rows if r["wrong"]]
    c.assert_clean()
