"""A job run for the user (the benches of ``neocomm simulate calibrate``, the training of
``validate --step``) that fails is reported by what its failing rank said, not by the MPI
launcher's closing banner, and its whole output is kept where the message says."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

from neocomm import _LAUNCHED_BY
from neocomm.cli import main
from neocomm.launcher import FAILED, run_job, why_job_failed

BANNER = """--------------------------------------------------------------------------
prterun has exited due to process rank 1 with PID 0 on node node-b calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
--------------------------------------------------------------------------
\x00\x00"""

FAILS = """
import neocomm
world = neocomm.init()
if world.rank == 1:
    raise ValueError("shard 7 of table t3 has no rows")
world.comm.Barrier()
"""


def test_the_cause_comes_before_the_launchers_banner_and_odd_bytes_are_dropped():
    out = ("neocomm train: 2 rank(s), 8 tables\nstep 10 loss 0.69\n"
           "neocomm: rank 1 failed with an unhandled exception; aborting the job.\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
           "    raise ValueError('shard 7')\nValueError: shard 7\n" + BANNER)
    assert why_job_failed(out) == ("neocomm: rank 1 failed with an unhandled exception; "
                                   "aborting the job. | ValueError: shard 7")
    # the watchdog's, a command's agreed error and the launcher's own are causes too
    assert why_job_failed(
        "neocomm: rank 3: all_to_all has not completed after 300.0 s (NEOCOMM_TIMEOUT=300);"
        " rank 2 never arrived. Aborting the job.\nneocomm train: error: --steps: bad\n"
        "neocomm run: the job did not finish within 60 s; stopping it\n") == (
        "neocomm: rank 3: all_to_all has not completed after 300.0 s (NEOCOMM_TIMEOUT=300); "
        "rank 2 never arrived. Aborting the job. | neocomm train: error: --steps: bad | "
        "neocomm run: the job did not finish within 60 s; stopping it")
    # the MPI library's own, and the rank watcher's word for a rank killed by a signal
    assert why_job_failed(
        "[node-b:00189] *** An error occurred in MPI_Allreduce\n"
        "[node-b:00189] *** reported by process [1,2]\n"
        "neocomm run: rank 3 (pid 77 on node-b) died of SIGKILL; the job ends\n" + BANNER) \
        == ("[node-b:00189] *** An error occurred in MPI_Allreduce | neocomm run: rank 3 "
            "(pid 77 on node-b) died of SIGKILL; the job ends")
    # warnings and lines that only mention a failure give way to a rank's own words; the
    # MPI library's words for a process that called abort or died count; tags are dropped
    noisy = ("12:00:01 [rank 0] WARNING topology: NUMA discovery failed; using one domain\n"
             "step 3: relative error of the sketch 0.01\n" * 6 +
             "[1,1]<stderr>:neocomm: rank 1 failed with an unhandled exception; aborting the "
             "job.\n[1,1]<stderr>:ValueError: shard 7\n"
             "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n" + BANNER)
    assert why_job_failed(noisy) == ("neocomm: rank 1 failed with an unhandled exception; "
                                     "aborting the job. | ValueError: shard 7 | MPI_ABORT was "
                                     "invoked on rank 1 in communicator MPI_COMM_WORLD")
    # a line glued behind the launcher's NULs is read as the rank wrote it
    assert why_job_failed("-----\n\x00\x00 neocomm: rank 2 failed with an unhandled "
                          "exception; aborting the job.\n") == \
        "neocomm: rank 2 failed with an unhandled exception; aborting the job."
    # with no such words, the lines that mention a failure (never a warning)
    assert why_job_failed("UserWarning: failed to find a GPU\nloading shard: read failed\n"
                          "done\n") == "loading shard: read failed"
    assert why_job_failed("No errors found\n\n") == "No errors found"
    # where no line says or mentions why, the last lines, printable
    assert why_job_failed(BANNER, keep=2) == (
        "terminated by signals sent by prterun (as reported here). | "
        "--------------------------------------------------------------------------")


def _two_rank_job(tmp_path, monkeypatch, source: str) -> list[str]:
    """``neocomm run -n 2 -- python job.py`` of ``source``, launched from a process that is
    not itself a rank."""
    for key in _LAUNCHED_BY:
        monkeypatch.delenv(key, raising=False)
    script = tmp_path / "job.py"
    script.write_text(source)
    return [shutil.which("neocomm") or "neocomm", "run", "-n", "2", "--timeout", "120", "--",
            sys.executable, str(script)]


def test_a_rank_that_fails_is_named_with_its_error_and_the_whole_output_is_kept(
        tmp_path, monkeypatch):
    """A real two-rank job in which rank 1 raises: the error names rank 1 and its
    exception, and the log holds everything the job printed, the launcher's banner too."""
    cmd = _two_rank_job(tmp_path, monkeypatch, FAILS)
    log = tmp_path / "job.log"
    with pytest.raises(RuntimeError) as caught:
        run_job(cmd, what="validation", log=str(log), shown="run -n 2 -- python job.py")
    message = str(caught.value)
    assert message.startswith("validation: `run -n 2 -- python job.py` failed (exit "), message
    assert "neocomm: rank 1 failed with an unhandled exception" in message, message
    assert message.count("failed (exit") == 1, message  # neocomm run's closing line, unsaid
    assert "ValueError: shard 7 of table t3 has no rows" in message, message
    assert message.endswith(f"(its whole output: {log})"), message
    text = log.read_text()
    assert "Traceback" in text and "ValueError: shard 7 of table t3 has no rows" in text


def test_a_job_that_exits_0_without_its_result_says_which_file_is_missing(tmp_path):
    missing = tmp_path / "metrics.jsonl"
    with pytest.raises(RuntimeError, match=f"failed \\(exit 0\\): it exited 0 but did not "
                                           f"write {missing}"):
        run_job([sys.executable, "-c", "print('done')"], what="validation",
                log=str(tmp_path / "job.log"), expect=(str(missing),))
    assert (tmp_path / "job.log").read_text() == "done\n"


def test_calibration_keeps_the_folder_of_a_failed_bench_and_not_of_an_interrupted_one(
        tmp_path, monkeypatch, capsys):
    """``neocomm simulate calibrate`` runs its benches in a folder of its own: kept (with the
    failed job's output) when one fails, gone when the command is interrupted."""
    import tempfile

    import collectives.calibrate as calibrate

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def failing(layouts, *, out_dir, **kw):
        seen.append(out_dir)
        log = os.path.join(out_dir, "bench-2r-1n-0.log")
        with open(log, "w") as fh:
            fh.write("neocomm: rank 1 failed\n")
        raise RuntimeError(f"calibration: `run ...` failed (exit 1): neocomm: rank 1 failed "
                           f"(its whole output: {log})")

    monkeypatch.setattr(calibrate, "run_benches", failing)
    assert main(["simulate", "calibrate", "--fabric", "cpu-host", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "neocomm: rank 1 failed" in err and seen[0] in err, err
    assert os.listdir(seen[0]) == ["bench-2r-1n-0.log"]

    def interrupted(layouts, *, out_dir, **kw):
        seen.append(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "run_benches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["simulate", "calibrate", "--fabric", "cpu-host", "--ranks", "2"])
    assert not os.path.exists(seen[1])


def test_the_jobs_folder_goes_when_its_jobs_succeed(tmp_path):
    from embedding.cli.simulate_measured import _jobs_folder

    with _jobs_folder("neocomm-validate-", dir=str(tmp_path)) as where:
        with open(os.path.join(where, "train-2r-1n-0.log"), "w") as fh:
            fh.write("ok\n")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="failed"):
        with _jobs_folder("neocomm-validate-", dir=str(tmp_path)) as where:
            with open(os.path.join(where, "train-2r-1n-0.log"), "w") as fh:
                fh.write("neocomm: rank 1 failed\n")
            raise RuntimeError("validation: `run` failed (exit 1)")
    assert os.listdir(tmp_path) == [os.path.basename(where)]
    shutil.rmtree(where)
    # nothing ran (no neocomm command, say): nothing to read, nothing kept
    with pytest.raises(ValueError, match="not on PATH"):
        with _jobs_folder("neocomm-validate-", dir=str(tmp_path)):
            raise RuntimeError("validation: the neocomm command is not on PATH")
    assert os.listdir(tmp_path) == []


def test_neocomm_run_closes_a_failed_job_with_why_and_a_good_one_with_nothing(tmp_path,
                                                                           monkeypatch):
    """After the MPI launcher's banners, ``neocomm run``'s last line says which rank failed
    and its error; everything the job printed to stderr still comes through, in order."""
    import subprocess

    cmd = _two_rank_job(tmp_path, monkeypatch, FAILS)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{FAILED} (exit {done.returncode}): "), done.stderr
    assert "neocomm: rank 1 failed with an unhandled exception" in last, done.stderr
    assert "ValueError: shard 7 of table t3 has no rows" in last, done.stderr
    assert done.stderr.index("Traceback") < done.stderr.index(last), done.stderr
    # run_job reports what that line gives as the job's why
    assert why_job_failed(done.stdout + done.stderr) == last.partition("): ")[2]
    good = subprocess.run(cmd[:-1] + ["-c", "import sys; print('out'); "
                                            "print('warning: err', file=sys.stderr)"],
                          capture_output=True, text=True, timeout=180)
    assert good.returncode == 0 and FAILED not in good.stderr, good.stderr
    assert good.stdout == "out\nout\n" and good.stderr.count("warning: err") == 2, good


SLOW = """
import sys
sys.stderr.write(("x" * 99 + "\\n") * 1500)  # 150 KB a rank, more than a pipe holds
sys.stderr.write("LAST LINE\\n")
sys.stderr.flush()
import neocomm
world = neocomm.init()
if world.rank == 1:
    raise ValueError("late failure")
world.comm.Barrier()
"""


def test_a_slow_reader_of_the_jobs_stderr_still_gets_all_of_it_and_the_closing_line(
        tmp_path, monkeypatch):
    """The job's standard error is passed on whole even when whoever reads ``neocomm run``'s
    is slower than the job (a log streamer, a slow terminal): nothing is left in the pipe
    when the launcher returns, and the closing line comes last."""
    import subprocess
    import time

    proc = subprocess.Popen(_two_rank_job(tmp_path, monkeypatch, SLOW),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    got = []
    while True:  # about 80 KB/s
        piece = proc.stderr.read1(4096)
        if not piece:
            break
        got.append(piece)
        time.sleep(0.05)
    err = b"".join(got).decode(errors="replace")
    assert proc.wait(timeout=120) != 0, err[-2000:]
    assert err.count("x" * 99 + "\n") == 3000 and err.count("LAST LINE") == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(FAILED) and "ValueError: late failure" in last, err[-2000:]
