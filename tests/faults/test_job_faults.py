"""A failing, killed or stalled rank ends the whole job non-zero — never a hang.

Each test launches a real job through ``neocomm run`` with a hard timeout
(exit 124) that would only trigger if the runtime hung.
"""
from __future__ import annotations

import re

import pytest

from _jobs import KILLER, python_job

JOB_TIMEOUT = 90  # seconds; a hang shows up as exit 124


def _job(tmp_path, body: str, n: int = 2, env: dict | None = None):
    """The job's result, after checking it left no process or /dev/shm file and did not hang."""
    return python_job(tmp_path, body, n=n, env=env, timeout=JOB_TIMEOUT).check_clean()


PRELUDE = """
import os, signal, sys, time
import numpy as np
import neocomm
w = neocomm.init()
be = w.world.backend()
"""


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    out = _job(tmp_path, PRELUDE + """
if w.rank == 1:
    raise RuntimeError("rank one is broken")
be.all_reduce(np.ones(4))
be.barrier()
""")
    assert out.returncode not in (0, 124), out
    assert "rank 1 failed with an unhandled exception" in out.stderr
    assert "rank one is broken" in out.stderr


def test_killed_rank_ends_the_job(tmp_path):
    out = _job(tmp_path, PRELUDE + """
be.barrier()
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
be.all_reduce(np.ones(4))
be.barrier()
""")
    assert out.returncode not in (0, 124), out


def test_stalled_collective_is_named_and_aborts(tmp_path):
    out = _job(tmp_path, PRELUDE + """
import collectives as C
C.all_reduce(np.ones(4))
if w.rank == 1:
    time.sleep(600)  # never arrives
C.all_reduce(np.ones(4))  # a planned call: its agreement is watched, with its number
""", env={"NEOCOMM_TIMEOUT": "3"})
    assert out.returncode not in (0, 124), out
    assert ("rank 0: argument agreement of all_reduce on group 'world', call #1 has not "
            "completed after") in out.stderr, out.stderr


def test_bad_input_fails_together_and_the_job_exits_nonzero(tmp_path):
    out = _job(tmp_path, PRELUDE + """
import collectives as C
x = np.ones(4, np.float32 if w.rank == 0 else np.float64)
try:
    C.all_reduce(x)
except neocomm.CollectiveArgumentError as e:
    print(f"rank {w.rank} caught: {e}", flush=True)
    sys.exit(3)
""", n=3)
    assert out.returncode == 3, out
    for r in range(3):
        assert f"rank {r} caught: all_reduce: dtype differs across ranks" in out.stdout


def test_clean_job_exits_zero(tmp_path):
    out = _job(tmp_path, PRELUDE + """
x = np.ones(4)
be.all_reduce(x)
assert x[0] == w.size
print("ok", w.rank)
""")
    assert out.returncode == 0, out
    assert out.stdout.count("ok") == 2


COLLECTIVES = PRELUDE + """
import collectives as C
"""


def test_a_rank_that_never_enters_the_first_collective_is_named(tmp_path):
    """The job's first collective (which also discovers the group's topology) is watched:
    the message names the wait, who is in it and who is not, and the job ends non-zero."""
    out = _job(tmp_path, COLLECTIVES + """
if w.rank == 1:
    time.sleep(600)
C.all_reduce(np.ones(4, np.float32))
""", n=3, env={"NEOCOMM_TIMEOUT": "4"})
    assert out.returncode not in (0, 124), out
    assert "group 'world'" in out.stderr and "ranks [0, 2] are in it" in out.stderr, out.stderr
    assert "rank 1 is not in any neocomm collective" in out.stderr, out.stderr


def test_the_first_collective_of_a_new_group_is_watched(tmp_path):
    out = _job(tmp_path, COLLECTIVES + """
C.all_reduce(np.ones(4, np.float32))
sub = w.world.split([0, 1, 2], name="trio")
if w.rank == 2:
    time.sleep(600)
if sub is not None:
    C.all_reduce(np.ones(4, np.float32), group=sub)
""", n=3, env={"NEOCOMM_TIMEOUT": "4"})
    assert out.returncode not in (0, 124), out
    assert "group 'trio'" in out.stderr and "ranks [0, 1] are in it" in out.stderr, out.stderr


def test_a_stall_names_the_call_number_and_where_every_rank_is(tmp_path):
    out = _job(tmp_path, COLLECTIVES + """
C.all_reduce(np.ones(4, np.float32))
if w.rank == 1:
    time.sleep(600)
if w.rank == 2:
    C.all_gather(np.ones(4, np.float32))
C.all_reduce(np.ones(4, np.float32))
""", n=4, env={"NEOCOMM_TIMEOUT": "4"})
    assert out.returncode not in (0, 124), out
    err = out.stderr  # from whichever rank's watchdog fired first: 0 and 3 wait together
    assert "rank 1 is not in any neocomm collective" in err, err
    if "ranks [2] are in it" in err:  # rank 2's view
        assert "all_gather on group 'world', call #1" in err, err
        assert "rank 0 is in argument agreement of all_reduce on group 'world', call #1" in err
    else:
        assert "all_reduce on group 'world', call #1" in err, err
        assert "ranks [0, 3] are in it" in err, err
        assert "rank 2 is in argument agreement of all_gather on group 'world', call #1" in err


def test_a_dead_rank_is_named_as_not_answering(tmp_path):
    """A rank killed without the launcher noticing at once (SIGSTOP: frozen) does not
    answer the inspector; the stall still ends the job, naming it."""
    out = _job(tmp_path, COLLECTIVES + """
C.all_reduce(np.ones(4, np.float32))
if w.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
C.all_reduce(np.ones(4, np.float32))
""", n=3, env={"NEOCOMM_TIMEOUT": "4"})
    assert out.returncode not in (0, 124), out
    assert "rank 1 did not answer" in out.stderr, out.stderr


#: A loop of collectives of every kind, large enough to be cut into chunks; the victim
#: rank counts the calls of a round and is killed at a random one of the next (KILLER).
KILLED_IN_A_COLLECTIVE = COLLECTIVES + KILLER + """
seed = {seed}
victim = seed % w.size
killer = _Killer(seed)
n = 1 << 16
x = np.arange(n * w.size, dtype=np.float32)
for round in range(4):  # 0 warms up (plans), 1 counts, 2 is killed
    if w.rank == victim and round == 1:
        killer.count()
    elif w.rank == victim and round == 2:
        killer.arm("the round")
    C.all_reduce(x.copy(), algo={algo!r})
    C.all_to_all(x)
    C.all_gather(x[:n])
    C.reduce_scatter(x)
    C.broadcast(x, root=w.size - 1)
    h = C.all_reduce(x.copy(), async_op=True)
    h.wait()
    if w.rank == victim and round in (1, 2):
        killer.end() if round == 2 else sys.setprofile(None)
print("rank", w.rank, "finished", flush=True)
"""


@pytest.mark.parametrize("seed,algo", [(1, "ring"), (2, "native"), (3, "rabenseifner"),
                                       (4, "hierarchical"), (5, None)])
def test_a_rank_killed_at_a_random_point_of_a_collective_ends_the_job(tmp_path, seed, algo):
    out = _job(tmp_path, KILLED_IN_A_COLLECTIVE.format(seed=seed, algo=algo), n=4,
               env={"NEOCOMM_RANKS_PER_NODE": "2"})  # two emulated nodes of two
    assert out.returncode not in (0, 124), out.output
    victim = seed % 4
    assert f"rank {victim}: SIGKILL at call" in out.stdout, out.output
    assert f"rank {victim} finished" not in out.stdout
    assert re.search(rf"rank {victim} \(pid \d+ on .*\) died of SIGKILL", out.stderr), out.stderr


#: Every kind of mismatched or invalid call, one after the other in one job: each must fail
#: on every rank through agreement (never through the watchdog), in the user's words.
MISMATCHES = COLLECTIVES + """
from neocomm import CollectiveArgumentError
r = w.rank
x = np.ones(16, np.float32)
cases = {
    "operation": lambda: (C.all_to_all_v(x, [8, 8], np.empty(16, np.float32), [8, 8])
                          if r == 0 else C.all_to_all(x)),
    "async": lambda: C.all_reduce(x, async_op=(r == 0)) and None if r else
                     C.all_reduce(x, async_op=True).wait(),
    "dtype": lambda: C.all_reduce(x if r else x.astype(np.float64)),
    "count": lambda: C.all_gather(x if r else x[:8]),
    "root": lambda: C.broadcast(x, root=0 if r else 1),
    "op": lambda: C.all_reduce(x, op="sum" if r else "max"),
    "invalid op": lambda: C.all_reduce(x, op="sum" if r else "average"),
    "free": lambda: sub.free() if r == 0 else C.all_reduce(x, group=sub),
}
sub = w.world.split(list(range(w.size)), name="everyone")
for name, call in cases.items():
    try:
        call()
        print(f"case {name} rank {r}: no error", flush=True)
    except CollectiveArgumentError as e:
        print(f"case {name} rank {r}: {e}", flush=True)
C.all_reduce(x)  # the group is still usable after all of them
print(f"rank {r} done", flush=True)
"""


def test_mismatched_calls_of_every_kind_fail_together_in_the_users_words(tmp_path):
    out = _job(tmp_path, MISMATCHES, n=2, env={"NEOCOMM_TIMEOUT": "120"})
    assert out.returncode == 0, out.output
    assert "has not completed" not in out.output  # agreement caught them, not the watchdog
    lines = {}
    for line in out.stdout.splitlines():
        if line.startswith("case "):
            head, msg = line.split(": ", 1)
            lines[head] = msg
    want = {
        "operation": "rank 0: all_to_all_v(float32, ",
        "async": "async_op=True",
        "dtype": "dtype differs across ranks",
        "count": "differs across ranks",
        "root": "rank 0: broadcast(float32, 16, root=1); rank 1: broadcast(float32, 16, root=0)",
        "op": "op='max'",
        "invalid op": "'average'",
        "free": "rank 0: free(",
    }
    for case, fragment in want.items():
        for r in range(2):
            msg = lines.get(f"case {case} rank {r}")
            assert msg is not None and "no error" not in msg, (case, r, out.output)
            assert fragment in msg, (case, r, msg)
            assert "crc" not in msg.lower(), msg
        assert lines[f"case {case} rank 0"] == lines[f"case {case} rank 1"], case
    assert "rank 0 done" in out.stdout and "rank 1 done" in out.stdout
