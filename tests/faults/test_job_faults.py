"""A failing, killed or stalled rank ends the whole job non-zero — never a hang.

Each test launches a real job through ``neocomm run`` with a hard timeout
(exit 124) that would only trigger if the runtime hung.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap


JOB_TIMEOUT = 90  # seconds; a hang shows up as exit 124


def _job(tmp_path, body: str, n: int = 2, env: dict | None = None):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    import os

    run_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", str(n),
                           "--timeout", str(JOB_TIMEOUT), "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=run_env, timeout=JOB_TIMEOUT + 30)


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
if w.rank == 1:
    time.sleep(600)  # never arrives
be.all_reduce(np.ones(4))
""", env={"NEOCOMM_TIMEOUT": "3"})
    assert out.returncode not in (0, 124), out
    assert "rank 0: argument agreement of all_reduce has not completed after" in out.stderr


def test_bad_input_fails_together_and_the_job_exits_nonzero(tmp_path):
    out = _job(tmp_path, PRELUDE + """
x = np.ones(4, np.float32 if w.rank == 0 else np.float64)
try:
    be.all_reduce(x)
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
