"""``neocomm run --hostfile`` on real hosts: the command is found, ranks land where the
hostfile says, groups follow the hosts, status and messages are right, nothing is left."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from conftest import explain, neocomm_run
from neocomm.launcher import FAILED
from testcluster import ROOT

#: one line of JSON per rank: where it runs and what it sees
WHERE = """
import json, os, socket, sys
import neocomm
w = neocomm.init()
print("WHERE " + json.dumps({"rank": w.rank, "host": socket.gethostname(),
      "intra": list(w.intra_node.ranks), "rail": list(w.rail.ranks), "node": w.node,
      "nodes": w.num_nodes, "exe": sys.executable, "var": os.environ.get("NEOCOMM_TEST_MARK"),
      "argv": sys.argv[1:]}), flush=True)
"""


def _where(done) -> dict[int, dict]:
    rows = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("WHERE ")]
    return {row["rank"]: row for row in rows}


def _script(cluster, text: str, name: str) -> str:
    path = os.path.join(cluster.workdir, name)
    with open(path, "w") as fh:
        fh.write(text)
    return path


def test_a_script_python_and_neocomm_start_on_every_host(two_hosts):
    """The three ways to name the command reach the remote host's ranks: a script, ``python``
    (this environment's, not the remote login's) and an installed command."""
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    env = c.launch_env(NEOCOMM_TEST_MARK="seen")
    script = _script(c, WHERE, "where.py")
    for command in ([script, "x"], ["python", script, "x"]):
        done = neocomm_run(c, 4, command, hostfile=hf, env=env)
        assert done.returncode == 0, explain(done)
        where = _where(done)
        assert sorted(where) == [0, 1, 2, 3], explain(done)
        assert {w["host"] for w in where.values()} == {"node-a", "node-b"}
        assert all(w["var"] == "seen" and w["argv"] == ["x"] for w in where.values())
        assert len({w["exe"] for w in where.values()}) == 1
    done = neocomm_run(c, 4, ["neocomm", "topo", "--json"], hostfile=hf)
    assert done.returncode == 0, explain(done)
    assert "node-a" in done.stdout and "node-b" in done.stdout, explain(done)
    c.assert_clean()


@pytest.mark.parametrize("nprocs,slots,want", [
    (4, {"node-a": 2, "node-b": 2}, ["node-a", "node-a", "node-b", "node-b"]),
    (3, {"node-a": 2, "node-b": 2}, ["node-a", "node-a", "node-b"]),
    (6, {"node-a": 2, "node-b": 1}, ["node-a"] * 4 + ["node-b"] * 2),
    (4, {"node-a": None, "node-b": None}, ["node-a", "node-a", "node-b", "node-b"]),
])
def test_ranks_fill_each_hosts_slots_in_order(two_hosts, nprocs, slots, want):
    """What mpirun users expect: each host's slots in order (a host without slots has as
    many as its cores: two here), more ranks than slots spread over the hosts; the line
    ``neocomm run`` prints says where each rank went, and the world's groups follow the
    hosts: ``intra_node`` is a host's ranks, ``rail`` the ranks of one local index."""
    c = two_hosts
    hf = c.hostfile(slots, name=f"hosts-{nprocs}-{len(want)}")
    done = neocomm_run(c, nprocs, [_script(c, WHERE, "where.py")], hostfile=hf)
    assert done.returncode == 0, explain(done)
    where = _where(done)
    assert [where[r]["host"] for r in range(nprocs)] == want, explain(done)
    for r, row in where.items():
        mates = [q for q in range(nprocs) if want[q] == want[r]]
        assert row["intra"] == mates
        assert row["nodes"] == len(set(want))
        local = mates.index(r)
        assert row["rail"] == [q for q in range(nprocs)
                               if [p for p in range(nprocs) if want[p] == want[q]].index(q)
                               == local]
    if all(slots.values()):  # the placement neocomm run announced is the one that happened
        line = next(l for l in done.stderr.splitlines() if "rank(s) on" in l)
        for host in set(want):
            ranks = [r for r in range(nprocs) if want[r] == host]
            span = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
            assert f"{host} ranks {span}" in line, line
    c.assert_clean()


def test_emulated_nodes_subdivide_hosts_and_never_cross_them(two_hosts):
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    script = _script(c, WHERE, "where.py")
    done = neocomm_run(c, 4, [script], hostfile=hf, extra=["--ranks-per-node", "1"])
    assert done.returncode == 0, explain(done)
    where = _where(done)
    assert all(where[r]["intra"] == [r] and where[r]["nodes"] == 4 for r in range(4))
    done = neocomm_run(c, 4, [script], hostfile=hf, extra=["--ranks-per-node", "4"])
    assert done.returncode != 0
    assert re.search(r"emulated node 0 \(ranks 0-3\) spans 2 hosts: node-a \(ranks 0-1\), "
                     r"node-b \(ranks 2-3\)", done.stderr), explain(done)
    assert "(here 1, 2)" in done.stderr
    c.assert_clean()


FAIL_ON_3 = """
import neocomm
w = neocomm.init()
if w.rank == 3:
    raise RuntimeError("rank three gives up")
w.world.backend().barrier()
"""


def test_a_failure_on_the_remote_host_exits_nonzero_naming_it(two_hosts):
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    done = neocomm_run(c, 4, [_script(c, FAIL_ON_3, "fail3.py")], hostfile=hf, timeout=180)
    assert done.returncode != 0, explain(done)
    text = done.stdout + done.stderr
    assert "rank three gives up" in text and "node-b" in text, explain(done)
    assert re.search(r"rank 3\b", text), explain(done)
    # the launcher's last line, after the MPI launcher's banner, says who failed and why
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{FAILED} (exit {done.returncode}): ") \
        and "neocomm: rank 3 failed" in last and "RuntimeError: rank three gives up" in last, \
        explain(done)
    c.assert_clean()


SLEEP = """
import time, neocomm
w = neocomm.init()
print("STARTED", w.rank, flush=True)
time.sleep(300)
"""


def _pids(cluster, host: str, word: str) -> list[int]:
    return [int(p.split()[0]) for p in cluster.processes(host) if word in p]


def _wait_started(cluster, proc, nprocs: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ranks = sum(len(_pids(cluster, h.name, "sleep.py")) for h in cluster.hosts)
        if ranks >= 2 * nprocs:  # each rank: its watcher and itself
            time.sleep(2)  # past MPI's start-up
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("the job did not start")


def _on(cluster, host: str, argv: list[str]) -> None:
    cluster.run(host, argv, check=True, timeout=30)


def test_sigterm_to_the_launcher_leaves_nothing_on_any_host(two_hosts):
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    script = _script(c, SLEEP, "sleep.py")
    proc = c.popen("node-a", ["neocomm", "run", "-n", "4", "--hostfile", hf, "--", script],
                   cwd=ROOT, env=c.launch_env(NEOCOMM_KILL_GRACE="3"))
    _wait_started(c, proc, 4)
    (launcher,) = [p for p in _pids(c, "node-a", "neocomm run") if p]
    _on(c, "node-a", ["kill", "-TERM", str(launcher)])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    c.assert_clean()


def test_a_remote_rank_killed_ends_the_job_naming_it(two_hosts):
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    script = _script(c, SLEEP, "sleep.py")
    proc = c.popen("node-a", ["neocomm", "run", "-n", "4", "--hostfile", hf, "--", script],
                   cwd=ROOT)
    _wait_started(c, proc, 4)
    rank = [p for p in c.processes("node-b") if "sleep.py" in p and "rankwatch" not in p]
    victim = int(rank[-1].split()[0])
    _on(c, "node-b", ["kill", "-KILL", str(victim)])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, (out, err)
    assert re.search(r"rank [23] \(pid \d+ on node-b\) died of SIGKILL", err), err
    c.assert_clean()


@pytest.mark.parametrize("where", ["/dev/shm", "/tmp"])
def test_a_full_place_on_a_remote_host_stops_the_job_naming_it(two_hosts, where):
    """A remote host whose /dev/shm (MPI's shared memory) or temporary directory (the MPI
    launcher's session files) is full: the job stops at once, naming that host."""
    c = two_hosts
    hf = c.hostfile({"node-a": 2, "node-b": 2})
    filler = os.path.join(where, "filler")
    # fill node-b's /dev/shm or /tmp (its private tmpfs) to the last block
    c.run("node-b", ["sh", "-c", f"dd if=/dev/zero of={filler} bs=1M 2>/dev/null; true"],
          check=True)
    try:
        done = neocomm_run(c, 4, [_script(c, WHERE, "where.py")], hostfile=hf, timeout=180)
    finally:
        c.run("node-b", ["rm", "-f", filler], check=True)
    assert done.returncode != 0, explain(done)
    text = done.stdout + done.stderr
    if where == "/dev/shm":  # found by the host's own start-up check, which says what
        assert re.search(r"cannot start the job on node-b: /dev/shm has", text), explain(done)
        c.assert_clean()
    else:  # the MPI launcher's daemon cannot write its session directory there
        assert re.search(r"Remote host:\s+node-b", text), explain(done)
        # the daemon made its (empty) session directory before the disk refused it
        c.assert_clean(tmp_allowed=("prted.",))
        c.run("node-b", ["sh", "-c", "rm -rf /tmp/prted.*"], check=True)
