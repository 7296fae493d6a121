"""Start real jobs with ``neocomm run`` and check what they leave behind.

Every process of a job inherits a token in its environment, so the job's
processes are found afterwards by pid (``/proc/<pid>/environ``), never by
name; ``/dev/shm`` is compared before and after. A job that hangs ends in
the launcher's own timeout (exit 124), which every caller treats as a failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from _shm import SHM, left_since

TOKEN = "FAULT_JOB_TOKEN"


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    left: list = field(default_factory=list)  # pids of the job still alive after it ended
    shm_left: list = field(default_factory=list)  # /dev/shm files the job created and left

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check_clean(self) -> "Job":
        """No hang (the launcher's timeout), no process and no shared-memory file left."""
        assert self.returncode != 124, f"the job hung (timed out):\n{self.output}"
        assert not self.left, f"processes {self.left} of the job outlived it:\n{self.output}"
        assert not self.shm_left, f"/dev/shm files left: {self.shm_left}\n{self.output}"
        return self


def _environ_has(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            if needle not in fh.read():
                return False
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def pids_of(token: str) -> list[int]:
    """Live processes whose environment carries ``token``."""
    needle = f"{TOKEN}={token}".encode()
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())
                  and _environ_has(p, needle))


def run_job(args: list[str], *, n: int = 2, cwd=None, env: dict | None = None,
            timeout: float = 120, wrap: list[str] | None = None,
            launcher_args: list[str] | None = None) -> Job:
    """Run ``neocomm run -n N --timeout T [launcher_args] -- args`` (inside ``wrap``,
    e.g. ``unshare``), and find what it left."""
    token = uuid.uuid4().hex
    run_env = dict(os.environ, **(env or {}))
    run_env.pop("NEOCOMM_PROGRESS", None)
    run_env[TOKEN] = token
    before = set(os.listdir(SHM))
    cmd = [sys.executable, "-m", "neocomm.cli", "run", "-n", str(n), "--timeout", str(timeout),
           *(launcher_args or []), "--", *args]
    t0 = time.monotonic()
    out = subprocess.run((wrap or []) + cmd, cwd=cwd, capture_output=True, text=True,
                         env=run_env, timeout=timeout + 60)
    seconds = time.monotonic() - t0
    left = pids_of(token)
    for pid in left:  # leave nothing behind for the next test, whatever this one says
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shm_left = left_since(before)
    return Job(out.returncode, out.stdout, out.stderr, seconds, left, shm_left)


def python_job(tmp_path, body: str, **kw) -> Job:
    """Run the Python program ``body`` on every rank (see :func:`run_job`)."""
    import textwrap

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    kw.setdefault("cwd", tmp_path)
    return run_job([sys.executable, str(script)], **kw)


def small_filesystem(path, size: str, fill: bool = False) -> list[str] | None:
    """A command prefix that runs a command with a tmpfs of ``size`` mounted on ``path``
    (filled to the brim when ``fill``) in a mount namespace of its own; None where this
    host cannot make one (no ``unshare``, or no right to mount)."""
    for flags in (["--mount"], ["--mount", "--map-root-user"]):
        probe = subprocess.run(["unshare", *flags, "sh", "-c",
                                "mount -t tmpfs -o size=64k tmpfs /mnt"],
                               capture_output=True)  # noqa: S603 - a fixed test command
        if probe.returncode == 0:
            break
    else:
        return None
    script = f'mount -t tmpfs -o size={size} tmpfs "$0" || exit 97; '
    if fill:
        script += 'cat /dev/zero > "$0/fill" 2>/dev/null; '
    return ["unshare", *flags, "sh", "-c", script + 'shift; exec "$@"', str(path), "_"]


def no_mounts():
    """Fail (in CI) or skip: this host cannot mount a small file system in a namespace."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail("CI must be able to run `unshare --mount` (as root, or with user "
                    "namespaces) to test full disks")
    pytest.skip("no `unshare --mount` here: cannot make a small file system")


#: Python for a job (formatted in, after ``import os, signal, sys``): ``killer.count()``
#: has a profiler count the function calls (Python and C, MPI's included) of a stretch of
#: work; ``killer.arm(what)`` kills the process with SIGKILL at call N of the next
#: stretch, N drawn from ``seed``; ``killer.end()`` after that stretch kills it at its end
#: if the call was not reached (waits that poll make a stretch shorter).
KILLER = """
import random as _random

class _Killer:
    def __init__(self, seed):
        self.rng, self.calls, self.target, self.armed = _random.Random(seed), 0, 0, False

    def _count(self, frame, event, arg):
        self.calls += 1

    def _kill(self, frame, event, arg):
        self.calls += 1
        if self.calls >= self.target:
            os.kill(os.getpid(), signal.SIGKILL)

    def count(self):
        self.calls = 0
        sys.setprofile(self._count)

    def arm(self, what):
        self.target, self.calls, self.armed = self.rng.randint(1, max(self.calls, 1)), 0, True
        print(f"rank {{w.rank}}: SIGKILL at call {{self.target}} of {{what}}", flush=True)
        sys.setprofile(self._kill)

    def end(self):
        sys.setprofile(None)
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
"""
