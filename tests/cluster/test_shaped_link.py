"""Two hosts over a link shaped to 1 Gbit/s (a token bucket at each end): the link, not
the CPU, is the bottleneck. ``neocomm bench`` checks its results and reports a bus
bandwidth the link can carry; ``neocomm topo`` names both hosts; ``neocomm fabric
validate --measure`` passes a spec the link meets and fails one it cannot."""
from __future__ import annotations

import json
import os

import pytest
from conftest import build, explain, neocomm_run

RATE = "1gbit"
LINE_RATE = 1e9 / 8 / 1e9  # GB/s: 1 Gbit/s


@pytest.fixture(scope="module")
def shaped():
    cluster = build(["node-a", "node-b"], rate=RATE)
    yield cluster
    cluster.close()


def _spec(cluster, name: str, tcp_gbs: float) -> str:
    path = os.path.join(cluster.workdir, f"{name}.toml")
    with open(path, "w") as fh:
        fh.write(f'[fabric]\nname = "{name}"\ndescription = "two CPU hosts over TCP"\n\n'
                 f"[cluster]\nnodes = 2\n\n[node]\ngpus = 0\nmin_cpus = 1\n\n"
                 f"[bandwidth]\ntcp = {tcp_gbs}\n")
    return path


def test_bench_is_checked_and_bounded_by_the_link(shaped):
    c = shaped
    hf = c.hostfile({"node-a": 1, "node-b": 1})
    out = os.path.join(c.workdir, "bench.json")
    done = neocomm_run(c, 2, ["neocomm", "bench", "all_reduce", "-b", "1M", "-e", "4M",
                              "-f", "4", "-n", "3", "-w", "1", "-r", "1", "-c", "1",
                              "--algo", "all", "--json", out], hostfile=hf, timeout=600)
    assert done.returncode == 0, explain(done)
    with open(out) as fh:
        report = json.load(fh)
    assert report["ranks"] == 2 and report["nodes"] == 2
    rows = report["rows"]
    assert rows and all(row["wrong"] == 0 for row in rows), rows
    # The token bucket lets through at most its rate (a burst of 64 KiB aside): what
    # the bench reports as bus bandwidth cannot exceed the link, whatever the host.
    burst = 64 << 10
    for row in rows:
        if row["algo"] == "mpi" or row["busbw"] is None:
            continue
        ceiling = LINE_RATE * (1 + burst / row["size"])
        assert row["busbw"] <= ceiling * 1.05, (row["algo"], row["size"], row["busbw"])
    c.assert_clean()


def test_topo_and_fabric_validate_over_the_link(shaped):
    c = shaped
    hf = c.hostfile({"node-a": 1, "node-b": 1})
    done = neocomm_run(c, 2, ["neocomm", "topo", "--json"], hostfile=hf)
    assert done.returncode == 0, explain(done)
    topo = json.loads(done.stdout[done.stdout.index("{"):])
    assert sorted(h["hostname"] for h in topo["hosts"]) == ["node-a", "node-b"], topo["hosts"]
    meets = _spec(c, "meets", LINE_RATE / 50)
    done = neocomm_run(c, 2, ["neocomm", "fabric", "validate", meets, "--measure", "--bytes",
                              str(4 << 20), "--iters", "2", "-v"], hostfile=hf)
    assert done.returncode == 0, explain(done)
    assert "tcp" in done.stdout, explain(done)
    # a spec that declares more than the link can carry fails, and says which check
    beyond = _spec(c, "beyond", LINE_RATE * 4)
    done = neocomm_run(c, 2, ["neocomm", "fabric", "validate", beyond, "--measure", "--bytes",
                              str(4 << 20), "--iters", "2"], hostfile=hf)
    assert done.returncode == 1, explain(done)
    assert "tcp" in done.stdout and "FAIL" in done.stdout.upper(), explain(done)
    c.assert_clean()
