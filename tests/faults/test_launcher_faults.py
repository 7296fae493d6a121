"""``neocomm run`` owns its job: signals, the timeout and leftovers end every process.

Each test starts a real 2-rank job with ``neocomm run``, waits until every
rank has written its pid, injects the fault and checks, by pid and start
time (never by process name), that no process of the job is left, that
the exit status is the conventional one, and that no shared-memory file of
the job is left in /dev/shm.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="tracks pids through /proc")

RANK = textwrap.dedent("""
    import os, signal, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    if "mpi" in mode:
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    if "stubborn" in mode:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(f"/dev/shm/neocomm-{os.getpid()}-faulttest", "w").close()
    with open(os.path.join(out, f"pid.{os.getpid()}"), "w") as fh:
        fh.write(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    while True:
        if "busy" not in mode:
            time.sleep(0.05)
""")


def _start(tmp_path, mode, *extra, env=None):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "pids"
    out.mkdir()
    full_env = {**os.environ, "NEOCOMM_KILL_GRACE": "2", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", *extra,
                             "--", sys.executable, str(script), str(out), mode],
                            env=full_env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(os.listdir(out)) < 2:
        assert proc.poll() is None, f"the job ended early: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, "the ranks did not start within 60 s"
        time.sleep(0.05)
    time.sleep(0.2)  # the pid files are complete
    ranks = {int(name.split(".")[1]): (out / name).read_text() for name in os.listdir(out)}
    return proc, ranks


def _alive(pid: int, start: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] not in ("Z", "X")


def _check_gone(proc, ranks, want_rc, bound):
    try:
        _, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"neocomm run did not exit within {bound} s")
    assert proc.returncode == want_rc, f"exit {proc.returncode}, expected {want_rc}: {err}"
    left = [pid for pid, start in ranks.items() if _alive(pid, start)]
    assert not left, f"ranks {left} outlived the job"
    shm = [n for n in os.listdir("/dev/shm") if n.endswith("-faulttest")
           and int(n.split("-")[1]) in ranks]
    assert not shm, f"shared-memory files left: {shm}"
    return err


@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("mode", ["idle", "busy", "mpi-idle"])
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, sig, rc, mode):
    proc, ranks = _start(tmp_path, mode)
    proc.send_signal(sig)
    err = _check_gone(proc, ranks, rc, bound=30)
    assert signal.Signals(sig).name in err


def test_ranks_that_ignore_the_signal_still_end(tmp_path):
    proc, ranks = _start(tmp_path, "stubborn")
    proc.send_signal(signal.SIGTERM)
    _check_gone(proc, ranks, 143, bound=30)


def test_the_tree_escalates_to_sigkill_for_orphans_that_ignore_sigterm(tmp_path):
    """A grandchild in a session of its own that ignores SIGTERM, whose parent is gone:
    the launcher's tree still finds it (sub-reaper) and kills it after the grace."""
    from neocomm.jobtree import JobTree, become_subreaper

    pidfile = tmp_path / "orphan"
    code = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"],
            start_new_session=True)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.02)
        time.sleep(0.1)
    """)
    assert become_subreaper()
    parent = subprocess.Popen([sys.executable, "-c", code])
    tree = JobTree(parent)
    while parent.poll() is None:  # the parent exits: the grandchild is an orphan now
        tree.refresh()
        time.sleep(0.02)
    orphan = int(pidfile.read_text())
    tree.refresh()
    assert orphan in tree.alive(), "the orphan was not re-parented to the launcher"
    tree.stop(signal.SIGTERM, grace=0.5)
    assert orphan not in tree.alive() and not os.path.exists(f"/proc/{orphan}")


def test_a_second_signal_kills_at_once(tmp_path):
    proc, ranks = _start(tmp_path, "stubborn", env={"NEOCOMM_KILL_GRACE": "60"})
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _check_gone(proc, ranks, 130, bound=20)


@pytest.mark.parametrize("mode", ["busy", "mpi-stubborn"])
def test_the_timeout_ends_every_rank_and_exits_124(tmp_path, mode):
    proc, ranks = _start(tmp_path, mode, "--timeout", "8")
    err = _check_gone(proc, ranks, 124, bound=40)
    assert "did not finish within 8" in err


def test_the_mpi_library_segments_of_a_killed_job_are_removed(tmp_path):
    before = set(os.listdir("/dev/shm"))
    proc, ranks = _start(tmp_path, "mpi-stubborn")
    during = set(os.listdir("/dev/shm")) - before
    proc.send_signal(signal.SIGTERM)
    _check_gone(proc, ranks, 143, bound=30)
    left = (set(os.listdir("/dev/shm")) - before) & during
    assert not left, f"segments of the killed job left in /dev/shm: {sorted(left)}"


def test_no_room_in_dev_shm_or_the_temporary_directory_is_refused_before_any_rank(tmp_path):
    from _jobs import no_mounts, run_job, small_filesystem

    marker = tmp_path / "started"
    rank = [sys.executable, "-c", f"open({str(marker)!r}, 'a').close()"]
    wrap = small_filesystem("/dev/shm", "64k")
    if wrap is None:
        no_mounts()
    out = run_job(rank, n=2, wrap=wrap, timeout=60).check_clean()
    assert out.returncode == 1, out.output
    assert "neocomm run: cannot start the job: /dev/shm has 64 KiB free; 2 ranks on this " \
           "host need up to 32 MiB there" in out.stderr, out.stderr
    assert not marker.exists()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = run_job(rank, n=2, wrap=small_filesystem(tmp, "64k", fill=True), timeout=60,
                  env={"TMPDIR": str(tmp)}).check_clean()
    assert out.returncode == 1, out.output
    assert f"{tmp} (the temporary directory, TMPDIR) has 0 bytes free and cannot be " \
           f"written (No space left on device)" in out.stderr, out.stderr
    assert not marker.exists()
    # room that is tight but may do: a warning, and the job runs
    out = run_job(rank, n=4, wrap=small_filesystem("/dev/shm", "40m"), timeout=120)
    assert out.check_clean().returncode == 0, out.output
    assert "warning: /dev/shm has 40 MiB free; 4 ranks on this host may use up to 64 MiB" \
        in out.stderr, out.stderr
    assert marker.exists()


FAKE_LAUNCHER = textwrap.dedent("""\
    #!/bin/sh
    # an MPI launcher that leaves one process of the job behind as it exits 0
    case "$1" in --version) echo "mpirun (Open MPI) 5.0.0"; exit 0;; esac
    if [ "$FAKE_LEFT" = rank ]; then
        # a rank still running: exit only once it runs (a real launcher never exits while
        # a rank it started is still being executed)
        "$FAKE_PYTHON" -m neocomm.rankwatch -- sh -c 'touch "$FAKE_MARK"; exec sleep 30' &
        while [ ! -e "$FAKE_MARK" ]; do sleep 0.05; done
    else
        sleep 1 &   # e.g. the ssh client of a remote daemon, closing a moment after
    fi
    exit 0
""")


@pytest.mark.parametrize("left,want", [("helper", 0), ("rank", 1)])
def test_what_outlives_the_launcher_decides_the_status(tmp_path, left, want):
    """After a launcher that exited 0: a process of the job that is not a rank (a remote
    shell closing its connection) does not make the job fail; a rank of this host that
    is still running after the grace does (exit 1, named), and both are stopped."""
    fake = tmp_path / "mpirun"
    fake.write_text(FAKE_LAUNCHER)
    fake.chmod(0o755)
    env = {**os.environ, "NEOCOMM_LAUNCHER": str(fake), "FAKE_LEFT": left,
           "FAKE_PYTHON": sys.executable, "NEOCOMM_KILL_GRACE": "2",
           "FAKE_MARK": str(tmp_path / "rank-started")}
    done = subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", "--", "true"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == want, done.stderr
    assert ("did not; stopping them" in done.stderr) == (want == 1), done.stderr
