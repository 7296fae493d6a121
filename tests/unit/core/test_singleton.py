"""A process started without a launcher (an MPI singleton) leaves nothing in /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _shm import left_since
from neocomm import _LAUNCHED_BY
from neocomm.mpistart import without_shared_memory

SINGLETON = """
import neocomm, numpy as np
import collectives as C
w = neocomm.init()
x = np.ones(4)
C.all_reduce(x)
assert w.size == 1 and x[0] == 1
with open("/proc/self/maps") as fh:
    shm = sorted({line.split()[-1] for line in fh if "/dev/shm/" in line})
import os
print("\\n".join(["ran", "btl=" + str(os.environ.get("OMPI_MCA_btl")),
                 "tmp=" + str(os.environ.get("TMPDIR"))] + shm))
"""


@pytest.mark.parametrize("btl", [None, "^ofi", "self,sm,tcp"])
def test_a_singleton_leaves_no_shared_memory_file(btl, tmp_path):
    """Whatever transports the user chose (``OMPI_MCA_btl``), a singleton starts MPI
    without the shared-memory one, and the user's setting is as it was afterwards; nor
    does it leave Open MPI's session directory in the temporary directory."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and not k.startswith("OMPI_MCA_")}
    env["TMPDIR"] = str(tmp_path)
    if btl is not None:
        env["OMPI_MCA_btl"] = btl
    out = subprocess.run([sys.executable, "-c", SINGLETON], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[:3] == ["ran", f"btl={btl}", f"tmp={tmp_path}"], lines
    left = [path for path in lines[3:] if os.path.exists(path)]
    assert left == [], f"the singleton left {left} in /dev/shm"
    assert list(tmp_path.iterdir()) == [], f"the singleton left {list(tmp_path.rglob('*'))}"


def test_the_shared_memory_transport_is_taken_out_of_any_choice():
    assert without_shared_memory(None) == without_shared_memory(" ") == "^sm"
    assert without_shared_memory("^ofi") == "^ofi,sm"
    assert without_shared_memory("^sm,ofi") == "^sm,ofi"
    assert without_shared_memory("self,sm,tcp") == "self,tcp"
    assert without_shared_memory("self, tcp") == "self,tcp"


def test_a_chosen_transport_is_kept():
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY}
    env["OMPI_MCA_btl"] = "self,tcp"
    out = subprocess.run([sys.executable, "-c", "import neocomm, os; "
                          "print(os.environ['OMPI_MCA_btl'])"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "self,tcp", out.stderr


def test_a_job_launched_from_neocomm_keeps_shared_memory():
    """What turns the transport off for a singleton must not reach the ranks of a job it
    launches: they would talk over TCP loopback, ten times slower for small messages."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and not k.startswith("OMPI_MCA_")}
    show = "import os; print('btl=' + str(os.environ.get('OMPI_MCA_btl')))"
    here = subprocess.run([sys.executable, "-c", "import neocomm, os; neocomm.init(); " + show],
                          capture_output=True, text=True, env=env, timeout=120)
    assert here.stdout.strip() == "btl=None", here
    job = subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", "--timeout",
                          "90", "--", sys.executable, "-c", show],
                         capture_output=True, text=True, env=env, timeout=120)
    assert job.returncode == 0, job.stderr
    assert job.stdout.split() == ["btl=None", "btl=None"], job.stdout


def test_processes_torchrun_started_are_refused_not_run_apart():
    """Under torchrun each process would be an MPI singleton and train on its own: init says
    so, naming the launcher, the ranks and the command to use instead. Passing a
    communicator (e.g. MPI.COMM_SELF) keeps a one-rank world possible on purpose."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY
           and not k.startswith("OMPI_MCA_")}
    env.update(TORCHELASTIC_RUN_ID="abc", WORLD_SIZE="2", RANK="1")
    out = subprocess.run([sys.executable, "-c", "import neocomm; neocomm.init()"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert ("torchrun started this process as rank 1 of 2 (WORLD_SIZE=2), but MPI sees 1 "
            "rank(s)" in out.stderr and "neocomm run -n 2 -- python" in out.stderr), out.stderr
    # MPI started through neocomm (a bare ``from mpi4py import MPI`` in a singleton would leave
    # Open MPI's shared-memory segment in /dev/shm)
    ok = subprocess.run([sys.executable, "-c", "import neocomm; from neocomm.mpistart import "
                         "start_mpi; start_mpi(); from mpi4py import MPI; "
                         "print(neocomm.init(comm=MPI.COMM_SELF).size)"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "1", ok.stderr


@pytest.mark.parametrize("argv", [
    ["info"], ["info", "--json"], ["topo"],
    ["bench", "allreduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"],
])
def test_commands_run_without_a_launcher_leave_nothing_in_dev_shm(argv):
    """``neocomm COMMAND`` run alone is an MPI singleton: whichever command starts MPI, it
    starts it as the runtime does and leaves no file in /dev/shm (only files that appear
    while it runs count)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHED_BY}
    before = set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", *argv], capture_output=True,
                         text=True, env=env, timeout=120)
    new = left_since(before)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the command printed nothing"
    assert new == [], f"neocomm {' '.join(argv)} left {new} in /dev/shm"
